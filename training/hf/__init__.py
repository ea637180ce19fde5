"""Hugging Face export and import of Trident checkpoints (LLaMA and GPT-2 families).

    from training.checkpoint import open_checkpoint
    from training.hf import export_to_hf, import_from_hf

    export_to_hf(open_checkpoint("runs/ckpt"), "runs/hf")            # AutoModelForCausalLM / AutoTokenizer
    import_from_hf("llama-folder", "runs/llama", tensor_parallel=2)  # a checkpoint at TP 2

``tools/convert_checkpoint.py --to-hf`` / ``--from-hf`` are the command-line entries. Nothing here
imports ``transformers``: the tensors go through :mod:`models.gpt.hf_mapping`, ``config.json``
through :mod:`training.hf.config`, the tokenizer through :mod:`training.hf.tokenizer`.
"""

from training.hf.config import HFConfigError, hf_config_json, transformer_config_from_hf
from training.hf.exporter import ExportSummary, export_to_hf, parse_size
from training.hf.importer import ImportSummary, SafetensorsFolder, import_from_hf

__all__ = [
    "ExportSummary",
    "HFConfigError",
    "ImportSummary",
    "SafetensorsFolder",
    "export_to_hf",
    "hf_config_json",
    "import_from_hf",
    "parse_size",
    "transformer_config_from_hf",
]

"""Shared steps of the Hugging Face parity tests (dense in ``tests/unit/test_hf_parity.py`` and, on real
ranks, ``tests/dist/test_hf_parity.py``; MoE in ``tests/e2e/test_hf_moe.py``): weights that make every
norm and bias matter, ``tools/convert_checkpoint.py`` run in process, a folder's safetensors read back,
a saved Hugging Face config edited before an import; the dense cases, their tokenizer files and a
seeded checkpoint written at TP2 x PP2.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import torch

from models.gpt import GPTModel
from tests.support.bpe import TRICKY_TEXTS, train_byte_level_bpe
from tests.support.configs import tiny_config
from tests.support.corpus import make_docs, write_jsonl

__all__ = [
    "CASES",
    "ROPE_OFFSET",
    "SEQ",
    "TEXTS",
    "TOL",
    "VOCAB",
    "check_config_refused",
    "convert",
    "convert_with_config_change",
    "gpt2_case",
    "llama_case",
    "perturb_norms_and_biases",
    "random_hf_model",
    "safetensors_of",
    "write_tokenizer_files",
    "write_trident_checkpoint",
]


def perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights start at one and biases at zero; make them matter before comparing."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def random_hf_model(hf_config):
    """A Hugging Face causal LM for ``hf_config``, every weight (norms, biases too) seeded N(0, 0.2^2)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    return model


def safetensors_of(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder`` (a sharded export read as one)."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def convert(*argv) -> tuple[int, str]:
    """``tools/convert_checkpoint.py ARGV --quiet`` in process: (exit code, what it wrote to stderr)."""
    from tools import convert_checkpoint

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = convert_checkpoint.main([*map(str, argv), "--quiet"])
    return code, err.getvalue().strip()


def check_config_refused(tmp_path: Path, hf_folder: Path, change: dict, message: str) -> None:
    """``--from-hf`` of ``hf_folder`` with ``change`` in its config.json fails with one line naming the
    file and ``message``, and writes nothing."""
    folder, result = convert_with_config_change(tmp_path, hf_folder, change)
    assert result == (1, f"error: {folder}/config.json: {message}")
    assert not (tmp_path / "ckpt").exists()


def convert_with_config_change(tmp_path: Path, hf_folder: Path, change: dict) -> tuple[Path, tuple[int, str]]:
    """Import a copy of ``hf_folder``, its config.json updated by ``change``, into ``tmp_path/ckpt``.

    Returns the copy and :func:`convert`'s result.
    """
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    return folder, convert("--from-hf", folder, "--save", tmp_path / "ckpt")


VOCAB, SEQ = 64, 16
TOL = 1e-5
ROPE_OFFSET = 3000
"""RoPE cases also run at positions ROPE_OFFSET.. , where Llama-3.1's scaling of the slow frequencies shows."""


def llama_case(**overrides):
    """The tiny LLaMA with FFN 48 (``overrides`` change it)."""
    return tiny_config("llama", **{"ffn_hidden_size": 48, **overrides})


def gpt2_case(**overrides):
    """The tiny GPT-2 (``overrides`` change it)."""
    return tiny_config("gpt", **overrides)


CASES = {
    "llama-gqa": (lambda: llama_case(rotary_base=500000.0), "LlamaForCausalLM", "LlamaConfig"),
    "llama-mqa-tied": (
        lambda: llama_case(num_query_groups=1, kv_channels=16, untie_embeddings_and_output_weights=False),
        "LlamaForCausalLM",
        "LlamaConfig",
    ),
    "llama3-rope-scaling": (
        lambda: llama_case(
            kv_channels=16,
            rotary_base=500000.0,
            rope_scaling=True,
            rope_scaling_factor=8.0,
            layernorm_epsilon=1e-6,
        ),
        "LlamaForCausalLM",
        "LlamaConfig",
    ),
    "gpt2": (gpt2_case, "GPT2LMHeadModel", "GPT2Config"),
}


TEXTS = [*TRICKY_TEXTS, "numbers 1234567 and <s> special </s> strings <|endoftext|>", " x", ""]


def write_tokenizer_files(root: Path) -> dict:
    """A SentencePiece BPE model (trained by tools/train_tokenizer.py) and GPT-2 BPE vocab/merges files."""
    from tools import train_tokenizer

    docs = make_docs(200, seed=3) + TEXTS
    jsonl = write_jsonl(root / "docs.jsonl", docs)
    spm = train_tokenizer.main(["--input", jsonl, "--model-prefix", str(root / "spm"), "--vocab-size", "400"])
    train_byte_level_bpe(docs, 400, save_to=root)
    return {
        "spm": {"tokenizer_model": str(spm)},
        "bpe": {"vocab_file": str(root / "vocab.json"), "merge_file": str(root / "merges.txt")},
        "docs": docs,
    }


def write_trident_checkpoint(root, config, vocab: int, tokenizer_type: str, files: dict) -> None:
    """A seeded GPTModel (norms and biases perturbed) written at TP2 x PP2 by the checkpoint writer."""
    from training.checkpoint import Parallelism, gpt_tensor_specs, write_checkpoint

    model = GPTModel(config, vocab, SEQ)
    perturb_norms_and_biases(model)
    specs, tied = gpt_tensor_specs(config, vocab, SEQ)
    state = model.state_dict()
    tensors = ((n, state[n][: spec.shape[0]]) for n, spec in specs.items())
    write_checkpoint(
        str(root),
        tensors,
        specs=specs,
        tied=tied,
        parallelism=Parallelism(2, 2, 1, "Et|tL"),
        config=config.to_dict(),
        vocab_size=vocab,
        max_sequence_length=SEQ,
        tokenizer_type=tokenizer_type,
        tokenizer_files=files,
    )

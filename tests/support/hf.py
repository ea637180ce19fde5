"""Shared steps of the Hugging Face parity tests (dense in ``tests/dist/test_hf_parity.py``, MoE in
``tests/e2e/test_hf_moe.py``): weights that make every norm and bias matter, ``tools/convert_checkpoint.py``
run in process, a folder's safetensors read back, and a saved Hugging Face config edited before an import.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import torch

__all__ = [
    "check_config_refused",
    "convert",
    "convert_with_config_change",
    "perturb_norms_and_biases",
    "random_hf_model",
    "safetensors_of",
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

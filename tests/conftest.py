import os

import pytest
import torch

from tests.support.multirank import RankPool


def pytest_configure(config):
    """``TRIDENT_SPAWN_AUDIT=report.tsv`` reports which tests start processes (tests/support/spawn_audit.py)."""
    report = os.environ.get("TRIDENT_SPAWN_AUDIT")
    if report:
        from tests.support.spawn_audit import SpawnAudit

        config.pluginmanager.register(SpawnAudit(report), "trident-spawn-audit")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU: skipped where there is none (tools/gpu_check.py runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tools/gpu_check.py on a GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ranks():
    """``ranks(n)`` gives this module's pool of ``n`` spawned gloo ranks, started once and reused."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A SentencePiece BPE model (trained by tools/train_tokenizer.py) and GPT-2 BPE vocab/merges files."""
    from tests.support.hf import write_tokenizer_files  # imported by the tests that use it only

    return write_tokenizer_files(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture
def no_tf32():
    """fp32 matmuls and convolutions in full fp32 on a GPU (TF32 rounds the mantissa to 10 bits)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

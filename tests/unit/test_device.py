"""Device and backend choice (core/device.py): the backend decides the device, never the hardware alone.

The decision is a pure function of the request, TRIDENT_BACKEND and the GPUs a node has, so every
case, GPU hosts included, is tested here without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from core.device import DeviceError, decide_backend, local_gpu_index

NO_GPU = {"cuda_available": False, "device_count": 0}
TWO_GPUS = {"cuda_available": True, "device_count": 2}


def _decide(requested=None, forced=None, local_rank=0, local_world_size=1, hardware=TWO_GPUS):
    return decide_backend(
        requested, forced=forced, local_rank=local_rank, local_world_size=local_world_size, **hardware
    )


def test_the_backend_follows_the_request_then_the_hardware():
    assert _decide() == ("nccl", None)
    assert _decide("gloo") == ("gloo", None)  # a GPU host can still compute on its CPUs
    assert _decide(forced="gloo", requested="nccl") == ("gloo", None)  # TRIDENT_BACKEND wins
    assert _decide(hardware=NO_GPU) == ("gloo", None)
    # Megatron's scripts pass --distributed-backend nccl; on a laptop that is gloo with one warning.
    assert _decide("nccl", hardware=NO_GPU) == (
        "gloo",
        "WARNING: --distributed-backend nccl needs CUDA, which this machine does not have: using gloo",
    )
    assert _decide(local_rank=1, local_world_size=2) == ("nccl", None)


def test_nccl_where_it_cannot_work_is_one_line_naming_the_numbers():
    with pytest.raises(DeviceError) as err:
        _decide(forced="nccl", hardware=NO_GPU)
    assert str(err.value) == "TRIDENT_BACKEND=nccl needs CUDA, and this machine has no usable GPU"
    too_many = (
        "{source} needs one GPU per process, but this node runs 4 processes (LOCAL_RANK {rank}, "
        "LOCAL_WORLD_SIZE 4) and sees 2 GPU(s): start at most 2 per node (torchrun --nproc-per-node 2) "
        "or use --distributed-backend gloo"
    )
    for rank in range(4):  # every rank of the node says it, not only the ones without a GPU
        with pytest.raises(DeviceError) as err:
            _decide("nccl", local_rank=rank, local_world_size=4)
        assert str(err.value) == too_many.format(source="--distributed-backend nccl", rank=rank)
    with pytest.raises(DeviceError) as err:
        _decide(local_rank=3, local_world_size=4)
    assert str(err.value) == too_many.format(source="NCCL (the default where GPUs exist)", rank=3)
    with pytest.raises(DeviceError, match="TRIDENT_BACKEND='mpi' is not a backend Trident runs on"):
        _decide(forced="mpi")
    assert _decide("gloo", local_rank=3, local_world_size=4) == ("gloo", None)  # gloo needs no GPU
    assert local_gpu_index(1, 2, 2) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_forced_nccl_without_cuda_stops_pretrain_before_any_process_group(monkeypatch, capsys):
    import torch.distributed as dist

    from training.training import pretrain

    monkeypatch.setenv("TRIDENT_BACKEND", "nccl")
    argv = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2"
    argv += " --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64"
    with pytest.raises(DeviceError, match="^TRIDENT_BACKEND=nccl needs CUDA"):
        pretrain(None, None, None, argv=argv.split())
    assert not dist.is_initialized()


def test_the_hf_importer_learns_a_model_s_tensors_without_allocating_them():
    """``gpt_tensor_specs`` (what an import must write) builds the model on the meta device: on a GPU
    host the whole model used to land on ``cuda:0``. Every tensor made while it runs is counted by a
    dispatch mode; 4 layers of LLaMA-3-8B's shape (1.9 B parameters) make none with memory beyond
    the RoPE table's few bytes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.gpt import llama_config
    from training.checkpoint.specs import gpt_tensor_specs

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.bytes += t.untyped_storage().nbytes()
            return out

    config = llama_config(
        num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336
    )
    with Allocations() as allocations:
        specs, _ = gpt_tensor_specs(config, 128256, 8192)
    numel = sum(torch.Size(spec.shape).numel() for spec in specs.values())
    assert numel == 2 * 128256 * 4096 + 4 * 218112000 + 4096  # the whole model is described ...
    assert allocations.bytes < 2**20, allocations.bytes  # ... and none of it allocated

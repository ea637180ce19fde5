"""Trident on one CUDA GPU at world size 1 on NCCL (issue 16): skipped without CUDA.

``tools/gpu_check.py`` runs this module on a GPU machine (``pytest -m cuda tests/unit/test_cuda.py``).

* fp32 with TF32 off: losses and gradients of GPT-2 and LLaMA (GQA) equal the CPU's within 1e-5;
  a bf16 ``pretrain()`` on the GPU follows the CPU's within 1e-2.
* The word embedding's fused gradient (``--gradient-accumulation-fusion``) repeats bit for bit and
  equals the CPU's within 1e-5.
* Attention runs under ``sdpa_kernel(FLASH_ATTENTION)`` (nothing else allowed) with GQA, batch 2,
  causal masking, and ``--attention-softmax-in-fp32``.
* 20 steps of ``pretrain()`` under ``torch.cuda.set_sync_debug_mode("error")`` outside logging steps:
  any call that makes the host wait for the GPU raises.
* The distributed optimizer with gradient and parameter overlap at world size 1 on NCCL: the same
  losses as the plain optimizer; its ``--timeline-dir`` holds CUDA-event times.
* A checkpoint save (synchronous and ``--async-save``'s saver) and a load on the GPU allocate no
  more than 5% of training's peak device memory.
* ``--record-memory-history`` dumps the allocator's history at each log step.
"""

from __future__ import annotations

import json

import pytest
import torch

from core.device import building_on
from core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from models.gpt import GPTModel
from tests.support.gpt_model import SEQ, VOCAB, make_batches, make_config, rel
from tests.support.pipeline_toy import reference_loss_and_grads
from tests.support.pretrain_run import pretrain_gpt_in_process

pytestmark = pytest.mark.cuda

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --eval-interval 1000 --eval-iters 0 --lr 1e-3 --mock-data --num-workers 0 "
    "--tokenizer-type NullTokenizer --vocab-size 127 --seed 7 --hidden-dropout 0 --attention-dropout 0"
)
LLAMA = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --group-query-attention "
    "--num-query-groups 2 --untie-embeddings-and-output-weights --disable-bias-linear"
)


def _pretrain(flags: str, hook=None):
    """``pretrain()`` in this process; ``--distributed-backend gloo`` keeps it on the CPU."""
    return pretrain_gpt_in_process(argv=f"{TINY} {flags}".split(), iteration_hook=hook)


def _twins(kind: str, **overrides) -> tuple[GPTModel, GPTModel]:
    """The same model on the CPU and on the GPU, with the CPU's weights."""
    with building_on("cpu"):
        cpu = GPTModel(make_config(kind, **overrides), VOCAB, SEQ)
    with building_on("cuda"):
        gpu = GPTModel(make_config(kind, **overrides), VOCAB, SEQ)
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def _on_gpu(batches):
    return [tuple(t.cuda() for t in batch) for batch in batches]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_fp32_losses_and_gradients_equal_the_cpu(kind, no_tf32):
    cpu, gpu = _twins(kind)
    batches = make_batches(2)
    ref_loss, ref_grads = reference_loss_and_grads(cpu, batches, per_token=True)
    loss, grads = reference_loss_and_grads(gpu, _on_gpu(batches), per_token=True)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    worst = max(rel(grads[name].cpu(), grad) for name, grad in ref_grads.items())
    print(f"{kind} fp32 CUDA vs CPU: loss {loss.item():.8f} vs {ref_loss.item():.8f}, worst grad {worst:.2e}")
    assert worst <= 1e-5


def test_the_fused_embedding_gradient_repeats_bit_for_bit_and_equals_the_cpu(no_tf32):
    """``--gradient-accumulation-fusion`` on a tied GPT: the embedding adds its rows into ``main_grad``
    with ``index_put_`` on a GPU (sorted; ``index_add_``'s atomics would sum a repeated token in any
    order), after the tied output layer's product. Two backwards give the same bits; the CPU agrees."""
    tokens = make_batches(1)[0][0]
    tokens[:, ::2] = 3  # a token repeated in every sequence: its row sums many gradients
    config = make_config("gpt", gradient_accumulation_fusion=True)
    weights = GPTModel(config, VOCAB, SEQ).state_dict()
    grads = []
    for device in ("cpu", "cuda", "cuda"):
        with building_on(device):
            model = DistributedDataParallel(
                config, DistributedDataParallelConfig(), GPTModel(config, VOCAB, SEQ)
            )
        model.module.load_state_dict(weights)
        batch = tokens.to(device)
        model(batch, labels=batch.roll(1, 1)).sum().backward()
        model.finish_grad_sync()
        grads.append(model.module.embedding.word_embeddings.weight.main_grad.cpu())
    assert torch.equal(grads[1], grads[2])
    assert rel(grads[1], grads[0]) <= 1e-5


def test_a_bf16_run_follows_the_cpu_within_1e_2():
    flags = f"{LLAMA} --bf16 --train-iters 3 --log-interval 1"
    on_cpu = _pretrain(f"{flags} --distributed-backend gloo")
    on_gpu = _pretrain(f"{flags} --distributed-backend nccl")
    for cpu_step, gpu_step in zip(on_cpu.losses, on_gpu.losses, strict=True):
        assert abs(gpu_step["lm loss"] - cpu_step["lm loss"]) <= 1e-2 * cpu_step["lm loss"]
    print(
        f"bf16 lm loss CPU {[s['lm loss'] for s in on_cpu.losses]}, GPU {[s['lm loss'] for s in on_gpu.losses]}"
    )


def test_bf16_main_weights_step_with_the_fused_kernel_and_follow_the_cpu_within_1e_2():
    """``--megatron-fsdp-main-params-dtype auto`` under ZeRO-3: fused AdamW steps the bf16 weight shards
    with bf16 moments on the GPU (on the CPU, ``foreach``), and the losses follow the CPU's."""
    flags = (
        f"{LLAMA} --bf16 --train-iters 3 --log-interval 1 --use-megatron-fsdp "
        "--megatron-fsdp-main-params-dtype auto"
    )
    on_cpu = _pretrain(f"{flags} --distributed-backend gloo")
    on_gpu = _pretrain(f"{flags} --distributed-backend nccl")
    for cpu_step, gpu_step in zip(on_cpu.losses, on_gpu.losses, strict=True):
        assert abs(gpu_step["lm loss"] - cpu_step["lm loss"]) <= 1e-2 * cpu_step["lm loss"]


def test_attention_runs_on_flash_with_gqa_batches_and_causal_masking():
    """Only the flash kernel is allowed: SDPA raises where the call is not eligible for it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cpu, gpu = _twins("llama", attention_softmax_in_fp32=True)  # GQA: 4 heads, 2 groups; batch 2
    assert gpu.config.num_query_groups < gpu.config.num_attention_heads
    batches = make_batches(2)
    ref_loss, _ = reference_loss_and_grads(cpu, batches, per_token=True)
    gpu.to(torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        loss, grads = reference_loss_and_grads(gpu, _on_gpu(batches), per_token=True)
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert abs(loss.float().item() - ref_loss.item()) <= 2e-2 * ref_loss.item()


def test_twenty_steps_make_no_host_wait_outside_logging_steps():
    """Steps 2-21 run with synchronising calls turned into errors; step 22 logs (and reads)."""

    def hook(state):
        if state.iteration == 1:
            torch.cuda.set_sync_debug_mode("error")
        elif state.iteration == 21:
            torch.cuda.set_sync_debug_mode("default")

    try:
        state = _pretrain(f"{LLAMA} --bf16 --clip-grad 1.0 --train-iters 22 --log-interval 22", hook)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert state.iteration == 22 and len(state.losses) == 22


def test_the_memory_history_is_dumped_at_each_log_step_on_the_profiled_rank(tmp_path):
    """``--record-memory-history`` (Megatron's flag): recorded from before the model is built, dumped as
    ``<path>_<rank>.pickle`` at log steps, with the model's allocations in its trace."""
    import pickle

    path = tmp_path / "memory" / "snapshot.pickle"
    flags = "--distributed-backend nccl --train-iters 2 --log-interval 1 --record-memory-history"
    try:
        _pretrain(f"{flags} --memory-snapshot-path {path}")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    snapshot = pickle.loads((tmp_path / "memory" / "snapshot_0.pickle").read_bytes())
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])


def test_distributed_optimizer_and_overlap_on_nccl_match_the_plain_optimizer(tmp_path, no_tf32):
    from training.reporting.timeline import load_trace

    flags = f"{LLAMA} --train-iters 4 --log-interval 2 --distributed-backend nccl"
    plain = _pretrain(flags)
    overlapped = _pretrain(
        f"{flags} --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        f"--timeline-dir {tmp_path} --timeline-iters 3"
    )
    for a, b in zip(plain.losses, overlapped.losses, strict=True):
        assert abs(a["lm loss"] - b["lm loss"]) <= 1e-5 * a["lm loss"]
    data = load_trace(str(tmp_path / "timeline.json"))
    assert data.clock == "cuda"
    ((_, _, _, start, end), *_) = data.iterations[0].ranks[0].events
    assert 0.0 <= start <= end
    assert json.loads((tmp_path / "timeline.json").read_text())["trident"]["clock"] == "cuda"


def _train_on_gpu(steps: int):
    """A 4 x 256 GPT on this GPU at world size 1 on NCCL with Adam, trained ``steps`` steps."""
    from core import parallel_state as ps
    from core.device import select_backend
    from core.distributed import finalize_model_grads
    from core.optimizer import OptimizerConfig, get_megatron_optimizer
    from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout
    from tests.dist.test_gpt_model import _train_step

    select_backend("nccl")
    ps.initialize_distributed()
    ps.initialize_model_parallel(1, 1)
    config = make_config(
        "gpt",
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        finalize_model_grads_func=finalize_model_grads,
    )
    chunks = parallelize_gpt(gpt_provider(config, 1024, SEQ), layout=pipeline_layout(config)).modules
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), chunks)
    for step in range(steps):
        optimizer.zero_grad()
        _train_step(ps, chunks, _on_gpu(make_batches(2, seed=step)))
        optimizer.step()
    return chunks, optimizer


def test_a_save_and_a_load_on_the_gpu_stay_within_5_percent_of_training_memory(tmp_path):
    from core import parallel_state as ps
    from core.device import select_backend
    from training.checkpoint.async_save import CheckpointSaver
    from training.checkpoint.load import load_checkpoint, save_checkpoint

    torch.cuda.reset_peak_memory_stats()
    try:
        chunks, optimizer = _train_on_gpu(2)
        training_peak = torch.cuda.max_memory_allocated()
        extra = {}
        for name, action in {
            "save": lambda: save_checkpoint(
                str(tmp_path / "sync"), 2, model_chunks=chunks, optimizer=optimizer
            ),
            "async save": lambda: _async_save(CheckpointSaver, tmp_path / "async", chunks, optimizer),
            "load": lambda: load_checkpoint(str(tmp_path / "sync"), model_chunks=chunks, optimizer=optimizer),
        }.items():
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            action()
            torch.cuda.synchronize()
            extra[name] = torch.cuda.max_memory_allocated() - before
            assert torch.cuda.max_memory_allocated() <= 1.05 * training_peak, name
        print(f"training peak {training_peak / 2**20:.1f} MiB; above it during {extra} bytes")
        assert all(v <= 0.05 * training_peak for v in extra.values()), (extra, training_peak)
    finally:
        ps.destroy_distributed()
        select_backend(None)


def _async_save(saver_class, directory, chunks, optimizer) -> None:
    saver = saver_class(async_save=True)
    saver.save(str(directory), 2, model_chunks=chunks, optimizer=optimizer)
    saver.wait()

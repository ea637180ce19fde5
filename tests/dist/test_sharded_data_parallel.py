"""Sharded data parallelism (Megatron-FSDP's strategies): every strategy trains the model no_shard trains.

Core level: a GPT chunk wrapped for data parallelism takes a few Adam steps of two microbatches each
(gradient accumulation), clipped, under ``no_shard`` and under each strategy, from the same initial
weights; the losses and the final weights must agree. Training level: pretrain() with the flags, at
DP2 x PP2 (1F1B, interleaved) and DP2 x TP2, gives the losses of the unsharded run.

Tolerance: ``optim`` does the same additions in the same order as ``no_shard`` (1e-6 on fp32).
``optim_grads`` and ``optim_grads_params`` reduce every microbatch separately, so a gradient is
(a1 + b1) + (a2 + b2) instead of (a1 + a2) + (b1 + b2): fp32 rounding, ~1e-7 relative per element,
which Adam's normalisation lifts where a gradient is zero in exact arithmetic (the key bias: its
update is then +-lr times the sign of rounding noise; measured 1.6e-5 relative on that tensor after
three steps, <= 4e-6 on every other). So: losses within 1e-6, weights within 5e-5 (per tensor, the
design's "within x"), and optim_grads_params bit-identical to optim_grads (the same reductions; the
gathered parameters are the shards themselves).
"""

from __future__ import annotations

import pytest
import torch

VOCAB = 64
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
TOLERANCE = {"optim": 1e-6, "optim_grads": 5e-5, "optim_grads_params": 5e-5}


def _chunk(strategy: str, tp: int, bf16: bool, initial: dict | None):
    from core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from core.transformer import TransformerConfig
    from models.gpt import GPTModel

    config = TransformerConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config, VOCAB, 16)
    if bf16:
        model = model.bfloat16()
    if initial is not None:
        model.load_state_dict(initial)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=strategy != "no_shard",
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True,
        bucket_size=1500,
    )
    return DistributedDataParallel(config, ddp_config, model)


def _steps(chunk, optimizer, dp_rank: int, steps: int = 3) -> tuple[list[float], dict[str, int]]:
    """Adam steps of two microbatches each: the losses of this rank's microbatches, and the bytes of
    parameters and gradients the chunk holds between steps."""
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(2):
            gen = torch.Generator().manual_seed(100 * step + 10 * dp_rank + micro)
            tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
            context = chunk.no_sync() if micro == 0 else torch.enable_grad()
            with context:
                loss = chunk(tokens, labels=torch.roll(tokens, -1, 1)).float().mean() / 2
                loss.backward()
            losses.append(float(loss.detach()))
        chunk.finish_grad_sync()
        applied, _, _ = optimizer.step()
        assert applied
    between_steps = chunk.persistent_bytes()
    chunk.finish_param_sync()
    return losses, between_steps


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _strategy_case(rank, world_size, tp: int, bf16: bool):
    from core import parallel_state as ps
    from core.optimizer import OptimizerConfig, get_megatron_optimizer
    from core.tensor_parallel.random import model_parallel_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    dp_rank = ps.get_data_parallel_rank()
    torch.manual_seed(0)
    model_parallel_seed(1234)
    reference = _chunk("no_shard", tp, bf16, None)
    initial = {k: v.clone() for k, v in reference.module.state_dict().items()}
    config = OptimizerConfig(lr=1e-2, bf16=bf16, clip_grad=0.05)  # the clip is active: the norm matters
    expected, memory = _steps(reference, get_megatron_optimizer(config, [reference]), dp_rank)
    want = dict(reference.module.named_parameters())
    out, final = {}, {}
    for strategy in STRATEGIES:
        chunk = _chunk(strategy, tp, bf16, initial)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(lr=1e-2, bf16=bf16, clip_grad=0.05, use_distributed_optimizer=True), [chunk]
        )
        losses, between_steps = _steps(chunk, optimizer, dp_rank)
        loss_difference = max(abs(x - y) / abs(y) for x, y in zip(losses, expected))
        weights = max(_relative(p, want[n]) for n, p in chunk.module.named_parameters())
        final[strategy] = [p.detach().clone() for p in chunk.module.parameters()]
        optimizer.zero_grad()
        out[strategy] = (loss_difference, weights, between_steps)
    out["no_shard"] = (0.0, 0.0, memory)
    out["zero3 is zero2"] = all(torch.equal(a, b) for a, b in zip(final["optim_grads"], final["optim_grads_params"]))
    return out


@pytest.mark.parametrize(("world", "tp"), [(2, 1), (4, 2)], ids=["DP2", "DP2xTP2"])
def test_every_strategy_trains_the_weights_no_shard_trains(ranks, world, tp):
    for rank, out in enumerate(ranks(world).run(_strategy_case, tp, False, timeout=240)):
        for strategy in STRATEGIES:
            losses, weights, memory = out[strategy]
            print(f"rank {rank} {strategy}: losses {losses:.1e}, weights {weights:.1e}, bytes {memory}")
            assert losses <= 1e-6 and weights <= TOLERANCE[strategy], strategy
        assert out["zero3 is zero2"]
        unsharded, dp = out["no_shard"][2], world // tp
        # Between steps: ZeRO-2 holds 1/DP of the gradients, ZeRO-3 also 1/DP of the parameters
        # (give or take each layer's padding to a multiple of lcm(DP, 128) elements).
        assert out["optim_grads"][2]["grads"] <= unsharded["grads"] / dp * 1.1
        assert out["optim_grads_params"][2]["params"] <= unsharded["params"] / dp * 1.1
        assert out["optim_grads"][2]["params"] >= unsharded["params"] * 0.9


# --------------------------------------------------------------------------------------------------
# pretrain() under the flags: the losses of the unsharded run, through the pipeline schedules
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    from tests.dist.test_distributed_optimizer import synthetic_corpus

    return synthetic_corpus(tmp_path_factory.mktemp("corpus"))


SPLITS = {
    "PP2xDP2": ["--pipeline-model-parallel-size", "2"],
    "PP2xVPP2xDP2": ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
    "TP2xDP2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--calculate-per-token-loss"],
}


def _pretrain_losses(pool, flags) -> list[float]:
    from tests.dist.test_distributed_optimizer import run_pretrain

    curves = [losses for losses, _, _ in pool.run(run_pretrain, flags, timeout=300) if losses]
    assert curves and all(c == curves[0] for c in curves)
    return curves[0]


@pytest.mark.parametrize("strategy", ["optim_grads"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_pretrain_under_a_strategy_gives_the_unsharded_losses(ranks, data_prefix, split, strategy):
    from tests.dist.test_distributed_optimizer import small_gpt

    common = small_gpt(data_prefix, 3, *SPLITS[split], "--ddp-bucket-size", "3000", "--overlap-grad-reduce")
    plain = _pretrain_losses(ranks(4), common)
    sharded = _pretrain_losses(
        ranks(4), common + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    )
    difference = max(abs(x - y) / abs(y) for x, y in zip(sharded, plain))
    print(f"{split} {strategy}: largest relative loss difference {difference:.1e}")
    assert len(sharded) == len(plain) == 3 and difference <= 1e-5

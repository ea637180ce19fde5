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
gathered parameters are the shards themselves). At DP3 even ``optim`` sums three ranks' gradients in
another order than ``no_shard`` (gloo's ring cuts a padded bucket into other chunks): 5e-5 for all.

The core-level cases run without pipelining, where ``--data-parallel-sharding-scope auto`` is the
microbatch scope described above; the pretrain() cases with PP2 run at step scope (its default under
pipelining: one reduce-scatter per bucket and step, ZeRO-1's sums), within the same bounds. The scope's
own tests (below) compare the two scopes with each other.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

VOCAB = 64
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
TOLERANCE = {"optim": 1e-6, "optim_grads": 5e-5, "optim_grads_params": 5e-5}


def _chunk(strategy: str, tp: int, bf16: bool, initial: dict | None, moe: dict | None = None, **options):
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
        **(moe or {}),  # MoE layers: the experts' fields
    )
    model = GPTModel(config, VOCAB, 16)
    if bf16:
        model = model.bfloat16()
    if initial is not None:
        model.load_state_dict(initial)
    ddp_config = DistributedDataParallelConfig(
        **{
            "use_distributed_optimizer": strategy != "no_shard",
            "data_parallel_sharding_strategy": strategy,
            "overlap_grad_reduce": True,
            "overlap_param_gather": strategy != "no_shard",  # ZeRO-3: each layer prefetches the next one's
            "bucket_size": 1500,
            **options,  # num_distributed_optimizer_instances, outer_dp_sharding_strategy (HSDP), the scope
        }
    )
    return DistributedDataParallel(config, ddp_config, model)


def _steps(chunk, optimizer, dp_rank: int, steps: int = 3) -> tuple[list[float], dict[str, int]]:
    """Adam steps of two microbatches each: the losses of this rank's microbatches and each step's
    gradient norm, and the bytes of parameters and gradients the chunk holds between steps."""
    from core.distributed.finalize_model_grads import finalize_model_grads
    from core.distributed.sharding_units import layer_units

    losses, peak, in_flight = [], [0], 0
    layers = layer_units(chunk.module)
    layer_buckets = {id(chunk.param_to_bucket[p]) for layer in layers for p in layer.parameters()}

    def measure(module, args) -> None:  # runs after the wrapper's own pre-hook gathered the layer
        live = [b for b in chunk.buckets if id(b) in layer_buckets and getattr(b, "params_live", True)]
        peak[0] = max(peak[0], len(live))

    handles = [layer.register_forward_pre_hook(measure) for layer in layers]
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
        queues = [getattr(b, "in_flight_queue", []) for b in chunk.buckets]
        in_flight = max(in_flight, *map(len, queues))  # microbatch reductions not landed when backward ends
        finalize_model_grads([chunk])  # DP, and over TP the sequence-parallel norms' gradients
        applied, grad_norm, _ = optimizer.step()
        assert applied
        losses.append(grad_norm)  # summed over the shards of every rank: the unsharded norm
    for handle in handles:
        handle.remove()
    between_steps = chunk.persistent_bytes()
    between_steps["layers gathered at once"] = peak[0]
    between_steps["reductions in flight"] = in_flight
    between_steps["buckets"] = len(chunk.buckets)
    between_steps["traffic"] = sorted(
        {(getattr(b, "reductions", 1), getattr(b, "gathers", 1)) for b in chunk.buckets}
    )
    chunk.finish_param_sync()
    return losses, between_steps


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _strategy_case(
    rank, world_size, tp: int, bf16: bool, main_params_dtype=torch.float32, clip: float = 0.05, **options
):
    from core import parallel_state as ps
    from core.optimizer import OptimizerConfig, get_megatron_optimizer
    from core.tensor_parallel.random import model_parallel_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    dp_rank = ps.get_data_parallel_rank()
    torch.manual_seed(0)
    model_parallel_seed(1234)
    reference = _chunk("no_shard", tp, bf16, None)
    initial = {k: v.clone() for k, v in reference.module.state_dict().items()}
    # The clip is active by default: the norm matters.
    config = OptimizerConfig(lr=1e-2, bf16=bf16, clip_grad=clip, main_params_dtype=main_params_dtype)
    from tests.dist.test_distributed_optimizer import _state_bytes

    full_optimizer = get_megatron_optimizer(config, [reference])
    expected, memory = _steps(reference, full_optimizer, dp_rank)
    memory["optimizer"] = _state_bytes(full_optimizer)
    want = dict(reference.module.named_parameters())
    out, final = {}, {}
    for strategy in STRATEGIES:
        chunk = _chunk(strategy, tp, bf16, initial, **(options if strategy != "optim" else {}))
        optimizer = get_megatron_optimizer(replace(config, use_distributed_optimizer=True), [chunk])
        losses, between_steps = _steps(chunk, optimizer, dp_rank)
        between_steps["optimizer"] = _state_bytes(optimizer)
        loss_difference = max(abs(x - y) / abs(y) for x, y in zip(losses, expected))
        weights = max(_relative(p, want[n]) for n, p in chunk.module.named_parameters())
        final[strategy] = [p.detach().clone() for p in chunk.module.parameters()]
        optimizer.zero_grad()
        out[strategy] = (loss_difference, weights, between_steps)
    out["no_shard"] = (0.0, 0.0, memory)
    out["zero3 is zero2"] = all(
        torch.equal(a, b) for a, b in zip(final["optim_grads"], final["optim_grads_params"])
    )
    return out


@pytest.mark.parametrize(
    ("world", "tp", "bf16"),
    [(2, 1, False), (4, 2, False), (2, 1, True), (3, 1, False), (4, 1, True)],
    ids=["DP2", "DP2xTP2", "DP2 bf16", "DP3 (odd: shards split parameters unevenly)", "DP4 bf16"],
)
def test_every_strategy_trains_the_weights_no_shard_trains(ranks, world, tp, bf16):
    for rank, out in enumerate(ranks(world).run(_strategy_case, tp, bf16, timeout=240)):
        for strategy in STRATEGIES:
            losses, weights, memory = out[strategy]
            print(f"rank {rank} {strategy}: losses {losses:.1e}, weights {weights:.1e}, bytes {memory}")
            limit = TOLERANCE[strategy] if world // tp == 2 else TOLERANCE["optim_grads"]
            assert losses <= 1e-6 and weights <= limit, strategy
        assert out["zero3 is zero2"]
        unsharded, dp = out["no_shard"][2], world // tp
        # Between steps: ZeRO-2 holds 1/DP of the gradients, ZeRO-3 also 1/DP of the parameters
        # (give or take each layer's padding to a multiple of lcm(DP, 128) elements).
        assert out["optim_grads"][2]["grads"] <= unsharded["grads"] / dp * 1.1
        assert out["optim_grads_params"][2]["params"] <= unsharded["params"] / dp * 1.1
        assert out["optim_grads"][2]["params"] >= unsharded["params"] * 0.9
        # Traffic of the last step, per bucket (M = 2 microbatches): M reduce-scatters under ZeRO-2/3
        # (ZeRO-1: one) and ZeRO-2's one all-gather after the step; ZeRO-3 gathers each layer's
        # parameters once per microbatch in forward and again in backward, 2M, but the chunk's own and
        # the last layer's only in forward, M (no pipeline: they stay gathered into the backward).
        assert out["optim_grads"][2]["traffic"] == [(2, 1)]
        assert out["optim_grads_params"][2]["traffic"] == [(2, 2), (2, 4)]
        # A bucket per layer (3) and at least one for the rest; in forward ZeRO-3 holds its shards, the
        # chunk's own unit, the layer running and the next one (prefetched), never all three layers.
        assert out["optim_grads_params"][2]["buckets"] >= 4
        assert out["optim_grads_params"][2]["layers gathered at once"] == 2
        # Weights, gradients and optimizer state between steps: at DP4 ZeRO-3 keeps about a quarter.
        total = {
            k: sum(out[k][2][key] for key in ("params", "grads", "optimizer")) for k in out if k in STRATEGIES
        }
        total["no_shard"] = sum(unsharded[key] for key in ("params", "grads", "optimizer"))
        print(
            f"rank {rank} DP{dp} bytes per rank, x no_shard: { ({k: round(v / total['no_shard'], 3) for k, v in total.items()}) }"
        )
        if dp == 4:
            assert total["optim_grads_params"] <= 0.3 * total["no_shard"]


def test_bf16_main_weights_under_every_strategy_train_what_no_shard_trains_in_a_third_of_the_state(ranks):
    """``--megatron-fsdp-main-params-dtype auto`` on a bf16 model: every strategy steps the bf16 weights (or
    their shards) with bf16 moments, and ends on no_shard's weights bit for bit, given no_shard's sums:
    ZeRO-2/3 at step scope (one reduction a step) and no clipping (the shards' norm is summed in another
    order: the logged norms, which sit in the compared values with the losses, agree within 1e-5). The
    clipped microbatch-scope comparison of the fp32-main test does not carry over: bf16 rounds the few
    gradient elements those sums change, and Adam turns the change into a full update (3.7e-2 relative
    on the attention's key bias, whose gradient is zero in exact arithmetic)."""
    step = {"clip": 0.0, "data_parallel_sharding_scope": "step"}
    results = ranks(2).run(_strategy_case, 1, True, torch.bfloat16, timeout=240, **step)
    fp32_main = ranks(2).run(_strategy_case, 1, True, timeout=240)
    for rank, (out, wide) in enumerate(zip(results, fp32_main)):
        for strategy in STRATEGIES:
            losses, weights, memory = out[strategy]
            print(f"rank {rank} {strategy}: losses {losses:.1e}, weights {weights:.1e}, bytes {memory}")
            assert losses <= 1e-5 and weights == 0.0, strategy
            # Adam's two moments in bf16 and no main copy: 4 bytes a parameter against 12.
            assert memory["optimizer"] * 3 == wide[strategy][2]["optimizer"], strategy
        assert out["zero3 is zero2"]
        assert out["no_shard"][2]["optimizer"] * 3 == wide["no_shard"][2]["optimizer"]


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
    "PP2xDP2 zb-h1": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
    "PP2xDP2 gpipe, full recompute": [
        *("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"),
        *("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
    ],
    "DP4 selective recompute": ["--recompute-activations"],
    "DP4 full recompute": [  # the last layer, kept gathered from forward into backward, recomputed
        *("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"),
    ],
    "PP2xDP2 zbv, untied": [
        *("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"),
        *("--pipeline-schedule", "zbv", "--untie-embeddings-and-output-weights"),
    ],
    "CP2xDP2": ["--context-parallel-size", "2"],
    "TP2xDP2 fused accumulation": [
        *("--tensor-model-parallel-size", "2", "--sequence-parallel", "--gradient-accumulation-fusion"),
    ],
    "PP2xDP2 zb-h1 fused accumulation": [
        *(
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-schedule",
            "zb-h1",
            "--gradient-accumulation-fusion",
        ),
    ],
    "PP2xDP2 bf16": ["--pipeline-model-parallel-size", "2", "--bf16"],
    "PP2xDP2 fp16": ["--pipeline-model-parallel-size", "2", "--fp16", "--initial-loss-scale", "1024"],
    "EP2xDP2 MoE": [
        *("--num-experts", "4", "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", "2"),
        *("--moe-layer-freq", "([1]*3+[0])"),
    ],
}


def _pretrain_losses(pool, flags) -> list[float]:
    from tests.dist.test_distributed_optimizer import run_pretrain

    curves = [losses for losses, _, _ in pool.run(run_pretrain, flags, timeout=300) if losses]
    assert curves and all(c == curves[0] for c in curves)
    return curves[0]


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_pretrain_under_a_strategy_gives_the_unsharded_losses(ranks, data_prefix, split, strategy):
    """``--overlap-param-gather`` too: ZeRO-2 gathers after the step as ZeRO-1 does, ZeRO-3 prefetches
    the next layer's parameters while a layer computes."""
    from tests.dist.test_distributed_optimizer import small_gpt

    common = small_gpt(data_prefix, 3, *SPLITS[split], "--ddp-bucket-size", "3000", "--overlap-grad-reduce")
    plain = _pretrain_losses(ranks(4), common)
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy, "--overlap-param-gather"]
    sharded = _pretrain_losses(ranks(4), common + fsdp)
    difference = max(abs(x - y) / abs(y) for x, y in zip(sharded, plain))
    print(f"{split} {strategy}: largest relative loss difference {difference:.1e}")
    assert len(sharded) == len(plain) == 3 and difference <= 1e-5


# --------------------------------------------------------------------------------------------------
# The sharding scope: per step (1 all-gather, 1 reduce-scatter per bucket) against per microbatch
# --------------------------------------------------------------------------------------------------


def _scope_case(rank, world_size):
    """ZeRO-2 and ZeRO-3 at microbatch and at step scope, from the same weights, no pipeline: each run's
    losses and norms, final weights and what ``_steps`` measures."""
    from core import parallel_state as ps
    from core.optimizer import OptimizerConfig, get_megatron_optimizer
    from core.tensor_parallel.random import model_parallel_seed

    ps.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_seed(1234)
    initial = {k: v.clone() for k, v in _chunk("no_shard", 1, False, None).module.state_dict().items()}
    out = {}
    for strategy in ("optim_grads", "optim_grads_params"):
        for scope in ("microbatch", "step"):
            chunk = _chunk(strategy, 1, False, initial, data_parallel_sharding_scope=scope)
            optimizer = get_megatron_optimizer(
                OptimizerConfig(lr=1e-2, clip_grad=0.05, use_distributed_optimizer=True), [chunk]
            )
            losses, between_steps = _steps(chunk, optimizer, ps.get_data_parallel_rank())
            weights = [p.detach().clone() for p in chunk.module.parameters()]
            chunk.keep_gathered_params()  # _steps gathered them to be read
            chunk.eval()
            with torch.no_grad():  # an evaluation's forward frees what it gathers, at either scope
                chunk(torch.zeros(2, 16, dtype=torch.long))
            between_steps["gathered after evaluation"] = sum(b.params_live for b in chunk.buckets)
            out[strategy, scope] = (chunk.sharding_scope, losses, weights, between_steps)
    ps.destroy_model_parallel()
    return out


def test_sharding_per_step_trains_what_sharding_per_microbatch_trains_with_one_collective_each(ranks):
    """DP2, two microbatches a step, distinct data on every rank and microbatch. At step scope a bucket
    accumulates the step's microbatches and is reduce-scattered once, (a1 + a2) + (b1 + b2) where the
    microbatch scope sums (a1 + b1) + (a2 + b2): fp32 rounding, so losses and norms within 1e-6 and weights
    within 5e-5 (the module's bound for ZeRO-2/3 against no_shard; measured 0 to 1e-6 and up to 2e-5, the
    bias whose gradient is rounding noise). ZeRO-3 at step scope is ZeRO-2 at step scope bit for bit. Per
    bucket and step (reduce-scatters, all-gathers): (M, 1) and (M, 2M) per microbatch (ZeRO-3's (M, M) for
    the buckets kept from forward into backward: the chunk's own and the last layer's), (1, 1) per step,
    and every layer stays gathered (but not after an evaluation's forward, in eval mode); between steps
    the same 1/DP of parameters and gradients."""
    for out in ranks(2).run(_scope_case, timeout=240):
        for strategy in ("optim_grads", "optim_grads_params"):
            (mb_scope, per_microbatch, mb_weights, memory) = out[strategy, "microbatch"]
            (step_scope, per_step, step_weights, held) = out[strategy, "step"]
            assert (mb_scope, step_scope) == ("microbatch", "step")
            losses = max(abs(x - y) / abs(y) for x, y in zip(per_step, per_microbatch, strict=True))
            weights = max(_relative(a, b) for a, b in zip(step_weights, mb_weights, strict=True))
            print(f"{strategy}: step against microbatch scope: losses {losses:.1e}, weights {weights:.1e}")
            assert losses <= 1e-6 and weights <= 5e-5, strategy
            assert held["traffic"] == [(1, 1)], strategy
            assert memory["traffic"] == ([(2, 2), (2, 4)] if strategy == "optim_grads_params" else [(2, 1)])
            assert (held["params"], held["grads"]) == (memory["params"], memory["grads"]), strategy
        assert out["optim_grads_params", "step"][1] == out["optim_grads", "step"][1]
        assert all(
            torch.equal(a, b)
            for a, b in zip(out["optim_grads_params", "step"][2], out["optim_grads", "step"][2], strict=True)
        )
        assert out["optim_grads_params", "microbatch"][3]["layers gathered at once"] == 2
        assert out["optim_grads_params", "step"][3]["layers gathered at once"] == 3
        assert [
            out["optim_grads_params", scope][3]["gathered after evaluation"]
            for scope in ("microbatch", "step")
        ] == [0, 0]


SCHEDULES = {  # (pipeline size, virtual size, --pipeline-schedule, untied embeddings)
    "PP2 1F1B": (2, None, "1f1b", False),
    "PP2xVPP2 interleaved": (2, 2, "1f1b", False),
    "PP2 zb-h1": (2, None, "zb-h1", False),
    "PP2xVPP2 zbv": (2, 2, "zbv", True),
}


def _pipelined_scope_case(rank, world_size, schedule: str, strategy: str, microbatches: int, overlap: bool):
    """PP2 x DP2 through the real schedule: two optimizer steps of ``microbatches`` microbatches at
    microbatch and at step scope from the same weights, on data that differ between microbatches and
    steps but not between the two data-parallel ranks. Each scope's losses, final weights (this rank's
    chunks, by name) and per-bucket traffic of the last step."""
    from core import parallel_state as ps
    from core.distributed import DistributedDataParallelConfig
    from core.optimizer import OptimizerConfig, get_megatron_optimizer
    from core.pipeline_parallel.schedules import get_forward_backward_func
    from core.tensor_parallel import model_parallel_seed
    from models.gpt import gpt_provider, parallelize_gpt, pipeline_layout
    from tests.support.gpt_model import MBS, SEQ, VOCAB, make_batches, make_config
    from tests.support.pipeline_toy import run_schedule

    pp, vpp, name, untied = SCHEDULES[schedule]
    ps.initialize_model_parallel(1, pp, vpp)
    out = {}
    for scope in ("microbatch", "step"):
        model_parallel_seed(1234)
        config = make_config(
            "gpt",
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_schedule=name,
            untie_embeddings_and_output_weights=untied,
        )
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            data_parallel_sharding_strategy=strategy,
            data_parallel_sharding_scope=scope,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
        )
        model = parallelize_gpt(
            gpt_provider(config, VOCAB, SEQ), layout=pipeline_layout(config), ddp_config=ddp_config
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(lr=1e-2, clip_grad=0.05, use_distributed_optimizer=True), model.chunks
        )
        hooks, losses = model.schedule_hooks(optimizer), []
        for step in range(2):
            optimizer.zero_grad()
            logged = run_schedule(
                get_forward_backward_func(),
                model.chunks if len(model.chunks) > 1 else model.chunks[0],
                make_batches(microbatches, seed=10 + step),
                seq_length=SEQ,
                micro_batch_size=MBS,
                schedule_hooks=hooks,
            )
            losses += [float(x["lm loss"]) for x in logged]
            applied, norm, _ = optimizer.step()
            assert applied
            losses.append(norm)
        traffic = sorted({(b.reductions, b.gathers) for c in model.chunks for b in c.buckets})
        for chunk in model.chunks:
            chunk.finish_param_sync()
        weights = {n: p.detach().clone() for c in model.chunks for n, p in c.module.named_parameters()}
        out[scope] = (losses, weights, traffic, [c.sharding_scope for c in model.chunks])
    ps.destroy_model_parallel()
    return out


def _check_pipelined_scopes(
    ranks, schedule: str, strategy: str, microbatches: int = 4, overlap: bool = True
) -> None:
    """Step scope trains bit for bit what microbatch scope trains: with the two DP ranks' data equal, every
    reduction halves and doubles exactly (pre-scaled by 1/2, summed over 2), so both scopes add the same
    microbatch gradients in the same order. Per bucket and step (reduce-scatters, all-gathers): (1, 1) at
    step scope; M reduce-scatters per microbatch, ZeRO-3 gathering 2M times (fewer under zero-bubble,
    whose deferred W keeps a layer gathered for the next forward), ZeRO-2 once after the step."""
    zero3 = strategy == "optim_grads_params"
    for out in ranks(4).run(_pipelined_scope_case, schedule, strategy, microbatches, overlap, timeout=300):
        (mb_losses, mb_weights, mb_traffic, mb_scopes), (losses, weights, traffic, scopes) = (
            out["microbatch"],
            out["step"],
        )
        assert set(mb_scopes) == {"microbatch"} and set(scopes) == {"step"}
        assert losses == mb_losses and len(losses) in (2, 2 * (microbatches + 1))  # norms; losses on the last
        assert weights.keys() == mb_weights.keys() and all(
            torch.equal(weights[n], mb_weights[n]) for n in weights
        )
        assert traffic == [(1, 1)], (schedule, strategy, traffic)
        reductions = {r for r, _ in mb_traffic}
        gathers = {g for _, g in mb_traffic}
        assert reductions == {microbatches}, mb_traffic
        if not zero3:
            assert gathers == {1}, mb_traffic
        elif "zb" in schedule:
            assert max(gathers) <= 2 * microbatches, mb_traffic
        else:
            assert gathers == {2 * microbatches}, mb_traffic


@pytest.mark.parametrize(
    ("schedule", "strategy", "overlap"),
    [
        ("PP2 1F1B", "optim_grads", True),
        *((s, "optim_grads_params", True) for s in SCHEDULES),
        ("PP2 1F1B", "optim_grads_params", False),
    ],
)
def test_pipelined_sharding_per_step_trains_what_sharding_per_microbatch_trains(
    ranks, schedule, strategy, overlap
):
    """About a second each (the module's four ranks already up): 1F1B under ZeRO-2, every schedule under
    ZeRO-3, and ZeRO-3 without overlap (the step's reduction then in finish_grad_sync, as ZeRO-1's); the
    other schedules under ZeRO-2 are in the slow suite."""
    _check_pipelined_scopes(ranks, schedule, strategy, overlap=overlap)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "PP2 1F1B"])
def test_zero2_per_step_under_every_schedule_trains_what_zero2_per_microbatch_trains(ranks, schedule):
    _check_pipelined_scopes(ranks, schedule, "optim_grads")


@pytest.mark.slow
@pytest.mark.parametrize("split", ["PP2xDP2", "PP2xVPP2xDP2", "PP2xDP2 zb-h1", "TP2xDP2"])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_pretrain_sharding_per_step_gives_the_losses_of_sharding_per_microbatch(
    ranks, data_prefix, split, strategy
):
    """pretrain() on distinct data per rank: the default scope (step under pipelining, microbatch at TP2 x
    DP2) against the other one given explicitly; fp32 rounding of the sums' order, 1e-5 as the module's
    pretrain comparisons."""
    from tests.dist.test_distributed_optimizer import small_gpt

    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    common = small_gpt(
        data_prefix, 3, *SPLITS[split], *fsdp, "--overlap-grad-reduce", "--overlap-param-gather"
    )
    other = "microbatch" if "PP2" in split else "step"
    default = _pretrain_losses(ranks(4), common)
    given = _pretrain_losses(ranks(4), common + ["--data-parallel-sharding-scope", other])
    difference = max(abs(x - y) / abs(y) for x, y in zip(given, default, strict=True))
    print(f"{split} {strategy}: default scope against {other}: {difference:.1e}")
    assert len(given) == 3 and difference <= 1e-5


def _meta_device_case(ranks, data_prefix, split: str) -> None:
    """ZeRO-3 with the model built on the meta device (each rank materialises its shards bucket by bucket)
    trains with the losses of the model built whole, bit for bit: the same initial values, the same run."""
    from tests.dist.test_distributed_optimizer import small_gpt

    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    common = small_gpt(
        data_prefix, 3, *SPLITS[split], *fsdp, "--overlap-grad-reduce", "--overlap-param-gather"
    )
    whole = _pretrain_losses(ranks(4), common)
    meta = _pretrain_losses(ranks(4), common + ["--init-model-with-meta-device"])
    print(f"{split} optim_grads_params: losses {whole} whole, {meta} on the meta device")
    assert len(meta) == 3 and meta == whole


def test_zero3_on_the_meta_device_gives_the_losses_of_the_model_built_whole(ranks, data_prefix):
    _meta_device_case(ranks, data_prefix, "TP2xDP2")


@pytest.mark.slow
@pytest.mark.parametrize("split", ["PP2xVPP2xDP2", "EP2xDP2 MoE", "PP2xDP2 bf16"])
def test_zero3_on_the_meta_device_gives_the_whole_models_losses_under_other_splits(ranks, data_prefix, split):
    _meta_device_case(ranks, data_prefix, split)


@pytest.mark.slow
def test_zero3_on_the_meta_device_casts_fp8_weights_as_built_whole_at_tp2_dp2(ranks):
    """``--fp8-param-gather``: each held weight is cast as it is materialised, its amax reduced over its
    group (TP x DP here) one weight at a time; the losses are those of the weights cast when built whole."""
    from tests.dist.test_fp8_param_gather import FP8_FP32, HELD
    from tests.dist.test_fp8_param_gather import _losses as fp8_losses

    split = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-megatron-fsdp", *HELD]
    whole, _ = fp8_losses(ranks(4), FP8_FP32 + split)
    meta, _ = fp8_losses(ranks(4), FP8_FP32 + split + ["--init-model-with-meta-device"])
    print(f"TP2xDP2 ZeRO-3 FP8 weights: losses {whole} whole, {meta} on the meta device")
    assert len(meta) == 4 and meta == whole


# --------------------------------------------------------------------------------------------------
# --compile: compiled layers under ZeRO-3 beyond one rank
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # compiling takes about 30 s on 2 cores
@pytest.mark.parametrize("scope", ["step", "microbatch"])
def test_compiled_zero3_at_dp2_gives_the_eager_losses(ranks, data_prefix, scope):
    """DP2 ZeRO-3 with ``--compile`` (aot_eager: Dynamo's and AOTAutograd's graphs, no code generation),
    prefetching and overlapped reductions, at both scopes: the compiled layers read the gathered
    parameters (their storage filled again before each use at microbatch scope, kept through the step at
    step scope) and give the eager run's losses within float rounding."""
    from tests.dist.test_distributed_optimizer import small_gpt

    flags = small_gpt(
        data_prefix, 3, "--overlap-grad-reduce", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
        "optim_grads_params", "--overlap-param-gather", "--data-parallel-sharding-scope", scope,
    )  # fmt: skip
    eager = _pretrain_losses(ranks(2), flags)
    compiled = _pretrain_losses(ranks(2), flags + ["--compile", "--compile-backend", "aot_eager"])
    difference = max(abs(c - e) / abs(e) for c, e in zip(compiled, eager))
    print(f"ZeRO-3 {scope} scope, DP2: compiled vs eager, largest relative loss difference {difference:.1e}")
    assert len(compiled) == len(eager) == 3 and difference <= 1e-5


# --------------------------------------------------------------------------------------------------
# Checkpoints: Trident's format, whatever the strategy; loadable under any strategy and split
# --------------------------------------------------------------------------------------------------


def _whole_tensors(path: str, iteration: int) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole (TP shards joined), by logical name."""
    from training.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path, iteration)
    return {name: ckpt.read_shard(name) for name, spec in ckpt.specs.items() if spec.shape}


def test_a_zero3_checkpoint_resumes_under_other_strategies_and_splits(ranks, data_prefix, tmp_path):
    """ZeRO-3 at TP2 x DP2 saves at iteration 2 of 4 (``--ckpt-format fsdp_dtensor``: Trident's format;
    ``--async-save``: the writer copies the gathered weights before the next forward frees them);
    the ZeRO-1 run that saves the same weights and optimizer state again writes them bit for bit; and the
    last two iterations resumed under ZeRO-1 at TP2 x DP2, ZeRO-2 at PP2 x DP2 and no_shard at DP4 log
    the straight run's losses (within 1e-5: another split or another reduction order)."""
    from safetensors.torch import load_file

    from tests.dist.test_distributed_optimizer import small_gpt
    from tools import convert_checkpoint

    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    fsdp = ["--use-megatron-fsdp", "--overlap-grad-reduce"]
    zero3, copied = str(tmp_path / "zero3"), str(tmp_path / "copied")
    flags = small_gpt(data_prefix, 4, *tp2, *fsdp, "--ckpt-format", "fsdp_dtensor")
    straight = _pretrain_losses(ranks(4), flags + ["--save", zero3, "--save-interval", "2", "--async-save"])
    # Load into ZeRO-1 at the same split and save at once (2 iterations, none left to train).
    load = ["--load", zero3, "--ckpt-step", "2"]
    again = small_gpt(data_prefix, 2, *tp2, "--use-distributed-optimizer", *load, "--save", copied)
    assert all(not losses for losses, _, _ in _pool_run(ranks(4), again + ["--override-opt_param-scheduler"]))
    saved, resaved = _whole_tensors(zero3, 2), _whole_tensors(copied, 2)
    assert saved.keys() == resaved.keys() and any(k.startswith("optimizer.") for k in saved)
    assert all(torch.equal(saved[k], resaved[k]) for k in saved)
    # --to-hf from the ZeRO-3 run writes the Hugging Face files the ZeRO-1 one writes (whose export
    # tests/dist/test_hf_parity.py checks against transformers' logits), bit for bit.
    exported = {}
    for which, root in (("zero3", zero3), ("zero1", copied)):
        out = str(tmp_path / f"hf_{which}")
        assert convert_checkpoint.main(["--load", root, "--iteration", "2", "--to-hf", out, "--quiet"]) == 0
        exported[which] = load_file(str(tmp_path / f"hf_{which}" / "model.safetensors"))
    assert exported["zero3"].keys() == exported["zero1"].keys()
    assert all(torch.equal(t, exported["zero1"][k]) for k, t in exported["zero3"].items())
    pp2 = ["--pipeline-model-parallel-size", "2"]
    splits = {
        "ZeRO-1 TP2xDP2": [*tp2, "--use-distributed-optimizer"],
        "ZeRO-2 PP2xDP2": [*pp2, *fsdp, "--data-parallel-sharding-strategy", "optim_grads"],
        "no_shard DP4": [],
    }
    _assert_resumed_losses(ranks(4), data_prefix, load, straight, splits, "ZeRO-3")


def test_bf16_main_weights_through_pretrain_resume_exactly_from_a_checkpoint_of_bf16_moments(
    ranks, data_prefix, tmp_path
):
    """``--bf16 --use-megatron-fsdp --megatron-fsdp-main-params-dtype auto`` at PP2 x DP2 under ZeRO-3:
    the checkpoint holds bf16 moments and no main copies, and the last two of four iterations resumed
    from iteration 2 log the straight run's losses bit for bit."""
    from tests.dist.test_distributed_optimizer import small_gpt

    saved = str(tmp_path / "bf16_main")
    bf16_main = [
        *("--bf16", "--use-megatron-fsdp", "--megatron-fsdp-main-params-dtype", "auto"),
        *("--pipeline-model-parallel-size", "2", "--overlap-grad-reduce"),
    ]
    flags = small_gpt(data_prefix, 4, *bf16_main)
    straight = _pretrain_losses(ranks(4), flags + ["--save", saved, "--save-interval", "2"])
    tensors = _whole_tensors(saved, 2)
    moments = {k: t.dtype for k, t in tensors.items() if k.startswith("optimizer.state.exp_avg")}
    assert moments and set(moments.values()) == {torch.bfloat16}
    assert not any(k.startswith("optimizer.state.main_param") for k in tensors)
    resumed = _pretrain_losses(ranks(4), flags + ["--load", saved, "--ckpt-step", "2"])
    assert resumed == straight[2:]


def _assert_resumed_losses(pool, data_prefix, load, straight, splits, saved_by: str) -> None:
    """The last two of four iterations, resumed from ``load`` under each of ``splits``, log the straight
    run's last two losses (within 1e-5: another split or another reduction order)."""
    from tests.dist.test_distributed_optimizer import small_gpt

    for name, split in splits.items():
        resumed = _pretrain_losses(pool, small_gpt(data_prefix, 4, *split, *load))
        difference = max(abs(x - y) / abs(y) for x, y in zip(resumed, straight[2:], strict=True))
        print(f"{name} from the {saved_by} checkpoint: {difference:.1e}")
        assert difference <= 1e-5, name


def _pool_run(pool, flags):
    from tests.dist.test_distributed_optimizer import run_pretrain

    return pool.run(run_pretrain, flags, timeout=300)


# --------------------------------------------------------------------------------------------------
# An independent check at TP=1: torch's fully_shard (FSDP2) trains the same weights as ZeRO-3
# --------------------------------------------------------------------------------------------------


def _seeded_zero3_chunk():
    """DP = world: this rank's DP rank, a ZeRO-3 chunk from the seeded initialisation, and its whole weights."""
    from core import parallel_state as ps
    from core.tensor_parallel.random import model_parallel_seed

    ps.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_seed(1234)
    chunk = _chunk("optim_grads_params", 1, False, None)
    gathered = {k: v.clone() for k, v in chunk.state_dict().items()}
    return ps.get_data_parallel_rank(), chunk, gathered


def _fully_shard_case(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from core.optimizer import OptimizerConfig, get_megatron_optimizer

    dp_rank, ours, initial = _seeded_zero3_chunk()
    config = OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=True)
    _steps(ours, get_megatron_optimizer(config, [ours], fused=False), dp_rank)
    # torch: each decoder layer and the rest its own FSDP unit, as ZeRO-3's units; gradients reduced
    # every microbatch (as ZeRO-3 does), so both sum the same numbers in the same order.
    theirs = _chunk("no_shard", 1, False, initial).module
    for layer in theirs.decoder.layers.values():
        fully_shard(layer)
    fully_shard(theirs)
    adam = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    for step in range(3):
        adam.zero_grad()
        for micro in range(2):
            gen = torch.Generator().manual_seed(100 * step + 10 * dp_rank + micro)
            tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
            (theirs(tokens, labels=torch.roll(tokens, -1, 1)).float().mean() / 2).backward()
        adam.step()
    # Compare this rank's rows (FSDP2 shards dim 0 in chunks of ceil(rows / DP)) with ours, gathered.
    mine = dict(ours.module.named_parameters())
    differences = []
    for name, param in theirs.named_parameters():
        local, rows = param.to_local(), param.shape[0]
        start = min(rows, dp_rank * -(-rows // world_size))
        if local.numel():
            differences.append(_relative(mine[name].detach()[start : start + local.shape[0]], local))
    return max(differences)


def test_zero3_trains_the_weights_torch_fully_shard_trains(ranks):
    differences = ranks(2).run(_fully_shard_case, timeout=240)
    print(f"ZeRO-3 against torch's fully_shard, largest relative weight difference: {max(differences):.1e}")
    assert max(differences) <= 1e-6


# --------------------------------------------------------------------------------------------------
# HSDP: the distributed optimizer replicated over N instances (--num-distributed-optimizer-instances),
# optionally with its state split over them too (--outer-dp-sharding-strategy optim)
# --------------------------------------------------------------------------------------------------

HSDP = {
    "optim N=1": ("optim", "no_shard"),  # the control: the rounding of another reduction order alone
    "optim N=2": ("optim", "no_shard"),
    "optim_grads N=2": ("optim_grads", "no_shard"),
    "optim_grads_params N=2": ("optim_grads_params", "no_shard"),
    "optim_grads_params N=2 outer optim": ("optim_grads_params", "optim"),
    "optim_grads_params N=2 outer optim, step scope": ("optim_grads_params", "optim"),
}


def _hsdp_case(rank, world_size, tp: int, steps: int):
    import torch.distributed as dist

    from core import parallel_state as ps
    from core.optimizer import OptimizerConfig, get_megatron_optimizer
    from core.tensor_parallel.random import model_parallel_seed
    from tests.dist.test_distributed_optimizer import _state_bytes

    groups = ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, num_distributed_optimizer_instances=2
    )
    getters = {  # megatron-core's getters, reading the groups just made
        "intra_dp_cp": ps.get_intra_partial_data_parallel_group,
        "inter_dp_cp": ps.get_inter_distributed_optimizer_instance_group,
        "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group,
    }
    members = {name: dist.get_process_group_ranks(get()) for name, get in getters.items()}
    assert all(get() is getattr(groups, name) for name, get in getters.items())
    assert (
        ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        is groups.intra_dp_cp
    )
    dp_rank = ps.get_data_parallel_rank()
    torch.manual_seed(0)
    model_parallel_seed(1234)
    reference = _chunk("no_shard", tp, False, None)
    initial = {k: v.clone() for k, v in reference.module.state_dict().items()}
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.05), [reference])
    expected, memory = _steps(reference, optimizer, dp_rank, steps)
    memory["optimizer"] = _state_bytes(optimizer)
    want = dict(reference.module.named_parameters())
    out = {"no_shard": (0.0, 0.0, memory)}
    for case, (strategy, outer) in HSDP.items():
        instances = int(case.split("N=")[1][0])
        chunk = _chunk(
            strategy,
            tp,
            False,
            initial,
            num_distributed_optimizer_instances=instances,
            outer_dp_sharding_strategy=outer,
            data_parallel_sharding_scope="step" if case.endswith("step scope") else "auto",
        )
        config = OptimizerConfig(lr=1e-2, clip_grad=0.05, use_distributed_optimizer=True)
        optimizer = get_megatron_optimizer(config, [chunk])
        losses, between_steps = _steps(chunk, optimizer, dp_rank, steps)
        between_steps["optimizer"] = _state_bytes(optimizer)
        differences = [abs(x - y) / abs(y) for x, y in zip(losses, expected)]
        between_steps["first step"] = max(
            differences[:3]
        )  # two losses and the norm, before any rounding grew
        weights = max(_relative(p, want[n]) for n, p in chunk.module.named_parameters())
        optimizer.zero_grad()
        out[case] = (max(differences), weights, between_steps)
    return members, out


@pytest.mark.parametrize(
    ("world", "tp"),
    [pytest.param(4, 1, id="DP4 N=2"), pytest.param(8, 2, id="DP4xTP2 N=2", marks=pytest.mark.slow)],
)
def test_hsdp_trains_the_weights_no_shard_trains(ranks, world, tp):
    """DP4 in two instances of two ranks: buckets sharded over the instance's two ranks, the reduced
    shards all-reduced over the two instances (or, outer optim, reduce-scattered, each instance stepping
    half of the shard); 20 steps of the same losses, norms and weights as no_shard, within rounding.

    Tolerance: the first step's losses and clipped norm agree within 1e-8 (the norm sums (a + b) + (c + d)
    where no_shard sums a ring's order: ~1e-9). Adam and the active clip then carry that rounding on; over
    20 steps the control, ZeRO-1 with one instance, drifts up to 7.3e-6 in losses and norms and 1.3e-4 in
    the weights (the relative norm of the difference, largest tensor: a bias whose gradient is rounding
    noise), the HSDP cases up to 1.2e-5 and 1.7e-4 (measured at DP4 and DP4 x TP2): so 5e-5 and 5e-4."""
    from core.rank_groups import generate_instance_groups, generate_parallel_groups

    layout = generate_instance_groups(generate_parallel_groups(world, tp)["dp_cp"], 2)
    for rank, (members, out) in enumerate(ranks(world).run(_hsdp_case, tp, 20, timeout=600)):
        assert members == {name: next(g for g in groups if rank in g) for name, groups in layout.items()}
        unsharded = out["no_shard"][2]
        total = {k: sum(v[2][key] for key in ("params", "grads", "optimizer")) for k, v in out.items()}
        for case, (losses, weights, memory) in out.items():
            print(
                f"rank {rank} {case}: losses and norms {losses:.1e}, weights {weights:.1e}, bytes {memory}, "
                f"x no_shard {total[case] / total['no_shard']:.3f}"
            )
            assert memory.get("first step", 0.0) <= 1e-8 and losses <= 5e-5 and weights <= 5e-4, case
        # Sharded over the instance's 2 ranks, not 4: half of the optimizer state (a quarter with the
        # outer sharding), half of the gradients (ZeRO-2/3) and parameters (ZeRO-3), padding aside.
        assert out["optim N=2"][2]["optimizer"] <= unsharded["optimizer"] / 2 * 1.1
        assert out["optim_grads N=2"][2]["grads"] <= unsharded["grads"] / 2 * 1.1
        assert out["optim_grads_params N=2"][2]["params"] <= unsharded["params"] / 2 * 1.1
        outer = out["optim_grads_params N=2 outer optim"][2]
        assert outer["optimizer"] <= unsharded["optimizer"] / 4 * 1.1
        assert outer["params"] == out["optim_grads_params N=2"][2]["params"]
        # At step scope: per bucket and step one reduce-scatter inside the instance (M = 2 at microbatch
        # scope) and one all-gather (2M; M for the chunk's own and the last layer's buckets, kept from
        # forward into backward), plus the outer sharding's all-gather across the instances after the
        # step; the same bytes between steps.
        step = out["optim_grads_params N=2 outer optim, step scope"][2]
        assert step["traffic"] == [(1, 2)] and outer["traffic"] == [(2, 3), (2, 5)]
        assert {k: step[k] for k in ("params", "grads", "optimizer")} == {
            k: outer[k] for k in ("params", "grads", "optimizer")
        }


def test_hsdp_through_pretrain_gives_the_unsharded_losses_and_its_checkpoints_load_anywhere(
    ranks, data_prefix, tmp_path
):
    """pretrain() at DP4 under --num-distributed-optimizer-instances 2 (ZeRO-3 inside each instance of
    two ranks, replicated across the two; then with the optimizer state split over them too) logs the
    no_shard losses; its checkpoint (saved at iteration 2 of 4, the optimizer state written once, by the
    first instance) resumes under the other HSDP form, ZeRO-1 at DP2 and no_shard at DP4 with the straight
    run's last two losses."""
    from tests.dist.test_distributed_optimizer import small_gpt

    hsdp = ["--use-megatron-fsdp", "--overlap-grad-reduce", "--num-distributed-optimizer-instances", "2"]
    outer = [*hsdp, "--outer-dp-sharding-strategy", "optim"]
    saved = str(tmp_path / "hsdp")
    plain = _pretrain_losses(ranks(4), small_gpt(data_prefix, 4))
    straight = _pretrain_losses(
        ranks(4), small_gpt(data_prefix, 4, *hsdp, "--save", saved, "--save-interval", "2")
    )
    assert max(abs(x - y) / abs(y) for x, y in zip(straight, plain, strict=True)) <= 1e-5
    assert any(name.startswith("optimizer.") for name in _whole_tensors(saved, 2))  # each range once
    load = ["--load", saved, "--ckpt-step", "2"]
    splits = {
        "HSDP outer optim DP4": outer,
        "ZeRO-1 DP2 x TP2": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
        "no_shard DP4": [],
    }
    _assert_resumed_losses(ranks(4), data_prefix, load, straight, splits, "HSDP")


def _communication_unit_case(rank, world_size):
    """ZeRO-3 at microbatch scope with overlap under three ``suggested_communication_unit_size`` s (None, one
    element, and room for two layers' gathers): losses and weights, how many layers were gathered at once
    in forward and how many microbatch reductions were under way when backward ended; and a layer's
    elements."""
    from core.optimizer import OptimizerConfig, get_megatron_optimizer

    dp_rank, reference, initial = _seeded_zero3_chunk()
    first_layer = next(iter(reference.module.decoder.layers.values()))
    layer = reference.param_to_bucket[next(first_layer.parameters())]
    elements = layer.param_data.numel()  # one bucket a layer
    out = {}
    for name, size in (("default", None), ("one element", 1), ("two layers' gathers", 4 * elements)):
        chunk = _chunk("optim_grads_params", 1, False, initial, suggested_communication_unit_size=size)
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [chunk])
        losses, between_steps = _steps(chunk, optimizer, dp_rank)
        weights = {n: p.detach().clone() for n, p in chunk.module.named_parameters()}
        out[name] = (losses, weights, between_steps, len(chunk.buckets))
    return out


def test_the_suggested_communication_unit_size_bounds_what_zero3_keeps_in_flight(ranks):
    """``--suggested-communication-unit-size`` (Megatron-FSDP's): the microbatch reduce-scatters under way
    hold at most that many elements of full buckets, and ZeRO-3 prefetches the next layers while their
    gathers hold at most half of it. One element: one reduction at a time and no prefetch (one layer
    gathered at a time); room for two layers' gathers: two layers prefetched beside the running one, and
    every bucket's last reduction still under way when backward ends; None keeps the defaults (two
    reductions, the next layer). The same additions in the same order, at other times: losses, norms and
    weights bit for bit."""
    for rank, out in enumerate(ranks(2).run(_communication_unit_case, timeout=300)):
        losses, weights, _, buckets = out["default"]
        expected = {"default": (2, 2), "one element": (1, 1), "two layers' gathers": (3, buckets)}
        for name, (gathered, in_flight) in expected.items():
            their_losses, their_weights, measured, _ = out[name]
            print(f"rank {rank} {name}: {measured}")
            assert (measured["layers gathered at once"], measured["reductions in flight"]) == (
                gathered,
                in_flight,
            )
            assert their_losses == losses, name
            assert all(torch.equal(their_weights[n], w) for n, w in weights.items()), name


def _in_two_instances() -> tuple[int, dict[str, torch.Tensor]]:
    """The groups of two distributed-optimizer instances (DP = world): this rank's DP rank and the seeded
    initial weights."""
    from core import parallel_state as ps
    from core.tensor_parallel.random import model_parallel_seed

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    torch.manual_seed(0)
    model_parallel_seed(1234)
    initial = {k: v.clone() for k, v in _chunk("no_shard", 1, False, None).module.state_dict().items()}
    return ps.get_data_parallel_rank(), initial


HSDP_OVERLAP = {  # (strategy, outer strategy, scope)
    "optim": ("optim", "no_shard", "auto"),
    "optim_grads": ("optim_grads", "no_shard", "auto"),
    "optim_grads_params": ("optim_grads_params", "no_shard", "auto"),
    "optim_grads_params, step scope": ("optim_grads_params", "no_shard", "step"),
    "optim_grads_params outer optim": ("optim_grads_params", "optim", "auto"),
}


def _hsdp_overlap_case(rank, world_size):
    """Each HSDP case at DP4, N=2, with and without ``overlap_grad_reduce``: one step of two microbatches;
    how many buckets had launched their reduction over the instances when backward returned, how many
    buckets there are, and the reduced gradient of each range this rank's optimizer steps."""
    from contextlib import nullcontext

    from core.distributed.finalize_model_grads import finalize_model_grads
    from core.optimizer import OptimizerConfig, get_megatron_optimizer

    dp_rank, initial = _in_two_instances()
    out = {}
    for case, (strategy, outer, scope) in HSDP_OVERLAP.items():
        for overlap in (False, True):
            chunk = _chunk(
                strategy,
                1,
                False,
                initial,
                num_distributed_optimizer_instances=2,
                outer_dp_sharding_strategy=outer,
                data_parallel_sharding_scope=scope,
                overlap_grad_reduce=overlap,
            )
            optimizer = get_megatron_optimizer(
                OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [chunk]
            )
            optimizer.zero_grad()
            for micro in range(2):
                gen = torch.Generator().manual_seed(10 * dp_rank + micro)
                tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
                with chunk.no_sync() if micro == 0 else nullcontext():
                    chunk(tokens, labels=torch.roll(tokens, -1, 1)).float().mean().backward()
            launched = sum(bucket.instances_reduced for bucket in chunk.buckets)
            finalize_model_grads([chunk])
            grads = {s.name: (s.start, s.model_grad().detach().clone()) for s in optimizer.shards}
            optimizer.zero_grad()
            out[case, overlap] = (launched, len(chunk.buckets), grads)
    return out


def test_hsdp_overlaps_the_reduction_over_the_instances_with_backward(ranks):
    """With ``overlap_grad_reduce`` each bucket's reduction over the instances is launched during backward,
    as soon as the next bucket's reduction inside the instance is (:class:`InstanceChain`): when the last
    microbatch's backward returns, every bucket but the last one launched has it in flight, under each
    strategy and scope, where without overlap none has. The gradients are the same, bit for bit: the same
    sums of two, (a + b) + (c + d), at other times."""
    for rank, out in enumerate(ranks(4).run(_hsdp_overlap_case, timeout=300)):
        for case in HSDP_OVERLAP:
            launched, buckets, grads = out[case, True]
            plain_launched, _, plain_grads = out[case, False]
            print(f"rank {rank} {case}: {launched} of {buckets} buckets launched during backward")
            assert buckets > 2 and launched == buckets - 1 and plain_launched == 0, case
            compared = 0
            for name in set(grads) & set(plain_grads):
                ours, theirs = _overlapping(grads[name], plain_grads[name])
                assert torch.equal(ours, theirs), (case, name)
                compared += ours.numel()
            assert compared > 0, case


# --------------------------------------------------------------------------------------------------
# HSDP with MoE experts: expert buckets sharded over the instance's expert replicas, summed over the
# instances (megatron-core's intra- and inter-partial expert data-parallel groups)
# --------------------------------------------------------------------------------------------------

MOE = {
    "num_moe_experts": 4,
    "expert_model_parallel_size": 2,
    "moe_router_topk": 2,
    "moe_token_dispatcher_type": "alltoall",
    "moe_aux_loss_coeff": 1e-2,
}


def _expert_grads_of_a_step(chunk, optimizer, dp_rank: int) -> dict[str, tuple[int, torch.Tensor]]:
    """:func:`_grads_of_a_step` of the experts."""
    from core.distributed.distributed_data_parallel import is_expert_param

    grads = _grads_of_a_step(chunk, optimizer, dp_rank)
    return {
        name: grads[name]
        for name, p in chunk.module.named_parameters()
        if is_expert_param(p) and name in grads
    }


def _grads_of_a_step(chunk, optimizer, dp_rank: int) -> dict[str, tuple[int, torch.Tensor]]:
    """One step's forward and backward (two microbatches, as :func:`_steps`), reduced; no update. Each
    range this rank's optimizer steps: (its start in the parameter, its reduced gradient)."""
    from core.distributed.finalize_model_grads import finalize_model_grads

    optimizer.zero_grad()
    for micro in range(2):
        gen = torch.Generator().manual_seed(10 * dp_rank + micro)
        tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
        with chunk.no_sync() if micro == 0 else torch.enable_grad():
            (chunk(tokens, labels=torch.roll(tokens, -1, 1)).float().mean() / 2).backward()
    finalize_model_grads([chunk])
    grads = {s.name: (s.start, s.model_grad().detach().clone()) for s in optimizer.shards}
    optimizer.zero_grad()
    return grads


GRAD_COMM = {  # (strategy, scope, instances): ZeRO-2/3 at step scope reduce once a step, as ZeRO-1
    "optim": ("optim", "auto", 1),
    "optim_grads": ("optim_grads", "step", 1),
    "optim_grads_params": ("optim_grads_params", "step", 1),
    "optim_grads_params, HSDP N=2": ("optim_grads_params", "step", 2),
}


def _grad_comm_case(rank, world_size):
    """DP4: each case's reduced gradients of one step with fp32 gradients sent as they are and as bf16."""
    from core.optimizer import OptimizerConfig, get_megatron_optimizer

    dp_rank, initial = _in_two_instances()
    out = {}
    for case, (strategy, scope, instances) in GRAD_COMM.items():
        for comm in ("auto", "bf16"):
            chunk = _chunk(
                strategy,
                1,
                False,
                initial,
                data_parallel_sharding_scope=scope,
                num_distributed_optimizer_instances=instances,
                megatron_fsdp_grad_comm_dtype=comm,
            )
            optimizer = get_megatron_optimizer(
                OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [chunk]
            )
            out[case, comm] = _grads_of_a_step(chunk, optimizer, dp_rank)
    return out


def test_gradients_travel_in_the_grad_comm_dtype(ranks):
    """``megatron_fsdp_grad_comm_dtype='bf16'`` with fp32 gradients (Megatron-FSDP's): each bucket is cast to
    bf16 for its reduce-scatter (and each shard for the all-reduce over HSDP's instances) and the sum cast
    back. So every reduced value is a bf16 number, which the fp32 sums are not, and it is the fp32 sum
    within bf16's rounding (8 bits: at most 1e-2 relative for a tensor; 4e-3 measured)."""
    for rank, out in enumerate(ranks(4).run(_grad_comm_case, timeout=300)):
        for case in GRAD_COMM:
            sent_whole, sent_in_bf16 = out[case, "auto"], out[case, "bf16"]
            assert set(sent_whole) == set(sent_in_bf16), case
            worst, exact = 0.0, 0
            for name, (start, grad) in sent_in_bf16.items():
                whole_start, whole = sent_whole[name]
                assert start == whole_start and grad.dtype == torch.float32, (case, name)
                assert torch.equal(grad, grad.bfloat16().float()), (case, name)
                exact += int(torch.equal(whole, whole.bfloat16().float()))
                if whole.norm() > 0:
                    worst = max(worst, _relative(grad, whole))
            print(
                f"rank {rank} {case}: largest relative difference {worst:.1e}; {exact} fp32 sums already bf16"
            )
            assert 0 < worst <= 1e-2 and exact < len(sent_whole), case


def _hsdp_moe_case(rank, world_size, steps: int):
    """DP4 x EP2 (expert DP 2): each strategy at N=1, and each HSDP case at N=2, from the same weights."""
    import torch.distributed as dist

    from core import parallel_state as ps
    from core.optimizer import OptimizerConfig, get_megatron_optimizer
    from core.tensor_parallel.random import model_parallel_seed

    groups = ps.initialize_model_parallel(expert_model_parallel_size=2, num_distributed_optimizer_instances=2)
    members = {
        name: dist.get_process_group_ranks(getattr(groups, name))
        for name in ("expt_dp", "intra_expt_dp", "inter_expt_dp", "intra_dist_opt")
    }
    getters = {  # megatron-core's getters of the expert instance groups, reading the groups just made
        "partial": ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)
        is groups.intra_expt_dp,
        "whole": ps.get_expert_data_parallel_group() is groups.expt_dp,
        "shared inter": ps.get_inter_distributed_optimizer_instance_group() is groups.inter_expt_dp,
        "partial size": ps.get_expert_data_parallel_world_size(partial_expert_data_parallel=True),
        "size": ps.get_expert_data_parallel_world_size(),
    }
    dp_rank = ps.get_data_parallel_rank()
    torch.manual_seed(0)
    model_parallel_seed(1234)
    initial = {k: v.clone() for k, v in _chunk("no_shard", 1, False, None, MOE).module.state_dict().items()}
    config = OptimizerConfig(lr=1e-2, clip_grad=0.05, use_distributed_optimizer=True)
    runs = [(s, 1, "no_shard") for s in STRATEGIES] + [(s, 2, outer) for s, outer in HSDP.values()]
    out = {}
    for strategy, instances, outer in dict.fromkeys(runs):  # "optim N=1" is the first run already
        chunk = _chunk(
            strategy,
            1,
            False,
            initial,
            MOE,
            num_distributed_optimizer_instances=instances,
            outer_dp_sharding_strategy=outer,
        )
        optimizer = get_megatron_optimizer(config, [chunk])
        expert_grads = _expert_grads_of_a_step(chunk, optimizer, dp_rank)
        losses, between_steps = _steps(chunk, optimizer, dp_rank, steps)
        weights = {n: p.detach().clone() for n, p in chunk.module.named_parameters()}
        optimizer.zero_grad()
        replica = optimizer.state_is_a_replica
        out[strategy, instances, outer] = (expert_grads, losses, weights, between_steps, replica)
    return members, getters, out


def _overlapping(
    a: tuple[int, torch.Tensor], b: tuple[int, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements two ranges of one flattened parameter (start, values) have in common, from each."""
    (start_a, values_a), (start_b, values_b) = a, b
    values_a, values_b = values_a.reshape(-1), values_b.reshape(-1)
    lo = max(start_a, start_b)
    hi = max(lo, min(start_a + values_a.numel(), start_b + values_b.numel()))
    return values_a[lo - start_a : hi - start_a], values_b[lo - start_b : hi - start_b]


@pytest.mark.slow
def test_hsdp_with_experts_trains_what_one_instance_trains(ranks):
    """DP4 with EP2 (expert DP 2), N=2: dense buckets sharded over two ranks and summed over the two
    instances, as before; expert buckets over the instance's one expert replica (megatron-core's
    intra-partial expert data-parallel group, EDP / N = 1) and summed over the same inter-instance group
    (outer ``optim``: reduce-scattered over it, each instance stepping half).

    Against one instance under the same strategy: the expert gradients are the same two-rank sums, bit
    for bit under ``optim`` (ZeRO-2/3 reduce each microbatch at N=1 but sum an instance's microbatches
    first at N=2: fp32 rounding, 1.1e-7 measured, so 1e-6); the clipped norm of the first step, counted over
    one instance (each expert once), within 1e-8 (the dense shards' sums in another order), and 20 steps of
    losses, norms and weights within the HSDP test's bounds (5e-5, 5e-4). Without the outer sharding the
    second instance's state is a replica (its ranks write no optimizer state)."""
    from core.rank_groups import (
        generate_expert_groups,
        generate_expert_instance_groups,
        generate_instance_groups,
    )

    dense = generate_instance_groups([[0, 1, 2, 3]], 2)
    layout = dense | generate_expert_instance_groups(
        generate_expert_groups(4, 1, 1, 1, 2)["expt_dp"], dense["inter_dp_cp"], 2
    )
    layout["expt_dp"] = [[0, 2], [1, 3]]
    for rank, (members, getters, out) in enumerate(ranks(4).run(_hsdp_moe_case, 20, timeout=600)):
        assert members == {name: next(g for g in layout[name] if rank in g) for name in members}
        assert getters == {"partial": True, "whole": True, "shared inter": True, "partial size": 1, "size": 2}
        for case, (strategy, outer) in HSDP.items():
            if "N=1" in case:
                continue
            (grads_1, losses_1, weights_1, _, replica_1) = out[strategy, 1, "no_shard"]
            (grads_2, losses_2, weights_2, memory_2, replica_2) = out[strategy, 2, outer]
            compared = 0
            for name in set(grads_1) & set(grads_2):
                ours, theirs = _overlapping(grads_2[name], grads_1[name])
                if strategy == "optim":  # one sum of the two replicas' step gradients either way
                    assert torch.equal(ours, theirs), name
                elif (
                    ours.numel()
                ):  # (a1 + b1) + (a2 + b2) at N=1, per microbatch; (a1 + a2) + (b1 + b2) at N=2
                    assert _relative(ours, theirs) <= 1e-6, name
                compared += ours.numel()
            if outer == "no_shard":  # N=2: every expert whole on every rank
                assert set(grads_1) <= set(grads_2) and all(start == 0 for start, _ in grads_2.values())
                assert compared == sum(g.numel() for _, g in grads_1.values())
            assert compared > 0
            differences = [abs(x - y) / abs(y) for x, y in zip(losses_2, losses_1, strict=True)]
            weights = max(_relative(weights_2[n], w) for n, w in weights_1.items())
            print(
                f"rank {rank} {case} against N=1: first step {max(differences[:3]):.1e}, losses and norms "
                f"{max(differences):.1e}, weights {weights:.1e}, bytes {memory_2}"
            )
            assert max(differences[:3]) <= 1e-8 and max(differences) <= 5e-5 and weights <= 5e-4, case
            assert (replica_1, replica_2) == (False, rank >= 2 and outer == "no_shard")


def _optimizer_elements_written(path: str, iteration: int) -> dict[str, int]:
    """Every optimizer tensor of a checkpoint: how many elements its pieces hold together (a range written
    twice counts twice)."""
    from training.checkpoint import open_checkpoint

    out: dict[str, int] = {}
    for record in open_checkpoint(path, iteration).manifest["files"].values():
        for name, piece in record["pieces"].items():
            if name.startswith("optimizer."):
                lo, hi = piece.get("flat") or (0, 1)  # a whole piece here: a scalar (TP = 1, sharded state)
                out[name] = out.get(name, 0) + hi - lo
    return out


@pytest.mark.slow
def test_hsdp_with_experts_through_pretrain_saves_what_one_instance_loads(ranks, data_prefix, tmp_path):
    """pretrain() at DP4 x EP2 (expert DP 2) with the distributed optimizer in two instances logs the
    losses of one instance; each of its checkpoints' optimizer tensors, the experts' too, is written once
    (by the first instance), and loaded at one instance and saved again it is the same, bit for bit; so is
    one instance's checkpoint loaded at two. Resumed at one instance, the N=2 checkpoint logs the straight
    run's last two losses."""
    from tests.dist.test_distributed_optimizer import small_gpt

    moe = SPLITS["EP2xDP2 MoE"]
    one = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
    two = [*one, "--num-distributed-optimizer-instances", "2"]
    saved = {n: str(tmp_path / f"n{n}") for n in (1, 2)}
    straight = {
        n: _pretrain_losses(
            ranks(4), small_gpt(data_prefix, 4, *moe, *flags, "--save", saved[n], "--save-interval", "2")
        )
        for n, flags in ((2, two), (1, one))
    }
    difference = max(abs(x - y) / abs(y) for x, y in zip(straight[2], straight[1], strict=True))
    print(f"EP2 x DP4, N=2 against N=1: largest relative loss difference {difference:.1e}")
    assert difference <= 1e-5
    # One instance: every rank writes its own ranges, each element once. Two: the first instance's ranks.
    written = _optimizer_elements_written(saved[2], 2)
    assert any(".experts." in name for name in written)
    assert written == _optimizer_elements_written(saved[1], 2)
    for source, at, flags in ((2, 1, one), (1, 2, two)):  # load under the other N, save at once
        copy = str(tmp_path / f"n{source}_at_n{at}")
        load = ["--load", saved[source], "--ckpt-step", "2", "--save", copy, "--override-opt_param-scheduler"]
        assert all(
            not losses for losses, _, _ in _pool_run(ranks(4), small_gpt(data_prefix, 2, *moe, *flags, *load))
        )
        before, after = _whole_tensors(saved[source], 2), _whole_tensors(copy, 2)
        assert before.keys() == after.keys() and any(
            k.startswith("optimizer.") and ".experts." in k for k in before
        )
        assert all(torch.equal(before[k], after[k]) for k in before), (source, at)
    resumed = _pretrain_losses(
        ranks(4), small_gpt(data_prefix, 4, *moe, *one, "--load", saved[2], "--ckpt-step", "2")
    )
    difference = max(abs(x - y) / abs(y) for x, y in zip(resumed, straight[2][2:], strict=True))
    print(f"N=1 from the N=2 checkpoint: {difference:.1e}")
    assert difference <= 1e-5

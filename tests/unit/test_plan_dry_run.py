"""The dry run builds real stages under fake tensors with a fake process group, and agrees with the model.

The heavier checks (LLaMA-3 8B/70B and GPT-3 175B per rank, the dry run against a real 4-rank run)
are ``tools/plan_check_memory.py``; the real-run one is also ``-m slow`` in tests/e2e/test_plan_dry_run.py.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from core.pipeline_parallel.layout import even_layout
from planner.candidate import Candidate
from planner.dry_run import compare, fake_backend_available
from planner.inputs import read_input
from planner.memory import candidate_memory
from planner.search import Planned
from pretrain_gpt import forward_step

_TINY_FLAGS = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 128 --max-position-embeddings 128 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --vocab-size 1023 --global-batch-size 8"
)
TINY = _TINY_FLAGS.split()


def test_this_torch_has_a_fake_process_group():
    assert fake_backend_available() is None


_MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "256",
    "--moe-aux-loss-coeff",
    "1e-2",
]


@pytest.mark.parametrize(
    ("extra", "fields"),
    [
        # the output layer inside the loss: no logits kept (--cross-entropy-fusion-impl linear)
        (
            ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear"],
            {"tp": 2, "pp": 2, "dp": 2, "schedule": "zb-h1"},
        ),
        # experts over EP, their state over expert DP; the fused loss keeps the logits, not a softmax
        ([*_MOE, "--cross-entropy-loss-fusion"], {"tp": 1, "pp": 2, "dp": 2, "ep": 2}),
        # fp16: the loss scaler's state, and the optimizer's step decided on the device
        (["--fp16"], {"tp": 1, "pp": 2, "dp": 2}),
        # bf16 weights stepped as they are: bf16 moments, no main copy, the gradients cast to bf16
        (
            ["--use-megatron-fsdp", "--megatron-fsdp-main-params-dtype", "auto"],
            {
                "tp": 1,
                "pp": 2,
                "dp": 2,
                "megatron_fsdp_dtypes": ("--megatron-fsdp-main-params-dtype", "auto"),
            },
        ),
    ],
    ids=["dense-TP2xPP2xDP2-zb-linear-loss", "moe-EP2xPP2xDP2", "fp16-PP2xDP2", "bf16-main-weights-PP2xDP2"],
)
def test_dry_run_matches_the_memory_model_on_every_rank(extra, fields):
    base = [f for f in TINY if f != "--bf16"] if "--fp16" in extra else TINY
    plan_input = read_input(base + extra)
    spec = plan_input.spec
    cand = Candidate(**fields, micro_batch_size=2, num_microbatches=2, dp_sharding="optim")
    cand = replace(cand, layout=even_layout(spec.num_layers, 2).to_string())
    planned = Planned(cand, candidate_memory(spec, cand, device="cpu"), 0.0)
    rows = compare(planned, plan_input, forward_step, ranks=[0, 1])
    for row in rows:
        model, measured = row["model"], row["dry_run"]
        for part in ("params", "grads", "optimizer"):  # the distributed optimizer's shards: within padding
            assert measured[part] == pytest.approx(model[part], rel=1e-3), part
        assert abs(row["ratio"] - 1) < 0.05, row


def _slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow, id="-".join(map(str, values)))


@pytest.mark.parametrize(
    ("pp", "strategy", "scope"),
    [
        pytest.param(2, "optim_grads_params", "step", id="2-optim_grads_params-step"),
        _slow(2, "optim_grads", "step"),
        _slow(2, "optim_grads", "microbatch"),
        _slow(2, "optim_grads_params", "microbatch"),
        _slow(1, "optim_grads", "step"),
        _slow(1, "optim_grads", "microbatch"),
        _slow(1, "optim_grads_params", "step"),
        _slow(1, "optim_grads_params", "microbatch"),
    ],
)
def test_the_dry_run_measures_zero_2_and_3_as_the_model_says(pp, strategy, scope):
    """ZeRO-2/3 at DP 2, 2 microbatches of 2, every pipeline rank, beside ZeRO-1 (``optim``) of the same
    split. Between steps the dry run holds exactly the model's parameter and gradient shards (the optimizer
    state as ZeRO-1's, within the step counts' few bytes). The model charges the whole buckets in use
    (``gathered``) on top of the activation peak: at step scope a rank whose peak comes after its chunk's
    first backward (the last pipeline rank, and no pipeline) holds all of them there, and the dry run
    measures the model's peak to the byte as it does ZeRO-1's (the same difference in activations and
    optimizer state). Elsewhere (here, without interleaving) it is an upper bound by less than ``gathered``: at 1F1B's peak (the
    first backward, with every warm-up microbatch saved) a rank has not yet allocated the gradient buckets
    of the layers that backward has not reached, and at microbatch scope frees a layer's buckets as soon as
    their reduction lands or their backward ends, so fewer than the model's units are live at once."""
    plan_input = read_input(TINY)
    spec = plan_input.spec
    rows = {}
    for strat, sc in (("optim", "auto"), (strategy, scope)):
        cand = Candidate(tp=1, pp=pp, dp=2, micro_batch_size=2, num_microbatches=2, dp_sharding=strat,
                         dp_sharding_scope=sc, layout=even_layout(spec.num_layers, pp).to_string())  # fmt: skip
        planned = Planned(cand, candidate_memory(spec, cand, device="cpu"), 0.0)
        rows[strat] = compare(planned, plan_input, forward_step, ranks=list(range(pp)))

    def beyond_state(row) -> int:  # the model's peak over the measured one, past the optimizer state
        return (row["model"]["peak"] - row["model"]["optimizer"]) - (
            row["dry_run"]["peak"] - row["dry_run"]["optimizer"]
        )

    for rank, (zero1, zero) in enumerate(zip(rows["optim"], rows[strategy])):
        model, measured = zero["model"], zero["dry_run"]
        assert (measured["params"], measured["grads"]) == (model["params"], model["grads"])
        assert abs(measured["optimizer"] - model["optimizer"]) < 32
        assert model["gathered"] > 0
        excess = beyond_state(zero) - beyond_state(zero1)
        if scope == "step" and rank == pp - 1:
            assert excess == 0, (rank, zero, zero1)
        else:
            assert 0 < excess < model["gathered"], (rank, excess, model["gathered"])


@pytest.mark.parametrize(("strategy", "outer"), [("optim_grads_params", "optim"), _slow("optim", "no_shard")])
def test_the_dry_run_measures_hsdp_as_the_model_says(strategy, outer):
    """HSDP (``--num-distributed-optimizer-instances 2``) at DP 4 runs the instances' process groups under the
    fake backend; beside the same strategy sharded over all 4 ranks, the dry run holds exactly the model's
    parameter and gradient shards (an instance's 2 ranks' worth), the optimizer state within the step counts'
    few bytes, and the model's peak differs from the measured one by what it differs without instances:
    what HSDP adds is counted to the byte (but the step counts' rounding)."""
    plan_input = read_input(TINY)
    spec = plan_input.spec
    rows = []
    for instances, outer_strategy in ((2, outer), (1, "no_shard")):
        cand = Candidate(tp=1, pp=1, dp=4, micro_batch_size=2, num_microbatches=1, layout="Et*4L",
                         dp_sharding=strategy, instances=instances, outer_dp_sharding=outer_strategy)  # fmt: skip
        planned = Planned(cand, candidate_memory(spec, cand, device="cpu"), 0.0)
        (row,) = compare(planned, plan_input, forward_step, ranks=[0])
        model, measured = row["model"], row["dry_run"]
        assert (measured["params"], measured["grads"]) == (model["params"], model["grads"]), instances
        assert abs(measured["optimizer"] - model["optimizer"]) < 32, instances
        rows.append(model["peak"] - measured["peak"])
    assert abs(rows[0] - rows[1]) < 32, rows


def test_cli_dry_run_reports_the_worst_rank(capsys):
    from planner.cli import main

    flags = [
        *TINY,
        "--num-gpus",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "2",
        "--top",
        "1",
    ]
    assert main([*flags, "--dry-run", "1"], forward_step_func=forward_step) == 0
    out = capsys.readouterr().out
    found = re.search(r"pp rank (\d): measured peak ([\d.]+) GB .* model ([\d.]+) GB .*: ([+-][\d.]+)%", out)
    assert found, out
    assert abs(float(found.group(4))) < 5.0


def test_a_context_parallel_layer_saves_what_the_model_says():
    """Ring attention (CP 2) with TP 2 and sequence parallelism: the bytes autograd keeps for one decoder
    layer and its RoPE tables, counted as stored, equal the model's terms (training refuses CP > 1 so far:
    the layer is what there is to check)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from core import parallel_state as ps
    from core.transformer import TransformerConfig
    from core.transformer.rope import RotaryEmbedding
    from core.transformer.transformer_layer import TransformerLayer
    from planner.activations import Shape, stage_activations
    from planner.live_bytes import LiveBytes
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args, transformer_config_from_args

    cp, tp, batch = 2, 2, 2
    args = validate_args(
        parse_args(
            [
                *TINY,
                *[
                    "--micro-batch-size",
                    "2",
                    "--train-iters",
                    "1",
                    "--lr",
                    "1e-4",
                    "--tensor-model-parallel-size",
                    "2",
                    "--sequence-parallel",
                ],
            ]
        ),
        2,
    )
    fields = transformer_config_from_args(args) | {"num_layers": 1, "context_parallel_size": cp}
    spec = read_input(TINY).spec
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp * tp)
    saved: dict[int, int] = {}
    try:
        ps.initialize_model_parallel(tp, 1, None, cp)
        with FakeTensorMode(allow_non_fake_inputs=True), LiveBytes(answer_scalars=True):
            layer = TransformerLayer(TransformerConfig(**fields), 0, ps.get_parallel_groups())
            weights = {id(p.untyped_storage()) for p in layer.parameters()}
            local = spec.seq_length // cp
            table = RotaryEmbedding(spec.kv_channels, 10000.0).for_length(spec.seq_length, torch.bfloat16)
            rotary = tuple(t.index_select(0, torch.arange(local)) for t in table)  # this rank's positions
            x = torch.randn(local // tp, batch, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)

            def keep(t):
                if id(t.untyped_storage()) not in weights:
                    saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                layer(x, rotary)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    shape = Shape(seq=local, batch=batch, tp=tp, sequence_parallel=True, device="cpu", cp=cp)
    assert sum(saved.values()) == stage_activations(spec, shape, ("t",), first=True).saved


def test_the_dry_run_holds_the_reduction_copies_the_model_adds_for_the_grad_comm_dtype():
    """``--megatron-fsdp-grad-comm-dtype bf16`` with fp32 gradients (ZeRO-1, PP 2 x DP 2): each bucket's
    reduction sends a bf16 copy, and at the end of backward every bucket's copy is alive at once, with (on
    the first pipeline rank) the word embedding's bf16 gradient whose accumulation launched the last one.
    With a sequence of 4 tokens that is each rank's peak, and the dry run measures the model's within 0.5%
    (without the flag the model's peak there is its optimizer's, 1.5% above the measured schedule's)."""
    flags = [*TINY, "--seq-length", "4", "--max-position-embeddings", "4"]
    comm = ("--megatron-fsdp-grad-comm-dtype", "bf16")
    plan_input = read_input([*flags, "--use-megatron-fsdp", *comm])
    cand = Candidate(tp=1, pp=2, dp=2, micro_batch_size=1, num_microbatches=2, dp_sharding="optim",
                     layout=even_layout(4, 2).to_string(), megatron_fsdp_dtypes=comm)  # fmt: skip
    memory = candidate_memory(plan_input.spec, cand, device="cpu")
    without = candidate_memory(read_input(flags).spec, replace(cand, megatron_fsdp_dtypes=()), device="cpu")
    rows = compare(Planned(cand, memory, 0.0), plan_input, forward_step, ranks=[0, 1])
    for rank, (model, plain, row) in enumerate(zip(memory, without, rows)):
        assert plain.reduction_copies == 0 and model.reduction_copies == model.grads / 2 > 0, rank
        assert model.peak == model.reduction_peak > model.schedule_peak, rank
        assert (model.last_weight_grad > 0) == (rank == 0)
        assert abs(model.peak / row["dry_run"]["peak"] - 1) < 0.005, (rank, model.peak, row["dry_run"])

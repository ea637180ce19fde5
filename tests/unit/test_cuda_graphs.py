"""CUDA graphs (``--cuda-graph-impl local``, issue 32): Megatron's flags, their refusals, the CPU's one line.

The graphs themselves need a GPU: the tests marked ``cuda`` (skipped here; ``tools/gpu_check.py`` runs
them) check equal losses with and without graphs over a few iterations, a layer's graphed forward and
backward against its eager twin, re-capture on a new shape, a graph per microbatch in flight, and the
cap with its one note.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from core.device import building_on
from core.transformer import cuda_graphs
from core.transformer.cuda_graphs import LayerGraphs, graph_layers
from core.transformer.transformer_config import TransformerConfig
from core.transformer.transformer_layer import TransformerLayer
from tests.support.flags import assert_refused, megatron_args
from tests.support.gpt_model import make_config
from tests.support.pretrain_run import pretrain_gpt_in_process

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --eval-interval 1000 --eval-iters 0 --lr 1e-3 --mock-data --num-workers 0 "
    "--tokenizer-type NullTokenizer --vocab-size 127 --seed 7 --hidden-dropout 0 --attention-dropout 0 "
    "--train-iters 4 --log-interval 1"
)
GRAPHS = "--cuda-graph-impl local --cuda-graph-warmup-steps 1"


def test_flags_have_megatrons_names_and_defaults():
    args = megatron_args()
    assert (args.cuda_graph_impl, args.cuda_graph_scope, args.cuda_graph_warmup_steps) == ("none", [], 3)
    assert args.enable_cuda_graph is False


@pytest.fixture
def on_cuda(monkeypatch):
    """The flags checked as for a run on CUDA, where the graphs' own rules apply (TRIDENT_BACKEND=nccl:
    parsing decides the device; nothing here starts a process group)."""
    monkeypatch.setenv("TRIDENT_BACKEND", "nccl")


def test_enable_cuda_graph_is_the_older_spelling_of_local(on_cuda):
    assert megatron_args("--enable-cuda-graph --attention-dropout 0").cuda_graph_impl == "local"
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, attention_dropout=0.0)
    assert config.cuda_graph_impl == "none"
    assert dataclasses.replace(config, enable_cuda_graph=True).cuda_graph_impl == "local"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--cuda-graph-impl transformer_engine",
            (
                "Trident does not support --cuda-graph-impl transformer_engine: Trident uses no Transformer Engine: "
                "use --cuda-graph-impl local (each decoder layer's forward and backward captured per input shape)"
            ),
        ),
        (
            "--cuda-graph-impl full_iteration",
            (
                "Trident does not support --cuda-graph-impl full_iteration yet: the whole forward-backward in one "
                "CUDA graph is not built; --cuda-graph-impl local captures each decoder layer"
            ),
        ),
        (
            "--external-cuda-graph",  # Megatron's older spelling of --cuda-graph-impl transformer_engine
            (
                "Trident does not support --external-cuda-graph: Trident uses no Transformer Engine: use "
                "--cuda-graph-impl local (each decoder layer's forward and backward captured per input shape)"
            ),
        ),
        (
            "--enable-cuda-graph --cuda-graph-impl local",
            "--enable-cuda-graph is Megatron's older spelling of --cuda-graph-impl local: give one of them, not both",
        ),
        (
            "--cuda-graph-impl local --cuda-graph-modules mlp",
            (
                "--cuda-graph-scope 'mlp' is a Transformer Engine scope: --cuda-graph-impl local captures whole "
                "decoder layers; leave --cuda-graph-scope out"
            ),
        ),
    ],
)
def test_what_no_device_runs_is_refused_in_one_line(argv, message):
    """Refused wherever the run computes: Transformer Engine's graphs, the whole-step graph, both spellings
    of ``local`` at once, and Megatron's newer name for the scope flag with a scope of its."""
    assert_refused(argv, message)


LOCAL = "--cuda-graph-impl local --attention-dropout 0"


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (
            f"{LOCAL} --cuda-graph-scope full_iteration",
            1,
            (
                "--cuda-graph-scope full_iteration (the whole forward-backward in one graph) is not built yet; "
                "--cuda-graph-impl local captures each decoder layer"
            ),
        ),
        (
            f"{LOCAL} --cuda-graph-scope attn",
            1,
            (
                "--cuda-graph-scope 'attn' is a Transformer Engine scope: --cuda-graph-impl local captures whole "
                "decoder layers; leave --cuda-graph-scope out"
            ),
        ),
        (f"{LOCAL} --cuda-graph-warmup-steps -1", 1, "--cuda-graph-warmup-steps must be >= 0, got -1"),
        (
            "--enable-cuda-graph",
            1,
            (
                "--cuda-graph-impl local does not work with --attention-dropout > 0: attention dropout draws from "
                "the RNG tracker, which is not graph-safe; set --attention-dropout 0"
            ),
        ),
        (
            f"{LOCAL} --tensor-model-parallel-size 2 --sequence-parallel",
            2,
            (
                "--cuda-graph-impl local does not work with --hidden-dropout > 0 under --sequence-parallel: that "
                "dropout draws from the RNG tracker, which is not graph-safe; set --hidden-dropout 0"
            ),
        ),
        (
            f"{LOCAL} --recompute-granularity selective",
            1,
            (
                "--cuda-graph-impl local does not work with --recompute-granularity: recomputation runs forward "
                "again inside backward"
            ),
        ),
        (
            f"{LOCAL} --num-experts 4",
            1,
            "--cuda-graph-impl local does not work with --num-experts: MoE routing gives data-dependent shapes",
        ),
        (
            f"{LOCAL} --fp8-format hybrid --bf16",
            1,
            "--cuda-graph-impl local does not work with --fp8-format: FP8 layers under graphs are not built yet",
        ),
        (
            (
                f"{LOCAL} --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                "--use-distributed-optimizer"
            ),
            2,
            (
                "--cuda-graph-impl local does not work with --data-parallel-sharding-strategy optim_grads_params: "
                "a layer's parameters are freed after each use and gathered into new memory, and a graph reads "
                "the addresses it captured"
            ),
        ),
        (
            f"{LOCAL} --compile",
            1,
            "--cuda-graph-impl local does not work with --compile: compiled layers under graphs are not built yet",
        ),
        (
            f"{LOCAL} --pipeline-model-parallel-size 2 --pipeline-schedule zb-h1 --global-batch-size 8",
            2,
            (
                "--cuda-graph-impl local does not work with --pipeline-schedule zb-h1: its W would replay a graph a "
                "later F overwrote"
            ),
        ),
    ],
)
def test_what_local_graphs_cannot_hold_is_one_line_naming_the_flags(argv, world, message, on_cuda):
    assert_refused(argv, message, world)


OFF_CUDA = (
    "--cuda-graph-impl local: CUDA graphs need CUDA; this run computes on the CPU (gloo) and goes on "
    "without them"
)


@pytest.mark.parametrize(
    "argv, refused_on_cuda",
    [
        (LOCAL, ""),
        (
            "--enable-cuda-graph",
            (
                "--cuda-graph-impl local does not work with --attention-dropout > 0: attention dropout draws from "
                "the RNG tracker, which is not graph-safe; set --attention-dropout 0"
            ),
        ),
        (
            f"{LOCAL} --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
            (
                "--cuda-graph-impl local does not work with --recompute-granularity: recomputation runs forward "
                "again inside backward"
            ),
        ),
    ],
)
def test_off_cuda_the_graph_flags_change_nothing_but_one_line(argv, refused_on_cuda):
    """What a CUDA run refuses is named in the line; the run is the run without the flags."""
    args = megatron_args(argv)
    plain = megatron_args(argv.replace("--enable-cuda-graph", "").replace("--cuda-graph-impl local", ""))
    expected = OFF_CUDA + (f"; with CUDA it would refuse: {refused_on_cuda}" if refused_on_cuda else "")
    assert args.cuda_graphs_note == expected
    assert (args.cuda_graph_impl, args.enable_cuda_graph) == ("none", False)
    what_was_typed = {"cuda_graphs_note", "explicit_args", "command_line"}
    assert {k: v for k, v in vars(args).items() if k not in what_was_typed} == {
        k: v for k, v in vars(plain).items() if k not in what_was_typed
    }


def test_the_python_api_refuses_the_same_with_field_names():
    with pytest.raises(ValueError, match="cuda_graph_impl local does not work with attention_dropout > 0"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, cuda_graph_impl="local")


def test_nothing_is_wrapped_off_cuda():
    config = make_config("gpt", cuda_graph_impl="local", gradient_accumulation_fusion=True)
    layer = TransformerLayer(config, 0)
    assert graph_layers([layer], config, torch.device("cpu")) == []
    assert "forward" not in vars(layer) and layer.mlp.linear_fc1.gradient_accumulation_fusion


def test_on_a_cpu_one_line_says_graphs_need_cuda_and_the_losses_are_unchanged(capsys):
    plain = pretrain_gpt_in_process(argv=TINY.split())
    capsys.readouterr()
    graphed = pretrain_gpt_in_process(argv=f"{TINY} {GRAPHS}".split())
    lines = [line for line in capsys.readouterr().out.splitlines() if "CUDA graph" in line]
    assert lines == [
        (
            "--cuda-graph-impl local: CUDA graphs need CUDA; this run computes on the CPU (gloo) and goes on "
            "without them"
        )
    ]
    assert [s["lm loss"] for s in graphed.losses] == [s["lm loss"] for s in plain.losses]


# --------------------------------------------------------------------------------------------------
# On a GPU (tools/gpu_check.py runs these)
# --------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("flags", ["", "--gradient-accumulation-fusion", "--use-distributed-optimizer"])
def test_graphed_layers_train_to_the_same_losses(flags, no_tf32):
    argv = f"{TINY} --train-iters 6 --distributed-backend nccl {flags}"
    plain = pretrain_gpt_in_process(argv=argv.split())
    graphed = pretrain_gpt_in_process(argv=f"{argv} {GRAPHS}".split())
    for eager_step, graph_step in zip(plain.losses, graphed.losses, strict=True):
        assert graph_step["lm loss"] == pytest.approx(eager_step["lm loss"], rel=1e-5, abs=1e-6)


TOL = {"rtol": 1e-5, "atol": 1e-6}
"""fp32 without TF32: a replay runs the captured kernels, which cuBLAS may pick apart from eager's."""


def _twins(warmup: int = 1, max_graphs: int = 16) -> tuple[TransformerLayer, TransformerLayer, LayerGraphs]:
    torch.manual_seed(0)
    with building_on("cuda"):
        eager = TransformerLayer(make_config("gpt"), 0).cuda()
    with torch.no_grad():  # a layer built alone is not initialised (the model initialises by name)
        for p in eager.parameters():
            p.normal_(0.0, 0.1)
    graphed = copy.deepcopy(eager)
    return eager, graphed, LayerGraphs(graphed, warmup_steps=warmup, max_graphs=max_graphs)


def _step(layer: TransformerLayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward from no gradients (a graph hands out gradients in its static buffers,
    which a data-parallel wrapper takes into main_grad: a bare layer lets them go between steps)."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.square().sum().backward()
    return out.detach(), x.grad


def _assert_twins_agree(eager, graphed, shape) -> None:
    x = torch.randn(*shape, device="cuda")
    (out_e, dx_e), (out_g, dx_g) = _step(eager, x), _step(graphed, x)
    torch.testing.assert_close(out_g, out_e, **TOL)
    torch.testing.assert_close(dx_g, dx_e, **TOL)
    for (name, p_e), p_g in zip(eager.named_parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(p_g.grad, p_e.grad, msg=name, **TOL)


@pytest.mark.cuda
def test_a_graphed_layer_equals_its_eager_twin_and_recaptures_on_a_new_shape(no_tf32):
    eager, graphed, graphs = _twins()
    for _ in range(3):
        _assert_twins_agree(eager, graphed, (16, 2, 32))
    assert graphs.graphs == 1  # warm-up call eager, then one capture replayed
    _assert_twins_agree(eager, graphed, (8, 2, 32))
    _assert_twins_agree(eager, graphed, (8, 2, 32))
    assert graphs.graphs == 2


@pytest.mark.cuda
def test_microbatches_in_flight_each_hold_a_graph(no_tf32):
    eager, graphed, graphs = _twins(warmup=0)
    xs = [torch.randn(16, 2, 32, device="cuda") for _ in range(3)]
    for layer in (eager, graphed):  # three forwards, then their backwards in order (a 1F1B warm-up)
        outs = [layer(x.clone().requires_grad_(True)) for x in xs]
        torch.autograd.backward([o.square().sum() for o in outs])
    assert graphs.graphs == 3
    for p_e, p_g in zip(eager.parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(p_g.grad, p_e.grad, **TOL)


@pytest.mark.cuda
def test_past_the_cap_new_shapes_run_eagerly_with_one_note(capsys, monkeypatch, no_tf32):
    monkeypatch.setattr(cuda_graphs, "_cap_noted", False)
    eager, graphed, graphs = _twins(warmup=0, max_graphs=1)
    for seq in (16, 8, 4, 8):
        _assert_twins_agree(eager, graphed, (seq, 2, 32))
    assert graphs.graphs == 1
    notes = [line for line in capsys.readouterr().out.splitlines() if "CUDA graphs" in line]
    assert notes == [
        (
            "--cuda-graph-impl local: layer 0 holds 1 CUDA graphs (input shapes x microbatches in flight); "
            "new ones run eagerly"
        )
    ]

"""The command line and the Python API refuse the same context-parallel, MoE and decoder configurations,
with the same problem: the config's rule, said with field names by ``TransformerConfig`` and with
Megatron's flags by ``training.arguments.checks``. No processes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from core.model_parallel_config import expert_tensor_parallel_problems, parallel_size_problems
from core.problems import Problem, ProblemsError, problem
from core.transformer import TransformerConfig
from core.transformer.moe.rules import moe_training_problems
from tests.support.flags import MODEL, megatron_args
from training.arguments.checks import command_line_message

SIZES = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
"""What ``MODEL``'s flags give the config."""

# (name, flags added to MODEL, the config's keyword arguments besides SIZES, world size, the API's message)
RULES: list[tuple[str, str, dict[str, Any], int, str]] = [
    (
        "hierarchical CP",
        "--cp-comm-type a2a+p2p",
        {"cp_comm_type": "a2a+p2p"},
        1,
        (
            "cp_comm_type a2a+p2p: Trident does not support hierarchical context parallelism (all-to-all inside "
            "a node, ring across nodes); use p2p, a2a or allgather"
        ),
    ),
    (
        "unknown CP form",
        "--cp-comm-type ring",
        {"cp_comm_type": "ring"},
        1,
        "cp_comm_type must be one of ('p2p', 'a2a', 'allgather'), got 'ring'",
    ),
    (
        "CP forms per layer",
        "--cp-comm-type p2p a2a p2p",
        {"cp_comm_type": ["p2p", "a2a", "p2p"]},
        1,
        "cp_comm_type gives 3 types for 2 layers; give one or one per layer",
    ),
    (
        "a2a heads over CP",
        "--context-parallel-size 4 --cp-comm-type a2a --num-attention-heads 2",
        {"context_parallel_size": 4, "cp_comm_type": "a2a", "num_attention_heads": 2},
        4,
        (
            "cp_comm_type a2a splits heads over the context-parallel ranks: num_attention_heads (2) and the query "
            "groups (2) per tensor_model_parallel_size (1) rank must be divisible by context_parallel_size (4)"
        ),
    ),
    (
        "a2a query groups over CP",
        "--context-parallel-size 2 --cp-comm-type a2a --group-query-attention --num-query-groups 1",
        {"context_parallel_size": 2, "cp_comm_type": "a2a", "num_query_groups": 1},
        2,
        (
            "cp_comm_type a2a splits heads over the context-parallel ranks: num_attention_heads (4) and the query "
            "groups (1) per tensor_model_parallel_size (1) rank must be divisible by context_parallel_size (2)"
        ),
    ),
    (
        "EP without experts",
        "--expert-model-parallel-size 2",
        {"expert_model_parallel_size": 2},
        2,
        "expert_model_parallel_size 2 needs num_moe_experts (a model with experts)",
    ),
    ("no experts", "--num-experts 0", {"num_moe_experts": 0}, 1, "num_moe_experts must be >= 1, got 0"),
    (
        "experts over EP",
        "--num-experts 6 --expert-model-parallel-size 4",
        {"num_moe_experts": 6, "expert_model_parallel_size": 4},
        4,
        "num_moe_experts (6) must be divisible by expert_model_parallel_size (4)",
    ),
    (
        "top-k over experts",
        "--num-experts 4 --moe-router-topk 5",
        {"num_moe_experts": 4, "moe_router_topk": 5},
        1,
        "moe_router_topk (5) must be between 1 and num_moe_experts (4)",
    ),
    (
        "top-1 without pre-softmax",
        "--num-experts 4 --moe-router-topk 1",
        {"num_moe_experts": 4, "moe_router_topk": 1},
        1,
        (
            "moe_router_topk 1 needs moe_router_pre_softmax: a softmax over one logit is 1 and gives the router "
            "no gradient"
        ),
    ),
    (
        "layer pattern",
        "--num-experts 4 --moe-layer-freq ([1]*3)",
        {"num_moe_experts": 4, "moe_layer_freq": "([1]*3)"},
        1,
        "moe_layer_freq ([1]*3) must list 0 or 1 for each of the 2 layers",
    ),
    (
        "layer pattern text",
        "--num-experts 4 --moe-layer-freq ([1]*",
        {"num_moe_experts": 4, "moe_layer_freq": "([1]*"},
        1,
        (
            "moe_layer_freq: moe_layer_freq '([1]*' is neither an integer nor a list expression such as "
            "'([0]+[1]*23)' ("
        ),
    ),
    (
        "expert size",
        "--num-experts 4 --moe-ffn-hidden-size 0",
        {"num_moe_experts": 4, "moe_ffn_hidden_size": 0},
        1,
        "moe_ffn_hidden_size must be >= 1 or None, got 0",
    ),
    (
        "shared experts over TP",
        (
            "--num-experts 4 --moe-shared-expert-intermediate-size 3 --tensor-model-parallel-size 2 "
            "--sequence-parallel"
        ),
        {
            "num_moe_experts": 4,
            "moe_shared_expert_intermediate_size": 3,
            "tensor_model_parallel_size": 2,
            "sequence_parallel": True,
        },
        2,
        "moe_shared_expert_intermediate_size (3) must be divisible by tensor_model_parallel_size (2)",
    ),
    (
        "capacity factor",
        "--num-experts 4 --moe-expert-capacity-factor 0",
        {"num_moe_experts": 4, "moe_expert_capacity_factor": 0.0},
        1,
        "moe_expert_capacity_factor must be > 0 or None, got 0.0",
    ),
    (
        "padding without capacity",
        "--num-experts 4 --moe-pad-expert-input-to-capacity",
        {"num_moe_experts": 4, "moe_pad_expert_input_to_capacity": True},
        1,
        "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor",
    ),
]


# The decoder's own rules, shared the same way.
DECODER: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("a size below 1", "--num-layers 0", {"num_layers": 0}, 1, "num_layers must be >= 1, got 0"),
    (
        "an FFN size below 1",
        "--ffn-hidden-size 0",
        {"ffn_hidden_size": 0},
        1,
        "ffn_hidden_size must be >= 1, got 0",
    ),
    (
        "heads over TP",
        "--tensor-model-parallel-size 2 --num-attention-heads 2 --group-query-attention --num-query-groups 1",
        {"tensor_model_parallel_size": 2, "num_attention_heads": 2, "num_query_groups": 1},
        2,
        "num_query_groups (1) must be divisible by tensor_model_parallel_size (2)",
    ),
    (
        "hidden over heads",
        "--hidden-size 30",
        {"hidden_size": 30},
        1,
        "hidden_size (30) must be divisible by num_attention_heads (4) when kv_channels is not set",
    ),
    (
        "full recompute",
        "--recompute-granularity full --recompute-method block",
        {"recompute_granularity": "full", "recompute_method": "block"},
        1,
        "recompute_granularity='full' needs recompute_num_layers >= 1, got None",
    ),
    (
        "selective recompute",
        "--recompute-granularity selective --recompute-num-layers 1",
        {"recompute_granularity": "selective", "recompute_num_layers": 1},
        1,
        "recompute_granularity='selective' takes no recompute_method (None) or recompute_num_layers (1)",
    ),
    (
        "linear loss fusion",
        "--cross-entropy-fusion-impl linear",
        {"cross_entropy_fusion_impl": "linear"},
        1,
        "cross_entropy_fusion_impl linear needs cross_entropy_loss_fusion (it says how that fusion is done)",
    ),
    (
        "rotary channels",
        "--position-embedding-type rope --rotary-percent 0.1",
        {"position_embedding_type": "rope", "rotary_percent": 0.1},
        1,
        "rotary_percent (0.1) x kv_channels (8) gives 0 rotary channels; RoPE needs an even number >= 2",
    ),
]


def _refusals(flags: str, config: dict[str, Any], world_size: int) -> tuple[str, Problem]:
    """What the command line says, and the config's first problem."""
    with pytest.raises(ValueError) as cli:
        megatron_args(f"{MODEL} --train-iters 3 {flags}", world_size)
    with pytest.raises(ProblemsError) as api:
        TransformerConfig(**SIZES | config)
    return str(cli.value), api.value.problems[0]


@pytest.mark.parametrize(
    "flags, config, world_size, message",
    [r[1:] for r in RULES + DECODER],
    ids=[r[0] for r in RULES + DECODER],
)
def test_the_command_line_and_the_config_refuse_with_the_same_problem(flags, config, world_size, message):
    said, first = _refusals(flags, config, world_size)
    assert said == command_line_message(first)
    assert str(first).startswith(message)


def test_the_command_line_says_flags_where_the_config_says_fields():
    said, first = _refusals(
        "--num-experts 4 --moe-router-topk 5", {"num_moe_experts": 4, "moe_router_topk": 5}, 1
    )
    assert str(first) == "moe_router_topk (5) must be between 1 and num_moe_experts (4)"
    assert said == "--moe-router-topk (5) must be between 1 and --num-experts (4)"


def test_training_moe_with_tp_needs_sequence_parallelism_in_the_layer_and_on_the_command_line():
    config = TransformerConfig(**SIZES, num_moe_experts=4, tensor_model_parallel_size=2)  # inference may
    (needs_sp,) = moe_training_problems(config)
    with pytest.raises(ValueError) as cli:
        megatron_args(f"{MODEL} --train-iters 3 --num-experts 4 --tensor-model-parallel-size 2", 2)
    assert str(cli.value) == command_line_message(needs_sp)


def test_a_problem_names_each_field_as_it_is_asked_to():
    refused = problem("{a} ({n}) must divide {b_c}", "a", "b_c", n=3)
    assert str(refused) == "a (3) must divide b_c"
    assert refused.render(lambda field: "--" + field.replace("_", "-")) == "--a (3) must divide --b-c"


def test_experts_split_over_tp_are_refused_by_the_parallel_config_and_the_command_line_alike():
    with pytest.raises(ValueError) as api:
        TransformerConfig(**SIZES, num_moe_experts=4, expert_tensor_parallel_size=2)
    with pytest.raises(ValueError) as cli:
        megatron_args(f"{MODEL} --train-iters 3 --num-experts 4 --expert-tensor-parallel-size 2")
    (refused,) = expert_tensor_parallel_problems(SimpleNamespace(expert_tensor_parallel_size=2))
    assert (str(api.value), str(cli.value)) == (str(refused), command_line_message(refused))


@pytest.mark.parametrize(
    "field", ["tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size"]
)
def test_a_parallel_size_below_1_is_refused_by_the_parallel_config_and_the_command_line_alike(field):
    """One rule, the parallel config's: the command line says it with the flag (CP 0 divided the world
    size by zero before it did)."""
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError) as api:
        TransformerConfig(**SIZES, **{field: 0})
    with pytest.raises(ValueError) as cli:
        megatron_args(f"{MODEL} --train-iters 3 {flag} 0")
    parallel = ("tensor_model", "pipeline_model", "context", "expert_model")
    sizes = {f"{name}_parallel_size": 1 for name in parallel} | {field: 0}
    (refused,) = parallel_size_problems(SimpleNamespace(**sizes))
    assert str(api.value) == str(refused) == f"{field} must be >= 1, got 0"
    assert str(cli.value) == command_line_message(refused) == f"{flag} must be >= 1, got 0"


def test_the_config_takes_megatrons_layer_pattern_text_as_the_command_line_does():
    config = TransformerConfig(**SIZES, num_moe_experts=4, moe_layer_freq="([1]*1+[0])")
    assert config.moe_layer_freq == [1, 0]
    assert config.moe_layer_pattern(2) == [True, False]

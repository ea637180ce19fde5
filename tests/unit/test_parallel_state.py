"""Process groups laid out as Megatron-LM lays them out: the pure group maths (no processes).

Every expected list is written out by hand from Megatron's rule (tests/support/megatron_groups.py),
never computed with the code under test. Real gloo groups: tests/dist/test_parallel_state.py."""

import itertools

import numpy as np
import pytest
import torch.distributed as dist

from core import parallel_state as ps
from tests.support.megatron_groups import EIGHT_RANK, EXPERT_INSTANCES, EXPERT_LAYOUTS, SINGLETONS_8

# Megatron's documented example (initialize_model_parallel docstring): 16 ranks, TP=2, PP=4.
MEGATRON_16 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "pp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "cp": [[r] for r in range(16)],
    "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "mp": [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]],
    "tp_dp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "tp_dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "embd": [[0, 12], [1, 13], [2, 14], [3, 15]],
    "pos_embd": [[0], [1], [2], [3]],
}


def test_megatron_documented_16_rank_example():
    assert (
        ps.generate_parallel_groups(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
        == MEGATRON_16
    )


@pytest.mark.parametrize("sizes", list(EIGHT_RANK), ids=lambda s: "tp{}-pp{}-cp{}".format(*s))
def test_eight_rank_layouts_match_megatron(sizes):
    tp, pp, cp = sizes
    assert ps.generate_parallel_groups(8, tp, pp, cp) == EIGHT_RANK[sizes]


def test_context_parallel_groups_follow_megatron_docstring():
    # Megatron: 8 GPUs, TP=4, CP=2 -> CP groups [0,4] [1,5] [2,6] [3,7].
    groups = ps.generate_parallel_groups(8, tensor_model_parallel_size=4, context_parallel_size=2)
    assert groups["cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["dp"] == SINGLETONS_8
    assert groups["dp_cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp_dp_cp"] == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_pp_before_dp_order_puts_data_parallel_outermost():
    # Megatron's --use-tp-pp-dp-mapping order; rank = tp + 2*pp + 4*dp.
    groups = ps.generate_parallel_groups(8, 2, 2, order="tp-cp-ep-pp-dp")
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["embd"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_without_pipeline_the_embedding_group_is_a_single_rank():
    groups = ps.generate_parallel_groups(4, tensor_model_parallel_size=2)
    assert groups["pp"] == [[0], [1], [2], [3]]
    assert groups["embd"] == [[0], [1], [2], [3]]
    assert groups["pos_embd"] == [[0], [1], [2], [3]]


def test_world_of_one_has_only_singleton_groups():
    groups = ps.generate_parallel_groups(1)
    assert set(groups) == set(ps.GROUP_NAMES)
    assert all(g == [[0]] for g in groups.values())


def test_pipeline_links_each_direction_of_each_neighbour_pair():
    assert ps.pipeline_channels(1) == []
    assert ps.pipeline_channels(2) == [(0, 1), (1, 0)]
    assert ps.pipeline_channels(4) == [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2), (3, 0), (0, 3)]


def test_non_dividing_world_size_is_one_clear_error():
    with pytest.raises(ValueError) as err:
        ps.generate_parallel_groups(6, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert str(err.value) == (
        "world size 6 is not divisible by tensor_model_parallel_size (2) x "
        "pipeline_model_parallel_size (4) x context_parallel_size (1) = 8"
    )


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-cp-ep-dp-pp-tp", "tp-cp-xp-dp-pp", "tp,cp,ep,dp,pp"])
def test_bad_order_is_rejected(order):
    with pytest.raises(ValueError) as err:
        ps.generate_parallel_groups(8, order=order)
    assert str(err.value) == (
        f"order {order!r} must name each of tp, cp, ep, dp, pp exactly once, "
        "joined by '-' (Megatron's default is 'tp-cp-ep-dp-pp')"
    )


def test_sizes_below_one_are_rejected():
    with pytest.raises(ValueError, match=r"^pipeline_model_parallel_size must be an integer >= 1, got 0$"):
        ps.generate_parallel_groups(8, pipeline_model_parallel_size=0)


def test_uninitialized_getters(monkeypatch):
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(
        RuntimeError,
        match=r"^model parallel groups are not initialized; "
        r"call initialize_model_parallel\(\.\.\.\)$",
    ):
        ps.get_tensor_model_parallel_group()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_pipeline_model_parallel_rank()
    assert not ps.is_rank_in_embedding_group()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    # Without torch.distributed at all, data/context sizes describe the single process.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()) == (1, 0)
    assert (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()) == (1, 0)


@pytest.mark.parametrize(
    "key", list(EXPERT_LAYOUTS), ids=lambda k: "w{}-tp{}-pp{}-cp{}-ep{}-etp{}-{}".format(*k)
)
def test_expert_groups_match_megatron_core(key):
    world, tp, pp, cp, ep, etp, order = key
    assert ps.generate_expert_groups(world, tp, pp, cp, ep, etp, order) == EXPERT_LAYOUTS[key]


def _groups_by(world: int, coords, varying: set[str]) -> list[list[int]]:
    """Ranks that share every coordinate outside ``varying``, ascending; groups by first member."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(world):
        key = tuple(v for axis, v in coords(rank).items() if axis not in varying)
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


def _megatron_expert_groups(world, tp, pp, cp, ep) -> dict[str, list[list[int]]]:
    """megatron-core's rule with the default order and expert TP 1, written independently of ours:
    dense rank = tp + TP*(cp + CP*(dp + DP*pp)), expert rank = ep + EP*(edp + EDP*pp)."""
    dp, edp = world // (tp * cp * pp), world // (ep * pp)

    def dense(r):
        return {"tp": r % tp, "cp": r // tp % cp, "dp": r // (tp * cp) % dp, "pp": r // (tp * cp * dp)}

    def expert(r):
        return {"ep": r % ep, "edp": r // ep % edp, "pp": r // (ep * edp)}

    return {
        "tp_cp": _groups_by(world, dense, {"tp", "cp"}),
        "ep": _groups_by(world, expert, {"ep"}),
        "expt_tp": [[r] for r in range(world)],
        "expt_tp_ep": _groups_by(world, expert, {"ep"}),
        "expt_tp_ep_pp": _groups_by(world, expert, {"ep", "pp"}),
        "expt_dp": _groups_by(world, expert, {"edp"}),
    }


def test_expert_groups_match_megatron_core_for_every_legal_split_up_to_16_ranks():
    checked = 0
    for world in range(1, 17):
        for tp, pp, cp, ep in itertools.product(*[[d for d in range(1, world + 1) if world % d == 0]] * 4):
            if world % (tp * pp * cp) or world % (ep * pp):
                continue
            expected = _megatron_expert_groups(world, tp, pp, cp, ep)
            assert ps.generate_expert_groups(world, tp, pp, cp, ep) == expected, (world, tp, pp, cp, ep)
            checked += 1
    assert checked > 500


def test_without_expert_parallelism_the_expert_data_group_is_the_dense_one_folded_over_tp_and_cp():
    groups = ps.generate_parallel_groups(8, 2, 2)
    experts = ps.generate_expert_groups(8, 2, 2)
    assert experts["ep"] == SINGLETONS_8
    assert experts["expt_dp"] == groups["tp_dp"]  # expert weights are whole on every TP rank
    assert experts["expt_tp_ep_pp"] == groups["pp"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (6, 1, 1, 1, 4),
            (
                "world size 6 is not divisible by expert_tensor_parallel_size (1) x "
                "expert_model_parallel_size (4) x pipeline_model_parallel_size (1) = 4"
            ),
        ),
        (
            (8, 1, 2, 1, 2, 1, "tp-cp-ep-pp-dp"),
            (
                "with order 'tp-cp-ep-pp-dp' (pp not last) the expert data-parallel size (2) must equal "
                "the data-parallel size (4), as megatron-core requires"
            ),
        ),
        ((8, 1, 1, 1, 0), "expert_model_parallel_size must be an integer >= 1, got 0"),
    ],
)
def test_expert_sizes_megatron_core_refuses_fail_in_one_line(args, message):
    with pytest.raises(ValueError) as err:
        ps.generate_expert_groups(*args)
    assert str(err.value) == message


# megatron-core's partial distributed optimizer (--num-distributed-optimizer-instances N): each DP x CP
# group cut into N consecutive blocks (intra), the ranks at one position of every block (inter), and each
# instance across TP/PP/CP in megatron-core's order (its tp-ep-pp groups, block position by position).
INSTANCES = {
    (4, 1, 1, 2): {  # DP4, N=2
        "intra_dp_cp": [[0, 1], [2, 3]],
        "inter_dp_cp": [[0, 2], [1, 3]],
        "intra_dist_opt": [[0, 1], [2, 3]],
    },
    (8, 2, 1, 2): {  # TP2 x DP4, N=2
        "intra_dp_cp": [[0, 2], [4, 6], [1, 3], [5, 7]],
        "inter_dp_cp": [[0, 4], [2, 6], [1, 5], [3, 7]],
        "intra_dist_opt": [[0, 1, 2, 3], [4, 5, 6, 7]],
    },
    (8, 1, 2, 2): {  # PP2 x DP4, N=2: pipeline groups [0,4] [1,5] [2,6] [3,7]
        "intra_dp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "inter_dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "intra_dist_opt": [[0, 4, 1, 5], [2, 6, 3, 7]],
    },
    (8, 1, 1, 4): {  # DP8, N=4
        "intra_dp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "inter_dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "intra_dist_opt": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
}


@pytest.mark.parametrize("sizes", list(INSTANCES), ids=lambda s: "world{}-tp{}-pp{}-N{}".format(*s))
def test_distributed_optimizer_instance_groups_match_megatron_core(sizes):
    world, tp, pp, instances = sizes
    dp_cp = ps.generate_parallel_groups(world, tp, pp)["dp_cp"]
    assert ps.generate_instance_groups(dp_cp, instances) == INSTANCES[sizes]


def test_instances_that_do_not_divide_dp_are_one_clear_error():
    with pytest.raises(ValueError) as err:
        ps.generate_instance_groups(ps.generate_parallel_groups(6, 2)["dp_cp"], 2)
    assert str(err.value) == (
        "num_distributed_optimizer_instances (2) must divide the data-parallel size x context-parallel size (3)"
    )


# The same split of the expert data-parallel groups (megatron-core's intra- and inter-partial expert
# data-parallel groups), written out in tests/support/megatron_groups.py.
@pytest.mark.parametrize(
    "sizes", list(EXPERT_INSTANCES), ids=lambda s: "world{}-tp{}-pp{}-ep{}-N{}".format(*s)
)
def test_expert_instance_groups_match_megatron_core(sizes):
    world, tp, pp, ep, instances = sizes
    dense = ps.generate_parallel_groups(world, tp, pp)
    inter = ps.generate_instance_groups(dense["dp_cp"], instances)["inter_dp_cp"]
    expt_dp = ps.generate_expert_groups(world, tp, pp, 1, ep)["expt_dp"]
    assert ps.generate_expert_instance_groups(expt_dp, inter, instances) == EXPERT_INSTANCES[sizes]


def _megatron_hierarchical(ranks: list[int], sizes: list[int]) -> list[list[list[int]]]:
    """megatron-core's create_hierarchical_groups, its einops rearrange "(l s u) -> (l u) s" in numpy."""
    out = []
    for level, size in enumerate(sizes):
        below, above = int(np.prod(sizes[:level])), int(np.prod(sizes[level + 1 :]))
        grid = np.array(ranks).reshape(above, size, below).transpose(0, 2, 1).reshape(above * below, size)
        out.append(grid.tolist())
    return out


def test_expert_instances_match_megatron_core_and_the_dense_instances_for_every_split_up_to_16_ranks():
    """For every legal split and N, with megatron-core's two orders: the expert groups are megatron-core's;
    the inter groups are the dense layers' (megatron-core makes only one); and each distributed-optimizer
    instance (``intra_dist_opt``, over which gradient norms are summed) holds the ranks of megatron-core's,
    which it builds from EDP / N consecutive expert tp-ep-pp groups: one replica of every expert shard."""
    checked = 0
    for world, order in itertools.product(range(1, 17), ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")):
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        for tp, pp, cp, ep, n in itertools.product(divisors, divisors, divisors, divisors, (2, 3, 4)):
            try:
                dense = ps.generate_parallel_groups(world, tp, pp, cp, order)
                experts = ps.generate_expert_groups(world, tp, pp, cp, ep, 1, order)
                instances = ps.generate_instance_groups(dense["dp_cp"], n)
            except ValueError:
                continue
            edp = len(experts["expt_dp"][0])
            if edp % n:
                continue
            ours = ps.generate_expert_instance_groups(experts["expt_dp"], instances["inter_dp_cp"], n)
            levels = [_megatron_hierarchical(g, [edp // n, n]) for g in experts["expt_dp"]]
            assert ours["intra_expt_dp"] == [g for inner, _ in levels for g in inner]
            assert ours["inter_expt_dp"] == [g for _, outer in levels for g in outer]
            assert sorted(ours["inter_expt_dp"]) == sorted(instances["inter_dp_cp"])
            blocks = [
                experts["expt_tp_ep_pp"][i : i + edp // n]
                for i in range(0, len(experts["expt_tp_ep_pp"]), edp // n)
            ]
            megatron = sorted(sorted(r for g in block for r in g) for block in blocks)
            assert sorted(sorted(g) for g in instances["intra_dist_opt"]) == megatron, (
                world,
                tp,
                pp,
                cp,
                ep,
                n,
            )
            checked += 1
    assert checked > 700


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            (4, 1, 1, 1, 4, "tp-cp-ep-dp-pp"),
            "num_distributed_optimizer_instances (2) must divide the expert data-parallel size (1)",
        ),
        (
            (4, 1, 1, 1, 2, "tp-cp-dp-ep-pp"),
            (
                "the expert layers' distributed-optimizer instances would differ from the dense layers' "
                "(inter-instance groups [[0, 1], [2, 3]] and [[0, 2], [1, 3]]); use megatron-core's order "
                "tp-cp-ep-dp-pp or tp-cp-ep-pp-dp"
            ),
        ),
    ],
)
def test_expert_instances_megatron_core_refuses_fail_in_one_line(sizes, message):
    world, tp, pp, cp, ep, order = sizes
    inter = ps.generate_instance_groups(ps.generate_parallel_groups(world, tp, pp, cp, order)["dp_cp"], 2)
    expt_dp = ps.generate_expert_groups(world, tp, pp, cp, ep, 1, order)["expt_dp"]
    with pytest.raises(ValueError) as err:
        ps.generate_expert_instance_groups(expt_dp, inter["inter_dp_cp"], 2)
    assert str(err.value) == message

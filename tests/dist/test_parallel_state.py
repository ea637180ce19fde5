"""Process groups laid out as Megatron-LM lays them out: the pure group maths, then real gloo groups.

Every expected list below is written out by hand from Megatron's rule (rank = tp + TP*(cp + CP*(dp +
DP*pp)) for the default order "tp-cp-ep-dp-pp"; a group varies only its own axes), never computed
with the code under test.
"""

import itertools
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from core import parallel_state as ps
from tests.support.torchrun_jobs import run_captured

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60
SINGLETONS_8 = [[r] for r in range(8)]

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

# 8-rank configurations: (tp, pp, cp) -> every group of every kind.
EIGHT_RANK = {
    (2, 2, 1): {  # DP=2; rank = tp + 2*dp + 4*pp
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "cp": SINGLETONS_8,
        "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "tp_dp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "tp_dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "embd": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pos_embd": [[0], [1], [2], [3]],
    },
    (1, 4, 1): {  # DP=2; rank = dp + 2*pp
        "tp": SINGLETONS_8,
        "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": SINGLETONS_8,
        "dp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "mp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp_dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "tp_dp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "embd": [[0, 6], [1, 7]],
        "pos_embd": [[0], [1]],
    },
    (2, 4, 1): {  # DP=1; rank = tp + 2*pp
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "dp": SINGLETONS_8,
        "cp": SINGLETONS_8,
        "dp_cp": SINGLETONS_8,
        "mp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "tp_dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "tp_dp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "embd": [[0, 6], [1, 7]],
        "pos_embd": [[0], [1]],
    },
    (1, 2, 2): {  # CP=2, DP=2; rank = cp + 2*dp + 4*pp
        "tp": SINGLETONS_8,
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "mp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "tp_dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp_dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "embd": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pos_embd": [[0], [1], [2], [3]],
    },
}


def _group_of(rank, groups):
    """The listed group containing ``rank`` (None if it is in none, as for the embedding groups)."""
    return next((g for g in groups if rank in g), None)


# ----------------------------------------------------------------------------------------------
# Pure group maths
# ----------------------------------------------------------------------------------------------


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


def test_single_process_initializes_itself_without_a_launcher():
    """``python script.py`` with no torchrun variables: a world of one, every group of size one."""
    script = (
        "import torch, torch.distributed as dist\n"
        "from core import parallel_state as ps\n"
        "g = ps.initialize_model_parallel()\n"
        "t = torch.ones(1); dist.all_reduce(t, group=ps.get_data_parallel_group()); assert t.item() == 1\n"
        "assert all(r == (0,) for r in g.ranks.values()), g\n"
        "assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage() and ps.is_rank_in_embedding_group()\n"
        "assert ps.get_pipeline_model_parallel_next_rank() == ps.get_pipeline_model_parallel_prev_rank() == 0\n"
        "ps.destroy_model_parallel(); ps.initialize_distributed()\n"
        "print('ok', dist.get_world_size(), ps.get_tensor_model_parallel_world_size.__name__)\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK")
    }
    out = run_captured([sys.executable, "-c", script], env=env, timeout=TIMEOUT, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["ok", "1"]


# ----------------------------------------------------------------------------------------------
# Real groups on 8 gloo ranks
# ----------------------------------------------------------------------------------------------


def _members_or_error(getter):
    try:
        return dist.get_process_group_ranks(getter())
    except RuntimeError as err:
        return str(err)


def _report_groups(rank, world_size, tp, pp, cp):
    """Initialise, then report what this rank sees: members, getter values and real all-reduces."""
    groups = ps.initialize_model_parallel(tp, pp, context_parallel_size=cp)
    members = {
        name: dist.get_process_group_ranks(getattr(groups, name))
        for name in ps.GROUP_NAMES
        if getattr(groups, name) is not None
    }
    sums = {}
    for name, group in (
        ("tp", ps.get_tensor_model_parallel_group()),
        ("pp", ps.get_pipeline_model_parallel_group()),
        ("dp", ps.get_data_parallel_group()),
        ("dp_cp", ps.get_data_parallel_group(True)),
    ):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    getters = {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        "dp_cp": (ps.get_data_parallel_rank(True), ps.get_data_parallel_world_size(True)),
    }
    return {
        "members": members,
        "sums": sums,
        "getters": getters,
        "next": ps.get_pipeline_model_parallel_next_rank(),
        "prev": ps.get_pipeline_model_parallel_prev_rank(),
        "first_rank": ps.get_pipeline_model_parallel_first_rank(),
        "last_rank": ps.get_pipeline_model_parallel_last_rank(),
        "first": ps.is_pipeline_first_stage(),
        "last": ps.is_pipeline_last_stage(),
        "in_embd": ps.is_rank_in_embedding_group(),
        "embd_getter": _members_or_error(ps.get_embedding_group),
        "pos_embd_getter": _members_or_error(ps.get_position_embedding_group),
        "tp_src": ps.get_tensor_model_parallel_src_rank(),
        "dp_src": ps.get_data_parallel_src_rank(),
        "same_object": ps.get_parallel_groups() is groups,
        "channels": {
            key: dist.get_process_group_ranks(group)
            for key, group in ps.get_pipeline_model_parallel_channel_groups().items()
        },
    }


@pytest.mark.parametrize("sizes", list(EIGHT_RANK), ids=lambda s: "tp{}-pp{}-cp{}".format(*s))
def test_real_groups_on_eight_ranks(ranks, sizes):
    expected = EIGHT_RANK[sizes]
    reports = ranks(8).run(_report_groups, *sizes, timeout=TIMEOUT)
    for rank, got in enumerate(reports):
        mine = {name: _group_of(rank, expected[name]) for name in ps.GROUP_NAMES}
        assert got["members"] == {name: g for name, g in mine.items() if g is not None}, f"rank {rank}"
        for name in ("tp", "pp", "dp", "dp_cp"):
            assert got["sums"][name] == sum(mine[name]), f"rank {rank} all_reduce over {name}"
        for name in ("tp", "pp", "dp", "cp", "dp_cp"):
            assert got["getters"][name] == (mine[name].index(rank), len(mine[name])), f"rank {rank} {name}"
        pipeline, stage = mine["pp"], mine["pp"].index(rank)
        assert got["next"] == pipeline[(stage + 1) % len(pipeline)]
        assert got["prev"] == pipeline[(stage - 1) % len(pipeline)]
        assert (got["first_rank"], got["last_rank"]) == (pipeline[0], pipeline[-1])
        assert (got["first"], got["last"]) == (stage == 0, stage == len(pipeline) - 1)
        assert got["in_embd"] == (mine["embd"] is not None)
        for name, outside in (
            ("embd", "an embedding group; only the first and last pipeline stages are"),
            ("pos_embd", "a position-embedding group; only the first pipeline stage is"),
        ):
            expected_getter = mine[name] if mine[name] is not None else f"rank {rank} is not in {outside}"
            assert got[f"{name}_getter"] == expected_getter, f"rank {rank} {name}"
        assert (got["tp_src"], got["dp_src"]) == (mine["tp"][0], mine["dp"][0])
        assert got["same_object"]
        # One two-rank group per directed link this rank is on, with exactly that link's two ranks.
        links = [c for c in ps.pipeline_channels(len(pipeline)) if stage in c]
        assert got["channels"] == {c: sorted([pipeline[c[0]], pipeline[c[1]]]) for c in links}


def _try_tp3(rank, world_size):
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=3)
    except ValueError as err:
        return str(err), ps.model_parallel_is_initialized()
    return None, ps.model_parallel_is_initialized()


def test_non_dividing_size_fails_on_every_rank_before_any_group(ranks):
    message = (
        "world size 8 is not divisible by tensor_model_parallel_size (3) x "
        "pipeline_model_parallel_size (1) x context_parallel_size (1) = 3"
    )
    assert ranks(8).run(_try_tp3, timeout=TIMEOUT) == [(message, False)] * 8


def _virtual_stages(rank, world_size):
    """pp=4, vpp=2 (dp=2): stage flags per chunk, by vp_stage and by the schedule-set virtual rank."""
    ps.initialize_model_parallel(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    by_argument, by_state = [], []
    for chunk in range(2):
        by_argument.append(
            (
                ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk),
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk),
                ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=chunk),
            )
        )
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        by_state.append(
            (
                ps.is_pipeline_first_stage(ignore_virtual=False),
                ps.is_pipeline_last_stage(ignore_virtual=False),
                ps.is_rank_in_embedding_group(ignore_virtual=False),
            )
        )
    ignoring = (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(), ps.is_rank_in_embedding_group())
    return by_argument, by_state, ignoring, ps.get_virtual_pipeline_model_parallel_world_size()


def test_virtual_pipeline_first_and_last_stage(ranks):
    # PP groups [0,2,4,6] [1,3,5,7]: ranks 0,1 run the first stage, 6,7 the last.
    results = ranks(8).run(_virtual_stages, timeout=TIMEOUT)
    for rank, (by_argument, by_state, ignoring, vpp) in enumerate(results):
        first, last = rank in (0, 1), rank in (6, 7)
        expected = [(first, False, first), (False, last, last)]  # chunk 0, chunk 1
        assert by_argument == expected, f"rank {rank}"
        assert by_state == expected, f"rank {rank}"
        assert ignoring == (first, last, first or last)
        assert vpp == 2


# ----------------------------------------------------------------------------------------------
# Expert groups: megatron-core's second decomposition (etp x ep x edp x pp, same order, cp of size 1)
# ----------------------------------------------------------------------------------------------

SINGLETONS_16 = [[r] for r in range(16)]

# (world, tp, pp, cp, ep, etp, order) -> expert groups, written out from megatron-core's rule: with the
# default order, expert rank = etp_rank + ETP*(ep_rank + EP*(edp_rank + EDP*pp_rank)), EDP = world/(ETP*EP*PP).
EXPERT_LAYOUTS = {
    (8, 1, 1, 1, 2, 1, DEFAULT := ps.DEFAULT_ORDER): {  # EDP 4; rank = ep + 2*edp
        "tp_cp": SINGLETONS_8,
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep_pp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    },
    (8, 2, 2, 1, 2, 1, DEFAULT): {  # TP 2 x PP 2 x DP 2; experts: EDP 2, rank = ep + 2*(edp + 2*pp)
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep_pp": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "expt_dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
    (8, 1, 2, 1, 4, 1, DEFAULT): {  # EDP 1; rank = ep + 4*pp
        "tp_cp": SINGLETONS_8,
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp_ep_pp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "expt_dp": SINGLETONS_8,
    },
    (8, 2, 1, 1, 4, 1, DEFAULT): {  # EP spans TP and DP: dense rank = tp + 2*dp, expert rank = ep + 4*edp
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp_ep_pp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (8, 1, 1, 2, 2, 1, DEFAULT): {  # CP 2: the expert grid has no cp axis, EP takes the cp ranks
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep_pp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    },
    (8, 2, 2, 1, 2, 1, "tp-cp-ep-pp-dp"): {  # pp before dp: rank = ep + 2*(pp + 2*edp), EDP = DP = 2
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp": SINGLETONS_8,
        "expt_tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep_pp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (8, 2, 1, 1, 2, 2, DEFAULT): {  # expert TP 2 (group maths only): rank = etp + 2*(ep + 2*edp)
        "tp_cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "expt_tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "expt_tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_tp_ep_pp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (16, 2, 2, 1, 4, 1, DEFAULT): {  # EDP 2; rank = ep + 4*(edp + 2*pp)
        "tp_cp": [[2 * i, 2 * i + 1] for i in range(8)],
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "expt_tp": SINGLETONS_16,
        "expt_tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "expt_tp_ep_pp": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
        "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    },
}


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


def _report_expert_groups(rank, world_size):
    ps.initialize_model_parallel(2, 2, expert_model_parallel_size=2)
    members = {
        name: dist.get_process_group_ranks(getattr(ps.get_parallel_groups(), name))
        for name in ps.EXPERT_GROUP_NAMES
    }
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=ps.get_expert_model_parallel_group())
    getters = {
        "ep": (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
        "expt_tp": (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
        "expt_tp_ep": (
            ps.get_expert_tensor_and_model_parallel_rank(),
            ps.get_expert_tensor_and_model_parallel_world_size(),
        ),
        "expt_dp": (ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()),
    }
    same = {
        "expt_tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group()
        is ps.get_parallel_groups().expt_tp_ep_pp,
        "expt_dp": ps.get_expert_data_parallel_group() is ps.get_parallel_groups().expt_dp,
    }
    try:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(expert_model_parallel_size=3)
        refused = None
    except ValueError as err:
        refused = str(err)
    return members, t.item(), getters, same, refused, ps.get_expert_model_parallel_src_rank.__name__


def test_real_expert_groups_on_eight_ranks(ranks):
    expected = EXPERT_LAYOUTS[(8, 2, 2, 1, 2, 1, ps.DEFAULT_ORDER)]
    for rank, (members, ep_sum, getters, same, refused, _) in enumerate(ranks(8).run(_report_expert_groups)):
        mine = {name: _group_of(rank, expected[name]) for name in ps.EXPERT_GROUP_NAMES}
        assert members == mine, f"rank {rank}"
        assert ep_sum == sum(mine["ep"])
        for name, (position, size) in getters.items():
            assert (position, size) == (mine[name].index(rank), len(mine[name])), f"rank {rank} {name}"
        assert all(same.values())
        assert refused == (
            "world size 8 is not divisible by expert_tensor_parallel_size (1) x "
            "expert_model_parallel_size (3) x pipeline_model_parallel_size (1) = 3"
        )

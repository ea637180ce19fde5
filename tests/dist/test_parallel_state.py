"""Process groups laid out as Megatron-LM lays them out, as real gloo groups on spawned ranks (and one
process that initialises itself without a launcher).

Every expected list is written out by hand from Megatron's rule (tests/support/megatron_groups.py),
never computed with the code under test. The group maths without processes:
tests/unit/test_parallel_state.py.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from core import parallel_state as ps
from tests.support.megatron_groups import EIGHT_RANK, EXPERT_LAYOUTS
from tests.support.torchrun_jobs import run_captured

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60


def _group_of(rank, groups):
    """The listed group containing ``rank`` (None if it is in none, as for the embedding groups)."""
    return next((g for g in groups if rank in g), None)


# ----------------------------------------------------------------------------------------------
# Pure group maths
# ----------------------------------------------------------------------------------------------


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

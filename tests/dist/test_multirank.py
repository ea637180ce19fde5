"""The rank harness itself: results by rank, a rank's traceback re-raised, a hang turned into a timeout."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.multirank import RankFailure


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, dist.get_world_size(), t.item()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(30)
    return rank


def test_results_come_back_by_rank(ranks):
    assert ranks(3).run(_all_reduce_rank) == [(0, 3, 3.0), (1, 3, 3.0), (2, 3, 3.0)]


def test_rank_exception_is_reraised_with_traceback(ranks):
    with pytest.raises(RankFailure, match=r"rank 1 raised(.|\n)*ValueError: boom on rank one"):
        ranks(2).run(_raise_on_rank_one, timeout=20)
    # The pool restarts after a failure.
    assert [r[0] for r in ranks(2).run(_all_reduce_rank)] == [0, 1]


def test_hang_fails_by_timeout(ranks):
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] did not finish within 2s"):
        ranks(2).run(_hang_on_rank_zero, timeout=2)

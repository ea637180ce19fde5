import pytest

from tests.multirank import RankPool


@pytest.fixture(scope="module")
def ranks():
    """``ranks(n)`` gives this module's pool of ``n`` spawned gloo ranks, started once and reused."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()

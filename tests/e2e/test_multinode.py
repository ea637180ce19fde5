"""Two torchrun "nodes" on loopback, rendezvous through c10d, training PP=2 x DP=2 as one job.

* the losses are those of the same job on one node with four ranks, exactly;
* exactly one W&B run is written, by the logging rank (last stage, first data-parallel rank),
  whichever node the c10d rendezvous put it on;
* the checkpoint both nodes saved together loads on one node and resumes the one-node run exactly.

Three launches (one of them two torchruns at once) are too slow for the CI budget on two shared
cores: ``pytest -m slow tests/e2e/test_multinode.py``.
"""

from __future__ import annotations

import glob

import pytest

from tests.support.torchrun_jobs import TINY, Job, free_port, job_env, losses, write_tiny_dataset
from training.reporting.wandb_logging import read_offline_history

LOGGING_RANK = 2  # pipeline rank 1, data-parallel rank 0: rank = dp + 2 * pp in Megatron's order


def _node_launcher(node_rank: int, port: int) -> list[str]:
    """torchrun's flags for one of two nodes meeting at a c10d rendezvous on loopback."""
    return [
        "--nnodes", "2",
        "--node-rank", str(node_rank),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "trident-multinode-test",
        "--rdzv-conf", f"is_host={int(node_rank == 0)}",
    ]  # fmt: skip


def _wandb_runs(save_dir) -> list[dict]:
    return [read_offline_history(d) for d in sorted(glob.glob(f"{save_dir}/wandb/offline-run-*"))]


def _wandb_losses(run: dict) -> dict[int, float]:
    return {row["_step"]: row["lm loss"] for row in run["history"] if "lm loss" in row}


@pytest.mark.slow
def test_two_loopback_nodes_train_as_one_node_and_their_checkpoint_loads_on_one(tmp_path):
    data = write_tiny_dataset(tmp_path / "tiny")
    env = job_env(WANDB_MODE="offline")
    flags = TINY + [
        "--pipeline-model-parallel-size", "2",
        "--train-iters", "8",
        "--data-path", str(data),
        "--wandb-project", "multinode",
    ]  # fmt: skip

    one = Job(4, flags + ["--wandb-save-dir", str(tmp_path / "one")], env=env)
    one_output = one.finish(timeout=600)
    assert one.proc.returncode == 0, one_output[-3000:]
    reference = losses(one_output)
    assert sorted(reference) == list(range(1, 9))

    port, ckpt = free_port(), tmp_path / "ckpt"
    node_flags = flags + [
        "--exit-interval",
        "6",
        "--save",
        str(ckpt),
        "--wandb-save-dir",
        str(tmp_path / "two"),
    ]
    nodes = [Job(2, node_flags, env=env, launcher=_node_launcher(rank, port)) for rank in (0, 1)]
    try:
        ranks_of = [set(node.wait_for_workers(timeout=600)) for node in nodes]
        outputs = [node.finish(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.proc.returncode for node in nodes] == [0, 0], outputs
    assert sorted(ranks_of[0] | ranks_of[1]) == [0, 1, 2, 3]
    logging_node = next(i for i, ranks in enumerate(ranks_of) if LOGGING_RANK in ranks)
    print(f"the rendezvous put ranks {sorted(ranks_of[0])} on node 0, {sorted(ranks_of[1])} on node 1")

    two = losses(outputs[logging_node])
    assert two == {i: reference[i] for i in range(1, 7)}  # the log line, digit for digit
    assert losses(outputs[1 - logging_node]) == {}  # the other node prints no loss
    runs = _wandb_runs(tmp_path / "two")
    assert len(runs) == 1, runs
    assert _wandb_losses(runs[0]) == {
        i: v for i, v in _wandb_losses(_wandb_runs(tmp_path / "one")[0]).items() if i <= 6
    }

    resumed = Job(
        4,
        flags + ["--load", str(ckpt), "--save", str(ckpt), "--wandb-save-dir", str(tmp_path / "two")],
        env=env,
    )
    resumed_output = resumed.finish(timeout=600)
    assert resumed.proc.returncode == 0, resumed_output[-3000:]
    assert f"loaded checkpoint {ckpt} at iteration 6" in resumed_output
    assert losses(resumed_output) == {7: reference[7], 8: reference[8]}
    runs = _wandb_runs(tmp_path / "two")
    assert len({run["id"] for run in runs}) == 1  # the resumed run logs under the same W&B id

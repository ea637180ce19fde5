"""Data-parallel reductions overlap the backward, through ``pretrain()``, for every schedule; the timeline.

One ``torchrun`` of 4 ranks calls ``pretrain()`` once per schedule in the same world (pretrain keeps
a world its caller started). Each run records, per rank and step, the order of two kinds of events:
a bucket's all-reduce launch, and a parameter's gradient accumulation, logged by a hook registered
after the data-parallel wrapper's own (so a launch that the last gradient triggers still comes
before that gradient's entry). A launch before the step's last accumulation happened while the last
microbatch's backward (under zero-bubble: its W) was still running.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.torchrun_jobs import job_env, run_captured, torchrun_command, write_tiny_dataset

ROOT = Path(__file__).resolve().parents[2]

MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    "--global-batch-size 8 --train-iters 1 --eval-iters 0 --eval-interval 1000 --log-interval 1 "
    "--lr 1e-3 --lr-warmup-iters 0 --overlap-grad-reduce --ddp-bucket-size 20000"
)
RUNS = {  # name: extra flags (4 ranks: the rest is data parallelism)
    "no pipelining": "",
    "1f1b": "--pipeline-model-parallel-size 2",
    "interleaved": "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
    "zb-h1": "--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1",
    "zbv": "--pipeline-model-parallel-size 2 --pipeline-schedule zbv --num-virtual-stages-per-pipeline-rank 2",
    # Weight gradients accumulated into main_grad by the linear layers themselves, in W.
    "zb-h1 fused accumulation": "--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1 "
    "--gradient-accumulation-fusion",
}

SCRIPT = """
import json, sys
import torch.distributed as dist
import pretrain_gpt
from core import parallel_state as ps
from training.faults import end_process
from core.distributed import grad_buffer
from training import get_args
from training.training import pretrain

events = []  # this rank's, in order: "step", "launch", "grad"
launch = grad_buffer.Bucket.start_grad_sync

def recorded_launch(bucket):
    if bucket.state == grad_buffer.IDLE:
        events.append("launch")
    launch(bucket)

grad_buffer.Bucket.start_grad_sync = recorded_launch  # records, then does exactly what it did
calls, hooked = [0], set()

def forward_step(data_iterator, model):
    args = get_args()
    per_step = args.num_microbatches * (args.virtual_pipeline_model_parallel_size or 1)
    if calls[0] % per_step == 0:
        events.append("step")
    calls[0] += 1
    if id(model) not in hooked:  # after the wrapper's hooks: they fire after its bucket bookkeeping
        hooked.add(id(model))
        for p in model.module.parameters():
            p.register_post_accumulate_grad_hook(lambda p: events.append("grad"))
    return pretrain_gpt.forward_step(data_iterator, model)

ps.initialize_distributed()
results = {}
for name, flags in json.loads(sys.argv[1]).items():
    events.clear(); calls[0] = 0; hooked.clear()
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, forward_step,
             argv=flags.split(), tokenizer_provider=pretrain_gpt.tokenizer_provider)
    steps = " ".join(events).split("step")[1:]
    counts = []
    for step in steps:
        order = step.split()
        last_grad = max(i for i, e in enumerate(order) if e == "grad")
        counts.append((sum(e == "launch" for e in order[:last_grad]), order.count("launch")))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counts)
    results[name] = everyone
if dist.get_rank() == 0:
    print("RESULTS " + json.dumps(results))
ps.destroy_distributed()
end_process(0)  # as pretrain_gpt.py ends: without finalization, where gloo's threads can abort
"""


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    prefix = write_tiny_dataset(tmp / "tiny_text_document", documents=40, length=40, vocab=1000)
    data = f"--data-path {prefix} --tokenizer-type NullTokenizer --vocab-size 1000"
    runs = {name: f"{MODEL} {data} {flags}" for name, flags in RUNS.items()}
    runs["zb-h1"] += f" --timeline-dir {tmp / 'timeline'}"
    script = tmp / "overlap.py"
    script.write_text(SCRIPT)
    done = run_captured(torchrun_command(4, [json.dumps(runs)], script=script), env=job_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :]), done.stdout, tmp / "timeline"


@pytest.mark.parametrize("schedule", list(RUNS))
def test_bucket_reductions_launch_before_the_last_backward_ends(overlap_run, schedule):
    results, _, _ = overlap_run
    steps = [step for rank in results[schedule] for step in rank]
    assert len(steps) == 4  # 4 ranks, one iteration
    before = sum(b for b, _ in steps)
    total = sum(t for _, t in steps)
    print(f"{schedule}: {before} of {total} bucket launches before the last microbatch's backward ended")
    assert total >= 4 and before >= 0.8 * total


def test_timeline_of_real_training_is_written_and_reports_the_bubble(overlap_run):
    from training.reporting.timeline import load_trace

    _, stdout, directory = overlap_run
    assert "timeline of iteration 1: measured bubble" in stdout
    data = load_trace(str(directory / "timeline.json"))
    assert (data.schedule, data.pp_size, data.vpp_size, data.num_microbatches) == ("zb-h1", 2, 1, 4)
    assert (
        data.clock == "host"
    )  # a CPU run's times are the host's (CUDA events on a GPU: tests/unit/test_cuda.py)
    (step,) = data.iterations
    assert step.iteration == 1 and len(step.ranks) == 4
    for rank in step.ranks:  # every compute action of the table is there once, in the table's kinds
        compute = sorted((k, mb) for k, mb, _, _, _ in rank.events if k in "FIW")
        assert compute == sorted((k, mb) for k in "FIW" for mb in range(4)), rank.rank
        assert all(start <= end for *_, start, end in rank.events)
        (dp,) = [e for e in rank.events if e[0] == "DP"]  # the step's reduction, after its last action
        assert dp[1:3] == (-1, 0) and dp[3] >= max(e[4] for e in rank.events if e[0] in "FIW")
        assert not [e for e in rank.events if e[0] in ("TP", "CP")]  # TP1, CP1: nothing to count
    assert 0.0 < step.simulated_bubble < 1.0 and 0.0 < step.measured_bubble < 1.0
    png = directory / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 300_000

"""A training step makes the host wait for the device only when it logs (issue 16).

``tests/support/host_waits.py`` counts, on this CPU machine, the calls that would block the host on a CUDA
device, per iteration of the real ``pretrain()`` at world size 1. Between log steps the count is 0;
a log step reads every pending step at once (1). The steps are still decided as if the host had
read each one: skipped fp16 overflows, the learning rate after them and the consecutive-skip stop
come out the same whatever the log interval.

On a GPU, ``tests/unit/test_cuda.py`` runs 20 steps under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest

from tests.support.host_waits import HostWaitCounter
from tests.support.pretrain_run import pretrain_gpt_in_process

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --eval-interval 1000 --eval-iters 0 --lr 1e-3 --mock-data --num-workers 0 "
    "--tokenizer-type NullTokenizer --vocab-size 64 --seed 7"
)
LLAMA_FP16 = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --group-query-attention "
    "--num-query-groups 2 --untie-embeddings-and-output-weights --disable-bias-linear --fp16 "
    "--use-distributed-optimizer --overlap-grad-reduce --clip-grad 0.5 --log-params-norm "
    "--log-num-zeros-in-grad --calculate-per-token-loss"
)
OVERFLOWS = "--initial-loss-scale 1048576 --hysteresis 1 --lr-warmup-iters 4 --train-iters 6"
"""fp16 from a loss scale that overflows: the first steps are skipped on the device and the warm-up
learning rate waits for the first applied one."""


def _pretrain(flags: str, hook=None):
    return pretrain_gpt_in_process(argv=f"{TINY} {flags}".split(), iteration_hook=hook)


def test_only_log_steps_wait_and_steps_decided_on_the_device_match_steps_read_at_once():
    """LLaMA-style fp16 with the distributed optimizer, grad overlap, clipping, the norms logged and
    per-token loss normalisation, 6 iterations logging every 3rd: iterations 2, 4 and 5 make no host
    wait, 3 and 6 one each (iteration 1 also counts setup). The losses, counters and learning rates
    equal those of a run that logs (and so reads) every step."""
    with HostWaitCounter() as counter:
        every_third = _pretrain(f"{LLAMA_FP16} {OVERFLOWS} --log-interval 3", counter.next_iteration)
    waits = {i: counter.count(i) for i in range(2, 7)}
    assert waits == {2: 0, 3: 1, 4: 0, 5: 0, 6: 1}, {i: counter.where(i) for i in range(2, 7)}
    every_step = _pretrain(f"{LLAMA_FP16} {OVERFLOWS} --log-interval 1")
    assert every_step.skipped_iterations >= 2  # the test exercises skipped steps
    counters = (
        "iteration",
        "consumed_samples",
        "skipped_iterations",
        "nan_iterations",
        "consecutive_skipped",
    )
    assert [getattr(every_third, c) for c in counters] == [getattr(every_step, c) for c in counters]
    assert every_third.losses == every_step.losses and len(every_step.losses) == 6


def test_too_many_consecutive_skips_stop_at_the_next_read():
    """GPT, fp32: an absurd learning rate makes steps 2-4 NaN without a host wait; the run stops at
    the log step after them (5), naming iteration 4, as the run that reads every step does at once."""
    flags = "--lr 1e30 --lr-warmup-iters 0 --max-consecutive-skipped-iterations 3 --train-iters 30"
    with HostWaitCounter() as counter, pytest.raises(RuntimeError) as err:
        _pretrain(f"{flags} --log-interval 5", counter.next_iteration)
    assert str(err.value) == (
        "3 consecutive iterations had a NaN/inf loss or gradient and were skipped (iteration 4); "
        "stopping. Lower --lr or check the data; --max-consecutive-skipped-iterations sets the limit"
    )
    assert [counter.count(i) for i in (2, 3, 4)] == [0, 0, 0], counter.where(2)

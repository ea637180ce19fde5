"""How a run ends when something goes wrong: one message, printed once, the right exit code, no orphans.

* :func:`run_main` wraps the entry point (``pretrain_gpt.py``). Errors listed in
  :mod:`training.errors` print one line, ``pretrain_gpt.py: error: ...``, and exit with the code
  that module's table gives: 2 (usage), 3 (flags that do not fit together, the world size or the
  checkpoint), 16 or 17 (result validation), else 1; anything else prints its traceback and exits 1. Exactly one rank prints: the first to claim the
  report in the job's store (:func:`judge`; before the process groups exist, torchrun's own store,
  or rank 0 without torchrun). Every other rank exits with the same code without a word, so a
  problem one rank sees is not buried under the others' "Connection closed by peer" tracebacks.
  torchrun ends all workers once one has exited with an error, so the quiet ranks wait until the
  report is printed before they exit. Nothing is written to torchrun's error file
  (``TORCHELASTIC_ERROR_FILE``, used by ``@record``), so torchrun's summary does not repeat the
  message; it lists the exit codes only.
* :func:`begin` starts :class:`core.watchdog.Watchdog`: a rank that stops answering ends the
  job within ``--distributed-timeout-minutes``, with a message naming it (``rank N``) and what the
  others were waiting in. The training loop names its phases with :func:`phase`, and
  :func:`watched` hooks keep the schedule's position for it, so a hang names the action each rank was
  in and, in one summary line, the rank and action all the others wait on.
* :func:`watch_launcher` ends a torchrun worker whose torchrun is gone (``kill -9`` of torchrun
  otherwise leaves the workers training): the parent-death signal on Linux, and a thread that
  watches the parent pid everywhere. The signal is SIGTERM: it ends the worker at once, or, with
  ``--exit-signal-handler``, after saving a checkpoint. Checkpoints are written atomically with the
  tracker last, so a worker ended mid-save leaves the last complete checkpoint as it was.
* :func:`ending_the_process` ends the entry point's process without the interpreter's finalization,
  where a gloo thread finishing a collective can abort a process whose work is done.
* ``--rerun-mode`` (:mod:`training.faults.validation`) reruns a step whose results fail a check, to
  tell a transient fault from a reproducible result (Megatron's exit codes 16 and 17).
* ``TRIDENT_FAULT`` (:mod:`training.faults.injection`) injects faults for tests and drills; ``--log-straggler``
  (:mod:`training.faults.stragglers`) names slow ranks; when a hung job ends every rank still answering
  dumps torch's Flight Recorder and its schedule position (:mod:`core.flight_recorder`).
* :func:`fail_together` runs a step on some ranks and fails every rank if it failed on any, before
  anyone waits in a collective for a rank that has given up (:mod:`training.faults.agreement` holds
  every across-rank agreement: the first error, all done, gather, sum).

``TRIDENT_TEST_DISTRIBUTED_TIMEOUT_SECONDS`` (for tests only) sets the watchdog's timeout in
seconds instead of ``--distributed-timeout-minutes``; the process groups keep the flag's timeout unless
``TRIDENT_TEST_PROCESS_GROUP_TIMEOUT_SECONDS`` (for tests only) sets theirs.
"""

from training.faults.agreement import fail_together
from training.faults.heartbeat import (
    TEST_TIMEOUT_ENV,
    begin,
    distributed_timeout_seconds,
    end,
    last_beats,
    phase,
    watched,
)
from training.faults.injection import after_checkpoint_file, faulty_forward
from training.faults.launcher import end_process, ending_the_process, watch_launcher
from training.faults.reporting import judge, one_line_errors, run_main

__all__ = [
    "TEST_TIMEOUT_ENV",
    "after_checkpoint_file",
    "begin",
    "distributed_timeout_seconds",
    "end",
    "end_process",
    "ending_the_process",
    "fail_together",
    "faulty_forward",
    "judge",
    "last_beats",
    "one_line_errors",
    "phase",
    "run_main",
    "watch_launcher",
    "watched",
]

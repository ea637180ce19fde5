"""How a run ends when something goes wrong: one message, printed once, the right exit code, no orphans.

* :func:`run_main` wraps the entry point (``pretrain_gpt.py``). Errors listed in
  :mod:`training.errors` print one line, ``pretrain_gpt.py: error: ...``, and exit 2 (usage) or 1;
  anything else prints its traceback and exits 1. Exactly one rank prints: rank 0 for errors every
  rank raises before the process groups exist, otherwise the first rank to claim the report in the
  job's store (:func:`judge`). Every other rank exits 1 without a word, so a problem one rank sees is
  not buried under the others' "Connection closed by peer" tracebacks. Nothing is written to
  torchrun's error file (``TORCHELASTIC_ERROR_FILE``, used by ``@record``), so torchrun's summary
  does not repeat the message; it lists the exit codes only.
* :func:`begin` starts :class:`core.watchdog.Watchdog`: a rank that stops answering ends the
  job within ``--distributed-timeout-minutes``, with a message naming it (``rank N``) and what the
  others were waiting in. The training loop names its phases with :func:`phase`.
* :func:`watch_launcher` ends a torchrun worker whose torchrun is gone (``kill -9`` of torchrun
  otherwise leaves the workers training): the parent-death signal on Linux, and a thread that
  watches the parent pid everywhere. The signal is SIGTERM: it ends the worker at once, or, with
  ``--exit-signal-handler``, after saving a checkpoint. Checkpoints are written atomically with the
  tracker last, so a worker ended mid-save leaves the last complete checkpoint as it was.
* :func:`agree` runs a step on some ranks and fails every rank if it failed on any, before anyone
  waits in a collective for a rank that has given up.

``TRIDENT_TEST_DISTRIBUTED_TIMEOUT_SECONDS`` (for tests only) sets the watchdog's timeout in
seconds instead of ``--distributed-timeout-minutes``; the process groups keep the flag's timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from training.errors import ConfigError, DataError, PeerFailure, UsageError

__all__ = [
    "TEST_TIMEOUT_ENV",
    "agree",
    "begin",
    "distributed_timeout_seconds",
    "end",
    "judge",
    "phase",
    "run_main",
    "watch_launcher",
]

T = TypeVar("T")
TEST_TIMEOUT_ENV = "TRIDENT_TEST_DISTRIBUTED_TIMEOUT_SECONDS"
EXIT_USAGE, EXIT_FAILURE, EXIT_INTERRUPTED = 2, 1, 130
_VERDICT = "_trident_verdict"


@dataclass(frozen=True)
class Verdict:
    """Whether this rank prints the error it ends with, and the text to print instead of the raw one."""

    report: bool
    message: str | None = None


def _clean_errors() -> tuple[type[BaseException], ...]:
    from training.checkpoint_io import CheckpointError

    return (ConfigError, DataError, CheckpointError)


def _prog() -> str:
    return os.path.basename(sys.argv[0]) or "trident"


def _env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


# --------------------------------------------------------------------------------------------------
# Who reports: once per job
# --------------------------------------------------------------------------------------------------

_claim_lock = threading.Lock()
_claimed: bool | None = None  # this process's answer, so that the watchdog and the main thread agree
_generation = 0  # pretrain() calls so far; every rank counts the same, so their store keys match


def _distributed() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _store() -> Any:
    """This run's keys in the job's store: a fresh namespace for every ``pretrain()`` call."""
    from torch.distributed import PrefixStore, distributed_c10d

    return PrefixStore(f"trident/run{_generation}", distributed_c10d._get_default_store())


def _claim() -> bool:
    """True once, on the first rank of the job to ask (True as well when the store cannot be reached)."""
    global _claimed
    from core.watchdog import claim_report

    with _claim_lock:
        if _claimed is None:
            dist = _distributed()
            try:
                _claimed = dist is None or claim_report(_store(), dist.get_rank())
            except Exception:  # noqa: BLE001 -- no store: better said twice than not at all
                _claimed = True
            return _claimed
        return False


def _reported_elsewhere() -> bool:
    from core.watchdog import error_reported

    try:
        return error_reported(_store())
    except Exception:  # noqa: BLE001
        return False


def judge(err: BaseException) -> None:
    """Decide, while the process groups still exist, whether this rank reports ``err`` (see module doc).

    A communication failure after another rank has reported is fallout: quiet. One nobody has
    reported yet is explained (who went silent, or that a peer is gone) instead of shown raw.
    """
    if getattr(err, _VERDICT, None) is not None or isinstance(err, (KeyboardInterrupt, SystemExit)):
        return
    from core.watchdog import is_communication_failure

    if isinstance(err, PeerFailure):
        verdict = Verdict(report=False)
    elif _distributed() is None:
        verdict = Verdict(report=True)
    elif is_communication_failure(err):
        if _reported_elsewhere():
            verdict = Verdict(report=False)
        else:
            message = _explain_communication_failure(err)
            verdict = Verdict(report=_claim(), message=message)
    else:
        verdict = Verdict(report=_claim())
    with contextlib.suppress(AttributeError, TypeError):
        setattr(err, _VERDICT, verdict)


def _explain_communication_failure(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = text.split("] ", 1)[-1]  # drop gloo's "[.../pair.cc:553] " source location
    watchdog = _WATCHDOG
    if watchdog is not None and ("timed out" in text.lower() or "timeout" in text.lower()):
        return watchdog.explain_timeout()
    doing = f" in {watchdog.doing()}" if watchdog is not None else ""
    return (
        f"lost the connection to another rank{doing}: it exited or was killed, and the launcher's "
        f"summary names it ({text})"
    )


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


def _print_error(line: str) -> None:
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def report(err: BaseException) -> int:
    """Print ``err`` if this rank is the one to (see :func:`judge`); return the exit code for it."""
    verdict: Verdict | None = getattr(err, _VERDICT, None)
    if verdict is None:  # raised before the process groups existed: the same on every rank
        verdict = Verdict(report=_env_rank() == 0)
    if isinstance(err, UsageError):
        if verdict.report:
            _print_error(f"{_prog()}: error: {err} (see --help)")
        return EXIT_USAGE
    if verdict.report:
        if verdict.message is not None:
            _print_error(f"{_prog()}: error: {verdict.message}")
        elif isinstance(err, _clean_errors()):
            _print_error(f"{_prog()}: error: {err}")
        else:
            sys.stdout.flush()
            traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
            sys.stderr.flush()
    return EXIT_FAILURE


def run_main(main: Callable[[], object]) -> None:
    """Run ``main`` as a program: exit 0 when it returns, else as :func:`report` says (module doc)."""
    watch_launcher()
    try:
        main()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except BaseException as err:  # noqa: BLE001 -- every failure ends here, printed at most once
        sys.exit(report(err))


# --------------------------------------------------------------------------------------------------
# Agreement on a step that may fail on some ranks only
# --------------------------------------------------------------------------------------------------


def agree(step: Callable[[], T] | None) -> T | None:
    """Run ``step`` (None: nothing to run on this rank), then fail every rank if it failed on any.

    The failing rank raises its own error; the others raise :class:`PeerFailure`, which ends them
    quietly. One small all-reduce; call it on every rank.
    """
    result, error = None, None
    if step is not None:
        try:
            result = step()
        except Exception as err:  # noqa: BLE001 -- re-raised below, after every rank knows
            error = err
    dist = _distributed()
    if dist is not None:
        import torch

        from core.device import current_device

        world = dist.get_world_size()
        first = torch.tensor([dist.get_rank() if error is not None else world], device=current_device())
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        failed = int(first.item())
        if failed < world and error is None:
            raise PeerFailure(f"rank {failed} failed and reported why")
    if error is not None:
        raise error
    return result


# --------------------------------------------------------------------------------------------------
# The watchdog
# --------------------------------------------------------------------------------------------------

_WATCHDOG: Any = None


def distributed_timeout_seconds(args: Any) -> float:
    """``--distributed-timeout-minutes`` in seconds."""
    return float(args.distributed_timeout_minutes) * 60.0


def _watchdog_timeout(args: Any) -> tuple[float, str]:
    override = os.environ.get(TEST_TIMEOUT_ENV)
    if override:
        return float(override), f"{TEST_TIMEOUT_ENV}={override}"
    return distributed_timeout_seconds(
        args
    ), f"--distributed-timeout-minutes {args.distributed_timeout_minutes}"


def _end_silently_or_report(message: str) -> None:
    """The watchdog found a silent rank: the job's one report, then this process ends at once.

    The main thread is blocked inside a collective that will not return, so the process cannot
    unwind; ``os._exit`` ends it without waiting for it.
    """
    if _claim():
        _print_error(f"{_prog()}: error: {message}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILURE)


def _end_quietly() -> None:
    """Another rank reported the job's error while this one waits for it: nothing will come."""
    if not _claimed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILURE)


def begin(args: Any) -> None:
    """A run starts (torch.distributed is up): a fresh report claim, and the watchdog for a world > 1."""
    global _WATCHDOG, _claimed, _generation
    from core.watchdog import Watchdog

    with _claim_lock:
        _claimed, _generation = None, _generation + 1
    dist = _distributed()
    if dist is None:
        return
    timeout, setting = _watchdog_timeout(args)
    _WATCHDOG = Watchdog(
        _store(),
        dist.get_rank(),
        dist.get_world_size(),
        timeout,
        on_silent=_end_silently_or_report,
        on_reported_elsewhere=_end_quietly,
        timeout_setting=setting,
    ).start()


def end() -> None:
    """The run is over (successfully or not): stop the watchdog, leaving a ``done`` heartbeat."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        _WATCHDOG = None


def phase(what: str, iteration: int | None = None) -> None:
    """The main thread starts ``what`` (of ``iteration``); the watchdog's measure of progress."""
    if _WATCHDOG is not None:
        _WATCHDOG.enter(what, iteration)


# --------------------------------------------------------------------------------------------------
# A torchrun worker whose torchrun is gone
# --------------------------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1
_launcher_watched = False


def watch_launcher(poll_seconds: float = 1.0) -> None:
    """Under torchrun, send this process SIGTERM when torchrun (its parent) dies."""
    global _launcher_watched
    if "TORCHELASTIC_RUN_ID" not in os.environ or _launcher_watched:
        return
    _launcher_watched = True
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    def watch() -> None:
        # The parent-death signal alone misses a parent that died before prctl, and exists on Linux only.
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="trident-launcher-watch", daemon=True).start()

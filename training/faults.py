"""How a run ends when something goes wrong: one message, printed once, the right exit code, no orphans.

* :func:`run_main` wraps the entry point (``pretrain_gpt.py``). Errors listed in
  :mod:`training.errors` print one line, ``pretrain_gpt.py: error: ...``, and exit 2 (usage) or 1;
  anything else prints its traceback and exits 1. Exactly one rank prints: the first to claim the
  report in the job's store (:func:`judge`; before the process groups exist, torchrun's own store,
  or rank 0 without torchrun). Every other rank exits with the same code without a word, so a
  problem one rank sees is not buried under the others' "Connection closed by peer" tracebacks.
  torchrun ends all workers once one has exited with an error, so the quiet ranks wait until the
  report is printed before they exit. Nothing is written to torchrun's error file
  (``TORCHELASTIC_ERROR_FILE``, used by ``@record``), so torchrun's summary does not repeat the
  message; it lists the exit codes only.
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
    from core.device import DeviceError
    from training.checkpoint import CheckpointError

    return (ConfigError, DataError, CheckpointError, DeviceError)


def _prog() -> str:
    return os.path.basename(sys.argv[0]) or "trident"


def _env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


# --------------------------------------------------------------------------------------------------
# Who reports: once per job
# --------------------------------------------------------------------------------------------------
# torchrun ends every worker as soon as one exits with an error, so the rank that prints must print
# before any other rank exits: the quiet ranks wait for the reporter's "printed" key in the store.

PRINTED_KEY = "trident/printed"
QUIET_WAIT_S = 30.0
_claim_lock = threading.Lock()
_claimed: bool | None = None  # this process's answer, so that the watchdog and the main thread agree
_generation = 0  # pretrain() calls so far; every rank counts the same, so their store keys match
_STORE: Any = None  # this run's namespace in the job's store; kept past teardown for the report
_RANK = 0


def _distributed() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _use_store(store: Any, rank: int) -> None:
    global _STORE, _RANK, _claimed
    with _claim_lock:
        _STORE, _RANK, _claimed = store, rank, None


def _launcher_store() -> Any:
    """torchrun's own store (its agent's), reachable before any process group exists; None elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    try:
        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=30),
        )
    except (KeyError, ValueError, RuntimeError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"trident/before-groups/attempt{attempt}", store)


def _claim() -> bool:
    """True once, on the first rank of the job to ask (True as well when there is no store to ask)."""
    global _claimed
    from core.watchdog import claim_report

    with _claim_lock:
        if _claimed is not None:
            return False
        try:
            _claimed = _STORE is None or claim_report(_STORE, _RANK)
        except Exception:  # noqa: BLE001 -- no store: better said twice than not at all
            _claimed = True
        return _claimed


def _announce_printed() -> None:
    if _STORE is not None:
        with contextlib.suppress(Exception):
            _STORE.set(PRINTED_KEY, "1")


def _wait_until_printed() -> None:
    """A quiet rank leaves only once the report is out (or after ``QUIET_WAIT_S``)."""
    if _STORE is not None:
        from datetime import timedelta

        with contextlib.suppress(Exception):
            _STORE.wait([PRINTED_KEY], timedelta(seconds=QUIET_WAIT_S))


def _reported_elsewhere() -> bool:
    from core.watchdog import error_reported

    try:
        return _STORE is not None and error_reported(_STORE)
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
    elif _STORE is None:
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
    text = text.split("] ", 1)[-1].split(". ", 1)[0]  # gloo's "[.../pair.cc:553] " and its advice
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
    if verdict is None:  # raised before any process group: the same error on every rank
        store = _launcher_store()
        _use_store(store, _env_rank())
        verdict = Verdict(report=_claim() if store is not None else _env_rank() == 0)
    code = EXIT_USAGE if isinstance(err, UsageError) else EXIT_FAILURE
    if not verdict.report:
        _wait_until_printed()
        return code
    if verdict.message is not None:
        _print_error(f"{_prog()}: error: {verdict.message}")
    elif isinstance(err, (UsageError, *_clean_errors())):
        _print_error(f"{_prog()}: error: {err}")
    else:
        sys.stdout.flush()
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        sys.stderr.flush()
    _announce_printed()
    return code


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


def distributed_timeout_seconds(minutes: float) -> float:
    """``--distributed-timeout-minutes`` in seconds."""
    return float(minutes) * 60.0


def _watchdog_timeout(minutes: float) -> tuple[float, str]:
    override = os.environ.get(TEST_TIMEOUT_ENV)
    if override:
        return float(override), f"{TEST_TIMEOUT_ENV}={override}"
    return distributed_timeout_seconds(minutes), f"--distributed-timeout-minutes {minutes}"


def _end_silently_or_report(message: str) -> None:
    """The watchdog found a silent rank: the job's one report, then this process ends at once.

    The main thread is blocked inside a collective that will not return, so the process cannot
    unwind; ``os._exit`` ends it without waiting for it.
    """
    if _claim():
        _print_error(f"{_prog()}: error: {message}")
        _announce_printed()
    else:
        _wait_until_printed()
    _exit_now(EXIT_FAILURE)


def _end_quietly() -> None:
    """Another rank reported the job's error while this one waits for it: nothing will come."""
    if not _claimed:
        _wait_until_printed()
        _exit_now(EXIT_FAILURE)


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def begin(timeout_minutes: float) -> None:
    """A run starts (torch.distributed is up): a fresh report claim, and the watchdog for a world > 1.

    ``timeout_minutes``: ``--distributed-timeout-minutes``, how long a silent rank may stay silent.
    """
    global _WATCHDOG, _generation
    from torch.distributed import PrefixStore, distributed_c10d

    from core.watchdog import Watchdog

    _generation += 1
    dist = _distributed()
    if dist is None:
        _use_store(None, 0)
        return
    store = PrefixStore(f"trident/run{_generation}", distributed_c10d._get_default_store())
    _use_store(store, dist.get_rank())
    timeout, setting = _watchdog_timeout(timeout_minutes)
    _WATCHDOG = Watchdog(
        store,
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

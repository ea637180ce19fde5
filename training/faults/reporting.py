"""Who reports a job's error, once: the claim in the job's store, the verdict, the entry point.

:func:`run_main` wraps the entry point; :func:`judge` decides, while the process groups still exist,
whether this rank prints the error it ends with (see :mod:`training.faults`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core import flight_recorder
from core.device import DeviceError
from core.watchdog import Heartbeat, claim_report, error_reported, is_communication_failure
from training.checkpoint.format import CheckpointError
from training.errors import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    LAUNCHED_BY_TRIDENT_RUN,
    ConfigError,
    DataError,
    PeerFailure,
    ResultRejected,
    UsageError,
)
from training.faults.launcher import watch_launcher
from training.reporting.logging_utils import print_line

_VERDICT = "_trident_verdict"


@dataclass(frozen=True)
class Verdict:
    """Whether this rank prints the error it ends with, and the text to print instead of the raw one."""

    report: bool
    message: str | None = None
    notes: tuple[str, ...] = ()
    """Lines printed after the error line (a hang's post-mortem: where the dumps are, its summary)."""


def one_line_errors() -> tuple[type[BaseException], ...]:
    """The errors the entry point prints as one line (``training.errors``, and the NaN check's
    ``FloatingPointError``, whose message says all there is), wherever they are raised."""
    return (ConfigError, DataError, CheckpointError, DeviceError, FloatingPointError, ResultRejected)


def prog() -> str:
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
watchdog: Any = None
"""The run's heartbeat watchdog (:func:`training.faults.heartbeat.begin` sets it), which explains timeouts."""
position: Any = None
"""Where the run's schedule is (a ``SchedulePosition``, :func:`training.faults.heartbeat.watched` sets
it), dumped with the flight recorder."""


def distributed() -> Any:
    """``torch.distributed`` when a job of more than one rank is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def use_store(store: Any, rank: int) -> None:
    """A run starts: its store namespace, and no claim or post-mortem yet."""
    global _STORE, _RANK, _claimed, _dumped
    with _claim_lock:
        _STORE, _RANK, _claimed, _dumped = store, rank, None, None


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


def claim() -> bool:
    """True once, on the first rank of the job to ask (True as well when there is no store to ask)."""
    global _claimed
    with _claim_lock:
        if _claimed is not None:
            return False
        try:
            _claimed = _STORE is None or claim_report(_STORE, _RANK)
        except Exception:  # noqa: BLE001 -- no store: better said twice than not at all
            _claimed = True
        return _claimed


def announce_printed() -> None:
    if _STORE is not None:
        with contextlib.suppress(Exception):
            _STORE.set(PRINTED_KEY, "1")


def wait_until_printed() -> None:
    """A quiet rank leaves only once the report is out (or after ``QUIET_WAIT_S``)."""
    if _STORE is not None:
        from datetime import timedelta

        with contextlib.suppress(Exception):
            _STORE.wait([PRINTED_KEY], timedelta(seconds=QUIET_WAIT_S))


def _reported_elsewhere() -> bool:
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
    if isinstance(err, PeerFailure):
        verdict = Verdict(report=False)
    elif _STORE is None:
        verdict = Verdict(report=True)
    elif is_communication_failure(err):
        dump_flight_recorder()  # a peer is gone or silent: a post-mortem, while the groups exist
        if _reported_elsewhere():
            verdict = Verdict(report=False)
        else:
            message = _explain_communication_failure(err)
            reports = claim()
            timed_out = reports and watchdog is not None and _timed_out(err)
            notes = post_mortem(watchdog.silent_ranks()) if timed_out else ()
            verdict = Verdict(report=reports, message=message, notes=notes)
    else:
        verdict = Verdict(report=claim())
    with contextlib.suppress(AttributeError, TypeError):
        setattr(err, _VERDICT, verdict)


def dump_flight_recorder() -> str | None:
    """This rank's post-mortem (:mod:`core.flight_recorder`), written once before the process ends
    (the watchdog's thread and the main thread may both get here); its path, or None."""
    global _dumped
    with _claim_lock:
        if watchdog is not None and _dumped is None:
            schedule = position.as_dict() if position is not None else None
            _dumped = flight_recorder.dump(watchdog.rank, watchdog.doing(), schedule) or ""
            if _STORE is not None:
                with contextlib.suppress(Exception):
                    _STORE.set(DUMPED_KEY.format(rank=_RANK), watchdog.heartbeat().encode())
    return _dumped or None


def wait_for_dumps(ranks: list[int], seconds: float) -> None:
    """The reporter waits (at most ``seconds``) for ``ranks`` to write their post-mortems: once it
    exits, torchrun ends every other worker."""
    if _STORE is None:
        return
    deadline = time.monotonic() + seconds
    keys = [DUMPED_KEY.format(rank=rank) for rank in ranks]
    with contextlib.suppress(Exception):
        while not _STORE.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)


_dumped: str | None = None
DUMPED_KEY = "trident/flight-recorder/{rank}"
"""Set once a rank has written its post-mortem, to its heartbeat then (the state it failed in: a rank
that fails goes on to stop its watchdog, whose last beat then says ``done``)."""
DUMPS_LINE = "flight recorder (each rank's last collectives and schedule position)"
NO_PIPELINE_WAIT = "hang summary: no rank waits for a pipeline message"


def post_mortem(silent: list[int]) -> tuple[str, ...]:
    """The reporter's lines after a hang's error: where every rank's dump is (it first waits for the
    ranks still answering to write theirs) and the summary naming the rank and action all wait on."""
    if watchdog is None:
        return ()
    others = [r for r in range(watchdog.world_size) if r not in silent and r != watchdog.rank]
    wait_for_dumps(others, 3 * watchdog.interval)
    dumped = dump_flight_recorder()
    summary = watchdog.summary(silent, _final_beats(watchdog.world_size))
    if summary.startswith(NO_PIPELINE_WAIT) and not silent:  # in a collective: who has not entered it
        behind = flight_recorder.not_entered(flight_recorder.read_dumps(range(watchdog.world_size)))
        summary = f"hang summary: {behind}" if behind else summary
    if dumped is None:
        return (summary,)
    return (f"{DUMPS_LINE}: {os.path.dirname(dumped)}/rank_*.json", summary)


def _final_beats(world_size: int) -> dict[int, Heartbeat]:
    """The heartbeat each rank had when it wrote its post-mortem (ranks that wrote one)."""
    beats = {}
    with contextlib.suppress(Exception):
        for rank in range(world_size):
            key = DUMPED_KEY.format(rank=rank)
            if _STORE is not None and _STORE.check([key]):
                beats[rank] = Heartbeat.decode(_STORE.get(key))
    return beats


def _timed_out(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def _explain_communication_failure(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = text.split("] ", 1)[-1].split(". ", 1)[0]  # gloo's "[.../pair.cc:553] " and its advice
    if watchdog is not None and _timed_out(err):
        return watchdog.explain_timeout()
    doing = f" in {watchdog.doing()}" if watchdog is not None else ""
    return (
        f"lost the connection to another rank{doing}: it exited or was killed, and the launcher's "
        f"summary names it ({text})"
    )


def claimed() -> bool | None:
    """This process's claim: True if it reports, False if another rank does, None if nobody asked yet."""
    return _claimed


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


def print_error(line: str) -> None:
    sys.stdout.flush()
    print_line(line, file=sys.stderr)


def exit_code(err: BaseException) -> int:
    """The code a process ending with ``err`` exits with (the table in ``training.errors``)."""
    if isinstance(err, ResultRejected):
        return err.exit_code
    if isinstance(err, UsageError):
        return EXIT_USAGE
    if isinstance(err, ConfigError) and os.environ.get(LAUNCHED_BY_TRIDENT_RUN):
        return EXIT_CONFIG
    return EXIT_FAILURE


def report(err: BaseException) -> int:
    """Print ``err`` if this rank is the one to (see :func:`judge`); return the exit code for it."""
    verdict: Verdict | None = getattr(err, _VERDICT, None)
    if verdict is None:  # raised before any process group: the same error on every rank
        store = _launcher_store()
        use_store(store, _env_rank())
        verdict = Verdict(report=claim() if store is not None else _env_rank() == 0)
    code = exit_code(err)
    if not verdict.report:
        wait_until_printed()
        return code
    if verdict.message is not None:
        print_error(f"{prog()}: error: {verdict.message}")
        for note in verdict.notes:
            print_error(note)
    elif isinstance(err, (UsageError, *one_line_errors())):
        print_error(f"{prog()}: error: {err}")
    else:
        sys.stdout.flush()
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        sys.stderr.flush()
    announce_printed()
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

"""The errors a run ends with on purpose, and how the entry point treats each (see ``training.faults``).

=================  =========  ===============================================================
error              exit code  printed
=================  =========  ===============================================================
``UsageError``     2          one line (``pretrain_gpt.py: error: ...``), like argparse
``ConfigError``    1 (3)      one line: flags that do not fit together, the world size or the checkpoint
``DataError``      1          one line naming the data file
``CheckpointError`` 1         one line naming the checkpoint file (``training.checkpoint``)
``PeerFailure``    1          nothing: another rank failed and has already said why
``ResultRejected`` 16 or 17   one line: result validation's verdict (``training.faults.validation``)
anything else      1          its traceback, once, from the rank that raised it
Ctrl-C             130        nothing (128 + SIGINT, as a shell reports it)
=================  =========  ===============================================================

A ``ConfigError`` exits 3 in the workers of ``trident-run`` (which sets :data:`LAUNCHED_BY_TRIDENT_RUN` in
their environment) and 1 elsewhere: under ``python`` or plain ``torchrun`` a refused configuration ends
as Megatron's refusals do, and torchrun restarts on any code anyway. ``trident-run``
(``training.launch``) hands 2, 3, 16 and 17 on to its caller and never restarts the workers after them
(its ``NO_RESTART`` says why, code by code; for 3: a configuration error depends on the command line,
the world size and the checkpoint, and a restart keeps all three). A launcher ended by a signal (SIGTERM from a scheduler) exits 128 + its number (143 for
SIGTERM) once every worker stopped cleanly (with ``--exit-signal-handler``: after saving a checkpoint at
the same iteration), else 1.

This module imports nothing heavy, so the data tools can raise these errors without torch.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED_VALIDATION",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_RESUME_TO_DISAMBIGUATE",
    "EXIT_SIGNALLED",
    "EXIT_USAGE",
    "LAUNCHED_BY_TRIDENT_RUN",
    "ConfigError",
    "DataError",
    "PeerFailure",
    "ResultRejected",
    "UsageError",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse's
EXIT_CONFIG = 3  # a ConfigError, in trident-run's workers only (the table above)
EXIT_RESUME_TO_DISAMBIGUATE = 16  # Megatron's codes (megatron/core/rerun_state_machine.py)
EXIT_FAILED_VALIDATION = 17
EXIT_SIGNALLED = 128  # + the signal's number, as a shell reports a process a signal ended
EXIT_INTERRUPTED = EXIT_SIGNALLED + 2  # SIGINT
"""The exit codes a run ends with: declared here once, read by the entry point, result validation and
the launcher (``training.launch``, which hands 2, 3, 16 and 17 on to its caller)."""

LAUNCHED_BY_TRIDENT_RUN = "TRIDENT_RUN"
"""The environment variable ``trident-run`` sets for its workers ("1"): there a ``ConfigError`` exits 3."""


class UsageError(Exception):
    """The command line cannot be parsed (unknown flag, a value of the wrong type); exit code 2."""


class ConfigError(ValueError):
    """Flags that parse but do not fit together, the world size, or the checkpoint being resumed; exit
    code 1, or 3 under ``trident-run``, which stops on it: the same command line, at the same world size
    and from the same checkpoint (what a restart keeps), fails the same way."""


class DataError(ValueError):
    """A data file that is missing, truncated, inconsistent or holds ids the tokenizer cannot have."""


class PeerFailure(RuntimeError):
    """Raised on the ranks that did not fail when another rank did and reported it; ends quietly."""


class ResultRejected(RuntimeError):
    """Result validation stops the run (Megatron's exit codes): 16, resume from the checkpoint on other
    devices to tell a persistent fault from a correct result; 17, the result failed validation."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

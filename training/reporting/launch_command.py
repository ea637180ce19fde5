"""The command that resumes this run, or trains it longer, as the end-of-run summary prints it.

The printed command must run as printed and continue the run, under the launcher the run used:

* the launcher comes from the launching process itself. Under torchrun that is the worker's parent
  (its ``/proc/<ppid>/cmdline`` on Linux), so ``torchrun --nnodes 2 --rdzv-endpoint ...`` or
  ``python -m torch.distributed.run --standalone ...`` come back exactly as typed; elsewhere it is
  ``sys.orig_argv`` (``python [-u] pretrain_gpt.py``). Where the parent cannot be read, the command is
  rebuilt from torchrun's environment (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``), and a note says what
  could not be known (a multi-node run's rendezvous flags);
* ``--load`` names the run's ``--save``; ``--finetune``, ``--ckpt-step``, ``--no-load-optim`` and
  ``--no-load-rng`` go, since with them the next run would start again instead of continuing;
* a run that stopped early resumes with its own length; a finished one trains twice as long, its
  ``--train-iters`` (or ``--train-samples``) replaced, never repeated, with
  ``--override-opt_param-scheduler`` so that the learning-rate schedule follows the new length
  (without it Megatron's resume check refuses the changed schedule).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass

from training.arguments.schema import BY_DEST, flag_name

__all__ = ["NextCommand", "next_command"]

_LOADING = ("load", "finetune", "ckpt_step", "no_load_optim", "no_load_rng")
"""Flags about what to load and how, which the next run replaces with a plain ``--load SAVE``."""


@dataclass(frozen=True)
class NextCommand:
    """What the summary prints: a label (``resume`` or ``train longer``), the command, and notes."""

    label: str
    command: str
    notes: tuple[str, ...] = ()


def _options(dest: str) -> set[str]:
    flag = BY_DEST[dest]
    return {*flag.options, *filter(None, [flag.negation])}


def _without(argv: list[str], dests: tuple[str, ...]) -> list[str]:
    """``argv`` without the flags of ``dests`` and their values (``--flag value`` or ``--flag=value``)."""
    options = set().union(*(_options(d) for d in dests))
    takes_value = {o for d in dests for o in _options(d) if BY_DEST[d].kind is not bool}
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in options:
            skip = token in takes_value
        elif token.split("=", 1)[0] not in options:
            out.append(token)
    return out


def _cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return [part.decode(errors="surrogateescape") for part in raw.split(b"\0")[:-1]] or None


def _prefix_of(full: list[str] | None, tail: list[str]) -> list[str] | None:
    """The tokens of ``full`` before ``tail`` (launcher, its options and the script), if it ends so."""
    if not full or len(full) <= len(tail) or (tail and full[-len(tail) :] != tail):
        return None
    return full[: len(full) - len(tail)]


def _short_torchrun(prefix: list[str]) -> list[str]:
    """``python /usr/bin/torchrun ...`` (the script's shebang, as the kernel expanded it) -> ``torchrun ...``."""
    if len(prefix) > 1 and os.path.basename(prefix[1]) == "torchrun":
        found = shutil.which("torchrun")
        if found and os.path.exists(prefix[1]) and os.path.samefile(found, prefix[1]):
            return ["torchrun", *prefix[2:]]
    return prefix


def _launcher(argv: list[str]) -> tuple[list[str], list[str]]:
    """The tokens before this run's flags, and notes on what could not be known."""
    script = sys.argv[0]
    if argv != sys.argv[1:]:  # pretrain() called with its own argv: no command line to repeat
        return [script], ["pretrain() was given these flags directly: pass them to it again"]
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return _prefix_of(list(getattr(sys, "orig_argv", [])), argv) or [sys.executable, script], []
    parent = _prefix_of(_cmdline(os.getppid()), argv)
    if parent is not None:
        notes = []
        if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            static = any(t.split("=", 1)[0] in ("--node-rank", "--node_rank") for t in parent)
            each = " (each node with its own --node-rank)" if static else ""
            notes.append(f"run it on every node, as the original command was{each}")
        return _short_torchrun(parent), notes
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(int(os.environ.get("WORLD_SIZE", str(per_node))) // per_node, 1)
    prefix = ["torchrun", "--nproc-per-node", str(per_node)]
    if nodes == 1:
        return [*prefix, "--standalone", script], []
    note = (
        "torchrun's command could not be read back: add its rendezvous flags (--rdzv-backend, "
        "--rdzv-endpoint, or --node-rank and --master-addr) and run it on every node"
    )
    return [*prefix, "--nnodes", str(nodes), script], [note]


def next_command(args: argparse.Namespace, iteration: int) -> NextCommand:
    """The command that continues this run from its ``--save`` checkpoint at ``iteration``."""
    argv = list(getattr(args, "command_line", sys.argv[1:]))
    prefix, notes = _launcher(argv)
    finished = iteration >= args.train_iters
    samples = "train_samples" in getattr(args, "explicit_args", ()) and args.train_samples is not None
    length = "train_samples" if samples else "train_iters"
    value = getattr(args, length) * (2 if finished else 1)
    flags = _without(argv, (*_LOADING, "train_iters", "train_samples"))
    flags += [flag_name("load"), args.save, flag_name(length), str(value)]
    if finished and not (args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler):
        flags.append(flag_name("override_opt_param_scheduler"))
    if args.finetune and flag_name("finetune") not in argv:
        notes.append(f"--config {args.config} sets finetune: remove it there, or the run starts over")
    command = " ".join(shlex.quote(token) for token in [*prefix, *flags])
    return NextCommand("train longer" if finished else "resume", command, tuple(notes))

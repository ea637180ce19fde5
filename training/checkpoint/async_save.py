"""How a training run saves: synchronously, or (``--async-save``) written in the background.

:class:`CheckpointSaver` is what the training loop calls. Synchronously, :meth:`~CheckpointSaver.save`
writes and commits while training waits (:func:`~training.checkpoint.save.save_checkpoint`). With
``async_save`` a save goes like this, on every rank at the same iterations:

1. ``save()`` on the training thread: the save still in flight, if any, is waited for and committed
   (at most one in flight); a thread starts copying this rank's tensors into host buffers allocated
   at the first save and reused (:mod:`training.checkpoint.staging`; GPU copies are queued on the
   stream), then writing them. The next optimizer step waits until the copies are made.
2. Training goes on. The loop calls ``poll()`` at the same point of every iteration; while a save is
   in flight it asks every rank, in one small all-reduce, whether its writer has finished, or failed.
3. Once every writer has finished, the same ``poll()`` commits on every rank: the files' records
   (checksums) are gathered, rank 0 writes the manifest and then the tracker. If any writer failed,
   every rank raises the first failing rank's one-line message naming the checkpoint's path, at this
   same iteration, and the tracker still names the previous checkpoint.
4. The next save, and ``wait()`` at the end of training, wait for the writer and commit. On the way
   out after an error, ``abandon()`` lets the writer finish its files but commits nothing.

The files are written exactly as a synchronous save writes them: each under a temporary name,
fsynced, renamed; the tracker last. A kill at any moment leaves the previous checkpoint loadable.

Why the agreement runs on the training thread. The writer thread makes no collective call. Its
writes end at different times on different ranks, so a collective it issued on a group the
training thread also uses would be ordered against the training's own collectives differently on
different ranks: mismatched or deadlocked. A group of its own would avoid that, but ranks would
still learn of a failure, or of the end of the writes, at different iterations, and stop at
different points. ``poll()`` instead runs every rank's check at the same point of the same
iteration, so all ranks take the same decision (commit, fail, or keep going) together, and the
tracker is written only after every rank has reported its files fsynced and renamed. The check
goes over a gloo group (the default group when that is gloo already): CPU tensors that never wait
for the GPU.

Why a thread, not a process. The writer's work is the copy of CPU tensors (a memcpy), xxhash over
the staged bytes, ``write`` with direct I/O and ``fsync`` (:mod:`training.checkpoint.images`), which
all release the GIL; the writing costs little CPU (about 0.15 s per GB, against a second per GB for
a write through the page cache); GPU copies are done by the copy engine. The training thread loses
the GIL only for the writer's brief Python steps between files. The stall is measured by
``tools/bench/async_save.py``. A forked process would inherit the process
groups' and CUDA's threads and locks mid-flight (unsafe), and a spawned one would have to import
torch and receive the staged tensors through shared memory, for no gain here.

``TRIDENT_TEST_ASYNC_SAVE_STALL_AT=N`` (tests only) stops the background write of iteration N's
checkpoint after its first file, for an hour: a test kills the job there.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from core.parallel_state import ParallelGroups
from training.checkpoint.format import CheckpointError, iteration_dir
from training.checkpoint.save import (
    SaveRequest,
    agree,
    check_json,
    commit,
    describe,
    failure,
    save_checkpoint,
    write_files,
)
from training.checkpoint.staging import HostStaging
from training.faults.agreement import distributed, everyone

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["STALL_ENV", "CheckpointSaver"]

STALL_ENV = "TRIDENT_TEST_ASYNC_SAVE_STALL_AT"


class _Write(threading.Thread):
    """This rank's files of one checkpoint, written in the background; ``error`` says why it failed."""

    def __init__(
        self, request: SaveRequest, staging: HostStaging, after_file: Callable[[str], None] | None
    ) -> None:
        super().__init__(name=f"checkpoint-writer-{request.iteration}", daemon=True)
        self.request, self.staging = request, staging
        self.after_file = _stall_hook(request.iteration) or after_file
        self.local: dict[str, Any] | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.staging.copy_in()  # the state as it was at the save, in host memory
            self.local = write_files(self.request, after_file=self.after_file)
        except BaseException as err:  # noqa: BLE001 -- reported to every rank by the next poll()
            self.error = failure(self.request.path, err)


def _stall_hook(iteration: int) -> Callable[[str], None] | None:
    if os.environ.get(STALL_ENV) != str(iteration):
        return None
    return lambda name: time.sleep(3600)


def _agreement_group():
    """A gloo group over the whole job for :meth:`CheckpointSaver.poll`; None means the default group."""
    if not distributed() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


class CheckpointSaver:
    """Saves a run's checkpoints, synchronously or in the background (see the module docstring).

    Construct it on every rank at the same point (with ``async_save`` it may create a process
    group). ``groups``: the run's process groups, which say where each rank's files go.
    ``announce(path)`` is called on every rank when a checkpoint is committed; ``after_file(name)``
    after each of this rank's files is in place (an exception there fails the save on every rank: the
    fault injector's ``write`` kind).
    """

    def __init__(
        self,
        *,
        groups: ParallelGroups | None = None,
        async_save: bool = False,
        announce: Callable[[str], None] | None = None,
        after_file: Callable[[str], None] | None = None,
    ) -> None:
        self.groups = groups
        self.async_save = async_save
        self.after_file = after_file
        self.staging = HostStaging()
        self._announce = announce or (lambda path: None)
        self._group = _agreement_group() if async_save else None
        self._write: _Write | None = None
        self._guarded: dict[int, Any] = {}
        """Step pre-hooks installed on optimizers (:meth:`_guard`), by the inner optimizer's id."""
        self._failed: str | None = None
        """Why the save in flight failed before its writer started (describing or staging it)."""

    @property
    def in_flight(self) -> bool:
        """Whether a save has been started and not yet committed or failed."""
        return self._write is not None or self._failed is not None

    def save(self, save_dir: str, iteration: int, **state: Any) -> str:
        """Save ``state`` (:func:`~training.checkpoint.save.describe`'s keywords) as iteration
        ``iteration``; with ``async_save``, return once the write has started. Call on every rank."""
        self.wait()
        state = {"groups": self.groups, **state}
        if not self.async_save:
            path = save_checkpoint(
                save_dir, iteration, staging=self.staging, after_file=self.after_file, **state
            )
            self._announce(path)
            return path
        check_json(state.get("scheduler_state"), state.get("extra"))
        path = iteration_dir(save_dir, iteration)
        self._guard(state.get("optimizer"))
        try:
            request = self.staging.stage(describe(save_dir, iteration, **state))
        except CheckpointError as err:  # the host cannot hold the copy: reported by the next poll()
            self._failed = str(err)
            return path
        except Exception as err:  # noqa: BLE001 -- reported to every rank by the next poll()
            self._failed = failure(path, err)
            return path
        self._write = _Write(request, self.staging, self.after_file)
        self._write.start()
        return path

    def _guard(self, optimizer) -> None:
        """Make ``optimizer``'s steps wait until the writer has copied the state it would change."""
        inner = getattr(optimizer, "optimizer", optimizer)
        if inner is None or id(inner) in self._guarded:
            return
        self._guarded[id(inner)] = inner.register_step_pre_hook(lambda *_: self.staging.wait_copied())

    def poll(self) -> str | None:
        """Commit the save in flight if every rank has written its part; raise on every rank if any
        rank failed. Call on every rank at the same point of every iteration; returns the path
        committed, if any. A no-op (no collective) when nothing is in flight."""
        if not self.in_flight:
            return None
        write, error = self._write, self._failed
        done = write is None or not write.is_alive()
        if write is not None and done:
            error = write.error
        all_done, any_failed = everyone(done, error is not None, self._group)
        if any_failed:  # every rank stops here, at the same iteration, with the first failure's message
            self.abandon()
            agree(error, self._group)
        if not all_done:
            return None
        self._write = None
        commit(write.request, write.local, None, self._group)
        self._announce(write.request.path)
        return write.request.path

    def wait(self) -> str | None:
        """Wait for the save in flight and commit it (collectives: call on every rank)."""
        if self._write is not None:
            self._write.join()
        return self.poll()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        """Leaving the training loop by an error abandons the save in flight; otherwise waits for it."""
        if kind is None:
            self.wait()
        else:
            self.abandon()

    def abandon(self) -> None:
        """On the way out after an error: let this rank's writer finish its files, commit nothing.

        No collective (other ranks may be gone); the tracker keeps naming the previous checkpoint.
        """
        write, self._write, self._failed = self._write, None, None
        if write is not None:
            write.join()

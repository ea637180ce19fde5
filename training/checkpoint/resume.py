"""Saving the run to ``--save`` and resuming it from ``--load``: model, optimizer, schedule and counters.

The checkpoint format, resharding and RNG states are the rest of :mod:`training.checkpoint`'s; this
module says what a training run puts in and takes out, and checks the learning-rate schedule on resume.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from training import faults
from training.arguments.config import LearningRateArgs
from training.checkpoint.load import load_checkpoint
from training.errors import ConfigError
from training.faults.restart import restart_attempt
from training.reporting.logging_utils import print_line, print_rank_0
from training.state import Session

if TYPE_CHECKING:
    from training.run import Run

# The scheduler settings a checkpoint stores, and the flags that set them (steps count samples).
_SCHEDULER_FLAGS = {
    "max_lr": ("--lr", False),
    "min_lr": ("--min-lr", False),
    "lr_warmup_steps": ("warm-up iterations (--lr-warmup-iters or --lr-warmup-fraction)", True),
    "lr_decay_steps": ("decay iterations (--lr-decay-iters, else --train-iters)", True),
    "lr_decay_style": ("--lr-decay-style", False),
    "start_wd": ("--start-weight-decay (else --weight-decay)", False),
    "end_wd": ("--end-weight-decay (else --weight-decay)", False),
    "wd_incr_steps": ("weight-decay ramp iterations (--train-iters)", True),
    "wd_incr_style": ("--weight-decay-incr-style", False),
}


def tokenizer_record(settings: Any, tokenizer: Any = None) -> dict | None:
    """What the checkpoint copies of the tokenizer: its type, files and (NullTokenizer) vocabulary size.

    ``settings``: the tokenizer flags (``TokenizerArgs``). A model file the tokenizer provider chose
    itself (Trident's default SentencePiece model) comes from ``tokenizer.model_file``.
    """
    if not getattr(settings, "tokenizer_type", None):
        return None
    roles = ("tokenizer_model", "vocab_file", "merge_file")  # GPT2BPETokenizer has the last two
    files = {role: getattr(settings, role) for role in roles if getattr(settings, role, None)}
    if "tokenizer_model" not in files and getattr(tokenizer, "model_file", None):
        files["tokenizer_model"] = tokenizer.model_file
    record = {"type": settings.tokenizer_type, "files": files}
    if settings.tokenizer_type == "NullTokenizer":
        record["vocab_size"] = settings.vocab_size
    return record


def save(run: Run, session: Session) -> None:
    """Write a checkpoint of the current iteration into ``--save`` (start writing it, with ``--async-save``)."""
    state = session.state
    faults.phase("saving a checkpoint", state.iteration, "save")
    for chunk in session.model.chunks:  # the weights must be whole before they are written
        chunk.finish_param_sync()
    path = session.saver.save(
        run.checkpointing.save,
        state.iteration,
        model_chunks=session.model.chunks,
        optimizer=session.optimizer,
        scheduler_state=session.scheduler.state_dict(),
        consumed_samples=state.consumed_samples,
        tokenizer=tokenizer_record(run.tokenizer, session.tokenizer),
        args=run.args,
        extra={
            "wandb_run_id": state.wandb_run_id,
            "skipped_iterations": state.skipped_iterations,
            "nan_iterations": state.nan_iterations,
            "rerun": state.rerun,
        },
    )
    if run.checkpointing.async_save and session.logs_loss:  # "saved checkpoint" follows at the commit
        print_line(f"writing checkpoint {path} in the background")
    if run.ddp.shard_params:  # ZeRO-3 frees the gathered weights at the next forward: copied first
        session.saver.staging.wait_copied()


def load(run: Run, session: Session) -> None:
    """Resume from ``--load`` (a missing checkpoint starts from scratch, unless told otherwise)."""
    flags, state = run.checkpointing, session.state
    keep_state = not flags.finetune
    loaded = load_checkpoint(
        flags.load,
        model_chunks=session.model.chunks,
        optimizer=session.optimizer,
        iteration=flags.ckpt_step,
        load_optim=not flags.no_load_optim and keep_state,
        load_rng=not flags.no_load_rng and keep_state,
        finetune=flags.finetune,
        verify=flags.verify_checkpoint,
        exit_on_missing=flags.exit_on_missing_checkpoint,
        groups=session.groups,
        fall_back=restart_attempt() > 0,
    )
    if restart_attempt():
        print_rank_0(
            f"torchrun restart {restart_attempt()}: resuming from the latest checkpoint in {flags.load}"
        )
    if loaded is None:
        print_rank_0(f"WARNING: no checkpoint in {flags.load}: starting from scratch")
        return
    if loaded.scheduler_state is not None:
        check_scheduler(
            session.scheduler,
            loaded.scheduler_state,
            loaded.manifest.get("args", {}),
            lr=run.lr,
            global_batch_size=run.training.global_batch_size,
            load=flags.load,
        )
        session.scheduler.load_state_dict(loaded.scheduler_state)
    extra = loaded.manifest.get("extra", {})
    state.iteration, state.consumed_samples = loaded.iteration, loaded.consumed_samples
    if keep_state:
        state.wandb_run_id = extra.get("wandb_run_id")
        state.skipped_iterations = extra.get("skipped_iterations", 0)
        state.nan_iterations = extra.get("nan_iterations", 0)
        state.rerun = extra.get("rerun")
    _report(loaded, rng_wanted=not flags.no_load_rng and keep_state)
    print_rank_0(f"loaded checkpoint {flags.load} at iteration {state.iteration}")


def _report(loaded, *, rng_wanted: bool) -> None:
    """Say what a resharded load changed, and which ranks kept fresh RNG states."""
    if loaded.resharded:
        saved = loaded.manifest["parallel"]
        experts = f" EP={saved['ep']}" if saved.get("ep", 1) > 1 else ""
        print_rank_0(
            f"resharded checkpoint {loaded.path} from TP={saved['tp']} PP={saved['pp']} VPP={saved['vpp']} "
            f"DP={saved['dp']}{experts} (layout '{saved['layout']}') to this run's split"
        )
    world = dist.get_world_size()
    if rng_wanted and loaded.rng_restored < world:
        print_rank_0(
            f"RNG states restored on {loaded.rng_restored} of {world} ranks; the other ranks did not exist "
            "in the checkpoint's split and keep fresh seeds, as Megatron seeds a new rank"
        )


def check_scheduler(
    scheduler, saved: dict, saved_args: dict, *, lr: LearningRateArgs, global_batch_size: int, load: str
) -> None:
    """Megatron's rule on resume: the flags' schedule must be the checkpoint's, unless told which wins.

    Without it a run resumed with a larger ``--train-iters`` silently keeps the old decay and trains
    at the minimum learning rate.
    """
    if lr.override_opt_param_scheduler or lr.use_checkpoint_opt_param_scheduler:
        return
    differ = scheduler.mismatches(saved)
    if not differ:
        return
    saved_gbs = saved_args.get("global_batch_size") or global_batch_size

    def shown(value, in_iterations: bool, gbs: int):
        if in_iterations and isinstance(value, int) and value % gbs == 0:
            return value // gbs
        return f"{value} samples" if in_iterations else value

    listed = []
    for name, mine, theirs in differ:
        flag, in_iterations = _SCHEDULER_FLAGS.get(name, (name, False))
        ours, old = shown(mine, in_iterations, global_batch_size), shown(theirs, in_iterations, saved_gbs)
        listed.append(f"{flag} {ours} here, {old} in the checkpoint")
    raise ConfigError(
        f"--load {load}: the learning-rate schedule differs from the checkpoint's: "
        + "; ".join(listed)
        + ". Pass --override-opt_param-scheduler to follow the flags, or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule"
    )

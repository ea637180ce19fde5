"""Build one rank of a planned run for real and count its memory through one full training step.

    report = dry_run(args, world_size=1024, pp_rank=0, vocab_size=128256, forward_step_func=forward_step)

``args`` are the ``pretrain_gpt.py`` flags a plan prints. They go through the real parser and
``validate_args``; then this rank's model chunks are built as training builds them, wrapped for data
parallelism, given the real optimizer, and one step runs: the pipeline schedule's complete table over
every microbatch, then the optimizer step. :class:`~planner.live_bytes.LiveBytes` counts
every tensor's storage on the way.

With ``fake=True`` (the planner's ``--dry-run``) nothing is allocated: tensors are PyTorch's fake
tensors (``FakeTensorMode``: shapes, dtypes and devices, no data) and the process group is PyTorch's
fake backend with the full world size, so every collective and pipeline message is posted and
returns at once. A 405B rank is checked on a laptop in seconds. With ``fake=False`` the same code
runs on real tensors inside an already started process group, which is how the dry run itself is
checked against a real run.

Adam's moments are created at the first optimizer step, so the optimizer takes one step on zero
gradients before the measured one; the report's peak is that of a step in steady state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from core import parallel_state as ps
from core.device import building_on, current_device
from core.optimizer import get_megatron_optimizer
from core.pipeline_parallel.schedules import get_forward_backward_func
from core.tensor_parallel import model_parallel_seed
from core.transformer.moe.router import TopKRouter
from models.gpt.parallelize import gpt_provider, parallelize_gpt
from planner.live_bytes import LiveBytes
from planner.memory import rank_memory
from planner.report import candidate_args
from training.run import parse_run

__all__ = ["DryRunReport", "dry_run", "fake_backend_available"]


@dataclass
class DryRunReport:
    """Bytes one rank holds, measured: after each build phase, and the peaks of one step."""

    pp_rank: int
    params: int
    """Model parameters (after the data-parallel wrapper moved them into its buffers, if it did)."""
    grads: int
    """Gradient buffers (and, with the distributed optimizer, the parameter buffer's padding)."""
    optimizer: int
    """Main parameters (the fp32 copies, where there are any) and Adam moments."""
    schedule_peak: int
    """Largest live total during the pipeline schedule (forward, backward, gradient reduction)."""
    optimizer_peak: int
    """Largest live total during the optimizer step."""

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return max(self.schedule_peak, self.optimizer_peak)

    def as_dict(self) -> dict:
        return asdict(self) | {"peak": self.peak}


def fake_backend_available() -> str | None:
    """None if PyTorch's fake process group can be used here, else why not (one line)."""
    try:
        import torch.testing._internal.distributed.fake_pg
    except ImportError as err:
        return f"PyTorch {torch.__version__} has no fake process group ({err})"
    if "fake" not in getattr(dist.Backend, "backend_list", ["fake"]):
        return f"PyTorch {torch.__version__} did not register the 'fake' process-group backend"
    return None


def _fake_store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _run(argv: list[str], world_size: int):
    with contextlib.redirect_stdout(None):  # the flag checks' notes: the plan already said them
        return parse_run(argv, world_size)


def _build_rank(run, vocab_size: int, fake: bool):
    """This rank's model (chunks wrapped for data parallelism) and optimizer, as ``setup`` builds them."""

    # Fake tensors have no values to initialise, and hold no memory (--init-model-with-meta-device's aim).
    fake_config = dataclasses.replace(
        run.model, perform_initialization=False, init_model_with_meta_device=False
    )
    config = fake_config if fake else run.model
    provider = gpt_provider(config, vocab_size, run.gpt.max_position_embeddings)
    model = parallelize_gpt(provider, layout=run.layout, groups=ps.get_parallel_groups(), ddp_config=run.ddp)
    optimizer = get_megatron_optimizer(
        run.optimizer,
        model.chunks,
        decoupled_lr=run.lr.decoupled_lr,
        decoupled_min_lr=run.lr.decoupled_min_lr,
    )
    return model, optimizer


def _batches(run, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """One step's microbatches, shaped as ``training.data.batches`` delivers them (all read at the step's start)."""
    batch, seq = run.training.micro_batch_size, run.gpt.seq_length
    return [
        {
            "tokens": torch.zeros((batch, seq), dtype=torch.int64, device=device),
            "labels": torch.zeros((batch, seq), dtype=torch.int64, device=device),
            "loss_mask": torch.ones((batch, seq), dtype=torch.float32, device=device),
            "position_ids": torch.arange(seq, device=device).repeat(batch, 1),
        }
        for _ in range(run.num_microbatches)
    ]


def _iterators(chunks: list, batches: list) -> list[Iterator | None]:
    return [iter(batches) if c.pre_process or c.post_process else None for c in chunks]


def dry_run(
    argv: list[str],
    *,
    world_size: int,
    pp_rank: int,
    vocab_size: int,
    forward_step_func: Callable,
    fake: bool = True,
    device: str | None = None,
    step_started: Callable[[], None] | None = None,
) -> DryRunReport:
    """Measure one rank of the run ``argv`` describes through one training step (module docstring).

    ``pp_rank``: the pipeline rank to build (with ``fake``; a real run builds its own rank).
    ``vocab_size``: the tokenizer's vocabulary (the model pads it as training does).
    ``device``: where the fake tensors live (default: the process group's device, the CPU for the fake
    group); ``"cuda"`` on a machine with a GPU measures with the GPU's kernels (flash attention).
    ``step_started``: called where the measured step starts (e.g. to reset the CUDA allocator's peak).
    """
    run = _run(argv, world_size)
    if fake:
        why = fake_backend_available()
        if why is not None:
            raise RuntimeError(f"--dry-run needs PyTorch's fake process group: {why}")
        rank = pp_rank * (world_size // run.parallel.pp)  # tp = cp = dp rank 0
        dist.init_process_group("fake", store=_fake_store(), rank=rank, world_size=world_size)
    tracker = LiveBytes(answer_scalars=fake)
    fake_mode = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        run.initialize_model_parallel()
        routing = balanced_routing() if fake else contextlib.nullcontext()
        placed = building_on(device) if device is not None else contextlib.nullcontext()
        with placed, fake_mode, tracker, routing:
            return _measure(run, vocab_size, forward_step_func, tracker, fake, step_started)
    finally:
        ps.destroy_model_parallel()
        if fake:
            dist.destroy_process_group()


def _measure(
    run,
    vocab_size: int,
    forward_step_func: Callable,
    tracker: LiveBytes,
    fake: bool,
    step_started: Callable[[], None] | None,
) -> DryRunReport:
    model_parallel_seed(run.model.seed + 100 * ps.get_pipeline_model_parallel_rank())
    model, optimizer = _build_rank(run, vocab_size, fake)
    if optimizer.grad_scaler is not None and fake:  # fake gradients cannot overflow: take a healthy step
        unscale = optimizer._unscale_and_check_for_inf
        optimizer._unscale_and_check_for_inf = lambda: unscale().zero_()
    optimizer.zero_grad()
    optimizer.step()  # Adam's moments exist from the first step on: measure a later one
    optimizer.zero_grad()
    grads = _storage_bytes(_gradient_tensors(model))
    state = _storage_bytes(
        [s.main_param for s in optimizer.shards if s.copy]
        + [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    )
    params = tracker.live - grads - state
    tracker.reset_peak()
    if step_started is not None:
        step_started()
    with tracker.labelled("schedule"):
        batches = _batches(run, current_device())
        get_forward_backward_func(run.parallel.pp, run.parallel.vpp)(
            forward_step_func=forward_step_func,
            data_iterator=_one_or_list(_iterators(model.chunks, batches)),
            model=_one_or_list(model.chunks),
            num_microbatches=run.num_microbatches,
            seq_length=run.gpt.seq_length,
            micro_batch_size=run.training.micro_batch_size,
            schedule_hooks=model.schedule_hooks(optimizer),
            pg_collection=model.groups,
        )
        del batches
    schedule_peak = tracker.peak
    tracker.reset_peak()
    with tracker.labelled("optimizer"):
        optimizer.step()
    return DryRunReport(
        ps.get_pipeline_model_parallel_rank(), params, grads, state, schedule_peak, tracker.peak
    )


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """MoE routers route evenly while inside: token ``t`` to experts ``t k, ..., t k + k - 1`` modulo
    the expert count, as a real tensor. Fake logits cannot say where tokens go, and the experts'
    shapes follow from it; the router still computes (and keeps) everything it does for real, only its
    routing map is replaced by the even one the memory model assumes."""

    original = TopKRouter.forward

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, fake_map = original(self, hidden)
        tokens, experts = fake_map.shape
        with unset_fake_temporarily():
            slots = torch.arange(tokens * self.topk).view(tokens, self.topk) % experts
            routing_map = torch.zeros((tokens, experts), dtype=torch.bool).scatter(1, slots, True)
        return probs, routing_map

    TopKRouter.forward = forward
    try:
        yield
    finally:
        TopKRouter.forward = original


def _gradient_tensors(model) -> Iterator[torch.Tensor]:
    """The gradient buffers: one flat tensor per buffer, or under ZeRO-2/3 each bucket's persistent shard
    and its full tensor (freed between uses: no bytes)."""
    for chunk in model.chunks:
        for buffer in chunk.buffers:
            if buffer.grad_data is not None:
                yield buffer.grad_data
            else:
                for bucket in buffer.buckets:
                    yield from (bucket.grad_data, bucket.grad_shard)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    storages = {id(s): s.nbytes() for s in (t.untyped_storage() for t in tensors)}
    return sum(storages.values())


def _one_or_list(items: list):
    return items if len(items) > 1 else items[0]


def compare(
    planned, plan_input, forward_step_func: Callable, *, ranks: list[int] | None = None
) -> list[dict]:
    """Dry-run ``ranks`` of a planned candidate (default: the rank the model says peaks highest) and
    put each next to the model's figures for the same kernels (the dry run's are the CPU's)."""

    cand, spec = planned.cand, plan_input.spec
    argv = candidate_args(plan_input.base_flags, cand)
    rows = []
    for rank in ranks if ranks is not None else [planned.peak.pp_rank]:
        measured = dry_run(
            argv, world_size=cand.world_size, pp_rank=rank, vocab_size=spec.vocab_size,
            forward_step_func=forward_step_func,
        )  # fmt: skip
        model = rank_memory(spec, cand, rank, device="cpu")
        rows.append({"pp_rank": rank, "model": model.as_dict(), "dry_run": measured.as_dict(),
                     "ratio": model.peak / measured.peak})  # fmt: skip
    return rows


def dry_run_report(candidates: list, plan_input, forward_step_func: Callable) -> str:
    """Lines for ``--dry-run N``: each candidate's worst rank, measured under fake tensors, beside the model."""
    lines = ["dry run (fake tensors, fake process group of the full world size; CPU kernels):"]
    for i, planned in enumerate(candidates):
        for row in compare(planned, plan_input, forward_step_func):
            model, measured = row["model"], row["dry_run"]
            lines.append(
                f"  #{i + 1} {planned.cand.split()} pp rank {row['pp_rank']}: measured peak "
                f"{measured['peak'] / 1e9:.2f} GB (params {measured['params'] / 1e9:.2f}, grads "
                f"{measured['grads'] / 1e9:.2f}, optimizer {measured['optimizer'] / 1e9:.2f}), model "
                f"{model['peak'] / 1e9:.2f} GB with the same (CPU) kernels: {row['ratio'] - 1:+.1%}; the plan's "
                f"figure, with a GPU's kernels, {planned.memory[row['pp_rank']].peak / 1e9:.2f} GB"
            )
    return "\n".join(lines)

"""Context-parallel attention on real gloo ranks against full attention.

Every rank builds the same full q, k, v (same seed), keeps its two load-balanced chunks, runs
ring / all-to-all / all-gather attention over its CP group, and compares its output and the
gradients of its chunks with full causal attention computed on one rank. Models under context
parallelism run through the schedules and pretrain() on the same pool. The sequence cutting and the
block attention, without processes, are in tests/unit/test_context_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core.transformer.context_parallel import block_attention as blocks
from core.transformer.context_parallel import get_batch_on_this_cp_rank, slice_sequence
from planner.calibrate import BEHIND_KIND, GROUP_BYTES, GROUP_KINDS, time_group_collectives
from tests.support.configs import full_recompute
from tests.support.context_parallel import TOL, rel
from tests.support.sgd_model import parallelize_with_sgd

# --------------------------------------------------------------------------------------------------
# CP attention on real ranks
# --------------------------------------------------------------------------------------------------

SEQ, HEADS, DIM = 16, 4, 8


def _cp_attention_rank(rank, world_size, cases):
    """Each case (comm_type, cp, groups, backend): max relative difference of out, dq, dk, dv."""
    from core import parallel_state as ps
    from core.transformer.attention import core_attention
    from core.transformer.context_parallel import context_parallel_attention

    results = []
    for comm_type, cp, groups, math in cases:
        blocks.FORCE_MATH = math
        ps.initialize_model_parallel(context_parallel_size=cp)
        gen = torch.Generator().manual_seed(5)
        q = torch.randn(2, HEADS, SEQ, DIM, generator=gen)
        k, v = (torch.randn(2, groups, SEQ, DIM, generator=gen) for _ in range(2))
        grad = torch.randn(2, HEADS, SEQ, DIM, generator=gen)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        n = HEADS // groups
        reference = core_attention(
            full[0], full[1].repeat_interleave(n, 1), full[2].repeat_interleave(n, 1), None, 0.0
        )
        reference.backward(grad)
        cp_rank = ps.get_context_parallel_rank()
        mine = [slice_sequence(t, cp, cp_rank, seq_dim=2).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(
            *mine,
            comm_type=comm_type,
            group=ps.get_context_parallel_group(),
            local_attention=lambda q_, k_, v_, mask: core_attention(q_, k_, v_, mask, 0.0),
        )
        out.backward(slice_sequence(grad, cp, cp_rank, seq_dim=2))
        cut = [
            slice_sequence(t, cp, cp_rank, seq_dim=2) for t in (reference.detach(), *(f.grad for f in full))
        ]
        results.append(max(rel(a, b) for a, b in zip((out.detach(), *(m.grad for m in mine)), cut)))
        ps.destroy_model_parallel()
    blocks.FORCE_MATH = False
    return results


def _ring_dropout_rank(rank, world_size):
    """Ring attention with dropout at CP = 4: recomputation (which replays the RNG streams) gives
    bit-identical outputs and gradients, and dropout changes the output."""
    from core import parallel_state as ps
    from core.tensor_parallel import model_parallel_seed
    from core.transformer.context_parallel import ring_attention
    from core.transformer.recompute import checkpoint

    ps.initialize_model_parallel(context_parallel_size=4)
    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(2, HEADS, SEQ, DIM, generator=gen) for _ in range(4)]
    q, k, v, grad = (slice_sequence(t, 4, ps.get_context_parallel_rank(), seq_dim=2) for t in full)

    def run(recompute: bool, p: float = 0.3):
        model_parallel_seed(7)
        mine = [t.clone().requires_grad_() for t in (q, k[:, :2], v[:, :2])]

        def attend(*args):
            return ring_attention(*args, ps.get_context_parallel_group(), dropout_p=p)

        out = checkpoint(attend, *mine) if recompute else attend(*mine)
        out.backward(grad)
        return [out.detach(), *(m.grad for m in mine)]

    plain, replayed, undropped = run(False), run(True), run(False, 0.0)
    return all(torch.equal(a, b) for a, b in zip(plain, replayed)), rel(plain[0], undropped[0])


CASES = [  # (comm_type, cp, key/value groups, plain-math blocks)
    ("p2p", 2, 2, False),
    ("p2p", 4, 4, False),
    ("p2p", 4, 1, True),
    ("a2a", 2, 2, False),
    ("a2a", 4, 4, False),
    ("allgather", 4, 2, False),
]


def test_context_parallel_attention_matches_full_attention(ranks):
    for replayed, changed_by_dropout in ranks(4).run(_ring_dropout_rank, timeout=60):
        assert replayed and changed_by_dropout > 0.1
    results = ranks(4).run(_cp_attention_rank, CASES, timeout=60)
    for case, *per_rank in zip(CASES, *results):
        assert max(per_rank) <= TOL, f"{case}: relative differences per rank {per_rank}"


def _time_group_collectives(rank, world_size):
    return time_group_collectives(rank, world_size, torch.float32, units=1, repeats=2, dp_bytes=1 << 20)


def test_calibration_times_ring_attentions_exchange_behind_ranks_out_of_step(ranks):
    """``--profile-local`` on 4 real gloo ranks: every kind in groups of 2 and of 4 (every group at
    once), and ring attention's exchange in the first group of 2 while the other two ranks compute out
    of step (``ring_exchange_behind``, what CP under pipelining pays) at each size of ``GROUP_BYTES``:
    never negative, never less than a smaller size's, the same figures on every rank. A group of all 4
    has no rank outside it: no such timing."""
    found = ranks(4).run(_time_group_collectives, timeout=120)
    assert all(f == found[0] for f in found)
    expected = [(kind, size) for kind in GROUP_KINDS for size in (2, 4)] + [(BEHIND_KIND, 2)]
    assert sorted(found[0]) == sorted(expected)
    points = found[0][BEHIND_KIND, 2]
    assert [size for size, _ in points] == list(GROUP_BYTES)
    seconds = [t for _, t in points]
    assert min(seconds) >= 0 and seconds == sorted(seconds)


# --------------------------------------------------------------------------------------------------
# GPT and LLaMA under CP (and TP, PP, DP) against the single-device model
# --------------------------------------------------------------------------------------------------

MODEL_SEQ, MBS, MICROBATCHES, VOCAB = 16, 2, 2, 60


def _model_config(kind: str, **overrides):
    from tests.support.gpt_model import make_config

    return make_config(kind, **overrides)


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens, labels, loss_mask) microbatches; the masks drop a quarter of the tokens."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        tokens, labels = (torch.randint(0, VOCAB, (MBS, MODEL_SEQ), generator=gen) for _ in range(2))
        mask = (torch.rand(MBS, MODEL_SEQ, generator=gen) > 0.25).float()
        out.append((tokens, labels, mask))
    return out


def _cp_loss_mean(loss_mask, per_token_loss):
    """The 2-tuple contract with CP, as Megatron's legacy loss_func: the whole sequence's mean, whose
    gradient flows through this rank's tokens only."""
    import torch.distributed as dist

    from core import parallel_state as ps

    total = (per_token_loss * loss_mask).sum()
    stats = torch.stack([total.detach(), loss_mask.sum()])
    dist.all_reduce(stats, group=ps.get_context_parallel_group())
    loss = (total + (stats[0] - total.detach())) / stats[1]
    return loss, {"lm loss": loss.detach()}


def _forward_step(form: str):
    from tests.support.pipeline_toy import loss_sum

    loss_func = _cp_loss_mean if form == "mean" else loss_sum

    def forward_step(data_iterator, model):
        tokens = labels = mask = None
        if model.pre_process or model.post_process:
            tokens, labels, mask = next(data_iterator)
        return model(tokens, labels=labels), lambda output: loss_func(mask, output)

    return forward_step


def _cp_model_rank(rank, world_size, kind, split, form):
    """One training step at ``split`` (see SPLITS); full gradients (and, with the distributed
    optimizer, parameters after one SGD step) from the first TP and DP x CP rank of each stage."""
    from core import parallel_state as ps
    from core.distributed import DistributedDataParallelConfig
    from core.pipeline_parallel.schedules import get_forward_backward_func
    from core.tensor_parallel import model_parallel_seed
    from tests.dist.test_gpt_model import _full

    tp, pp, cp, options = SPLITS[split]
    options = dict(options)
    distributed_optimizer = options.pop("distributed_optimizer", False)
    vpp = options.get("virtual_pipeline_model_parallel_size")
    ps.initialize_model_parallel(tp, pp, vpp, cp)
    model_parallel_seed(1234)
    config = _model_config(
        kind,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        calculate_per_token_loss=form == "per_token",
        **options,
    )
    model = parallelize_with_sgd(
        config,
        VOCAB,
        MODEL_SEQ,
        lr=0.5,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=3000)
        if distributed_optimizer
        else None,
    )
    chunks, optimizer = model.chunks, model.optimizer
    dp, dp_rank, cp_rank = (
        ps.get_data_parallel_world_size(),
        ps.get_data_parallel_rank(),
        ps.get_context_parallel_rank(),
    )
    mine = _batches(dp * MICROBATCHES)[dp_rank * MICROBATCHES : (dp_rank + 1) * MICROBATCHES]
    cut = []
    for tokens, labels, mask in mine:
        part = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "loss_mask": mask})
        cut.append((part["tokens"], part["labels"], part["loss_mask"]))
    logs = get_forward_backward_func()(
        forward_step_func=_forward_step(form),
        data_iterator=[iter(cut) for _ in chunks] if vpp else iter(cut),
        model=chunks if vpp else chunks[0],
        num_microbatches=MICROBATCHES,
        seq_length=MODEL_SEQ,
        micro_batch_size=MBS,
        schedule_hooks=model.hooks,
    )
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad  # the data-parallel buffer (all-reduced in full on gloo)
    grads = _full([c.module if distributed_optimizer else c for c in chunks], "grad")
    params = None
    if distributed_optimizer:  # the optimizer shards over DP x CP; each rank updates its shard
        assert chunks[0].data_parallel_group is ps.get_data_parallel_group(with_context_parallel=True)
        assert optimizer.step()[0]
        chunks[0].finish_param_sync()
        params = _full([c.module for c in chunks], "param")
    first = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    return {
        "grads": grads if first else None,
        "params": params if first else None,
        "logs": [(dp_rank, i, d["lm loss"].clone()) for i, d in enumerate(logs)]
        if ps.get_tensor_model_parallel_rank() == 0
        else [],
        "cp_rank": cp_rank,
    }


SPLITS = {  # name: (tp, pp, cp, config options) on 4 ranks; DP takes the rest
    "cp2_p2p": (1, 1, 2, {}),
    "cp4_p2p": (1, 1, 4, {}),
    "cp2_a2a": (1, 1, 2, {"cp_comm_type": "a2a"}),
    "cp2_allgather": (1, 1, 2, {"cp_comm_type": "allgather"}),
    "tp2_sp_cp2": (2, 1, 2, {"sequence_parallel": True}),
    "pp2_cp2_1f1b": (1, 2, 2, {}),
    "pp2_cp2_zb-h1": (1, 2, 2, {"pipeline_schedule": "zb-h1"}),
    "dp2_cp2_distopt": (1, 1, 2, {"distributed_optimizer": True}),
    "pp2_cp2_selective": (1, 2, 2, {"recompute_granularity": "selective", "cp_comm_type": "a2a"}),
    "pp2_cp2_gpipe": (1, 2, 2, {"pipeline_schedule": "gpipe"}),
    "pp2_vpp2_cp2": (1, 2, 2, {"virtual_pipeline_model_parallel_size": 2}),
    "pp2_vpp2_cp2_zbv": (1, 2, 2, {"virtual_pipeline_model_parallel_size": 2, "pipeline_schedule": "zbv"}),
    "cp4_full_recompute": (1, 1, 4, full_recompute("uniform", 2)),
    "tp2_sp_cp2_a2a": (2, 1, 2, {"sequence_parallel": True, "cp_comm_type": "a2a"}),
    "pp2_cp2_compile": (1, 2, 2, {"compile": True, "compile_backend": "aot_eager"}),
    "pp2_cp2_a2a_compile_zb-h1": (
        1,
        2,
        2,
        {
            "compile": True,
            "compile_backend": "aot_eager",
            "cp_comm_type": "a2a",
            "pipeline_schedule": "zb-h1",
        },
    ),
}
CI = {  # one representative per composition (PP2 x CP2 under 1F1B: the pretrain_gpt.py test); the rest is slow
    ("llama", "cp4_p2p", "per_token"),
    ("gpt", "cp2_a2a", "mean"),
    ("llama", "tp2_sp_cp2", "per_token"),
    ("llama", "pp2_cp2_zb-h1", "per_token"),
    ("gpt", "dp2_cp2_distopt", "sum"),
}
FORMS = ("per_token", "sum", "mean")  # calculate_per_token_loss; 3-tuple per microbatch; 2-tuple


def _reference(kind: str, batches, form: str):
    """Loss and gradients of the same model on one device, and the parameters after one SGD step."""
    from models.gpt import GPTModel
    from tests.support.pipeline_toy import reference_loss_and_grads

    model = GPTModel(_model_config(kind), VOCAB, MODEL_SEQ)
    loss, grads = reference_loss_and_grads(model, batches, form == "per_token")
    stepped = {n: (p - 0.5 * grads[n]).detach() for n, p in model.named_parameters()}
    return loss, grads, stepped


def _reported_loss(results, form: str) -> torch.Tensor:
    """The step's loss from every last-stage rank's logs: per microbatch, CP ranks' parts combined."""
    parts: dict[tuple[int, int], list[torch.Tensor]] = {}
    for result in results:
        for dp_rank, index, value in result["logs"]:
            parts.setdefault((dp_rank, index), []).append(value)
    if form == "mean":  # every CP rank logs the whole sequence's mean
        return torch.stack([values[0] for values in parts.values()]).mean()
    sums = {key: torch.stack(values).sum(0) for key, values in parts.items()}
    if form == "per_token":
        total = torch.stack(list(sums.values())).sum(0)
        return total[0] / total[1]
    return torch.stack([s[0] / s[1] for s in sums.values()]).mean()


@pytest.mark.parametrize(
    "kind,split,form",
    [
        pytest.param(kind, split, form, marks=[] if (kind, split, form) in CI else [pytest.mark.slow])
        for split in SPLITS
        for kind in ("gpt", "llama")
        for form in FORMS
        if (kind, split) != ("llama", "tp2_sp_cp2_a2a")  # one query group per TP rank: a2a cannot split it
    ],
)
def test_model_under_context_parallelism_matches_single_device(ranks, kind, split, form):
    tp, pp, cp, _ = SPLITS[split]
    dp = 4 // (tp * pp * cp)
    results = ranks(4).run(_cp_model_rank, kind, split, form, timeout=120)
    ref_loss, ref_grads, ref_stepped = _reference(kind, _batches(dp * MICROBATCHES), form)
    grads = {n: g for r in results if r["grads"] for n, g in r["grads"].items()}
    worst = {}
    for name, grad in grads.items():
        twin = "embedding.word_embeddings.weight" if name not in ref_grads else name
        assert grad is not None and grad.abs().sum() > 0, f"{name} received no gradient"
        worst[name] = rel(grad, ref_grads[twin])
    assert set(ref_grads) <= set(grads), f"missing: {set(ref_grads) - set(grads)}"
    assert max(worst.values()) <= TOL, max(worst.items(), key=lambda kv: kv[1])
    loss = _reported_loss(results, form)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
    stepped = {n: p for r in results if r["params"] for n, p in r["params"].items()}
    for name, param in stepped.items():
        assert rel(param, ref_stepped[name]) <= TOL, name
    assert bool(stepped) == ("distopt" in split)


# --------------------------------------------------------------------------------------------------
# pretrain_gpt.py under CP: the loss curve, and a CP=2 checkpoint resumed at another CP
# --------------------------------------------------------------------------------------------------

PP2_CP2 = ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    from tests.dist.test_distributed_optimizer import synthetic_corpus

    return synthetic_corpus(tmp_path_factory.mktemp("cp_corpus"))


def _offline_pretrain(rank, world_size, flags):
    """One pretrain() on this rank, W&B offline: (losses on the loss stage, what rank 0 printed)."""
    import contextlib
    import io
    import os

    from tests.support.pretrain_run import pretrain_gpt_in_process

    os.environ["WANDB_MODE"] = "offline"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        state = pretrain_gpt_in_process(argv=flags)
    return [losses["lm loss"] for losses in state.losses], out.getvalue() if rank == 0 else ""


def _pretrain_losses(pool, flags: list[str]) -> tuple[list[float], str]:
    """The loss stage's losses (its ranks agree) and rank 0's output."""
    results = pool.run(_offline_pretrain, [*flags, "--num-workers", "0", "--eod-mask-loss"], timeout=240)
    curves = [losses for losses, _ in results if losses]
    assert curves and all(c == curves[0] for c in curves)  # every loss-stage rank reports the same
    return curves[0], results[0][1]


@dataclass
class Cp2Run:
    root: str
    losses: list[float]
    printed: str
    logs: Path
    plain_root: str
    plain: list[float]


@pytest.fixture(scope="module")
def cp2_run(ranks, corpus, tmp_path_factory) -> Cp2Run:
    """10 iterations at TP1 x PP2 x CP2 (GPT, 4 ranks), saved at iteration 5, logged to W&B (offline)
    and TensorBoard; and TP1 (DP 4) alone, saved at iteration 5 too."""
    from tests.dist.test_distributed_optimizer import small_gpt

    root, plain_root = str(tmp_path_factory.mktemp("cp2_ckpt")), str(tmp_path_factory.mktemp("tp1_ckpt"))
    logs = tmp_path_factory.mktemp("cp2_logs")
    logging = ["--wandb-project", "cp", "--wandb-save-dir", str(logs), "--tensorboard-dir", str(logs / "tb")]
    flags = small_gpt(corpus, 10, *PP2_CP2, "--save", root, "--save-interval", "5", *logging)
    losses, printed = _pretrain_losses(ranks(4), flags)
    plain, _ = _pretrain_losses(ranks(4), small_gpt(corpus, 10, "--save", plain_root, "--save-interval", "5"))
    return Cp2Run(root, losses, printed, logs, plain_root, plain)


def test_wandb_tensorboard_and_the_log_name_the_context_parallel_split(cp2_run):
    """W&B's config and TensorBoard's text name CP; the startup line names it; throughput (and so
    MFU) is per GPU: the whole sequences' FLOPs over all four ranks."""
    import argparse
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training.checkpoint.reader import open_checkpoint
    from training.reporting.throughput import num_floating_point_operations
    from training.reporting.wandb_logging import read_offline_history

    assert "TP=1 PP=2 VPP=1 CP=2 DP=1" in cp2_run.printed
    (run_dir,) = glob.glob(str(cp2_run.logs / "wandb" / "offline-run-*"))
    history = read_offline_history(run_dir)
    config = history["config"]
    assert (config["context_parallel_size"], config["cp_comm_type"], config["data_parallel_size"]) == (
        2,
        ["p2p"],
        1,
    )
    events = EventAccumulator(str(cp2_run.logs / "tb"), size_guidance={"tensors": 0}).Reload()
    text = events.Tensors("context_parallel_size/text_summary")[0].tensor_proto.string_val[0]
    assert text == b"2"
    vocab = open_checkpoint(cp2_run.root, 5).padded_vocab_size
    flops = num_floating_point_operations(argparse.Namespace(**config), 1, vocab)  # seq 16, not 16 / CP
    rows = [row for row in history["history"] if "throughput" in row]
    assert len(rows) == 10
    for row in rows:
        per_gpu = flops * row["batch-size"] / (row["iteration-time"] * 1e12 * 4)
        assert row["throughput"] == pytest.approx(per_gpu, rel=1e-6)


def test_pretrain_at_pp2_cp2_has_the_loss_curve_of_tp1(cp2_run):
    losses, plain = cp2_run.losses, cp2_run.plain
    assert len(losses) == 10 and losses[-1] < losses[0]
    worst = max(abs(a - b) / b for a, b in zip(losses, plain, strict=True))
    print(f"PP2xCP2 vs TP1 over 10 iterations: max relative loss difference {worst:.2e}")
    assert worst <= TOL


def test_a_cp2_checkpoint_converts_exports_and_generates_as_the_tp1_one(cp2_run, tmp_path):
    """Saved at PP2 x CP2 the checkpoint records no CP split: its tensors are those of the TP1 run's
    checkpoint (within 1e-5), the converter reshards it exactly, its Hugging Face export equals the TP1
    one's, and it loads for generation at CP 1 with the TP1 checkpoint's logits."""
    from safetensors.torch import load_file

    from models.gpt.generation import generate
    from training.checkpoint.convert import convert_checkpoint, target_split
    from training.checkpoint.reader import open_checkpoint
    from training.hf.exporter import export_to_hf
    from training.inference import load_for_generation

    ckpt, plain = open_checkpoint(cp2_run.root, 5), open_checkpoint(cp2_run.plain_root, 5)
    assert ckpt.config.context_parallel_size == 1
    assert (ckpt.manifest["parallel"]["pp"], ckpt.manifest["parallel"]["dp"]) == (2, 2)  # DP x CP
    assert ckpt.tensor_names() == plain.tensor_names()
    for name in ckpt.tensor_names():  # Adam's steps: elements with gradients near 0 differ by ~lr x 1e-3
        assert (ckpt.full_tensor(name) - plain.full_tensor(name)).abs().max() <= TOL, name
    convert_checkpoint(
        ckpt, str(tmp_path / "tp2"), *target_split(ckpt, tensor_parallel=2, pipeline_parallel=1)
    )
    converted = open_checkpoint(str(tmp_path / "tp2"), 5)
    assert converted.manifest["parallel"]["tp"] == 2
    for name in ckpt.tensor_names():
        assert torch.equal(converted.full_tensor(name), ckpt.full_tensor(name)), name
    exported = {}
    for which, source in (("cp2", ckpt), ("tp1", plain)):
        export_to_hf(source, str(tmp_path / which))
        exported[which] = load_file(str(tmp_path / which / "model.safetensors"))
    assert exported["cp2"].keys() == exported["tp1"].keys()
    for name, tensor in exported["cp2"].items():
        assert (tensor - exported["tp1"][name]).abs().max() <= TOL, name
    prompt = [5, 9, 2, 7, 11, 3]
    logits = []
    for root in (cp2_run.root, cp2_run.plain_root):
        loaded = load_for_generation(root, 5)
        assert loaded.model.config.context_parallel_size == 1
        out = generate(loaded.model, prompt, max_new_tokens=4, vocab_size=loaded.vocab_size, eos_id=None)
        assert len(out.tokens) == len(prompt) + 4
        logits.append(loaded.model(torch.tensor([prompt]))[..., : loaded.vocab_size])  # padding: -inf
    print(f"max |logit difference| CP2 vs TP1 checkpoint: {(logits[0] - logits[1]).abs().max():.2e}")
    assert (logits[0] - logits[1]).abs().max() <= 1e-4


@pytest.mark.parametrize("cp", [pytest.param(1), pytest.param(4, marks=pytest.mark.slow)])
def test_a_cp2_checkpoint_resumes_at_another_cp_with_the_same_next_losses(
    ranks, corpus, cp2_run, cp, tmp_path
):
    from tests.dist.test_distributed_optimizer import small_gpt

    flags = ["--context-parallel-size", str(cp), "--load", cp2_run.root, "--ckpt-step", "5"]
    resumed, _ = _pretrain_losses(ranks(4), small_gpt(corpus, 10, *flags, "--save", str(tmp_path)))
    assert len(resumed) == 5
    worst = max(abs(a - b) / b for a, b in zip(resumed, cp2_run.losses[5:], strict=True))
    print(f"CP2 checkpoint resumed at CP{cp}: max relative difference of the next 5 losses {worst:.2e}")
    assert worst <= TOL

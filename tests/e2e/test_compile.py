"""``--compile``: compiled layers and loss compute what eager ones compute, under every split.

CI runs Dynamo and AOTAutograd without code generation (``--compile-backend aot_eager``: the same
graphs, graph breaks and autograd nodes, no C++ compiler) here, single-process: equivalence with
full and selective recomputation, variable sequence lengths without recompiles, the zero-bubble
split of a compiled stage. tests/dist/test_gpt_model.py trains one step of a compiled LLaMA at
TP2 x SP x PP2 x DP2 with ZB-H1 against the single-device eager model. Marked slow: 20 iterations
of ``pretrain()`` at TP1, TP2 (+SP), PP2 with 1F1B, ZB-H1, interleaved and ZBV, and DP2 with the
distributed optimizer and full recompute, compiled against eager, once with aot_eager and once with
inductor:

    python -m pytest -q -m slow tests/e2e/test_compile.py
"""

from __future__ import annotations

import json

import pytest
import torch

from core.pipeline_parallel.backward_split import backward_input, backward_weight, fused_backward
from core.transformer import TransformerBlock
from core.transformer.compile import compile_stats
from core.transformer.initialization import initialize_by_name
from models.gpt import GPTModel
from tests.support.compiled import assert_compiled_matches_eager
from tests.support.configs import full_recompute, tiny_config
from tests.support.torchrun_jobs import (
    TINY,
    job_env,
    run_captured,
    torchrun_command,
    write_tiny_dataset,
)

VOCAB, SEQ, MBS = 64, 16, 2


@pytest.mark.parametrize(
    "kind,overrides",
    [
        # Variable sequence lengths: the sequence dimension is dynamic from the first compile on.
        ("llama", {"recompute_granularity": "selective", "variable_seq_lengths": True}),
        ("gpt", full_recompute("uniform", 1)),
    ],
)
def test_compiled_model_computes_the_eager_loss_and_gradients(kind, overrides):
    lengths = (16, 24, 40) if overrides.get("variable_seq_lengths") else (SEQ,)
    models = {
        compiled: GPTModel(
            tiny_config(kind, compile=compiled, compile_backend="aot_eager", **overrides), VOCAB, 64
        )
        for compiled in (False, True)
    }
    graphs, start = [], compile_stats()
    for length in lengths:
        tokens = torch.randint(0, VOCAB, (MBS, length), generator=torch.Generator().manual_seed(length))
        assert_compiled_matches_eager(models, tokens, length)
        after = compile_stats()
        graphs.append(after["graphs"])
    # At TP=1 the linear layers compile with their layer, and both layers share their graphs. Full
    # recompute: one region a layer and the loss, no break. Selective recompute keeps core attention
    # eager: the one break, a layer in two regions. A new sequence length compiles nothing.
    breaks = after["graph_breaks"] - start["graph_breaks"]
    if overrides.get("recompute_granularity") == "selective":
        assert graphs[0] - start["graphs"] <= 5 and breaks > 0
    else:
        assert graphs[0] - start["graphs"] <= 2 and breaks == 0
    assert graphs == graphs[:1] * len(lengths), graphs


def test_zero_bubble_split_of_a_compiled_stage_repeats_no_compiled_backward():
    """Compiled for a zero-bubble schedule, the regions hold no parameters: W runs none of them."""
    x = torch.randn(SEQ, MBS, 32, generator=torch.Generator().manual_seed(0))
    grad_out = torch.randn(SEQ, MBS, 32, generator=torch.Generator().manual_seed(1))
    config = tiny_config("gpt", compile=True, compile_backend="aot_eager", pipeline_schedule="zb-h1")
    block = TransformerBlock(config, [0, 1], post_process=False)
    initialize_by_name(block, config)
    results = {}
    for split in (False, True):
        block.zero_grad(set_to_none=True)
        stage_input = x.clone().requires_grad_()
        out = block(stage_input)
        compiled_nodes = _compiled_nodes(out.grad_fn)
        assert len(compiled_nodes) >= 6
        runs: list[int] = []
        for node in compiled_nodes:
            node.register_prehook(lambda grads, runs=runs: runs.append(1))
        if split:
            input_grad, weights = backward_input(out, grad_out, stage_input)
            during_i = len(runs)
            backward_weight(weights)
            assert during_i == len(compiled_nodes) and len(runs) == during_i, "W ran a compiled region"
        else:
            fused_backward(out, grad_out)
            input_grad = stage_input.grad
        results[split] = input_grad, {n: p.grad.clone() for n, p in block.named_parameters()}
    assert torch.equal(results[True][0], results[False][0])
    for name, grad in results[False][1].items():
        assert torch.equal(results[True][1][name], grad), name


def _compiled_nodes(root) -> list:
    seen, stack, found = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            found.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return found


SCRIPT = """
import json, sys
import torch, torch._dynamo
import torch.distributed as dist
import pretrain_gpt
from core import parallel_state as ps
from training.faults import end_process
from training.training import pretrain

ps.initialize_distributed()
curves = {}
for name, flags in json.loads(sys.argv[1]).items():
    torch._dynamo.reset()
    state = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                     pretrain_gpt.forward_step, argv=flags.split(), tokenizer_provider=pretrain_gpt.tokenizer_provider)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [float(d["lm loss"]) for d in state.losses])
    curves[name] = max(everyone, key=len)
if dist.get_rank() == 0:
    print("CURVES " + json.dumps(curves))
ps.destroy_distributed()
end_process(0)  # as pretrain_gpt.py ends: without finalization, where gloo's threads can abort
"""

SPLITS = {
    "TP1": "",
    "TP2 SP": "--tensor-model-parallel-size 2 --sequence-parallel",
    "PP2 1F1B": "--pipeline-model-parallel-size 2",
    "PP2 ZB-H1": "--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1",
    "PP2 interleaved": "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
    "PP2 ZBV": "--pipeline-model-parallel-size 2 --pipeline-schedule zbv --num-virtual-stages-per-pipeline-rank 2",
    "DP2 distributed optimizer, full recompute": "--use-distributed-optimizer --recompute-granularity full "
    "--recompute-method uniform --recompute-num-layers 1",
}


def _curves(tmp_path, splits: list[str], backend: str) -> dict[str, list[float]]:
    data = write_tiny_dataset(tmp_path / "tiny")
    # --num-workers 0: one process runs several pretrain() calls; a data worker forked after a compiled
    # run (Dynamo's state in the parent) can crash.
    base = " ".join(TINY) + f" --data-path {data} --train-iters 20 --eval-interval 1000 --num-workers 0"
    runs = {}
    for split in splits:
        runs[split] = f"{base} {SPLITS[split]}"
        runs[f"{split} compiled"] = f"{base} {SPLITS[split]} --compile --compile-backend {backend}"
    script = tmp_path / "compile_runs.py"
    script.write_text(SCRIPT)
    done = run_captured(
        torchrun_command(2, [json.dumps(runs)], script=script),
        env=job_env(),
        timeout=1800 if backend == "inductor" else 300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "--compile warm-up (first iteration): " in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.startswith("CURVES "))
    return json.loads(line[len("CURVES ") :])


def _check_curves(curves: dict[str, list[float]], splits: list[str]) -> None:
    for split in splits:
        eager, compiled = curves[split], curves[f"{split} compiled"]
        assert len(eager) == len(compiled) == 20, split
        worst = max(abs(c - e) / abs(e) for c, e in zip(compiled, eager))
        print(f"{split}: compiled vs eager, worst relative loss difference over 20 iterations {worst:.2e}")
        assert worst <= 1e-5, (split, worst)
        assert eager[-1] < eager[0]


@pytest.mark.slow
@pytest.mark.timeout(2000)  # inductor compiles every split's layers on 2 cores (its run may take 1800 s)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_follows_the_eager_loss_curve(tmp_path, backend):
    _check_curves(_curves(tmp_path, list(SPLITS), backend), list(SPLITS))

"""``--gradient-accumulation-fusion``: weight gradients accumulate straight into ``main_grad``.

Against the hook path (autograd makes the gradient, the data-parallel wrapper's hook adds it): the
same ``main_grad`` after two microbatches (fp32 within 1e-6; bf16 exactly, as the CPU forms the
16-bit product first, but for the word embedding, whose rows the fused path adds in fp32), no
post-accumulate hook for a fused weight (a tied output layer's included), buckets ready after the last
microbatch; and under the zero-bubble split the weight gradients are made in W only, once. A tied
embedding lent to a later chunk stays on autograd.
A dropped wrapper frees its model (its hooks hold their buckets weakly). The data-parallel and
pipeline runs through ``pretrain()`` are in tests/e2e/test_grad_overlap.py.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

import core.tensor_parallel.grad_accumulation as fusion
from core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from core.distributed.grad_buffer import IDLE, LAUNCHED
from core.pipeline_parallel.backward_split import backward_input, backward_weight, fused_backward
from core.transformer import TransformerBlock
from models.gpt import GPTModel, gpt_provider, parallelize_gpt, pipeline_layout
from tests.support.configs import tiny_config

VOCAB, SEQ, MBS = 64, 8, 2
EMBEDDING = "embedding.word_embeddings.weight"


def _config(kind: str, fused: bool, dtype: torch.dtype):
    return tiny_config(kind, gradient_accumulation_fusion=fused, params_dtype=dtype, pipeline_dtype=dtype)


def _wrap(module, config):
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000)
    return DistributedDataParallel(config, ddp, module)


def _count_separate_grads(module) -> dict[str, int]:
    """Per parameter: microbatches whose gradient autograd delivered as a tensor apart from main_grad."""
    calls = {name: 0 for name, _ in module.named_parameters()}

    def hook(param, name):
        if param.grad is not None and param.grad.data_ptr() != param.main_grad.data_ptr():
            calls[name] += 1

    for name, param in module.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: hook(p, name))
    return calls


@pytest.mark.parametrize(
    "kind,dtype", [("llama", torch.float32), ("gpt", torch.float32), ("llama", torch.bfloat16)]
)
def test_fused_accumulation_gives_the_hook_paths_main_grad(kind, dtype):
    batches = [
        torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(i)) for i in (1, 2)
    ]
    grads, separate = {}, {}
    for fused in (False, True):
        config = _config(kind, fused, dtype)
        module = GPTModel(config, VOCAB, SEQ)
        separate[fused] = _count_separate_grads(module)  # runs before the wrapper's hook
        model = _wrap(module, config)
        for i, tokens in enumerate(batches):
            if i == 0:
                with model.no_sync():
                    model(tokens, labels=tokens.roll(1, 1)).sum().backward()
                assert all(b.state == IDLE for b in model.buckets)
            else:
                model(tokens, labels=tokens.roll(1, 1)).sum().backward()
        assert all(b.state == LAUNCHED for b in model.buckets), "a bucket never became ready"
        grads[fused] = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
    fused_weights = [n for n in grads[True] if n.endswith("weight") and "linear" in n]
    fused_weights += [EMBEDDING] + (["output_layer.weight"] if kind == "llama" else [])
    assert all(separate[True][n] == 0 for n in fused_weights), separate[True]
    if dtype == torch.bfloat16:  # the hook path: a bf16 weight gradient per microbatch
        assert all(separate[False][n] == 2 for n in fused_weights)
    for name, expected in grads[False].items():
        got = grads[True][name]
        error = ((got - expected).norm() / expected.norm()).item()
        if dtype == torch.float32:
            assert error <= 1e-6, name
        elif name == EMBEDDING:  # the hook path rounds each microbatch's row sums to bf16; fused adds in fp32
            assert 0 < error <= 2**-8, name
        else:
            assert torch.equal(got, expected), name


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_next_steps_first_gradient_overwrites_the_stale_buffer(fused, dtype):
    """No pass zeroes ``main_grad`` between steps: after ``zero_grad_buffer`` the first microbatch's
    gradient overwrites what the last step left (NaN here; a fused layer with ``beta = 0``, the hook
    by a copy) and the second adds: bit-identical to a wrapper whose buffer is fresh."""
    batches = [
        torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(i)) for i in (1, 2)
    ]
    grads = []
    for stale in (False, True):
        config = _config("gpt", fused, dtype)
        model = _wrap(GPTModel(config, VOCAB, SEQ), config)
        if stale:
            model(batches[1], labels=batches[0]).sum().backward()
            model.finish_grad_sync()
            for buffer in model.buffers:
                buffer.grad_data.fill_(float("nan"))
            model.zero_grad_buffer()
        for i, tokens in enumerate(batches):
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                model(tokens, labels=tokens.roll(1, 1)).sum().backward()
        model.finish_grad_sync()
        grads.append({n: p.main_grad.clone() for n, p in model.module.named_parameters()})
    for name, expected in grads[0].items():
        assert torch.equal(grads[1][name], expected), name


def test_zero_bubble_split_makes_the_weight_gradients_once_in_w(monkeypatch):
    made = []
    accumulate = fusion.accumulate_weight_grad
    monkeypatch.setattr(
        fusion, "accumulate_weight_grad", lambda *a, **k: made.append(1) or accumulate(*a, **k)
    )
    x = torch.randn(SEQ, MBS, 32, generator=torch.Generator().manual_seed(0))
    grad_out = torch.randn(SEQ, MBS, 32, generator=torch.Generator().manual_seed(1))
    results = {}
    for split in (False, True):
        config = _config("llama", True, torch.float32)
        torch.manual_seed(3)
        block = _wrap(TransformerBlock(config, [0, 1], post_process=False), config)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.2)
        stage_input = x.clone().requires_grad_()
        out = block(stage_input)
        made.clear()
        if split:
            input_grad, weights = backward_input(out, grad_out, stage_input)
            assert not made and all(b.state == IDLE for b in block.buckets), "I made a weight gradient"
            assert all(not p.main_grad.any() for n, p in block.module.named_parameters() if "linear" in n)
            backward_weight(weights)
        else:
            fused_backward(out, grad_out)
            input_grad = stage_input.grad
        assert len(made) == 8  # 2 layers x (QKV, projection, fc1, fc2), each once
        assert all(b.state == LAUNCHED for b in block.buckets)
        results[split] = input_grad, {n: p.main_grad.clone() for n, p in block.module.named_parameters()}
    assert torch.equal(results[True][0], results[False][0])
    for name, grad in results[False][1].items():
        assert torch.equal(results[True][1][name], grad), name


def test_fusion_without_main_grad_is_one_clear_error():
    model = GPTModel(_config("llama", True, torch.float32), VOCAB, SEQ)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True needs the weights' main_grad"):
        model(torch.zeros(1, SEQ, dtype=torch.long))


@pytest.mark.parametrize("fused", [False, True])
def test_a_dropped_wrapper_frees_its_model_and_buffers(fused):
    """Autograd holds each parameter's hooks from C++, out of the collector's sight: hooks that held
    their bucket strongly kept every dropped model alive (the GPU check's second dry run found it)."""
    config = _config("llama", fused, torch.float32)
    model = _wrap(GPTModel(config, VOCAB, SEQ), config)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens.roll(1, 1)).sum().backward()
    alive = [weakref.ref(x) for x in (model, model.module, model.buckets[0], next(model.parameters()))]
    del model
    gc.collect()
    assert [ref() is None for ref in alive] == [True] * 4


def test_a_fused_layer_whose_input_is_the_stage_input_splits_too():
    """At TP=1 nothing stands between a linear layer and its input, which can be the stage's input itself:
    a leaf that I asks ``autograd.grad`` for, of which torch's engine cannot say whether it runs. The layer
    still makes that gradient in I, and the weight gradient in W."""
    from core.tensor_parallel import ColumnParallelLinear

    config = _config("gpt", True, torch.float32)
    x = torch.randn(SEQ, MBS, 32, generator=torch.Generator().manual_seed(0))
    results = {}
    for split in (False, True):
        torch.manual_seed(3)
        layer = _wrap(ColumnParallelLinear(32, 16, config=config, init_method=torch.nn.init.normal_), config)
        stage_input = x.clone().requires_grad_()
        out, _ = layer(stage_input)
        grad_out = torch.ones_like(out)
        if split:
            input_grad, weights = backward_input(out, grad_out, stage_input)
            assert not layer.module.weight.main_grad.any()  # no weight gradient in I
            backward_weight(weights)
        else:
            fused_backward(out, grad_out)
            input_grad = stage_input.grad
        results[split] = input_grad, layer.module.weight.main_grad.clone()
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


def test_a_tied_embedding_lent_to_a_later_chunk_gets_the_unfused_gradient():
    """Two chunks of one rank share the tied word embedding: the first looks it up, the second's output
    layer borrows it. Their backwards are two, so neither can report the weight after the other: the
    embedding stays on autograd there, and the shared ``main_grad`` is the unfused path's. In one chunk,
    the output layer only accumulates and the embedding reports."""
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(1))
    grads = {}
    for fused in (False, True):
        config = tiny_config(
            "gpt", gradient_accumulation_fusion=fused, virtual_pipeline_model_parallel_size=2
        )
        torch.manual_seed(0)
        model = parallelize_gpt(
            gpt_provider(config, VOCAB, SEQ),
            layout=pipeline_layout(config),
            ddp_config=DistributedDataParallelConfig(),
        )
        first, last = model.modules
        weight = first.embedding.word_embeddings.weight
        assert last.shared_embedding_or_output_weight() is weight
        assert not first.embedding.word_embeddings.gradient_accumulation_fusion
        assert not getattr(weight, "grad_reported_by_embedding", False)
        hidden = model.chunks[0](tokens)
        sent = hidden.detach().requires_grad_()
        last.set_input_tensor(sent)
        model.chunks[1](None, labels=tokens.roll(1, 1)).sum().backward()
        hidden.backward(sent.grad)
        for chunk in model.chunks:
            chunk.finish_grad_sync()
        grads[fused] = weight.main_grad.clone()
    assert ((grads[True] - grads[False]).norm() / grads[False].norm()).item() <= 1e-6
    whole = GPTModel(_config("gpt", True, torch.float32), VOCAB, SEQ)
    assert whole.embedding.word_embeddings.gradient_accumulation_fusion
    assert whole.embedding.word_embeddings.weight.grad_reported_by_embedding

"""Data parallelism in one process: DDP's gradient buffers and buckets against plain autograd, the
distributed optimizer's sharded layout, no_sync over several chunks, and the checks that name a
parameter. The reductions over real ranks: tests/dist/test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from core.distributed import DistributedDataParallel, DistributedDataParallelConfig, multi_no_sync
from tests.support.data_parallel import relative_error, toy
from tests.support.pipeline_toy import make_microbatches, reference_loss_and_grads


def test_main_grads_live_in_one_flat_buffer_and_match_plain_autograd():
    batches = make_microbatches(3, 2, 6, False)
    plain, model = toy(), toy()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    _, expected = reference_loss_and_grads(plain, batches, per_token=False)
    for tokens, labels, mask in batches:
        loss = (ddp(tokens, labels=labels) * mask).sum() / mask.sum() / len(batches)
        loss.backward()
    ddp.finish_grad_sync()
    buffer = ddp.buffers[0].grad_data
    for name, param in model.named_parameters():
        assert param.grad.data_ptr() == param.main_grad.data_ptr()  # fp32: .grad is the buffer view
        assert param.main_grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert relative_error(param.main_grad, expected[name]) < 1e-6
    assert len(ddp.buckets) == 1  # no overlap: one bucket per buffer, as Megatron


def test_wrapper_forwards_attributes_and_state_dict_has_no_prefix():
    model = toy()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    assert ddp.pre_process and ddp.post_process and ddp.vp_stage is None
    ddp.set_input_tensor(["x"])
    assert model.input_tensor == "x"
    assert set(ddp.state_dict()) == set(model.state_dict())
    with pytest.raises(AttributeError):
        ddp.no_such_attribute  # noqa: B018


def test_buckets_follow_reverse_parameter_order_and_bucket_size():
    model = toy()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100), model
    )
    names = [n for bucket in ddp.buckets for n in bucket.names]
    assert names == [n for n, _ in model.named_parameters()][::-1]
    # A bucket closes once it holds >= 100 elements: head (11 + 88) + layers.1.bias (8), and so on.
    assert [len(b.params) for b in ddp.buckets] == [3, 3, 1]
    assert [b.grad_data.numel() for b in ddp.buckets] == [11 + 88 + 8, 64 + 8 + 64, 88]


def test_sharded_buffers_pad_buckets_hold_the_parameters_and_isolate_a_tied_embedding():
    model = toy()
    model.embedding.weight.shared_embedding = True
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=100
    )
    ddp = DistributedDataParallel(model.config, config, model)
    # Buckets close at >= 100 elements and are padded to lcm(dp, 128); the embedding sits alone, so
    # the first and last stage shard their two copies of it identically.
    assert [b.names for b in ddp.buckets] == [
        ["head.bias", "head.weight", "layers.1.bias"],
        ["layers.1.weight", "layers.0.bias", "layers.0.weight"],
        ["embedding.weight"],
    ]
    assert [b.grad_data.numel() for b in ddp.buckets] == [128, 256, 128]
    storage = ddp.buffers[0].param_data.untyped_storage().data_ptr()
    for name, param in model.named_parameters():  # the values moved into the flat parameter buffer
        assert param.untyped_storage().data_ptr() == storage and torch.equal(param, before[name])
        assert ddp.param_to_bucket[param].owned_range(param) == (0, param.numel())  # one rank owns all


def test_bf16_model_accumulates_in_fp32_buffer():
    model = toy().to(torch.bfloat16)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    tokens, labels, mask = make_microbatches(1, 2, 6, False)[0]
    (ddp(tokens, labels=labels) * mask).sum().backward()
    assert all(p.main_grad.dtype == torch.float32 and p.grad is None for p in model.parameters())
    assert ddp.buffers[0].grad_data.abs().sum() > 0


def test_grad_aliasing_main_grad_is_not_counted_twice():
    """An fp32 optimizer hands main_grad over as param.grad; the next backward must not double it."""
    model = toy()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    tokens, labels, mask = make_microbatches(1, 2, 6, False)[0]
    (ddp(tokens, labels=labels) * mask).sum().backward()
    once = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = p.main_grad
    (ddp(tokens, labels=labels) * mask).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.main_grad, 2 * once[n]), n


def test_gradient_after_reduction_without_zeroing_is_an_error():
    model = toy()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    tokens, labels, mask = make_microbatches(1, 2, 6, False)[0]
    (ddp(tokens, labels=labels) * mask).sum().backward()
    ddp.finish_grad_sync()
    with pytest.raises(RuntimeError, match=r"zero_grad_buffer\(\)"):
        (ddp(tokens, labels=labels) * mask).sum().backward()
    ddp.zero_grad_buffer()
    (ddp(tokens, labels=labels) * mask).sum().backward()  # fine again


@pytest.mark.parametrize("overlap", [False, True])
def test_a_parameter_two_chunks_share_keeps_its_gradient_over_steps(overlap):
    """ZBV puts a tied embedding in two chunks of one rank: one Parameter in both wrappers' buffers, its
    ``main_grad`` the second's. Each step's gradient (both uses summed) lands there whole, however the
    step's first write and the zeroing of what got none are split between the two wrappers."""
    torch.manual_seed(0)
    shared = torch.nn.Embedding(5, 3)
    modules = [torch.nn.ModuleDict({"embedding": shared, "linear": torch.nn.Linear(3, 3)}) for _ in range(2)]
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap)
    chunks = [DistributedDataParallel(None, config, m) for m in modules]
    for step in range(3):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        tokens = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(step))
        hidden = modules[0]["linear"](shared(tokens))
        loss = (modules[1]["linear"](hidden) @ shared.weight.t()).square().sum()
        expected = torch.autograd.grad(loss, shared.weight, retain_graph=True)[0]
        loss.backward()
        for chunk in chunks:
            chunk.finish_grad_sync()
        assert torch.equal(shared.weight.main_grad, expected), step


def test_multi_no_sync_suspends_every_chunk():
    chunks = [DistributedDataParallel(None, DistributedDataParallelConfig(), toy()) for _ in range(2)]
    with multi_no_sync(chunks)():
        assert not any(b.is_last_microbatch for c in chunks for b in c.buckets)
    assert all(b.is_last_microbatch for c in chunks for b in c.buckets)


def test_nan_check_names_the_parameter():
    model = toy()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(check_for_nan_in_grad=True), model
    )
    model.head.bias.main_grad[0] = float("nan")
    with pytest.raises(RuntimeError, match=r"NaN or Inf in the gradients of \['head.bias'\]"):
        ddp.finish_grad_sync()

"""Tensor-parallel layers, mappings, loss and RNG on two real gloo ranks, against single-device torch.

Every rank builds the same full tensors from the same seed, so each can compute the single-device
reference itself and compare its own shard; a rank's failed assertion is re-raised by the pool.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core import comm_time, parallel_state
from core.model_parallel_config import ModelParallelConfig
from core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    fused_vocab_parallel_cross_entropy,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    gather_full,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_seed,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    set_tensor_model_parallel_attributes,
    shard_of,
    vocab_parallel_cross_entropy,
)
from core.tensor_parallel.fp8 import Fp8Recipe, update_fp8_scales
from core.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from planner.calibrate import DP_KINDS, GROUP_BYTES, GROUP_KINDS, time_group_collectives
from tests.support.tensor_parallel import close

TP = 2


def _config(sequence_parallel: bool = False) -> ModelParallelConfig:
    return ModelParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=sequence_parallel)


def _copy_init(full: torch.Tensor):
    return lambda weight: weight.copy_(full)


def _set_bias(param: torch.Tensor, full: torch.Tensor, rank: int) -> None:
    with torch.no_grad():
        param.copy_(shard_of(full, param, rank, TP))


# --------------------------------------------------------------------------------------------------
# Rank functions
# --------------------------------------------------------------------------------------------------


def _reference_linear(seed: int, in_features: int, out_features: int):
    """Seeded input [3, 2, in], weight and bias, and a plain ``nn.Linear`` run forward and backward on
    them: (x, weight, bias, ref, x_ref, y_ref, dy)."""
    torch.manual_seed(seed)
    x = torch.randn(3, 2, in_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    ref = nn.Linear(in_features, out_features)
    with torch.no_grad():
        ref.weight.copy_(weight), ref.bias.copy_(bias)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    return x, weight, bias, ref, x_ref, y_ref, dy


def _check_column(rank, world_size, gather_output):
    group = dist.group.WORLD
    x, weight, bias, ref, x_ref, y_ref, dy = _reference_linear(0, 4, 6)

    layer = ColumnParallelLinear(
        4, 6, config=_config(), init_method=_copy_init(weight), gather_output=gather_output, tp_group=group
    )
    assert layer.weight.shape == (3, 4) and layer.weight.partition_dim == 0
    _set_bias(layer.bias, bias, rank)
    x_tp = x.clone().requires_grad_()
    y, bias_out = layer(x_tp)
    assert bias_out is None
    if not gather_output:
        y_ref, dy = y_ref.chunk(TP, dim=-1)[rank], dy.chunk(TP, dim=-1)[rank]
    close(y, y_ref, "output")
    y.backward(dy)
    close(x_tp.grad, x_ref.grad, "input grad")
    close(gather_full(layer.weight, group, tensor=layer.weight.grad), ref.weight.grad, "weight grad")
    close(gather_full(layer.bias, group, tensor=layer.bias.grad), ref.bias.grad, "bias grad")

    layer.skip_bias_add = True
    y_skip, bias_skip = layer(x.clone())
    assert bias_skip is layer.bias
    close(y_skip + (bias if gather_output else bias_skip), y, "skip_bias_add output + bias")


def _check_row(rank, world_size, input_is_parallel):
    group = dist.group.WORLD
    x, weight, bias, ref, x_ref, y_ref, dy = _reference_linear(1, 6, 4)

    layer = RowParallelLinear(
        6,
        4,
        config=_config(),
        init_method=_copy_init(weight),
        input_is_parallel=input_is_parallel,
        tp_group=group,
    )
    assert layer.weight.shape == (4, 3) and layer.weight.partition_dim == 1
    assert not layer.bias.tensor_model_parallel
    _set_bias(layer.bias, bias, rank)
    x_in = x.chunk(TP, dim=-1)[rank] if input_is_parallel else x
    x_tp = x_in.clone().requires_grad_()
    y, bias_out = layer(x_tp)
    assert bias_out is None
    close(y, y_ref, "output")
    y.backward(dy)
    x_grad_ref = x_ref.grad.chunk(TP, dim=-1)[rank] if input_is_parallel else x_ref.grad
    close(x_tp.grad, x_grad_ref, "input grad")
    close(gather_full(layer.weight, group, tensor=layer.weight.grad), ref.weight.grad, "weight grad")
    close(layer.bias.grad, ref.bias.grad, "bias grad")

    layer.skip_bias_add = True
    y_skip, bias_skip = layer(x_in.clone())
    assert bias_skip is layer.bias
    close(y_skip + bias_skip, y, "skip_bias_add output + bias")


def _check_mlp(rank, world_size, sequence_parallel):
    """Column -> GELU -> Row equals the plain MLP; groups come from parallel_state (tp_group=None)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    torch.manual_seed(2)
    s, b, h, f = 4, 2, 4, 8
    x, w1, b1, w2, b2 = (
        torch.randn(s, b, h),
        torch.randn(f, h),
        torch.randn(f),
        torch.randn(h, f),
        torch.randn(h),
    )
    params_ref = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    x_ref = x.clone().requires_grad_()
    y_ref = F.linear(F.gelu(F.linear(x_ref, params_ref[0], params_ref[1])), params_ref[2], params_ref[3])
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)

    config = _config(sequence_parallel)
    fc1 = ColumnParallelLinear(h, f, config=config, init_method=_copy_init(w1))
    fc2 = RowParallelLinear(f, h, config=config, init_method=_copy_init(w2), input_is_parallel=True)
    _set_bias(fc1.bias, b1, rank)
    _set_bias(fc2.bias, b2, rank)

    def local(t):  # what this rank holds of a [s, b, h] activation
        return t.chunk(TP, dim=0)[rank] if sequence_parallel else t

    x_tp = local(x).clone().requires_grad_()
    hidden, _ = fc1(x_tp)
    y, _ = fc2(F.gelu(hidden))
    close(y, local(y_ref), "output")
    y.backward(local(dy))
    close(x_tp.grad, local(x_ref.grad), "input grad")
    assert fc2.bias.sequence_parallel == sequence_parallel
    if sequence_parallel:  # each rank saw only its sequence slice: the finaliser's all-reduce
        dist.all_reduce(fc2.bias.grad, group=parallel_state.get_tensor_model_parallel_group())
    grads = [gather_full(p, tensor=p.grad) for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)]
    for name, grad, p_ref in zip(("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"), grads, params_ref):
        close(grad, p_ref.grad, f"{name} grad")


def _check_embedding(rank, world_size, reduce_scatter):
    group = dist.group.WORLD
    torch.manual_seed(3)
    vocab, dim = 8, 4
    weight = torch.randn(vocab, dim)
    tokens = torch.tensor([[0, 5, 3, 7], [4, 1, 1, 6]])  # [b, s], ids on both halves of the vocab
    w_ref = weight.clone().requires_grad_()
    y_ref = F.embedding(tokens, w_ref)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)

    emb = VocabParallelEmbedding(
        vocab,
        dim,
        init_method=_copy_init(weight),
        config=_config(),
        reduce_scatter_embeddings=reduce_scatter,
        tp_group=group,
    )
    assert (emb.vocab_start_index, emb.vocab_end_index) == (4 * rank, 4 * rank + 4)
    y = emb(tokens)
    if reduce_scatter:  # [b, s, h] -> [s, b, h], this rank's sequence slice
        y_ref, dy = (t.transpose(0, 1).chunk(TP, dim=0)[rank] for t in (y_ref, dy))
    close(y, y_ref, "output")
    y.backward(dy)
    close(gather_full(emb.weight, group, tensor=emb.weight.grad), w_ref.grad, "weight grad")


def _check_cross_entropy(rank, world_size, label_smoothing):
    group = dist.group.WORLD
    torch.manual_seed(4)
    logits, target = torch.randn(3, 2, 8) * 3, torch.randint(0, 8, (3, 2))
    logits_ref = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(
        logits_ref.reshape(-1, 8), target.reshape(-1), reduction="none", label_smoothing=label_smoothing
    ).view(3, 2)
    dloss = torch.rand(3, 2)
    loss_ref.backward(dloss)

    local = logits.chunk(TP, dim=-1)[rank].clone().requires_grad_()
    untouched = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing=label_smoothing, tp_group=group)
    assert loss.shape == target.shape
    close(loss, loss_ref, "loss")
    loss.backward(dloss, retain_graph=True)
    close(local.grad, logits_ref.grad.chunk(TP, dim=-1)[rank], "logits grad")
    assert torch.equal(local.detach(), untouched), "the caller's logits were modified"
    with pytest.raises(RuntimeError, match="cannot be back-propagated twice"):
        loss.backward(dloss)

    # The fused version (3 tokens per 48-byte slice: two slices), fp32: the same numbers.
    fused_local = logits.chunk(TP, dim=-1)[rank].clone().requires_grad_()
    fused = fused_vocab_parallel_cross_entropy(
        fused_local * 1.0, target, label_smoothing=label_smoothing, tp_group=group, slice_bytes=48
    )
    close(fused, loss_ref, "fused loss")
    fused.backward(dloss, retain_graph=True)
    close(fused_local.grad, logits_ref.grad.chunk(TP, dim=-1)[rank], "fused logits grad")
    with pytest.raises(RuntimeError, match="cannot be back-propagated twice"):
        fused.backward(dloss)
    # bf16 logits: what the plain function computes from their fp32 copy, without the copy.
    half = logits.chunk(TP, dim=-1)[rank].bfloat16().requires_grad_()
    plain = vocab_parallel_cross_entropy(half.float(), target, label_smoothing, group)
    (plain_grad,) = torch.autograd.grad(plain, half, dloss)
    fused = fused_vocab_parallel_cross_entropy(half * 1.0, target, label_smoothing, group, slice_bytes=48)
    (fused_grad,) = torch.autograd.grad(fused, half, dloss)
    close(fused, plain, "bf16 fused loss")
    close(fused_grad.float(), plain_grad.float(), "bf16 fused logits grad")


def _check_linear_cross_entropy(rank, world_size, vocab_size):
    """The output layer inside the loss against ``F.linear`` + ``F.cross_entropy`` on one device:
    the loss, the hidden states' gradient (summed over TP by the column layer's input mapping), this
    rank's weight shard's gradient through autograd and accumulated into ``main_grad``. Vocabulary 8
    split 4 + 4; ``vocab_size`` 7 pads one column, 3 leaves rank 1 a shard of padding alone."""
    group = dist.group.WORLD
    torch.manual_seed(5)
    hidden, weight = torch.randn(3, 2, 4), torch.randn(8, 4)
    target, dloss = torch.randint(0, vocab_size, (3, 2)), torch.rand(3, 2)
    hidden_ref, weight_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(hidden_ref, weight_ref).masked_fill(torch.arange(8) >= vocab_size, float("-inf"))
    loss_ref = F.cross_entropy(logits.reshape(-1, 8), target.reshape(-1), reduction="none").view(3, 2)
    loss_ref.backward(dloss)
    for accumulate in (False, True):
        local_hidden = hidden.clone().requires_grad_()
        shard = weight.chunk(TP)[rank].clone().requires_grad_()
        if accumulate:  # as DistributedDataParallel prepares a weight for the fusion
            shard.main_grad = torch.full_like(shard, 0.5)
            shard.grad_accumulated = lambda p: setattr(p, "reported", True)
        loss = linear_cross_entropy(
            copy_to_tensor_model_parallel_region(local_hidden, tp_group=group), shard, target,
            vocab_size=vocab_size, tp_group=group, accumulate_into_main_grad=accumulate, slice_bytes=64,
        )  # fmt: skip
        assert not loss.isnan().any() and loss.shape == target.shape
        close(loss, loss_ref, "loss")
        loss.backward(dloss)
        close(local_hidden.grad, hidden_ref.grad, "hidden grad")
        expected = weight_ref.grad.chunk(TP)[rank]
        got = shard.main_grad - 0.5 if accumulate else shard.grad
        assert not accumulate or (shard.grad is None and shard.reported and shard.grad_added_to_main_grad)
        if expected.any():
            close(got, expected, f"weight grad (accumulate={accumulate})")
        else:  # a shard of padding: no gradient at all
            assert torch.equal(got, expected), f"padding's weight grad {got}"


def _run(fn, x, grad):
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _check_mappings(rank, world_size):
    """Forward and backward of every mapping on integer-valued tensors, compared exactly."""
    g = dist.group.WORLD
    r = rank
    ar = torch.arange(8.0)
    ones = torch.ones(2, 1, 2)
    mine = ones * (r + 1)  # rank-dependent: 1s on rank 0, 2s on rank 1
    both_last = torch.cat([ones, 2 * ones], dim=-1)  # what gathering ``mine`` along the last dim gives
    both_first = torch.cat([ones, 2 * ones], dim=0)  # ... and along the first dim

    def check(name, fn, x, grad, y_expected, grad_expected):
        y, x_grad = _run(lambda t: fn(t, tp_group=g), x, grad)
        assert torch.equal(y, y_expected), f"{name} forward: {y} != {y_expected}"
        assert torch.equal(x_grad, grad_expected), f"{name} backward: {x_grad} != {grad_expected}"

    x = ar.view(2, 1, 4) + 10 * r
    check("copy", copy_to_tensor_model_parallel_region, x, mine.repeat(1, 1, 2), x, 3 * torch.ones(2, 1, 4))
    check(
        "reduce",
        reduce_from_tensor_model_parallel_region,
        x,
        mine.repeat(1, 1, 2),
        2 * ar.view(2, 1, 4) + 10,
        mine.repeat(1, 1, 2),
    )
    full = ar.view(2, 1, 4)
    check(
        "scatter",
        scatter_to_tensor_model_parallel_region,
        full,
        mine,
        full[..., 2 * r : 2 * r + 2],
        both_last,
    )
    check(
        "gather",
        gather_from_tensor_model_parallel_region,
        mine,
        full,
        both_last,
        full[..., 2 * r : 2 * r + 2],
    )

    seq = ar.view(4, 1, 2)
    check(
        "scatter_to_sequence",
        scatter_to_sequence_parallel_region,
        seq,
        mine,
        seq[2 * r : 2 * r + 2],
        both_first,
    )
    check(
        "gather_from_sequence",
        gather_from_sequence_parallel_region,
        mine,
        seq + 100 * r,
        both_first,
        (2 * seq + 100)[2 * r : 2 * r + 2],
    )
    check(
        "gather_from_sequence(tensor_parallel_output_grad=False)",
        lambda t, tp_group: gather_from_sequence_parallel_region(t, False, tp_group=tp_group),
        mine,
        seq + 100 * r,
        both_first,
        (seq + 100 * r)[2 * r : 2 * r + 2],
    )
    check(
        "reduce_scatter_to_sequence",
        reduce_scatter_to_sequence_parallel_region,
        seq + 100 * r,
        mine,
        (2 * seq + 100)[2 * r : 2 * r + 2],
        both_first,
    )


def _dropout_mask(n: int = 256) -> torch.Tensor:
    return F.dropout(torch.ones(n), p=0.5) != 0


def _check_rng(rank, world_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    model_parallel_seed(1234)
    tracker = get_rng_tracker()
    assert get_cuda_rng_tracker() is tracker

    outer_before = torch.get_rng_state()
    with tracker.fork():
        inside = _dropout_mask()
    assert torch.equal(torch.get_rng_state(), outer_before), "fork() did not restore the outer state"
    outside = _dropout_mask()

    saved = tracker.get_states()
    with tracker.fork():
        first = _dropout_mask()
    with tracker.fork():
        assert not torch.equal(_dropout_mask(), first), "the forked stream did not advance"
    tracker.set_states(saved)
    with tracker.fork():
        replay = _dropout_mask()
    assert torch.equal(first, replay), "set_states did not replay the same mask"
    return inside, outside


def _check_errors(rank, world_size):
    group = dist.group.WORLD
    config, init = _config(), nn.init.zeros_

    def raises(message, fn, *args, **kwargs):
        with pytest.raises(ValueError) as info:
            fn(*args, **kwargs)
        assert str(info.value) == message, f"{str(info.value)!r} != {message!r}"

    raises(
        "ColumnParallelLinear output_size (5) is not divisible by tensor_model_parallel_size (2)",
        ColumnParallelLinear,
        4,
        5,
        config=config,
        init_method=init,
        tp_group=group,
    )
    raises(
        "RowParallelLinear input_size (7) is not divisible by tensor_model_parallel_size (2)",
        RowParallelLinear,
        7,
        4,
        config=config,
        init_method=init,
        tp_group=group,
    )
    raises(
        "VocabParallelEmbedding num_embeddings (9) is not divisible by tensor_model_parallel_size (2)",
        VocabParallelEmbedding,
        9,
        4,
        init_method=init,
        config=config,
        tp_group=group,
    )
    raises(
        "RowParallelLinear with sequence_parallel=True needs input_is_parallel=True",
        RowParallelLinear,
        4,
        4,
        config=_config(True),
        init_method=init,
        tp_group=group,
    )
    raises(
        "cannot split the sequence (first) dimension (dim 0, size 3) of a tensor of shape (3, 2, 4) "
        "evenly over tensor_model_parallel_size (2)",
        scatter_to_sequence_parallel_region,
        torch.zeros(3, 2, 4),
        tp_group=group,
    )
    raises(
        "cannot split the sequence (first) dimension (dim 0, size 5) of a tensor of shape (5, 4) "
        "evenly over tensor_model_parallel_size (2)",
        reduce_scatter_to_sequence_parallel_region,
        torch.zeros(5, 4),
        tp_group=group,
    )
    raises(
        "cannot split the hidden (last) dimension (dim 1, size 3) of a tensor of shape (2, 3) "
        "evenly over tensor_model_parallel_size (2)",
        scatter_to_tensor_model_parallel_region,
        torch.zeros(2, 3),
        tp_group=group,
    )
    dist.barrier(group)  # still in step: nothing above reached a collective


def _check_round_trip(rank, world_size):
    group = dist.group.WORLD
    for shape, dim, stride in [((4, 6), 0, 1), ((4, 6), 1, 1), ((8, 3), 0, 2), ((2, 3, 8), -1, 2)]:
        full = torch.arange(float(torch.Size(shape).numel())).view(shape)
        local_shape = list(shape)
        local_shape[dim] //= TP
        param = nn.Parameter(torch.empty(local_shape))
        set_tensor_model_parallel_attributes(param, True, dim, stride)
        with torch.no_grad():
            param.copy_(shard_of(full, param, rank, TP))
        assert torch.equal(gather_full(param, group), full), (shape, dim, stride)
    # Initialisation slices one full master weight, so it does not depend on the TP size.
    model_parallel_seed(7, tp_group=group)
    layer = ColumnParallelLinear(4, 6, config=_config(), init_method=nn.init.normal_, tp_group=group)
    torch.manual_seed(7)
    assert torch.equal(gather_full(layer.weight, group), nn.init.normal_(torch.empty(6, 4)))
    replicated = nn.Parameter(torch.randn(3))
    set_tensor_model_parallel_attributes(replicated, False, -1, 1)
    assert torch.equal(shard_of(replicated.detach(), replicated, rank, TP), replicated.detach())
    assert torch.equal(gather_full(replicated, group), replicated.detach())


def _check_fp8_mlp(rank, world_size, case):
    """Column -> GELU -> Row with FP8 products (issue 28) at TP 2 equals the same FP8 MLP on one rank, to
    fp32 rounding: every TP rank casts with the whole tensor's scale (amaxes reduced over TP), and under
    sequence parallelism the input is cast after the all-gather. Two steps, so the delayed recipe's
    second one scales from its history. The blockwise recipe reduces nothing: with features per rank in
    multiples of 128 no block straddles two shards, so each rank casts its part of what one rank casts."""
    scaling, sequence_parallel = case.split("-")[0], case.endswith("-sp")
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    group, single = dist.group.WORLD, singles[rank]
    recipe = Fp8Recipe(format="hybrid", scaling=scaling, amax_history_len=2, amax_compute_algo="max")
    torch.manual_seed(3)
    s, h, f = (32, 128, 512) if scaling == "blockwise" else (32, 32, 64)
    w1, w2 = torch.randn(f, h) * 0.05, torch.randn(h, f) * 0.05
    models = {}
    for name, tp_group, config in (
        ("tp2", group, _config(sequence_parallel)),
        ("tp1", single, ModelParallelConfig()),
    ):
        fc1 = ColumnParallelLinear(
            h, f, config=config, init_method=_copy_init(w1), tp_group=tp_group, bias=False
        )
        fc2 = RowParallelLinear(
            f,
            h,
            config=config,
            init_method=_copy_init(w2),
            input_is_parallel=True,
            tp_group=tp_group,
            bias=False,
        )
        assert fc1.enable_fp8(recipe) is None and fc2.enable_fp8(recipe) is None
        models[name] = (fc1, fc2, tp_group)
    for step in range(2):
        x = torch.randn(s, 2, h) * (1 + step)
        dy = torch.randn(s, 2, h) * 1e-3
        out = {}
        for name, (fc1, fc2, tp_group) in models.items():
            split = name == "tp2" and sequence_parallel
            x_in = (x.chunk(TP, dim=0)[rank] if split else x).clone().requires_grad_()
            y, _ = fc2(F.gelu(fc1(x_in)[0]))
            y.backward(dy.chunk(TP, dim=0)[rank] if split else dy)
            grads = [gather_full(p, tp_group, tensor=p.grad) for p in (fc1.weight, fc2.weight)]
            if split:  # the whole sequence, as the single rank has it
                y, x_grad = (
                    gather_from_sequence_parallel_region(t, tp_group=tp_group) for t in (y, x_in.grad)
                )
            else:
                x_grad = x_in.grad
            out[name] = (y, x_grad, *grads)
            update_fp8_scales([fc1, fc2], tp_group)
            for p in (fc1.weight, fc2.weight):
                p.grad = None
        for what, a, b in zip(
            ("output", "input grad", "fc1 weight grad", "fc2 weight grad"), out["tp2"], out["tp1"]
        ):
            close(a, b, f"step {step} {what}", tol=1e-5)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


# Each TP layer against its single-device counterpart, at both values of the one option its check takes.
LAYER_CHECKS = [
    ("column_parallel_linear_matches_linear", _check_column, "gather_output", [True, False]),
    ("row_parallel_linear_matches_linear", _check_row, "input_is_parallel", [True, False]),
    ("column_row_mlp_matches_single_device", _check_mlp, "sequence_parallel", [False, True]),
    ("vocab_parallel_embedding_matches_embedding", _check_embedding, "reduce_scatter", [False, True]),
    ("vocab_parallel_cross_entropy_matches_torch", _check_cross_entropy, "label_smoothing", [0.0, 0.1]),
    (
        "linear_cross_entropy_matches_the_output_layer_and_torch",
        _check_linear_cross_entropy,
        "vocab_size",
        [7, 3],
    ),
    (
        "fp8_mlp_at_tp2_matches_tp1",
        _check_fp8_mlp,
        "recipe",
        ["tensorwise-sp", "delayed-nosp", "blockwise-sp"],
    ),
]


@pytest.mark.parametrize(
    "check, value",
    [
        pytest.param(check, value, id=f"{name}-{option}={value}")
        for name, check, option, values in LAYER_CHECKS
        for value in values
    ],
)
def test_tensor_parallel_layers_match_single_device(ranks, check, value):
    ranks(TP).run(check, value)


def test_mappings_forward_and_backward_do_what_their_names_say(ranks):
    ranks(TP).run(_check_mappings)


def _counted_reduction(rank, world_size):
    """A TP reduction outside and inside ``comm_time``'s counting (the timeline's ``TP`` total)."""
    x = torch.ones(1024)
    reduce_from_tensor_model_parallel_region(x, dist.group.WORLD)
    outside = comm_time.end()["TP"]
    comm_time.begin()
    out = reduce_from_tensor_model_parallel_region(x, dist.group.WORLD)
    assert torch.equal(out, torch.full((1024,), float(world_size)))
    return outside, comm_time.end()["TP"]


def test_a_tensor_parallel_reduction_is_counted_only_while_a_timeline_counts(ranks):
    for outside, counted in ranks(TP).run(_counted_reduction):
        assert outside == 0.0 and 0.0 < counted < 5.0


def test_rng_tracker_forks_per_rank_and_replays(ranks):
    (inside0, outside0), (inside1, outside1) = ranks(TP).run(_check_rng)
    assert torch.equal(outside0, outside1), "dropout outside fork() must match across TP ranks"
    assert not torch.equal(inside0, inside1), "dropout inside fork() must differ across TP ranks"


def test_non_divisible_sizes_raise_clear_errors(ranks):
    ranks(TP).run(_check_errors)


def test_shard_of_and_gather_full_round_trip(ranks):
    ranks(TP).run(_check_round_trip)


def _time_group_collectives(rank, world_size):
    return time_group_collectives(rank, world_size, torch.float32, units=1, repeats=2, dp_bytes=1 << 20)


def test_calibration_times_each_tp_collective_at_each_size(ranks):
    """``--profile-local``'s TP and DP collectives and ring attention's exchange
    (``planner/calibrate.py``) on real gloo ranks: every kind at group size 2 and each size of
    ``GROUP_BYTES``, the collectives also at a data-parallel bucket's size (``DP_BYTES``, here 1 MiB to
    keep the test cheap); seconds never
    negative, never less than a smaller size's; every rank returns the same figures (the slowest rank's
    medians). Two ranks: no other rank to compute out of step, so no ``ring_exchange_behind``."""
    found = ranks(TP).run(_time_group_collectives)
    assert found[0] == found[1] and ("ring_exchange", 2) in found[0]
    assert sorted(found[0]) == [(kind, 2) for kind in sorted(GROUP_KINDS)]
    for (kind, _), points in found[0].items():
        assert [size for size, _ in points] == list(GROUP_BYTES) + ([1 << 20] if kind in DP_KINDS else [])
        seconds = [t for _, t in points]
        assert min(seconds) >= 0 and seconds == sorted(seconds)

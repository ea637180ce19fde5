"""``--init-model-with-meta-device`` in one process: the model it builds is the model built whole, and under
ZeRO-3 a rank never holds its whole model while building it.

* Equivalence: GPT (LayerNorm, GELU, tied embeddings), LLaMA (RMSNorm, SwiGLU, RoPE) and LLaMA with MoE
  layers (stacked experts, router), with no wrapper and wrapped under each sharding strategy at DP1:
  every parameter and every buffer bit for bit, and nothing left on the meta device.
* Memory: at DP4 (PyTorch's fake process group: one process plays data-parallel rank 0 of four; building
  the model and its buffers communicates nothing) the peak of live tensor storage while the model is
  built and wrapped under ``optim_grads_params``. Counted by :class:`StorageBytes`, a
  ``TorchDispatchMode`` that remembers (weakly) every storage an ATen op outputs and, after every op,
  sums what each still holds: ``nbytes()`` read then, so a storage freed by ``resize_(0)`` (the buckets
  free that way, outside the dispatcher) stops counting at the next op, and one given memory again
  counts from the op that writes it, which comes before anything reads it. Every allocation is an op's
  output (``empty``, ``zeros``, ``clone``, ``normal_`` on a new tensor), so nothing allocated escapes it; a
  storage that existed before the mode was entered is not counted (nothing of the model does). Also with
  the dense linear weights held in FP8, whose fp32 initial values a rank keeps only for the weights it
  steps part of.
* ``pretrain()`` at DP1 under ``--use-megatron-fsdp`` with ``--fp8-param-gather`` (weights held in FP8,
  cast after materialisation): the losses of the run built whole, bit for bit; and a run resumed with
  ``--load`` continues with the losses of the uninterrupted one (the loaded values win); the checkpoint
  does not record the flag (generation and conversion build the model whole).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from core import parallel_state as ps
from core.device import materialize_module
from core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from core.tensor_parallel.fp8 import held_weight
from core.tensor_parallel.fp8_params import hold_weights_in_fp8, is_stack
from models.gpt import GPTModel
from tests.support.configs import tiny_config
from tests.support.fp8_run import TINY
from tests.support.pretrain_run import pretrain_keeping_models
from training.checkpoint import open_checkpoint

VOCAB, SEQ = 64, 16
MODELS = {
    "gpt": ("gpt", {}),
    "llama": ("llama", {}),
    "llama moe": ("llama", {"num_moe_experts": 4, "moe_router_topk": 2, "moe_layer_freq": 1}),
}
STRATEGIES = (None, "no_shard", "optim", "optim_grads", "optim_grads_params")


def _built(meta: bool, strategy: str | None, kind: str, **overrides) -> torch.nn.Module:
    """The model, with every parameter whole: unwrapped (``None``) or wrapped under ``strategy``."""
    config = tiny_config(kind, init_model_with_meta_device=meta, **overrides)
    model = GPTModel(config, VOCAB, SEQ)
    if config.fp8_param_gather:
        hold_weights_in_fp8([model])
    if strategy is None:
        materialize_module(model, torch.device("cpu"))
        return model
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=strategy != "no_shard", data_parallel_sharding_strategy=strategy
    )
    wrapped = DistributedDataParallel(config, ddp, model)
    wrapped.finish_param_sync()  # ZeRO-3: gather the shards to compare them whole
    return wrapped.module


@pytest.mark.parametrize("strategy", STRATEGIES, ids=[str(s) for s in STRATEGIES])
@pytest.mark.parametrize("model", list(MODELS))
def test_a_model_built_on_the_meta_device_is_the_model_built_whole(model, strategy):
    kind, overrides = MODELS[model]
    whole, meta = _built(False, strategy, kind, **overrides), _built(True, strategy, kind, **overrides)
    assert not any(t.is_meta for t in (*meta.parameters(), *meta.buffers()))
    for mine, theirs in (
        (meta.named_parameters(), whole.named_parameters()),
        (meta.named_buffers(), whole.named_buffers()),
    ):
        mine, theirs = dict(mine), dict(theirs)
        assert mine.keys() == theirs.keys()
        different = [
            n for n in mine if mine[n].dtype != theirs[n].dtype or not torch.equal(mine[n], theirs[n])
        ]
        assert different == []
    assert "rotary_pos_emb.inv_freq" in dict(meta.named_buffers()) or kind == "gpt"


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_weights_and_expert_stacks_held_in_fp8_are_cast_on_the_meta_device_as_built_whole(strategy, recipe):
    """``--fp8-param-gather`` with routed experts: each held weight's E4M3 bytes and scales (one per
    expert of a stack; blockwise, one per 128 x 128 tile) come out of the meta device's deferred cast as
    from the cast of the whole model."""
    width = 128 if recipe == "blockwise" else 64  # blockwise: whole tiles
    fp8 = {"fp8": "e4m3", "fp8_recipe": recipe, "fp8_param_gather": True, "ffn_hidden_size": width}
    overrides = {**MODELS["llama moe"][1], **fp8}
    whole, meta = (_built(m, strategy, "llama", hidden_size=width, **overrides) for m in (False, True))
    held = {n: p for n, p in whole.named_parameters() if held_weight(p) is not None}
    stacks = [n for n, p in held.items() if is_stack(p)]
    assert all(held_weight(p).tiled == (recipe == "blockwise") for p in held.values())
    assert len(held) == 8 and len(stacks) == 4  # 2 layers: QKV and out, the experts' fc1 and fc2 stacks
    for name, param in meta.named_parameters():
        if name in held:
            mine, theirs = held_weight(param), held_weight(held[name])
            assert param.dtype == torch.float8_e4m3fn
            assert torch.equal(param.view(torch.uint8), held[name].view(torch.uint8)), name
            assert torch.equal(mine.scale_inv, theirs.scale_inv), name


class StorageBytes(TorchDispatchMode):
    """The peak of the bytes held by every storage an op output while the mode is on (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = tensor.untyped_storage()
                self.storages.setdefault(id(storage), weakref.ref(storage))
        live = 0
        for key, ref in list(self.storages.items()):
            storage = ref()
            if storage is None:
                del self.storages[key]
            else:
                live += storage.nbytes()
        self.peak = max(self.peak, live)
        return out


def _peak_building_zero3(meta: bool, fp8: bool) -> tuple[int, int, dict[str, int]]:
    """(peak bytes while building and wrapping, the whole model's bytes in its dtype (fp32), what the
    wrapper keeps); ``fp8``: the dense linear weights held in FP8 (``--fp8-param-gather``)."""
    held = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param_gather": True} if fp8 else {}
    config = tiny_config("llama", num_layers=8, hidden_size=64, init_model_with_meta_device=meta, **held)
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    with StorageBytes() as tracker:
        model = GPTModel(config, VOCAB, SEQ)
        assert len(hold_weights_in_fp8([model])) == (32 if fp8 else 0)  # 4 a layer
        wrapped = DistributedDataParallel(config, ddp, model)
    whole = sum(p.numel() for p in model.parameters()) * torch.float32.itemsize
    return tracker.peak, whole, wrapped.persistent_bytes()


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8 weights"])
def test_under_zero3_a_rank_never_holds_its_whole_model_while_building_it(fp8):
    """DP4, fp32, 8 layers: the peak is this rank's 1/4 of the parameters and of the gradients, the one
    bucket (layer) being laid out with its gradient buffer, and one parameter's fp32 initial tensor; with
    the weights held in FP8, also the fp32 values of the weights this rank steps part of, which the
    optimizer's main copy starts from (a weight it steps none of lets them go). Built whole first, the
    peak is the whole model and more."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        ps.initialize_model_parallel()
        whole_peak, whole, kept = _peak_building_zero3(False, fp8)
        meta_peak, same, kept_too = _peak_building_zero3(True, fp8)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    print(
        f"DP4 ZeRO-3 build{' (FP8 weights)' if fp8 else ''}: model {whole} B; peak {whole_peak} B "
        f"({whole_peak / whole:.2f}x) built whole, {meta_peak} B ({meta_peak / whole:.2f}x) on the meta device"
    )
    assert same == whole and kept_too == kept and kept["grads"] <= whole / 4 * 1.05
    assert whole_peak > whole
    assert meta_peak < (0.9 if fp8 else 0.8) * whole


FSDP_FP8 = "--train-iters 3 --use-megatron-fsdp --fp8-param-gather"


def _losses(flags: str) -> list[float]:
    state, _, _ = pretrain_keeping_models(f"{TINY} {flags}".split())
    return [float(step["lm loss"]) for step in state.losses]


@pytest.mark.slow  # three runs of pretrain(), 8 s; the README suite trains on the meta device in tests/dist
def test_pretrain_on_the_meta_device_with_fp8_weights_gives_the_losses_and_resumes(tmp_path):
    whole = _losses(f"{FSDP_FP8} --save {tmp_path} --save-interval 2")
    assert _losses(f"{FSDP_FP8} --init-model-with-meta-device") == whole
    resumed = _losses(f"{FSDP_FP8} --init-model-with-meta-device --load {tmp_path} --ckpt-step 2")
    assert resumed == whole[2:]
    # How a run builds its model is not part of the model: generation and conversion build it whole.
    assert "init_model_with_meta_device" not in open_checkpoint(str(tmp_path)).manifest["model"]["config"]


def test_a_meta_parameter_nothing_can_initialise_is_refused_by_name_not_left_uninitialised():
    """Built without initialisation (``perform_initialization=False``), a meta parameter has no values to
    be given: the wrapper refuses it instead of handing out uninitialised memory."""
    config = tiny_config("gpt", init_model_with_meta_device=True, perform_initialization=False)
    with pytest.raises(ValueError) as error:
        DistributedDataParallel(config, DistributedDataParallelConfig(), GPTModel(config, VOCAB, SEQ))
    assert str(error.value) == (
        "decoder.final_layernorm.bias (32,) is on the meta device with nothing to initialise it: "
        "init_model_with_meta_device needs a model that initialises by name (perform_initialization=True)"
    )

"""Megatron's tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

A column-parallel linear splits the output features over the TP ranks and a row-parallel linear
the input features, so the pair ``Column -> elementwise -> Row`` (an MLP, or attention's QKV and
output projections) needs one all-reduce forward and one backward. With sequence parallelism the
activations around the pair are split along the sequence instead of replicated: the Column layer
all-gathers its input and the Row layer reduce-scatters its output, the same traffic as the
all-reduce but with 1/TP of the activation memory outside the pair.

Weights are created empty on ``param_device(config)`` (``current_device()``, or the meta device under
``init_model_with_meta_device``) in ``config.params_dtype`` and initialised from a full fp32 master
weight built on the CPU and sliced (Megatron's CPU initialisation): the result
does not depend on the TP size as long as every TP rank's default generator is seeded alike
(``model_parallel_seed`` does that), so runs with different splits start from the same model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from core.device import param_device
from core.model_parallel_config import ModelParallelConfig
from core.tensor_parallel.fp8 import Fp8Recipe, Fp8State, fp8_linear, fp8_shape_problem
from core.tensor_parallel.grad_accumulation import (
    embedding_with_grad_accumulation,
    linear_with_grad_accumulation,
)
from core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from core.tensor_parallel.utils import (
    divide,
    resolve_tp_group,
    set_tensor_model_parallel_attributes,
    shard_of,
    tp_rank,
    tp_world_size,
    vocab_range,
)

InitMethod = Callable[[torch.Tensor], object]
"""Fills a full (unsharded) fp32 weight in place, e.g. ``functools.partial(nn.init.normal_, std=0.02)``."""


def _new_param(shape: tuple[int, ...], config: ModelParallelConfig) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=param_device(config), dtype=config.params_dtype))


def _init_from_full(
    weight: torch.Tensor, full_shape: tuple[int, ...], init_method: InitMethod, rank: int, world_size: int
) -> None:
    """Fill ``weight`` with its shard of a full fp32 CPU master weight initialised by ``init_method``."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        weight.copy_(shard_of(master, weight, rank, world_size).to(weight.dtype))


def _should_init(perform_initialization: bool | None, config: ModelParallelConfig) -> bool:
    """An explicit flag wins; otherwise ``config.perform_initialization`` if the config has one."""
    if perform_initialization is not None:
        return perform_initialization
    return bool(getattr(config, "perform_initialization", True))


class _ParallelLinear(nn.Module):
    """What the column- and row-parallel linears share: the TP group, the config's switches, a weight
    initialised from its full master, and a zeroed bias."""

    @property
    def keep_out_of_compile(self) -> bool:
        """Under ``--compile`` the layer runs eagerly when it communicates (TP > 1), casts to FP8 or
        accumulates into ``main_grad`` itself: its matmuls, collectives and weight gradients stay outside
        the compiled regions (see ``core.transformer.compile``). Otherwise it is one ``F.linear`` and
        compiles with its neighbours, so a TP=1 layer is one region instead of five."""
        return (
            tp_world_size(self.tp_group) > 1
            or self.fp8_state is not None
            or self.gradient_accumulation_fusion
        )

    def _fp8_sharding(self) -> tuple[bool, bool, bool]:
        """Whether (input, weight, output gradient) are split over the TP ranks."""
        raise NotImplementedError

    def _local_features(self) -> tuple[int, int]:
        """This rank's (input, output) features: the FP8 product's K and N."""
        raise NotImplementedError

    def enable_fp8(self, recipe: Fp8Recipe) -> str | None:
        """Run this layer's products in FP8 under ``recipe``; returns why not (and leaves it in high
        precision) when a CUDA FP8 product could not take its shapes."""
        in_features, out_features = self._local_features()
        why = fp8_shape_problem(recipe, in_features, out_features, "its features per rank")
        if why is not None:
            return why
        self.fp8_state = Fp8State(recipe, self.tp_group, self._fp8_sharding())
        return None

    def _product(
        self, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, accumulate: bool
    ) -> torch.Tensor:
        """``input_ @ weight^T + bias``: in FP8, accumulating into ``main_grad``, or plain."""
        if self.fp8_state is not None and weight is self.weight:
            return fp8_linear(input_, weight, bias, self.fp8_state, accumulate)
        if accumulate:
            return linear_with_grad_accumulation(input_, weight, bias)
        return F.linear(input_, weight, bias)

    def _setup(
        self,
        input_size: int,
        output_size: int,
        config: ModelParallelConfig,
        tp_group: ProcessGroup | None,
        perform_initialization: bool | None,
    ) -> tuple[int, bool]:
        """The common attributes; returns (TP world size, whether to initialise)."""
        self.config = config
        self.tp_group = resolve_tp_group(tp_group)
        world_size = tp_world_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel = config.sequence_parallel and world_size > 1
        self.gradient_accumulation_fusion = getattr(config, "gradient_accumulation_fusion", False)
        self.fp8_state: Fp8State | None = None  # set by enable_fp8: the products run in FP8
        return world_size, _should_init(perform_initialization, config)

    def _add_weight(
        self, shape: tuple[int, int], partition_dim: int, stride: int, init_method: InitMethod | None
    ) -> None:
        """``weight``: this rank's ``shape``, split along ``partition_dim``, filled with its shard of
        the full master weight ``init_method`` makes (None: left uninitialised)."""
        self.weight = _new_param(shape, self.config)
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim, stride)
        if init_method is not None:
            full_shape = (self.output_size, self.input_size)
            rank, world_size = tp_rank(self.tp_group), tp_world_size(self.tp_group)
            _init_from_full(self.weight, full_shape, init_method, rank, world_size)

    def _add_bias(self, size: int | None, init: bool, tp_attributes: tuple[bool, int, int]) -> None:
        """``bias`` of ``size`` (None: no bias) with ``set_tensor_model_parallel_attributes``'s
        (is_parallel, dim, stride), zeroed when initialising."""
        if size is None:
            self.register_parameter("bias", None)
            return
        self.bias = _new_param((size,), self.config)
        set_tensor_model_parallel_attributes(self.bias, *tp_attributes)
        if init:
            with torch.no_grad():
                self.bias.zero_()


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A``'s output rows (and ``b``) split over the TP ranks.

    Each rank computes its slice of the output features: ``[*, input_size] -> [*, output_size / tp]``,
    or the full ``output_size`` with ``gather_output=True``. With ``config.sequence_parallel`` the
    input arrives split along dim 0 (``[s / tp, b, h]``) and is all-gathered first.
    ``forward`` returns ``(output, bias)`` like Megatron: ``bias`` is returned (and not added) only
    with ``skip_bias_add``, so a caller can fuse it into the next elementwise op.
    ``skip_weight_param_allocation`` creates no weight; ``forward`` then takes one (tied output
    layers pass the word embedding).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        perform_initialization: bool | None = None,
        tp_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        world_size, init = self._setup(input_size, output_size, config, tp_group, perform_initialization)
        self.output_size_per_partition = divide(output_size, world_size, "ColumnParallelLinear output_size")
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        if skip_weight_param_allocation:
            self.weight = None
        else:
            shape = (self.output_size_per_partition, input_size)
            self._add_weight(shape, 0, stride, init_method if init else None)
        self._add_bias(self.output_size_per_partition if bias else None, init, (True, 0, stride))

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_`` ``[s, b, input_size]`` (``[s / tp, ...]`` with sequence parallelism) -> ``(output, bias)``."""
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True; "
                    "pass the weight to forward()"
                )
            weight = self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"ColumnParallelLinear got a weight of shape {tuple(weight.shape)}, expected {expected}"
            )

        total_input = self.whole_input(input_)
        bias = None if self.skip_bias_add else self.bias
        output = self._product(total_input, weight, bias, self.fuses_accumulation_of(weight))
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output, tp_group=self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def _fp8_sharding(self) -> tuple[bool, bool, bool]:
        split = tp_world_size(self.tp_group) > 1  # the input is whole (all-gathered under SP)
        return (False, split, split)

    def _local_features(self) -> tuple[int, int]:
        return self.input_size, self.output_size_per_partition

    def whole_input(self, input_: torch.Tensor) -> torch.Tensor:
        """What this rank multiplies: ``input_`` all-gathered along the sequence under sequence
        parallelism; in backward its gradient is summed over the TP ranks (reduce-scattered with SP)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tp_group=self.tp_group)
        return copy_to_tensor_model_parallel_region(input_, tp_group=self.tp_group)

    def fuses_accumulation_of(self, weight: torch.Tensor) -> bool:
        """Whether ``weight``'s gradient goes straight into its ``main_grad`` under
        ``gradient_accumulation_fusion``: this layer's own weight, or a borrowed one (a tied output
        layer's) whose lender accumulates its own gradient too and reports the weight
        (``grad_reported_by_embedding``, :mod:`core.tensor_parallel.grad_accumulation`). Any other
        borrowed weight gets its gradient through autograd."""
        if not self.gradient_accumulation_fusion:
            return False
        return weight is self.weight or getattr(weight, "grad_reported_by_embedding", False)


class RowParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A``'s input columns split over the TP ranks; ``b`` is replicated.

    Each rank multiplies its slice of the input features (``input_is_parallel=True``: the input is
    already split, typically a ColumnParallelLinear's output; otherwise it is split here) and the
    partial products are summed by an all-reduce, or by a reduce-scatter along dim 0 with
    ``config.sequence_parallel``. The bias is added once, after the sum. Under sequence
    parallelism each rank's bias gradient covers only its sequence slice, so the bias is marked
    ``sequence_parallel = True`` for the gradient finaliser to all-reduce over TP (as in Megatron).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod,
        bias: bool = True,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        stride: int = 1,
        perform_initialization: bool | None = None,
        tp_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        world_size, init = self._setup(input_size, output_size, config, tp_group, perform_initialization)
        self.input_size_per_partition = divide(input_size, world_size, "RowParallelLinear input_size")
        self.tp_size = world_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel=True needs input_is_parallel=True")
        shape = (output_size, self.input_size_per_partition)
        self._add_weight(shape, 1, stride, init_method if init else None)
        self._add_bias(output_size if bias else None, init, (False, -1, 1))
        if self.bias is not None:
            self.bias.sequence_parallel = self.sequence_parallel

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_`` ``[s, b, input_size / tp]`` (or full, see ``input_is_parallel``) -> ``(output, bias)``."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, tp_group=self.tp_group)
        if self.tp_size == 1:
            # Nothing to sum over: the bias goes into the matmul (one addmm instead of a second pass).
            bias = None if self.skip_bias_add else self.bias
            return self._linear(input_parallel, bias), (self.bias if self.skip_bias_add else None)
        partial = self._linear(input_parallel, None)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, tp_group=self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, tp_group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None

    def _linear(self, input_: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._product(input_, self.weight, bias, self.gradient_accumulation_fusion)

    def _fp8_sharding(self) -> tuple[bool, bool, bool]:
        split = self.tp_size > 1  # the output gradient is whole: the output was summed over TP
        return (split, split, False)

    def _local_features(self) -> tuple[int, int]:
        return self.input_size_per_partition, self.output_size


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the vocabulary (rows) split evenly over the TP ranks.

    Each rank looks up the tokens it owns, writes zeros for the others, and the partial results are
    summed: an all-reduce giving ``[b, s, h]`` on every rank, or, with
    ``reduce_scatter_embeddings=True``, a transpose to ``[s, b, h]`` and a reduce-scatter along the
    sequence, which hands the first transformer layer its sequence-parallel input directly
    (Megatron's behaviour, transpose included).

    ``gradient_accumulation_fusion`` (Trident; off by default, as the embedding has no such option in
    Megatron): the weight's gradient goes straight into its ``main_grad``, each token's row added
    where it falls (:func:`~core.tensor_parallel.grad_accumulation.embedding_with_grad_accumulation`),
    instead of a vocabulary-sized gradient per microbatch. The model turns it on where nothing else
    adds to the weight's gradient through autograd in the same backward.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod,
        config: ModelParallelConfig,
        reduce_scatter_embeddings: bool = False,
        perform_initialization: bool | None = None,
        tp_group: ProcessGroup | None = None,
        gradient_accumulation_fusion: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.tp_group = resolve_tp_group(tp_group)
        world_size = tp_world_size(self.tp_group)
        rank = tp_rank(self.tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = divide(
            num_embeddings, world_size, "VocabParallelEmbedding num_embeddings"
        )
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, rank, world_size)
        self.reduce_scatter_embeddings = reduce_scatter_embeddings

        self.weight = _new_param((self.num_embeddings_per_partition, embedding_dim), config)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        if _should_init(perform_initialization, config):
            _init_from_full(self.weight, (num_embeddings, embedding_dim), init_method, rank, world_size)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Token ids ``[b, s]`` -> ``[b, s, h]``, or ``[s / tp, b, h]`` with ``reduce_scatter_embeddings``."""
        if self.num_embeddings_per_partition == self.num_embeddings:
            output = self._lookup(input_)
        else:
            foreign = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = torch.where(foreign, 0, input_ - self.vocab_start_index)
            output = self._lookup(local_ids).masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output = output.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output, tp_group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, tp_group=self.tp_group)

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.gradient_accumulation_fusion:
            return embedding_with_grad_accumulation(local_ids, self.weight)
        return F.embedding(local_ids, self.weight)

"""Mixture of experts (Megatron's ``megatron.core.transformer.moe``).

``moe_config`` (the config fields), ``router`` (top-k gate and balancing losses), ``token_dispatcher``
(alltoall, allgather), ``experts`` (looped or grouped), ``moe_layer`` (the layer), ``moe_logging``
(the losses for the log), ``groups`` (its process groups). Import from those modules: this package
is imported by the transformer config itself, before the layers exist.
"""

"""Megatron's flags: the parser, the flags checked together, the schema they come from, config files.

Megatron's two public calls are here as in ``megatron.training.arguments``:
``parse_args`` (:mod:`training.arguments.parser`) and ``validate_args``
(:mod:`training.arguments.checks`).
"""

from training.arguments.checks import validate_args
from training.arguments.parser import parse_args, transformer_config_from_args

__all__ = ["parse_args", "transformer_config_from_args", "validate_args"]

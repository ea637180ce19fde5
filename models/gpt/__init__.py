"""GPT-style decoder models: GPT-2, LLaMA and Mixtral are configurations of one GPTModel."""

from models.gpt.gpt_model import GPTModel, pipeline_layout
from models.gpt.parallelize import ParallelGPT, gpt_provider, parallelize_gpt
from models.gpt.presets import gpt2_config, llama_config, mixtral_config, preset

__all__ = [
    "GPTModel",
    "ParallelGPT",
    "gpt2_config",
    "gpt_provider",
    "llama_config",
    "mixtral_config",
    "parallelize_gpt",
    "pipeline_layout",
    "preset",
]

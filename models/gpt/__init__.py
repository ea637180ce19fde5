"""GPT-style decoder models: GPT-2 and LLaMA are configurations of one GPTModel."""

from models.gpt.gpt_model import GPTModel, build_model_chunks, pipeline_layout
from models.gpt.presets import gpt2_config, llama_config, preset

__all__ = ["GPTModel", "build_model_chunks", "gpt2_config", "llama_config", "pipeline_layout", "preset"]

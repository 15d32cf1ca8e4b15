"""Generation with the model as it trained: the base checkpoint streamed into NF4 plus a PEFT LoRA adapter folder
(ours, or one PEFT or Unsloth wrote for a supported model), KV-cached greedy or sampled decoding, stop strings,
chat templates, JSONL prompts and answers (``recipes/generate.py``, ``tune-ext generate`` / ``tune-ext chat``)."""

from torchtune_ext.generation._generate import (
    Answer,
    Generator,
    SamplingSettings,
    check_chat_prompt,
    kv_cache_bytes,
    sample_next_token,
    weight_bytes,
)
from torchtune_ext.generation._model import build_model_for, load_model_with_adapter, open_base_checkpoint
from torchtune_ext.generation._recipe import GenerationRecipe, read_prompts, run_generation

__all__ = [
    "Answer",
    "GenerationRecipe",
    "Generator",
    "SamplingSettings",
    "build_model_for",
    "check_chat_prompt",
    "kv_cache_bytes",
    "load_model_with_adapter",
    "open_base_checkpoint",
    "read_prompts",
    "run_generation",
    "sample_next_token",
    "weight_bytes",
]

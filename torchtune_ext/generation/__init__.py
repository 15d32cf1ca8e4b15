"""Generation with the model as it trained: the base streamed into NF4 plus a PEFT LoRA adapter."""

from torchtune_ext.generation._model import build_model_for, load_model_with_adapter, open_base_checkpoint

__all__ = ["build_model_for", "load_model_with_adapter", "open_base_checkpoint"]

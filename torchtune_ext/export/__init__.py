"""Exports of a trained model: GGUF for llama.cpp / Ollama."""

from torchtune_ext.export._gguf import GGUF_TYPES, export_gguf

__all__ = ["GGUF_TYPES", "export_gguf"]

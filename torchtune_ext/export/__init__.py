"""Exporting what a run trained: the adapter merged into its HF base (``tune-ext merge``) and GGUF for llama.cpp /
Ollama (``tune-ext export gguf``)."""

from torchtune_ext.export._gguf import GGUF_TYPES, export_gguf
from torchtune_ext.export._gguf_cli import add_export_subcommand
from torchtune_ext.export._merge import merge_adapter

__all__ = ["GGUF_TYPES", "add_export_subcommand", "export_gguf", "merge_adapter"]

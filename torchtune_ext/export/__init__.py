"""Exporting what a run trained: the adapter merged into its HF base (``tune-ext merge``)."""

from torchtune_ext.export._merge import merge_adapter

__all__ = ["merge_adapter"]

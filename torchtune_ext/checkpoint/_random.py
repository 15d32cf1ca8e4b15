"""Random-weight HF checkpoints of any torchtune architecture, written one tensor at a time: the embedded tiny default's
base model, and real-shaped models for benchmarks (no download).

Why not transformers' ``AutoModelForCausalLM.from_config(config).save_pretrained(folder)``: it builds and
initializes the whole model in host memory, so its peak grows with the model where this one's grows with the
largest tensor, and it is slower (both measured in BENCHMARKS.md); it draws the weights with its own init from the
global RNG, so the tiny default's weights, and every number the tests pin on them, would change; and transformers
is an optional dependency (the ``hf`` extra), while the tiny default needs this in a core install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import torch
from torch import nn

from torchtune_ext.checkpoint import _safetensors
from torchtune_ext.checkpoint._atomic import atomic_directory
from torchtune_ext.checkpoint._checkpointer import base_keys
from torchtune_ext.checkpoint._hf import HFConverter, write_hf_model_files

PathLike = Union[str, Path]
_EMBEDDING_KEYS = ("tok_embeddings.weight", "output.weight")


@torch.no_grad()
def write_random_hf_checkpoint(
    checkpoint_dir: PathLike,
    model: nn.Module,
    model_type: str,
    hf_config: Dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    embedding_std: Optional[float] = None,
    max_shard_size_mb: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Path:
    """Writes a random-weight HF checkpoint for a torchtune architecture, one tensor at a time.

    Weights ~ N(0, std) (embeddings: ``embedding_std``), biases ~ N(0, std), norm scales = 1. Used for the tiny
    default and for memory benchmarks.

    Args:
        checkpoint_dir (PathLike): output folder (written atomically).
        model (nn.Module): the architecture, typically built on the meta device (no memory); adapters are ignored.
        model_type (str): checkpointer model type (decides the HF layout).
        hf_config (Dict[str, Any]): written as ``config.json``.
        dtype (torch.dtype): weights' dtype.
        seed (int): RNG seed.
        std (float): init standard deviation.
        embedding_std (Optional[float]): standard deviation of the token embedding (and untied output); None: std.
        max_shard_size_mb (Optional[int]): None: one ``model.safetensors``; else shards + index.
        progress (Optional[Callable[[str], None]]): called with each HF key as it is written.

    Returns:
        Path: ``checkpoint_dir``.
    """
    converter = HFConverter.for_model(model_type, model)
    base = base_keys(model)
    generator = torch.Generator().manual_seed(seed)

    def make(key: str, shape) -> torch.Tensor:
        if key.endswith(".scale"):
            return torch.ones(shape, dtype=dtype)
        scale = embedding_std if embedding_std is not None and key in _EMBEDDING_KEYS else std
        return torch.empty(shape, dtype=torch.float32).normal_(0, scale, generator=generator).to(dtype)

    groups = converter.hf_groups({k: v.shape for k, v in base.items()})  # Phi's fused HF tensors
    specs = [_safetensors.TensorSpec(hf_key, shape, dtype) for hf_key, (_, shape) in groups.items()]
    shards = [specs] if max_shard_size_mb is None else _safetensors.plan_shards(specs, max_shard_size_mb * 1024**2)

    def tensors(shard):
        for spec in shard:
            if progress is not None:
                progress(spec.name)
            yield converter.group_to_hf({k: make(k, base[k].shape) for k in groups[spec.name][0]})

    with atomic_directory(checkpoint_dir) as tmp:
        write_hf_model_files(tmp, shards, tensors, hf_config, dtype, single_file=max_shard_size_mb is None)
    return Path(checkpoint_dir)

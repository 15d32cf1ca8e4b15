"""One RoPE cache per model, sized for the run's sequences and grown on demand.

torchtune's ``lora_qwen2`` builder gives every attention layer its own RoPE module, each with an fp32 cache for the
builder's ``max_seq_len`` (32,768 positions for Qwen 2.5: 0.875 GiB over Qwen2.5-1.5B's 28 layers); its Llama builders
share one module, sized for up to 131,072 positions. :func:`share_rope_` makes every attention layer with the same
RoPE settings use one module, sizes its cache for the run (``tokenizer.max_seq_len``) and rebuilds it larger when a
longer sequence comes. A cache row depends only on its position, so the outputs are those of the unshared model.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch._subclasses.functional_tensor import FunctionalTensor
from torchtune.models.gemma2._attention import Gemma2Attention
from torchtune.modules import MultiHeadAttention

_SETTINGS_TO_IGNORE = ("training", "max_seq_len", "is_cache_built")


def _settings_key(rope: nn.Module) -> Tuple[Any, ...]:
    """What makes two RoPE modules compute the same table: their type and scalar settings (not the cache length)."""
    scalars = {
        k: v
        for k, v in vars(rope).items()
        if isinstance(v, (int, float, str, bool)) and k not in _SETTINGS_TO_IGNORE and not k.startswith("_")
    }
    return (type(rope), tuple(sorted(scalars.items())))


def _cache_rows(rope: nn.Module) -> Optional[int]:
    cache = getattr(rope, "cache", None)
    return cache.shape[0] if isinstance(cache, torch.Tensor) and not cache.is_meta else None


def _resize(rope: nn.Module, max_seq_len: int) -> None:
    """Sets the positions the cache holds, rebuilding a built cache (on its own device; on meta, its shape)."""
    rope.max_seq_len = max_seq_len
    cache = getattr(rope, "cache", None)
    if not isinstance(cache, torch.Tensor) or cache.shape[0] == max_seq_len:
        return
    if cache.is_meta:
        meta = torch.empty((max_seq_len, *cache.shape[1:]), dtype=cache.dtype, device="meta")
        rope.register_buffer("cache", meta, persistent=False)
    else:
        rope.build_rope_cache(max_seq_len)


def _grow_on_demand(rope: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Forward pre-hook: rebuilds the cache for the next power of two when a sequence is longer than it."""
    rows = _cache_rows(rope)
    if rows is None:
        return
    x = args[0] if args else kwargs["x"]
    needed = x.size(1)
    input_pos = kwargs.get("input_pos")
    # Every layer of one forward gets the same input_pos tensor: its maximum (a host sync) is read once per forward,
    # again only if the tensor changed in place (its version counter).
    if input_pos is not None and not isinstance(input_pos, FunctionalTensor):  # traced for compile: no values
        checked = getattr(rope, "_checked_input_pos", None)
        if checked is None or checked[0] is not input_pos or checked[1] != input_pos._version:
            rope._checked_input_pos = (input_pos, input_pos._version)
            needed = max(needed, int(input_pos.max()) + 1)
    if needed > rows:
        _resize(rope, 1 << (needed - 1).bit_length())


def _is_rope(module: Any) -> bool:
    return isinstance(module, nn.Module) and hasattr(module, "build_rope_cache") and hasattr(module, "max_seq_len")


def share_rope_(model: nn.Module, max_seq_len: Optional[int] = None) -> List[nn.Module]:
    """Makes the attention layers of ``model`` that have the same RoPE settings share one RoPE module.

    Each shared module's cache holds ``max_seq_len`` positions (None: what the first layer's module was built for)
    and is rebuilt for the next power of two when a longer sequence (or a later ``input_pos``) comes. Call it before
    the cache is built (on the meta device, e.g. right after the builder) or after: a built cache is rebuilt at the
    new length. Applying it again only resizes.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` (any family: Llama, Qwen, ...).
        max_seq_len (Optional[int]): positions to cache, e.g. the run's ``tokenizer.max_seq_len``.

    Returns:
        List[nn.Module]: the distinct RoPE modules left (one for every family torchtune_ext builds).

    Raises:
        ValueError: if ``max_seq_len`` is not a positive integer.
    """
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
        raise ValueError(f"max_seq_len={max_seq_len!r} must be a positive integer (the RoPE positions to cache).")
    shared: Dict[Tuple[Any, ...], nn.Module] = {}
    for module in model.modules():
        if isinstance(module, (MultiHeadAttention, Gemma2Attention)) and _is_rope(module.pos_embeddings):
            rope = shared.setdefault(_settings_key(module.pos_embeddings), module.pos_embeddings)
            module.pos_embeddings = rope
    for rope in shared.values():
        if max_seq_len is not None:
            _resize(rope, max_seq_len)
        if not getattr(rope, "_grows_on_demand", False):
            rope.register_forward_pre_hook(_grow_on_demand, with_kwargs=True)
            rope._grows_on_demand = True
    return list(shared.values())


def hf_rope_scaling(hf_config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """An HF Phi ``config.json``'s LongRoPE settings in :func:`lora_phi`'s ``rope_scaling`` form.

    Args:
        hf_config (Dict[str, Any]): the config (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``).

    Returns:
        Optional[Dict[str, Any]]: None when the checkpoint has plain RoPE.
    """
    scaling = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return None
    if "original_max_position_embeddings" in hf_config:
        scaling.setdefault("original_max_position_embeddings", hf_config["original_max_position_embeddings"])
    return scaling

"""State-dict transforms: a full-vocabulary checkpoint to a pruned model's keys, and the trained rows back."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch
from torch.distributed.tensor import DTensor

from torchtune_ext.modules.vocab_pruning._module import PRUNED_OUTPUT_PREFIX, KeptIds, validate_kept_ids
from torchtune_ext.nf4 import NF4Tensor, check_float_dtype, dequantize_nf4


def dense_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(tensor, NF4Tensor):
        return dequantize_nf4(tensor, dtype)
    return tensor.detach().to(dtype)


def kept_rows(tensor: torch.Tensor, kept: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kept rows of a (possibly NF4) tensor, as a dense ``dtype`` copy on the tensor's device."""
    return dense_copy(tensor, dtype)[kept.to(tensor.device)].clone()


def _check_full_tensors(state_dict: Mapping[str, Any], what: str) -> None:
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            raise ValueError(f"{what}[{key!r}] is a DTensor; gather the full state dict first (get_full_state_dict).")


def _is_row_key(name: str) -> bool:
    """Whether an output param (name relative to the output module) has one row per vocabulary entry."""
    return name in ("weight", "bias", "lora_b.weight", "magnitude")


def prune_state_dict(
    state_dict: Mapping[str, Any], kept_ids: KeptIds, *, dtype: torch.dtype = torch.float32
) -> Dict[str, Any]:
    """Turns a full-vocabulary torchtune state dict into the keys and shapes of a pruned model.

    ``tok_embeddings.weight`` and the per-token rows of ``output.*`` keep their ``kept_ids`` rows (as dense
    ``dtype`` copies, NF4 dequantized); ``output.*`` moves to ``tok_embeddings.output.*``; the other keys are
    unchanged. Use it to load a base checkpoint into a pruned model built on the meta device (e.g. before
    ``load_from_full_model_state_dict`` in a distributed recipe).

    Args:
        state_dict (Mapping[str, Any]): full state dict with torchtune keys.
        kept_ids (KeptIds): the kept token ids.
        dtype (torch.dtype): dtype of the pruned tensors. Default: fp32.

    Returns:
        Dict[str, Any]: the pruned state dict (a new dict; untouched values are shared).

    Raises:
        ValueError: if ``tok_embeddings.weight`` is missing, on invalid ``kept_ids`` or a DTensor value.
    """
    check_float_dtype(dtype)
    _check_full_tensors(state_dict, "state_dict")
    if "tok_embeddings.weight" not in state_dict:
        raise ValueError("state_dict has no 'tok_embeddings.weight'; is it a torchtune-format model state dict?")
    kept = validate_kept_ids(kept_ids, state_dict["tok_embeddings.weight"].shape[0])
    pruned: Dict[str, Any] = {}
    for key, value in state_dict.items():
        if key == "tok_embeddings.weight":
            pruned[key] = kept_rows(value, kept, dtype)
        elif key.startswith("output."):
            name = key[len("output.") :]
            pruned[PRUNED_OUTPUT_PREFIX + name] = (
                kept_rows(value, kept, dtype) if _is_row_key(name) else dense_copy(value, dtype)
            )
        else:
            pruned[key] = value
    return pruned


def _full_rows(
    key: str, pruned: torch.Tensor, base: Optional[torch.Tensor], kept: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """``base`` (or zeros) with the rows at ``kept`` replaced by ``pruned``, in the wider of the two dtypes."""
    if pruned.shape[0] != kept.numel():
        raise ValueError(
            f"state_dict[{key!r}] has {pruned.shape[0]} rows but there are {kept.numel()} kept ids; are these "
            "the kept ids the model was pruned with?"
        )
    if base is None:
        full = pruned.new_zeros((vocab_size, *pruned.shape[1:]))
    else:
        full = dense_copy(base, torch.promote_types(base.dtype, pruned.dtype)).clone()  # trained precision
        if tuple(full.shape[1:]) != tuple(pruned.shape[1:]) or full.shape[0] != vocab_size:
            raise ValueError(
                f"base tensor for {key!r} has shape {tuple(full.shape)}, incompatible with the pruned "
                f"{tuple(pruned.shape)} and vocab_size {vocab_size}."
            )
    full[kept.to(full.device)] = pruned.detach().to(device=full.device, dtype=full.dtype)
    return full


def export_full_vocab_state_dict(
    state_dict: Mapping[str, Any], base_state_dict: Mapping[str, Any], kept_ids: KeptIds
) -> Dict[str, Any]:
    """Writes the trained rows of a pruned model's state dict back into the base's full-vocabulary tensors.

    The result has the keys of an unpruned torchtune model: ``tok_embeddings.weight`` (and ``output.*`` when
    untied) have ``V`` rows, the kept ones from ``state_dict`` and the others from ``base_state_dict``, in the
    base's dtype; other keys pass through. Works on model state dicts, merged checkpoints
    (``get_merged_lora_ckpt`` first) and adapter state dicts alike. Per-token tensors the base lacks (e.g.
    ``output.lora_b.weight``) get zero rows outside the kept set, LoRA's initial value.

    Args:
        state_dict (Mapping[str, Any]): full (gathered) state dict of the pruned model.
        base_state_dict (Mapping[str, Any]): base checkpoint with torchtune keys; only
            ``tok_embeddings.weight`` and ``output.*`` are read.
        kept_ids (KeptIds): the ids the model was pruned with (``VocabPruning.kept_ids``).

    Returns:
        Dict[str, Any]: the full-vocabulary state dict.

    Raises:
        ValueError: if the base has no ``tok_embeddings.weight``, on invalid ``kept_ids``, row counts that do not
            match them, or DTensor values.
    """
    _check_full_tensors(state_dict, "state_dict")
    base_embedding = base_state_dict.get("tok_embeddings.weight")
    if base_embedding is None:
        raise ValueError("base_state_dict has no 'tok_embeddings.weight'; pass the base model's torchtune state dict.")
    vocab_size = base_embedding.shape[0]
    kept = validate_kept_ids(kept_ids, vocab_size)
    full: Dict[str, Any] = {}
    for key, value in state_dict.items():
        if key == "tok_embeddings.weight":
            full[key] = _full_rows(key, value, base_embedding, kept, vocab_size)
        elif key.startswith(PRUNED_OUTPUT_PREFIX):
            name = key[len(PRUNED_OUTPUT_PREFIX) :]
            base = base_state_dict.get("output." + name)
            if _is_row_key(name):
                full["output." + name] = _full_rows(key, value, base, kept, vocab_size)
            else:
                full["output." + name] = value if base is None else value.to(base.dtype)
        else:
            full[key] = value
    return full


def is_vocab_key(key: str) -> bool:
    """
    Args:
        key (str): a torchtune state-dict key of an unpruned model.

    Returns:
        bool: whether vocab pruning replaces it (``tok_embeddings.weight`` and ``output.*``).
    """
    return key == "tok_embeddings.weight" or key.startswith("output.")


def vocab_state_dict(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """The entries of a full-vocabulary torchtune state dict that :func:`export_full_vocab_state_dict` reads.

    Keep these from the base checkpoint (``tok_embeddings.weight`` and ``output.*``) instead of the whole base
    state dict, to export at the end of training.

    Args:
        state_dict (Mapping[str, Any]): a base state dict with torchtune keys.

    Returns:
        Dict[str, Any]: its ``tok_embeddings.weight`` and ``output.*`` entries (the same tensors, not copies).
    """
    return {k: v for k, v in state_dict.items() if is_vocab_key(k)}

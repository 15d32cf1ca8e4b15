"""Checks that a base checkpoint is the model the config builds, before any weight is read: real weight files (not
git-lfs pointers), and ``config.json``'s model type, attention heads and tied/untied output against the model;
and that no merged tensor written is non-finite.

The checkpoint's keys and shapes are checked by :meth:`QLoRAHFCheckpointer.validate` itself (it calls
:func:`check_checkpoint_matches` first).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from torchtune_ext._finite import NonFiniteError, all_finite
from torchtune_ext.checkpoint import _safetensors
from torchtune_ext.checkpoint._gemma2 import gemma2_config_problems
from torchtune_ext.checkpoint._phi3 import phi_rope_problems
from torchtune_ext.checkpoint._qwen3 import qwen3_config_problems

#: checkpointer.model_type -> the HF ``model_type`` values of its checkpoints.
HF_MODEL_TYPES: Dict[str, Sequence[str]] = {
    "LLAMA2": ("llama",),
    "LLAMA3": ("llama",),
    "LLAMA3_2": ("llama",),
    "MISTRAL": ("mistral",),
    "QWEN2": ("qwen2",),
    "QWEN3": ("qwen3",),
    "GEMMA2": ("gemma2",),
    "PHI3_MINI": ("phi3",),
}
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"
_LFS_POINTER_MAX_BYTES = 1024


def lfs_pointer_size(path: Path) -> Optional[int]:
    """The size of the real file that a git-lfs pointer stands for (-1 if it does not say), or None if ``path`` is
    not a git-lfs pointer file.

    Args:
        path (Path): a file.

    Returns:
        Optional[int]: see above.
    """
    if path.stat().st_size > _LFS_POINTER_MAX_BYTES:
        return None
    text = path.read_bytes()
    if not text.startswith(_LFS_POINTER):
        return None
    match = re.search(rb"^size (\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else -1


def check_not_lfs_pointers(paths: Sequence[Path]) -> None:
    """Fails on weight files that are git-lfs pointers (a clone without git-lfs) instead of the weights.

    Raises:
        ValueError: naming every pointer file, the size of the file it stands for, and ``git lfs pull``.
    """
    pointers = []
    for path in paths:
        size = lfs_pointer_size(path)
        if size is not None:
            real = f", standing for a {size / 1e9:.2f} GB file" if size >= 0 else ""
            pointers.append(f"{path.name} ({path.stat().st_size} bytes{real})")
    if pointers:
        folder = paths[0].parent
        verb = "is a git-lfs pointer" if len(pointers) == 1 else "are git-lfs pointers"
        raise ValueError(
            f"{', '.join(pointers)} in {folder} {verb}, not the weights: the model was cloned without git-lfs. "
            f"Run `git lfs pull` in {folder} (or download it with `tune download <hf-repo> --output-dir <dir>`)."
        )


def _builder_name(builder: Optional[str]) -> str:
    return f"the model builder {builder}" if builder else "the configured model (`model:`)"


def check_hf_config(
    hf_config: Dict[str, Any], model_type: str, model: nn.Module, builder: Optional[str], has_lm_head: bool
) -> None:
    """Checks ``config.json`` against the checkpointer's model type and the built model.

    Args:
        hf_config (Dict[str, Any]): the checkpoint's ``config.json``.
        model_type (str): ``checkpointer.model_type``.
        model (nn.Module): the model (on meta).
        builder (Optional[str]): its builder, for the message.
        has_lm_head (bool): whether the checkpoint's files hold ``lm_head.weight``.

    Raises:
        ValueError: listing every disagreement, naming both sides.
    """
    problems = _model_type_problems(hf_config, model_type) + _size_problems(hf_config, model)
    problems += _tying_problems(hf_config, model, has_lm_head)
    problems += qwen3_config_problems(hf_config, model_type, model)  # settings no weight shape shows
    problems += gemma2_config_problems(hf_config, model)  # settings no weight shape shows
    problems += phi_rope_problems(hf_config, model)  # RoPE is in no weight's shape
    if problems:
        raise ValueError(
            f"The checkpoint's config.json does not match {_builder_name(builder)} (checkpointer.model_type="
            f"{model_type}): " + "; ".join(problems) + ". Pick the builder (`model._component_`) and "
            "checkpointer.model_type of this checkpoint, or the checkpoint of this model."
        )


def _model_type_problems(hf_config: Dict[str, Any], model_type: str) -> List[str]:
    expected = HF_MODEL_TYPES.get(model_type, ())
    found = hf_config.get("model_type")
    if found is None or not expected or found in expected:
        return []
    architectures = hf_config.get("architectures") or []
    return [
        f"config.json has model_type {found!r}"
        + (f" ({', '.join(architectures)})" if architectures else "")
        + f" but checkpointer.model_type={model_type} reads {' or '.join(repr(e) for e in expected)} checkpoints"
    ]


def _size_problems(hf_config: Dict[str, Any], model: nn.Module) -> List[str]:
    """The attention geometry, which the weights' shapes do not show (other sizes fail the shape check)."""
    attn = model.layers[0].attn
    heads = hf_config.get("num_attention_heads")
    sizes = {
        "num_attention_heads": (heads, attn.num_heads, "attention heads"),
        "num_key_value_heads": (hf_config.get("num_key_value_heads", heads), attn.num_kv_heads, "key/value heads"),
    }
    return [
        f"config.json has {key}={found} but the model has {built} {what}"
        for key, (found, built, what) in sizes.items()
        if found is not None and int(found) != int(built)
    ]


def _tying_problems(hf_config: Dict[str, Any], model: nn.Module, has_lm_head: bool) -> List[str]:
    builder_tied = not any(name == "output.weight" for name, _ in model.named_parameters())
    said = hf_config.get("tie_word_embeddings")
    checkpoint_tied = bool(said) if said is not None else not has_lm_head
    if checkpoint_tied == builder_tied:
        return []
    evidence = ", ".join(
        ([f"config.json tie_word_embeddings: {str(said).lower()}"] if said is not None else [])
        + [f"lm_head.weight {'in' if has_lm_head else 'not in'} its files"]
    )
    if builder_tied:
        return [
            f"the checkpoint has its own output projection ({evidence}) but the model ties its output to the token "
            "embedding (training would drop lm_head and the merged model would lack it): use the builder of the "
            "untied model"
        ]
    return [
        f"the checkpoint ties its output projection to the token embedding ({evidence}) but the model has its own "
        "output weight: use the builder of the tied model"
    ]


def check_checkpoint_matches(checkpointer: Any, model: nn.Module, builder: Optional[str] = None) -> None:
    """The checks above for a :class:`QLoRAHFCheckpointer`, from file headers only: no git-lfs pointer, then
    ``config.json`` against the model (its keys and shapes are checked by ``validate`` after this).

    Args:
        checkpointer (Any): the checkpointer (``checkpoint_paths``, ``hf_config``, ``model_type``).
        model (nn.Module): the model (on meta).
        builder (Optional[str]): its builder, for the messages.

    Raises:
        ValueError: see :func:`check_not_lfs_pointers` and :func:`check_hf_config`.
    """
    paths = list(checkpointer.checkpoint_paths)
    check_not_lfs_pointers(paths)
    has_lm_head = any("lm_head.weight" in _safetensors.read_header(path) for path in paths)
    check_hf_config(checkpointer.hf_config, checkpointer.model_type, model, builder, has_lm_head)


def check_finite_merged(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """Passes a merged tensor on to be written, or fails if it holds a NaN or an infinity.

    Args:
        key (str): its torchtune key.
        tensor (torch.Tensor): the merged tensor, in the merged model's dtype.

    Returns:
        torch.Tensor: ``tensor``.

    Raises:
        NonFiniteError: naming the tensor (nothing of the merged model is kept).
    """
    if not all_finite(tensor):
        raise NonFiniteError(
            f"The merged model's {key} holds NaN or infinite values in {tensor.dtype} (the adapter's values overflow "
            "it): the merged model is not written. Train with a lower optimizer.lr, or export in a wider dtype."
        )
    return tensor

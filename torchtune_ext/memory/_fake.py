"""Fake CPU copies of meta-built models, and the accelerator code path of our NF4 linear on CPU tensors.

Fake CUDA tensors cannot run backward on a machine without a GPU (the autograd engine needs a CUDA device guard),
so estimates run on fake CPU tensors: shapes, dtypes and storage sizes without data. Three things differ between a
CPU and a CUDA run of our NF4 code, and :func:`accelerator_code_path` makes a CPU run take the CUDA branch of each:
``linear_nf4`` on CPU dequantizes large weights slab by slab into reused buffers (on an accelerator it dequantizes
the whole weight, computes, frees it), ``dequantize_nf4`` on CPU decodes in 4M-value chunks into a huge-page
buffer (on an accelerator in one pass), and on x86 CPUs the native kernels decode into the output's dtype directly
and multiply a few tokens without a dequantized weight (an accelerator decodes in the weight's dtype, then casts).
"""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Dict, Iterator, Tuple

import torch
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import torchtune_ext.modules.low_precision as low_precision
from torchtune_ext.nf4 import cpu_kernels_off

# The switches of our NF4 code's CPU-only branches, and the values that turn those branches off: in the module that
# defines linear_nf4 (slab-wise CPU matmuls), and in the one that defines the dequantize_nf4 it calls (chunked CPU
# decoding into huge pages; lookup-table caches keyed by device).
_LINEAR_SWITCHES = {"_CPU_SLAB_NUMEL": 1 << 62, "_SMALL_BATCH_TOKENS": 0}
_CODEC_SWITCHES = {"_CPU_CHUNK_NUMEL": 1 << 62}
_CODEC_ALLOCATOR = "empty_with_huge_pages"
# Per-(dtype, device) lookup-table caches: fake tables must not outlive an estimate, real ones must not enter it.
_TABLE_CACHES = ("_QUAD_LUTS", "_CODE_LUTS")


def _empty(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _nf4_code_modules() -> Tuple[ModuleType, ModuleType]:
    """The module defining ``linear_nf4`` and the one defining the ``dequantize_nf4`` it calls."""
    linear_module = sys.modules[low_precision.linear_nf4.__module__]
    return linear_module, sys.modules[linear_module.dequantize_nf4.__module__]


@contextmanager
def accelerator_code_path() -> Iterator[None]:
    """Within: our NF4 code on CPU tensors runs its accelerator branch (whole-weight dequantization, no slabs, no
    native CPU kernels).

    Also empties the NF4 lookup-table caches for the duration (restored after), so the tables a run builds are
    counted, and fake tables never reach a later real run.

    Raises:
        RuntimeError: if the NF4 code no longer has the switches this relies on (the estimate would otherwise
            follow the CPU branch).
    """
    linear_module, codec_module = _nf4_code_modules()
    switches = [(linear_module, name, value) for name, value in _LINEAR_SWITCHES.items()]
    switches += [(codec_module, name, value) for name, value in _CODEC_SWITCHES.items()]
    switches.append((codec_module, _CODEC_ALLOCATOR, _empty))
    caches = [getattr(codec_module, name, None) for name in _TABLE_CACHES]
    missing = [f"{m.__name__}.{name}" for m, name, _ in switches if not hasattr(m, name)]
    missing += [f"{codec_module.__name__}.{name}" for name, c in zip(_TABLE_CACHES, caches) if not isinstance(c, dict)]
    if missing:
        raise RuntimeError(
            f"cannot select the accelerator branch of the NF4 code on CPU tensors: {missing} not found; update "
            "torchtune_ext/memory/_fake.py to the NF4 code's CPU switches"
        )
    saved = [(module, name, getattr(module, name)) for module, name, _ in switches]
    saved_caches = [dict(cache) for cache in caches]
    try:
        for module, name, value in switches:
            setattr(module, name, value)
        for cache in caches:
            cache.clear()
        with cpu_kernels_off():
            yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for cache, content in zip(caches, saved_caches):
            cache.clear()
            cache.update(content)


def _fake_tensor(tensor: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake CPU tensor like ``tensor`` (meta or real, plain or a traceable subclass such as NF4Tensor)."""
    if not tensor.is_meta:
        return mode.from_tensor(tensor)
    with mode:
        if is_traceable_wrapper_subclass(tensor):
            # The subclass moves its inner tensors itself (NF4Tensor's _to_copy); fake mode makes them fake.
            return tensor.to("cpu")
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


def _rebuild_rope_caches(model: nn.Module, mode: FakeTensorMode) -> None:
    """RoPE caches of a meta-built model are meta or unbuilt (Llama 3.1's) and their init reads values (its
    scaling), so they are built for real on the CPU (at most tens of MiB, briefly), then made fake."""
    for module in model.modules():
        if not hasattr(module, "rope_init"):
            continue
        with torch.device("cpu"):
            module.rope_init()
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[name] = mode.from_tensor(buffer)


def to_fake_model(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of ``model`` whose params and buffers are fake CPU tensors of ``mode`` (``model`` is left as it is).

    Args:
        model (nn.Module): a model on the meta device (or real); shared params stay shared (tied embeddings).
        mode (FakeTensorMode): the fake mode the copy's tensors belong to.

    Returns:
        nn.Module: the fake copy, same classes, names, dtypes and ``requires_grad``.
    """
    memo: Dict[int, torch.Tensor] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(_fake_tensor(param, mode), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = _fake_tensor(buffer, mode)
    fake = copy.deepcopy(model, memo)
    if any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers())):
        _rebuild_rope_caches(fake, mode)
    return fake

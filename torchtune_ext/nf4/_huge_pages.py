"""Large CPU outputs backed by transparent huge pages.

A fresh multi-megabyte CPU tensor comes from ``mmap`` and pays one page fault per 4 KiB page on first write; for a
dequantized 4096x4096 fp32 weight those faults cost as much as the dequantization itself. PyTorch asks the kernel for
2 MiB pages only when the user sets ``THP_MEM_ALLOC_ENABLE=1``; this asks for them for the one tensor it allocates,
with the same ``madvise(MADV_HUGEPAGE)`` hint. Where the hint is unavailable (not Linux, THP disabled) the tensor is
an ordinary one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Optional, Sequence

import torch

_HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_libc: Optional[ctypes.CDLL] = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def empty_with_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, its whole 2 MiB pages hinted to be huge pages (Linux).

    Args:
        shape (Sequence[int]): the tensor's shape.
        dtype (torch.dtype): its dtype.

    Returns:
        torch.Tensor: an uninitialised CPU tensor.
    """
    out = torch.empty(shape, dtype=dtype)
    if torch.compiler.is_compiling():  # a traced tensor has no address to hint
        return out
    begin = out.data_ptr()
    end = begin + out.numel() * out.element_size()
    first = -(-begin // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    last = end // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if sys.platform.startswith("linux") and last - first >= _HUGE_PAGE_BYTES:
        _madvise()(first, last - first, _MADV_HUGEPAGE)  # a refused hint leaves ordinary pages
    return out

"""The allocations a memory estimate counts analytically, not as storages: the CUDA and inductor attention
backward kernels' internal workspace, and the blocks torch's caching host allocator reserves for pinned memory."""

from __future__ import annotations

from typing import Optional

import torch

_aten = torch.ops.aten


def pinned_block_bytes(nbytes: int) -> int:
    """The block torch's caching host allocator reserves for ``nbytes`` of pinned memory: the next power of two
    (``c10::llvm::PowerOf2Ceil`` in ``CachingHostAllocator``).

    Args:
        nbytes (int): the tensor's bytes.

    Returns:
        int: the block's bytes (0 for 0).
    """
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def attention_backward_workspace(query: torch.Tensor, backend: Optional[str] = None) -> int:
    """Bytes the CUDA attention backward kernels allocate inside the op (not as outputs), for ``query`` of shape
    ``[batch, heads, seq, head_dim]``: FlashAttention-2 (``"flash"``: 16-bit inputs on sm80+) keeps an fp32 dQ
    accumulator ``[batch, seq rounded to 128, heads, head_dim rounded to 32]`` and fp32 softmax row sums ``[batch,
    heads, seq rounded to 128]``; the memory-efficient kernel (``"efficient"``) keeps the fp32 row sums ``[batch,
    heads, seq]`` and, for 16-bit inputs (fp16 on a T4), an fp32 dQ accumulator ``[batch, heads, seq, head_dim]``
    (fp32 inputs accumulate in dQ itself). The CPU kernel's own scratch is not the GPU's, so this is counted
    analytically.

    Args:
        query (torch.Tensor): the attention query.
        backend (Optional[str]): ``"flash"`` or ``"efficient"`` (a device profile's ``sdpa_backend``); None: by
            dtype, as on sm80+ (flash for 16-bit, efficient for fp32).

    Returns:
        int: bytes.

    Raises:
        ValueError: for the ``"math"`` backend, whose O(seq^2) intermediates this estimate does not run.
    """
    batch, heads, seq, head_dim = query.shape
    sixteen_bit = query.dtype != torch.float32
    backend = backend or ("flash" if sixteen_bit else "efficient")
    if backend == "math":
        raise ValueError(
            "the math SDPA kernel (O(seq^2) memory) is not estimated: use a dtype the device's fused "
            "attention kernels take (fp32 or fp16 below sm80)"
        )
    if backend == "efficient":
        return 4 * batch * heads * seq * ((head_dim + 1) if sixteen_bit else 1)
    seq_rounded = _round_up(seq, 128)
    return 4 * batch * seq_rounded * heads * _round_up(head_dim, 32) + 4 * batch * heads * seq_rounded


def flex_attention_backward_workspace(query: torch.Tensor) -> int:
    """Bytes inductor's flex attention backward allocates besides its outputs, for ``query`` of shape ``[batch,
    heads, seq, head_dim]``: ``delta = (out * grad_out).sum(-1)`` in fp32, ``[batch, heads, seq]``
    (``torch/_inductor/kernel/flex/flex_attention.py``); the kernel accumulates dQ in registers, not in memory.

    Args:
        query (torch.Tensor): the attention query.

    Returns:
        int: bytes.
    """
    batch, heads, seq, _ = query.shape
    return 4 * batch * heads * seq


# Attention backward ops and the position of their query argument; their kernel-internal workspace is added for the
# duration of the op (see attention_backward_workspace).
ATTENTION_BACKWARD = {
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 1,
    _aten._scaled_dot_product_flash_attention_backward.default: 1,
    _aten._scaled_dot_product_efficient_attention_backward.default: 1,
}

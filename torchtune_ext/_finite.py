"""Non-finite values: the error a diverged run (or a broken checkpoint) stops with, and a cheap test for them."""

from __future__ import annotations

import torch

from torchtune_ext.config import UserFacingError


class NonFiniteError(UserFacingError, RuntimeError):
    """Training produced, or was given, NaN or infinite values; the run stops before writing any of them (its message
    is the report: the entry points print it without a traceback, exit code 1)."""


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite, from one fp32 sum (a NaN or an infinity makes it non-finite;
    finite values too large to sum in fp32, beyond 1e29 or so, count as non-finite too), without a tensor-sized
    temporary.

    Args:
        tensor (torch.Tensor): a float tensor (any other dtype is finite).

    Returns:
        bool: True if all values are finite.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    return bool(torch.isfinite(tensor.detach().sum(dtype=torch.float32)))

"""fp32 matrix products on CPU through oneDNN, where ``torch.mm`` goes to MKL.

PyTorch's CPU ``torch.mm`` in fp32 calls MKL's sgemm, which does not run its AVX-512 kernels on AMD CPUs and runs a
batch of a few rows as one matrix-vector product per row; oneDNN, built into the same PyTorch (its bf16 ``torch.mm``
already goes there), picks its kernels from the CPU's features. Same fp32 arithmetic (no reduced-precision math
unless the user sets ``torch.backends.mkldnn.matmul.fp32_precision``), another summation order, so every CPU fp32
product of our layers (NF4 and dense bases, LoRA adapters, the loss's output projection) goes through :func:`mm_t`:
the NF4 and dense paths of a layer compute alike. Products of fewer than :data:`MIN_ROWS` rows (a decoded token)
stay with ``torch.mm``, faster there; ``torch.backends.mkldnn.flags(enabled=False)`` turns oneDNN off, and it is
used on x86 CPUs only. Timings: BENCHMARKS.md, "Peers".
"""

from __future__ import annotations

import platform
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

#: products with fewer rows (tokens) than this use ``torch.mm``.
MIN_ROWS = 4
_available: Optional[bool] = None


def _onednn_available() -> bool:
    global _available
    if _available is None:  # measured on x86 only (other CPUs' oneDNN builds sit on other libraries)
        _available = (
            platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
    return _available and torch._C._get_mkldnn_enabled()


def use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`mm_t` computes ``x @ weight.T`` with oneDNN (CPU, fp32, 2-D, at least :data:`MIN_ROWS` rows,
    no empty dimension; not for fake tensors or while compiling: the memory estimate runs the step on fake CPU
    tensors for a GPU, which never takes this path).

    Args:
        x (torch.Tensor): the left factor.
        weight (torch.Tensor): the right factor, transposed.

    Returns:
        bool: True for oneDNN, False for ``torch.mm``.
    """
    # compiled graphs and the memory estimate (fake tensors) model the step a GPU runs: torch.mm; compiling is asked
    # first (dynamo folds it, and cannot trace is_fake)
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or is_fake(x) or is_fake(weight):
        return False
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] < MIN_ROWS or x.shape[1] == 0 or weight.shape[0] == 0:
        return False
    return _onednn_available()


def mm_t(x: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T``, not differentiable: oneDNN where :func:`use_onednn`, else ``torch.mm``.

    Args:
        x (torch.Tensor): ``(n, k)``, any strides.
        weight (torch.Tensor): ``(m, k)``, any strides (``w.t()`` gives ``x @ w``).
        out (Optional[torch.Tensor]): ``(n, m)`` to write into (may be a strided view; oneDNN's result is copied).

    Returns:
        torch.Tensor: ``(n, m)`` (``out`` if given).
    """
    if not use_onednn(x, weight):
        return torch.mm(x, weight.t(), out=out) if out is not None else torch.mm(x, weight.t())
    result = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return result if out is None else out.copy_(result)


class _Linear(torch.autograd.Function):
    """``x @ weight.T`` (``x`` 2-D) and its gradients, every product through :func:`mm_t`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        return mm_t(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        x, weight = ctx.saved_tensors
        grad_x = mm_t(grad, weight.t()) if ctx.needs_input_grad[0] else None
        grad_weight = mm_t(grad.t(), x.t()) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), differentiable, its products through :func:`mm_t` where
    :func:`use_onednn` (so that a dense layer computes as our NF4 layers do), else ``F.linear`` itself.

    Args:
        x (torch.Tensor): ``(..., in_dim)``.
        weight (torch.Tensor): ``(out_dim, in_dim)``.

    Returns:
        torch.Tensor: ``(..., out_dim)``.
    """
    flat = x.reshape(-1, x.shape[-1])
    if not use_onednn(flat, weight):
        return F.linear(x, weight)
    return _Linear.apply(flat, weight).view(*x.shape[:-1], weight.shape[0])

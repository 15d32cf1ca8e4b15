"""Reductions across ranks that work on CUDA/NCCL and CPU/gloo alike: sums, gradients of replicated params, the global
gradient norm over sharded and replicated params together."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ext.distributed._utils import group_device


def all_reduce_grads(params: Sequence[nn.Parameter]) -> None:
    """Sums the gradients of replicated params over all ranks, in fp32, so every rank steps identically.

    A sum, as FSDP's reduce-scatter of the sharded params does in :func:`shard_model` (``set_gradient_divide_factor
    (1.0)``): the recipes divide the loss by the global token count, so each rank's gradient is already its share of
    the global mean, and replicated and sharded params take the same steps. A param without a gradient on this rank
    joins with zeros (every rank must join every all-reduce).

    Args:
        params (Sequence[nn.Parameter]): replicated params that require grad (see :func:`replicated_params`).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads]).to(group_device())
    dist.all_reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad).to(grad.device))
        offset += grad.numel()


@torch.no_grad()
def grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """The global 2-norm of the gradients of sharded (DTensor) and replicated params together.

    DTensor shards contribute their local sum of squares, summed over ranks; replicated gradients (identical on
    every rank) are counted once.

    Args:
        params (Iterable[nn.Parameter]): params whose ``grad`` to include.

    Returns:
        torch.Tensor: a 0-dim fp32 tensor on the CPU, equal on every rank (inf/nan if a gradient is).
    """
    params = list(params)
    # Summed where the gradients are, in the same order as one at a time, then one copy to the host (not one each).
    sharded, replicated = _sum_of_squares(params, sharded=True), _sum_of_squares(params, sharded=False)
    if dist.is_initialized():
        sharded = all_reduce_sum(sharded)
    return (sharded + replicated).sqrt().float()


def _sum_of_squares(params: Iterable[nn.Parameter], sharded: bool) -> torch.Tensor:
    """The fp64 sum of squares of the (local shards of) sharded or replicated gradients, on the CPU."""
    total = None
    for param in params:
        grad = param.grad
        if grad is None or isinstance(grad, DTensor) != sharded:
            continue
        square = (grad.to_local() if sharded else grad).double().pow(2).sum()
        total = square if total is None else total + square.to(total.device)
    zero = torch.zeros((), dtype=torch.float64)
    return zero if total is None else zero + total.cpu()


@torch.no_grad()
def clip_grad_norm_(params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips gradients of sharded and replicated params by their global norm (torch's ``clip_grad_norm_`` cannot mix
    them); on one rank without sharded params it is torch's ``clip_grad_norm_``.

    Args:
        params (Sequence[nn.Parameter]): params to clip.
        max_norm (float): maximum total norm (``inf`` only measures it).

    Returns:
        torch.Tensor: the total norm before clipping (0-dim).
    """
    params = list(params)
    several_ranks = dist.is_initialized() and dist.get_world_size() > 1
    if not several_ranks and not any(isinstance(p, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    total = grad_norm(params)
    coef = float(max_norm) / (float(total) + 1e-6)
    if math.isfinite(float(total)) and coef < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coef)
    return total


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sums a small tensor over all ranks (the collective runs where the backend needs it), returned on the CPU.

    Args:
        value (torch.Tensor): the local value.

    Returns:
        torch.Tensor: the global sum (the value itself without a process group).
    """
    if not dist.is_initialized():
        return value.detach().cpu()
    reduced = value.detach().to(group_device()).clone()
    dist.all_reduce(reduced)
    return reduced.cpu()

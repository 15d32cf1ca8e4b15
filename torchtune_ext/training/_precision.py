"""Compute dtypes for QLoRA recipes: fp32 (T4 and other GPUs without bf16), bf16, and fp16 with loss scaling.

fp16 computes in fp16 while the adapters stay fp32 ("master" weights, so small updates are not lost), and the
loss is scaled dynamically (``torch.amp.GradScaler``): a step whose gradients overflow is skipped, the scale
backs off, and :class:`LossScaler` counts the skipped steps for the logs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Iterable, Optional, Set

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from torchtune_ext._dtype import parse_dtype


def default_adapter_dtype(dtype: torch.dtype, adapter_dtype: Optional[str] = None) -> torch.dtype:
    """The adapters' param dtype: fp32 master adapters under fp16, else the compute dtype, unless overridden.

    Args:
        dtype (torch.dtype): compute dtype.
        adapter_dtype (Optional[str]): explicit override ("fp32", "bf16", "fp16").

    Returns:
        torch.dtype: the adapter dtype.

    Raises:
        ValueError: on fp16 adapters with fp16 compute (GradScaler cannot unscale fp16 gradients).
    """
    if adapter_dtype is not None:
        chosen = parse_dtype(adapter_dtype, what="adapter_dtype")
        if chosen == torch.float16:
            raise ValueError("adapter_dtype=fp16 is not supported: use adapter_dtype=fp32 (the default with fp16).")
        return chosen
    return torch.float32 if dtype == torch.float16 else dtype


class LossScaler:
    """Dynamic loss scaling for fp16, or a pass-through for fp32/bf16, with a count of skipped steps.

    The default initial scale is 2**10, not torch's 2**16: the recipes back-propagate token-count-weighted
    losses (summed, not averaged, over a batch's tokens, as torchtune's recipes do for gradient accumulation), so
    the gradient of each token's logits is ``scale * (p - y)``, which overflows fp16 (max 65504) at 2**16.

    Args:
        enabled (bool): scale (fp16) or not.
        device (torch.device): the training device.
        init_scale (float): initial scale. Default: 2**10.
        growth_interval (int): steps without overflow before the scale doubles. Default: 2000.
        min_scale (float): the floor: a run whose scale falls below it after skipped steps stops
            (:class:`~torchtune_ext.training.NonFiniteGuard`). Default: 2**-10, 20 halvings below the default
            initial scale; by then even unscaled fp16 gradients overflowed again and again.

    Raises:
        ValueError: if ``min_scale`` is not positive.
    """

    _grad_scaler_class = torch.amp.GradScaler

    def __init__(
        self,
        enabled: bool,
        device: torch.device,
        init_scale: float = 2.0**10,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-10,
    ):
        if not min_scale > 0:
            raise ValueError(f"loss_scaler.min_scale={min_scale} must be positive.")
        self.enabled = enabled
        self.min_scale = float(min_scale)
        self.skipped_steps = 0
        self._unscaled: Set[int] = set()  # ids of the optimizers unscaled since their last step
        self._scaler = self._grad_scaler_class(
            device.type, init_scale=init_scale, growth_interval=growth_interval, enabled=enabled
        )

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """
        Args:
            loss (torch.Tensor): the loss to back-propagate.

        Returns:
            torch.Tensor: the scaled loss (the loss itself when disabled).
        """
        return self._scaler.scale(loss)

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divides the gradients of ``optimizer``'s params by the scale in place (before clipping)."""
        if self.enabled:
            self._scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: Optimizer) -> bool:
        """Steps the optimizer unless the gradients overflowed, and updates the scale.

        The skip is decided here, on the host, for every optimizer: ``GradScaler.step`` hands a fused optimizer
        the overflow flag as a tensor instead, which the optimizer copies to its params' device without waiting;
        with the params on the host (``fsdp_cpu_offload``) and the flag on the GPU, the step could read the flag
        before the copy lands. The gradients are unscaled already, so the optimizer steps as it would unscaled.

        Args:
            optimizer (Optimizer): the optimizer.

        Returns:
            bool: True if the step was taken, False if it was skipped (inf/nan gradients).
        """
        if not self.enabled:
            optimizer.step()
            return True
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        # GradScaler's own record of this optimizer's overflow (every rank's, for the distributed scaler).
        flags = self._scaler._found_inf_per_device(optimizer).values()
        taken = not any(bool(flag.item()) for flag in flags)  # .item() waits for the flag
        if taken:
            optimizer.step()
        self._scaler.update()
        self._unscaled.discard(id(optimizer))
        self.skipped_steps += int(not taken)
        return taken

    def get_scale(self) -> float:
        """
        Returns:
            float: the current loss scale (1.0 when disabled).
        """
        return self._scaler.get_scale() if self.enabled else 1.0

    def state_dict(self) -> Dict[str, Any]:
        """
        Returns:
            Dict[str, Any]: the scaler's state and the skipped-step count.
        """
        return {"scaler": self._scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """
        Args:
            state (Dict[str, Any]): from :meth:`state_dict`.
        """
        if self.enabled and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)


class _DistributedGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` for FSDP2: unscales DTensor gradients through their local shards.

    torch's per-device foreach unscale cannot take DTensor and plain gradients in one list (a replicated
    vocab-pruning module next to sharded adapters); unscaling local tensors works for both, and
    ``ShardedGradScaler.unscale_`` then all-reduces the inf/nan flag so every rank skips the same steps.
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        grouped = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grouped[grad.device][grad.dtype].append(grad)
        per_device_found_inf: Dict[torch.device, torch.Tensor] = {}
        for device, per_dtype in grouped.items():
            flag = per_device_found_inf.setdefault(device, found_inf.to(device))
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
        if not per_device_found_inf:
            per_device_found_inf[found_inf.device] = found_inf
        return per_device_found_inf


class DistributedLossScaler(LossScaler):
    """:class:`LossScaler` whose overflow check agrees across ranks: the same arguments, defaults and behaviour (fp16:
    dynamic scaling, overflowed steps skipped and counted); the inf/nan flag is all-reduced over the default process
    group before the step decision."""

    _grad_scaler_class = _DistributedGradScaler


def check_param_dtypes(named_params: Iterable, dtype: torch.dtype, what: str) -> None:
    """Raises if any param is not ``dtype`` (a silent upcast/downcast would change memory and numerics).

    Args:
        named_params (Iterable): ``(name, param)`` pairs.
        dtype (torch.dtype): expected dtype.
        what (str): what the params are, for the error.

    Raises:
        ValueError: naming the first param with another dtype.
    """
    for name, param in named_params:
        if param.dtype != dtype:
            raise ValueError(f"{what} param {name} has dtype {param.dtype}, expected {dtype}.")

"""Compute dtypes for QLoRA recipes: fp32 (T4 and other GPUs without bf16), bf16, and fp16 with loss scaling.

fp16 computes in fp16 while the adapters stay fp32 ("master" weights, so small updates are not lost), and the
loss is scaled dynamically (``torch.amp.GradScaler``): a step whose gradients overflow is skipped, the scale
backs off, and :class:`LossScaler` counts the skipped steps for the logs.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Union

import torch
from torch.optim import Optimizer

DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES: Dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


def is_bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes natively in bf16.

    CUDA needs compute capability >= 8.0 (a T4 is 7.5: ``torch.cuda.is_bf16_supported()`` says True there
    through emulation, which is slow, so emulation does not count); CPUs always can.

    Args:
        device (torch.device): the training device.

    Returns:
        bool: True when bf16 is supported.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "mps":
        return torch.backends.mps.is_available()
    if device.type == "xpu":
        return torch.xpu.is_available() and torch.xpu.is_bf16_supported()
    return True


def parse_dtype(name: Union[str, torch.dtype, None], device: torch.device, what: str = "dtype") -> torch.dtype:
    """Turns a recipe's ``dtype`` string into a torch dtype, checking the device supports it.

    Args:
        name (Union[str, torch.dtype, None]): "fp32", "bf16" or "fp16" (or float32/bfloat16/float16); None: fp32.
        device (torch.device): the training device.
        what (str): the config key, used in errors.

    Returns:
        torch.dtype: the dtype.

    Raises:
        ValueError: on an unknown dtype.
        RuntimeError: on bf16 where the device does not support it.
    """
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        key = _ALIASES.get(str(name).lower(), str(name).lower())
        if key not in DTYPES:
            raise ValueError(f"{what}={name!r} is not supported; use {what}=fp32, {what}=bf16 or {what}=fp16.")
        dtype = DTYPES[key]
    if dtype not in DTYPES.values():
        raise ValueError(f"{what}={dtype} is not supported; use {what}=fp32, {what}=bf16 or {what}=fp16.")
    if dtype == torch.bfloat16 and not is_bf16_supported(device):
        raise RuntimeError(
            f"{what}=bf16 was requested but {device} does not support bf16 (e.g. a T4). Use {what}=fp32 (same "
            f"results, ~20% more memory) or {what}=fp16 (fp16 compute with fp32 adapters and loss scaling)."
        )
    return dtype


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
        chosen = parse_dtype(adapter_dtype, torch.device("cpu"), "adapter_dtype")
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
    """

    def __init__(self, enabled: bool, device: torch.device, init_scale: float = 2.0**10, growth_interval: int = 2000):
        self.enabled = enabled
        self.skipped_steps = 0
        self._scaler = torch.amp.GradScaler(
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

    def step(self, optimizer: Optimizer) -> bool:
        """Steps the optimizer unless the gradients overflowed, and updates the scale.

        Args:
            optimizer (Optimizer): the optimizer.

        Returns:
            bool: True if the step was taken, False if it was skipped (inf/nan gradients).
        """
        if not self.enabled:
            optimizer.step()
            return True
        scale_before = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        taken = self._scaler.get_scale() >= scale_before
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

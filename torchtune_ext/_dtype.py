"""The float dtypes of configs and APIs (``dtype=fp32|bf16|fp16``): one parser for all of them, and the device check.

A private bottom-layer module: the state-dict tooling (``distributed``), the checkpointer and the recipes all parse
dtype names here.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch

from torchtune_ext.config import ConfigError

DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES: Dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}


class _NoBF16Error(ConfigError, RuntimeError):
    """``dtype=bf16`` on a device without bf16: a config error (also a ``RuntimeError``, as before)."""


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


def parse_dtype(
    name: Union[str, torch.dtype, None], device: Optional[torch.device] = None, what: str = "dtype"
) -> Optional[torch.dtype]:
    """Turns a dtype name of a config or an API argument into a torch dtype, checking the device supports it.

    Args:
        name (Union[str, torch.dtype, None]): "fp32", "bf16" or "fp16" (or float32/bfloat16/float16, or the dtype).
        device (Optional[torch.device]): the device it will compute on; None: no device check.
        what (str): the config key or argument name, used in errors.

    Returns:
        Optional[torch.dtype]: the dtype; None for None.

    Raises:
        ValueError: on an unknown dtype.
        RuntimeError: on bf16 where the device does not support it.
    """
    if name is None:
        return None
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        key = _ALIASES.get(str(name).lower(), str(name).lower())
        if key not in DTYPES:
            raise ConfigError(f"{what}={name!r} is not supported; use {what}=fp32, {what}=bf16 or {what}=fp16.")
        dtype = DTYPES[key]
    if dtype not in DTYPES.values():
        raise ConfigError(f"{what}={dtype} is not supported; use {what}=fp32, {what}=bf16 or {what}=fp16.")
    if dtype == torch.bfloat16 and device is not None and not is_bf16_supported(device):
        raise _NoBF16Error(
            f"{what}=bf16 was requested but {device} does not support bf16 (e.g. a T4). Use {what}=fp32 (same "
            f"results, ~20% more memory) or {what}=fp16 (fp16 compute with fp32 adapters and loss scaling)."
        )
    return dtype

"""The device check of a config: ``device`` is one this machine has (else the ones it has)."""

from __future__ import annotations

from typing import Any, List

from torchtune_ext.config._errors import ConfigError, bad_value


def available_devices() -> List[str]:
    """
    Returns:
        List[str]: the devices this machine has: ``cpu``, then each accelerator (``cuda:0``, ``mps``, ...).
    """
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    for name in ("xpu", "npu", "hpu", "mtia"):
        module = getattr(torch, name, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            count = getattr(module, "device_count", lambda: 1)()
            devices += [f"{name}:{i}" for i in range(count)]
    return devices


def check_device(value: Any) -> List[ConfigError]:
    """``device`` must be one this machine has (null: torchtune's choice, the accelerator if any)."""
    import torch

    if value is None:
        return []
    available = available_devices()
    kinds = {d.split(":")[0] for d in available}
    listed = ", ".join(available)
    try:
        device = torch.device(str(value))
    except (RuntimeError, ValueError):
        return [bad_value("device", value, "is not a device", f"use one of this machine's: {listed}")]
    if device.type not in kinds:
        where = " (on Colab/Kaggle: choose a GPU runtime, then restart)" if device.type == "cuda" else ""
        return [
            bad_value(
                "device",
                value,
                f"is not available: this machine has no {device.type} device{where}",
                f"use one of this machine's: {listed} (device=cpu works everywhere, slowly)",
            )
        ]
    if device.index is not None and f"{device.type}:{device.index}" not in available:
        return [bad_value("device", value, "does not exist on this machine", f"use one of: {listed}")]
    return []

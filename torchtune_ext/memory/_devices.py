"""Device profiles for the dry run: the memory torch reports on a card, its attention kernels per dtype, bf16.

A dry run answers "does it fit on *that* card" on a machine without it, so the card is described by what the
estimate needs (:class:`DeviceProfile`):

- ``total_memory_gib``: what ``torch.cuda.get_device_properties(0).total_memory`` reports (the CUDA driver's
  ``totalGlobalMem``), in GiB. It is less than the marketing size and less than ``nvidia-smi``'s ``memory.total``
  (the driver reserves some), and it varies a little with the driver and ECC: each profile takes the smallest value
  found in public logs, and says where each number comes from (``source``). Where no torch figure was found, the
  ``nvidia-smi`` figure is scaled by the smallest torch / ``nvidia-smi`` ratio found (the T4's, 14930 / 15360),
  and the source says so: an assumption, conservative, until someone prints it on that card.
- ``capability``: the CUDA compute capability; bf16 needs sm80+ (torch's ``is_bf16_supported`` on a T4 is False;
  the recipes refuse ``dtype=bf16`` there, and so does a dry run on the T4 profile).
- the attention kernel torch's SDPA dispatches to per dtype (:meth:`DeviceProfile.sdpa_backend`): FlashAttention-2
  for fp16/bf16 on sm80+; the memory-efficient (cutlass) kernel for fp32 everywhere and for fp16 (and bf16 on sm80+)
  below sm80; the O(n^2) math kernel otherwise (bf16 on sm75, which the recipes refuse anyway).

Every fits / does-not-fit answer keeps a headroom below the card's memory (:func:`fits_line`): by default
:data:`DEFAULT_HEADROOM` of it, for what the estimate may have missed, until a GPU has measured it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from torchtune_ext.config import ConfigError

MIB = 1 << 20
GIB = 1 << 30
#: fraction of the device memory (and of the host memory) a fits answer leaves unused.
DEFAULT_HEADROOM = 0.05
#: torch / nvidia-smi total memory on a T4 (14930 MiB / 15360 MiB): the smallest ratio found, used where only
#: nvidia-smi's figure was found.
_SMI_RATIO = 14930 / 15360

FLASH = "flash"
EFFICIENT = "efficient"
MATH = "math"


@dataclass(frozen=True)
class DeviceProfile:
    """A GPU as the dry run needs it.

    Attributes:
        name (str): the profile's name (``device_profile=``).
        total_memory_gib (float): ``torch.cuda.get_device_properties().total_memory`` in GiB.
        capability (Tuple[int, int]): CUDA compute capability.
        source (str): where ``total_memory_gib`` comes from.
        host_memory_gib (Optional[float]): host RAM of the usual machine with this card (Colab's T4: 12.7), if the
            profile is for one; None: the dry run uses this machine's.
    """

    name: str
    total_memory_gib: float
    capability: Tuple[int, int]
    source: str
    host_memory_gib: Optional[float] = None

    @property
    def bf16(self) -> bool:
        """Whether the card computes in bf16 (sm80+)."""
        return self.capability >= (8, 0)

    def sdpa_backend(self, dtype: torch.dtype) -> str:
        """The kernel torch's ``scaled_dot_product_attention`` runs (training, no mask beyond causal) in ``dtype``.

        Args:
            dtype (torch.dtype): the compute dtype.

        Returns:
            str: ``"flash"``, ``"efficient"`` or ``"math"``.
        """
        sixteen_bit = dtype in (torch.float16, torch.bfloat16)
        if sixteen_bit and self.capability >= (8, 0):
            return FLASH
        if dtype in (torch.float32, torch.float16) or self.bf16:
            return EFFICIENT
        return MATH

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Refuses bf16 on a card without it, as the recipes refuse it on such a device.

        Raises:
            ConfigError: bf16 below sm80.
        """
        if dtype == torch.bfloat16 and not self.bf16:
            major, minor = self.capability
            raise ConfigError(
                f"dtype=bf16 with device_profile={self.name} (sm{major}{minor}): the card has no bf16 and the recipe "
                "refuses it there. Use dtype=fp32 (same results, ~20% more memory) or dtype=fp16, or drop "
                "device_profile if the run is not for that card.",
                "dtype",
            )


def _mib(value: float) -> float:
    return value * MIB / GIB


#: The profiles (``device_profile=``). Sources: public logs of ``torch.cuda.get_device_properties(0)`` (torch
#: prints ``total_memory`` in MiB as "MB") and of ``nvidia-smi --query-gpu=memory.total``.
PROFILES: Dict[str, DeviceProfile] = {
    "t4": DeviceProfile(
        "t4",
        _mib(14930),
        (7, 5),
        "torch total_memory=14930MB (a 2025 log, torch 2.2.1, CUDA 11.8), the smallest of the T4 values found "
        "(14930-15109 MiB; Google Colab prints 15102MB); nvidia-smi shows 15360 MiB",
        host_memory_gib=12.7,
    ),
    "l4": DeviceProfile(
        "l4",
        _mib(23034 * _SMI_RATIO),
        (8, 9),
        "assumption: nvidia-smi memory.total 23034 MiB (several public logs) x the T4's torch/nvidia-smi ratio "
        "(no torch print of an L4 found)",
    ),
    "a10g": DeviceProfile(
        "a10g", _mib(22587), (8, 6), "torch total_memory=22587MB (a public log; an older one prints 22723MB)"
    ),
    "a100_40gb": DeviceProfile(
        "a100_40gb",
        _mib(40326),
        (8, 0),
        "torch total_memory=40326MB (A100-PCIE-40GB, torch 1.9 log; the SXM4 card reports 40536MB)",
    ),
    "a100_80gb": DeviceProfile(
        "a100_80gb",
        _mib(81920 * _SMI_RATIO),
        (8, 0),
        "assumption: nvidia-smi memory.total 81920 MiB x the T4's torch/nvidia-smi ratio (no torch print found)",
    ),
    "h100": DeviceProfile(
        "h100",
        _mib(81082),
        (9, 0),
        "torch total_memory=81082MB (H100 80GB HBM3, torch 2.0.1 log; others print 81089-81090MB)",
    ),
}


def device_profile(
    name: Optional[str], memory_gib: Optional[float] = None, capability: Optional[str] = None
) -> Optional[DeviceProfile]:
    """The profile named ``name``, or one made of ``device_memory_gb`` and ``compute_capability``.

    Args:
        name (Optional[str]): a key of :data:`PROFILES`, or None.
        memory_gib (Optional[float]): ``device_memory_gb``: overrides the profile's memory (or makes a profile).
        capability (Optional[str]): ``compute_capability`` as "8.0"; default: the profile's, else "8.0".

    Returns:
        Optional[DeviceProfile]: None when neither a name nor a memory is given.

    Raises:
        ConfigError: on an unknown profile or a malformed capability.
    """
    if name is None and memory_gib is None:
        return None
    if name is not None and name not in PROFILES:
        raise ConfigError(f"device_profile={name!r} is unknown; use one of {', '.join(PROFILES)}, or device_memory_gb.")
    base = PROFILES[name] if name is not None else None
    cap = base.capability if base is not None else (8, 0)
    if capability is not None:
        try:
            major, minor = (int(part) for part in str(capability).split("."))
        except ValueError:
            raise ConfigError(f"compute_capability={capability!r} must look like 7.5 or 8.0") from None
        cap = (major, minor)
    if base is None:
        return DeviceProfile("custom", float(memory_gib), cap, "device_memory_gb (given)")
    if memory_gib is not None:
        return DeviceProfile(base.name, float(memory_gib), cap, "device_memory_gb (given)", base.host_memory_gib)
    return DeviceProfile(base.name, base.total_memory_gib, cap, base.source, base.host_memory_gib)


def fits_line(what: str, need_bytes: int, total_gib: float, headroom: float = DEFAULT_HEADROOM) -> str:
    """One fits / does-not-fit answer that states its headroom.

    Args:
        what (str): e.g. "device (t4)".
        need_bytes (int): bytes needed.
        total_gib (float): the memory there, in GiB.
        headroom (float): the fraction of it kept unused.

    Returns:
        str: e.g. "device (t4): needs 12.30 GiB of 14.58 GiB - 5% headroom = 13.85 GiB usable: fits".
    """
    usable = usable_gib(total_gib, headroom)
    verdict = "fits" if need_bytes <= usable * GIB else "does NOT fit"
    return (
        f"{what}: needs {need_bytes / GIB:.2f} GiB of {total_gib:.2f} GiB - {headroom:.0%} headroom = "
        f"{usable:.2f} GiB usable: {verdict}"
    )


def usable_gib(total_gib: float, headroom: float = DEFAULT_HEADROOM) -> float:
    """``total_gib`` less the headroom: what a fits answer may use."""
    return total_gib * (1 - headroom)


__all__ = ["DEFAULT_HEADROOM", "PROFILES", "DeviceProfile", "device_profile", "fits_line", "usable_gib"]

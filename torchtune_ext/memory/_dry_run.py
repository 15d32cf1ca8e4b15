"""The dry run's answer: does the step fit on the card (a device profile) and in the host's RAM, with a headroom.

:func:`dry_run_target` reads the dry run's settings (``device_profile``, ``device_memory_gb``,
``compute_capability``, ``host_memory_gb``, ``memory_headroom``) and refuses bad ones before any estimate runs;
:func:`fit_report` turns an estimate into the report's fits lines and the longest sequence that fits every limit.

Host RAM needed (:class:`HostMemory`) is, at its largest, the process plus the larger of:

- loading: the checkpoint chunk rank 0 reads (``LOAD_CHUNK_BYTES``, or the largest tensor if bigger, in the
  checkpoint's dtype) plus that largest tensor once more in the compute dtype (one tensor converted before it goes
  to the device): an upper bound;
- training: the pinned buffers of activation offloading as torch's caching host allocator reserves them (each block
  rounded up to a power of two; the estimate's ``pinned_host_bytes``).

The process: this process's resident memory at the dry run (torch, the recipe, the tokenizer) plus
:data:`CUDA_HOST_ALLOWANCE_GIB` for what the CUDA runtime and its libraries map on the host (an assumption: no GPU
measured it here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional

import psutil
import torch
from torch import nn

from torchtune_ext.checkpoint import LOAD_CHUNK_BYTES
from torchtune_ext.config import ConfigError
from torchtune_ext.memory._devices import DEFAULT_HEADROOM, DeviceProfile, device_profile, fits_line, usable_gib
from torchtune_ext.memory._estimate import GIB, MemoryEstimate
from torchtune_ext.memory._estimator import MemoryEstimator, _longest_fitting

#: host memory the CUDA runtime, cuBLAS and cuDNN map in a training process (assumption, unmeasured here).
CUDA_HOST_ALLOWANCE_GIB = 1.0
_SCALE = 1 << 40  # fixed-point scale of the normalised need in the joint search


@dataclass(frozen=True)
class DryRunTarget:
    """Where the dry run asks the step to fit.

    Attributes:
        profile (Optional[DeviceProfile]): the card (None: no device answer).
        host_memory_gib (float): the host's RAM in GiB.
        headroom (float): fraction of each memory a fits answer leaves unused.
    """

    profile: Optional[DeviceProfile]
    host_memory_gib: float
    headroom: float = DEFAULT_HEADROOM


def this_machine_memory_gib() -> float:
    """This machine's RAM in GiB (``host_memory_gb``'s default)."""
    return psutil.virtual_memory().total / GIB


def dry_run_target(cfg: Any, device: torch.device, dtype: torch.dtype) -> DryRunTarget:
    """The dry run's device and host, from the config; checked before any estimate runs.

    ``device_profile`` names a card (:data:`torchtune_ext.memory.PROFILES`); ``device_memory_gb`` overrides its
    memory or, alone, describes a card with ``compute_capability`` (default 8.0); neither: the CUDA device here, if
    any. ``host_memory_gb`` (default: this machine's) and ``memory_headroom`` (default 0.05) are the other limits.

    Args:
        cfg (Any): the recipe config.
        device (torch.device): the configured device.
        dtype (torch.dtype): the compute dtype.

    Returns:
        DryRunTarget: the target.

    Raises:
        ConfigError: on an unknown profile, a malformed capability, bf16 on a card without it, or a headroom
            outside [0, 1).
    """
    memory = cfg.get("device_memory_gb", None)
    capability = cfg.get("compute_capability", None)
    if cfg.get("device_profile", None) is None and memory is None and device.type == "cuda":
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(device)
            memory, capability = props.total_memory / GIB, capability or f"{props.major}.{props.minor}"
    profile = device_profile(cfg.get("device_profile", None), memory, capability)
    if profile is not None:
        profile.check_dtype(dtype)
    headroom = cfg.get("memory_headroom", DEFAULT_HEADROOM)
    if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not 0 <= headroom < 1:
        raise ConfigError(f"memory_headroom={headroom!r} must be a fraction in [0, 1), e.g. 0.05")
    host = cfg.get("host_memory_gb", None)
    return DryRunTarget(profile, float(host) if host is not None else this_machine_memory_gib(), float(headroom))


@dataclass(frozen=True)
class HostMemory:
    """Host RAM of a training run, in bytes (see the module docstring)."""

    process: int
    loading: int
    pinned: int

    @property
    def needed(self) -> int:
        """The largest host RAM the run needs: the process plus the larger of loading and the pinned buffers."""
        return self.process + max(self.loading, self.pinned)


def loading_bytes(model: nn.Module, checkpoint_dtype: torch.dtype, compute_dtype: torch.dtype) -> int:
    """Host bytes while loading: a chunk of the checkpoint plus the largest tensor converted (an upper bound).

    Args:
        model (nn.Module): the model (meta is fine): its largest parameter stands for the checkpoint's largest tensor.
        checkpoint_dtype (torch.dtype): the checkpoint's dtype.
        compute_dtype (torch.dtype): the dtype tensors are converted to.

    Returns:
        int: bytes.
    """
    largest = max(p.numel() for p in model.parameters())
    chunk = max(LOAD_CHUNK_BYTES, largest * checkpoint_dtype.itemsize)
    return chunk + largest * compute_dtype.itemsize


def process_bytes() -> int:
    """This process's resident memory now plus :data:`CUDA_HOST_ALLOWANCE_GIB`."""
    return psutil.Process(os.getpid()).memory_info().rss + int(CUDA_HOST_ALLOWANCE_GIB * GIB)


def longest_fitting_seq_len(
    estimator: MemoryEstimator,
    target: DryRunTarget,
    batch_size: int,
    host: HostMemory,
    upper: Optional[int] = None,
) -> int:
    """The longest sequence whose step fits the card and the host, each with the headroom.

    Args:
        estimator (MemoryEstimator): the step's estimator.
        target (DryRunTarget): the limits.
        batch_size (int): sequences per step.
        host (HostMemory): the run's process and loading bytes (its ``pinned`` is ignored: each length's own).
        upper (Optional[int]): the longest length to consider; default the model's ``max_seq_len``.

    Returns:
        int: the length (0 if nothing fits).
    """
    device_budget = usable_gib(target.profile.total_memory_gib, target.headroom) * GIB if target.profile else None
    host_budget = usable_gib(target.host_memory_gib, target.headroom) * GIB
    fixed: List[int] = []

    def need(seq_len: int) -> int:
        estimate = estimator.estimate(batch_size, seq_len)
        needed = replace(host, pinned=estimate.pinned_host_bytes).needed
        ratios = [needed / host_budget]
        base = [replace(host, pinned=0).needed / host_budget]
        if device_budget is not None:
            ratios.append(estimate.device_bytes / device_budget)
            base.append((estimate.persistent_bytes + estimate.cuda_context_bytes) / device_budget)
        fixed.append(int(max(base) * _SCALE))
        return int(max(ratios) * _SCALE)

    top = upper or estimator.max_seq_len
    if top is None:
        raise ValueError("pass upper=: the model has no max_seq_len")
    return _longest_fitting(need, _SCALE, top, min(top, 2048), fixed)


def fit_report(
    estimator: MemoryEstimator,
    estimate: MemoryEstimate,
    target: DryRunTarget,
    host: HostMemory,
    batch_size: int,
    label: Callable[[str], str] = str,
) -> List[str]:
    """The report's lines on the card, the host and the longest sequence that fits both.

    Args:
        estimator (MemoryEstimator): the step's estimator (for the search).
        estimate (MemoryEstimate): the estimate at the configured length.
        target (DryRunTarget): the limits.
        host (HostMemory): host RAM of the run at the configured length.
        batch_size (int): sequences per step.
        label (Callable[[str], str]): prefixes a line (e.g. a rank).

    Returns:
        List[str]: the lines.
    """
    lines = []
    profile = target.profile
    if profile is not None:
        backend = profile.sdpa_backend(estimate.dtype)
        lines.append(
            label(
                f"device {profile.name} (sm{profile.capability[0]}{profile.capability[1]}, bf16 "
                f"{'yes' if profile.bf16 else 'no'}, attention: {backend} SDPA kernel): torch reports "
                f"{profile.total_memory_gib:.2f} GiB ({profile.source})"
            )
        )
        lines.append(label(fits_line("device", estimate.device_bytes, profile.total_memory_gib, target.headroom)))
    lines.append(
        label(
            f"host RAM: process {host.process / GIB:.2f} GiB (RSS now + {CUDA_HOST_ALLOWANCE_GIB:g} GiB CUDA "
            f"libraries, assumed) + max(loading {host.loading / GIB:.2f} GiB (checkpoint chunk + largest tensor "
            f"converted), pinned offload buffers {host.pinned / GIB:.2f} GiB (power-of-two blocks of torch's "
            f"caching host allocator; {estimate.host_bytes / GIB:.2f} GiB of tensors))"
        )
    )
    lines.append(label(fits_line("host", host.needed, target.host_memory_gib, target.headroom)))
    longest = longest_fitting_seq_len(estimator, target, batch_size, host)
    limits = "device and host" if profile is not None else "host"
    lines.append(
        label(
            f"longest sequence that fits ({limits}, {target.headroom:.0%} headroom each) at batch {batch_size}: "
            f"{longest} tokens (an estimate until a GPU measures it)"
        )
    )
    return lines


__all__ = [
    "CUDA_HOST_ALLOWANCE_GIB",
    "DryRunTarget",
    "HostMemory",
    "dry_run_target",
    "fit_report",
    "loading_bytes",
    "longest_fitting_seq_len",
    "process_bytes",
    "this_machine_memory_gib",
]

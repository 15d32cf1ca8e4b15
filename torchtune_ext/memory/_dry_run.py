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

Ranks on one machine share its RAM (Kaggle's 2x T4 is one host): each rank is a process with its own pinned offload
buffers, and they load together, then train together, so the host needs the sum of their processes plus the larger
of their summed loading and their summed pinned buffers (:func:`host_total`). A per-rank dry run
(``DryRunTarget.ranks_per_host`` > 1) checks ``host_memory_gb`` against that sum: in each rank's report its own
figure times the ranks on the host, and after the last rank the sum of every rank's own figures
(:func:`host_report`). Ranks > 0 receive the checkpoint one tensor at a time (broadcast from rank 0), at most the
largest tensor, which for the supported models is about rank 0's 1 GiB chunk: the same loading bound serves every
rank (an upper bound).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, List, Optional, Sequence

import psutil
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from torchtune_ext.checkpoint import LOAD_CHUNK_BYTES
from torchtune_ext.config import ConfigError, recipe_setting
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
        ranks_per_host (int): ranks sharing the host's RAM (a per-rank dry run: ``world_size``, one machine).
    """

    profile: Optional[DeviceProfile]
    host_memory_gib: float
    headroom: float = DEFAULT_HEADROOM
    ranks_per_host: int = 1


def this_machine_memory_gib() -> float:
    """This machine's RAM in GiB (``host_memory_gb``'s default)."""
    return psutil.virtual_memory().total / GIB


def dry_run_target(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> DryRunTarget:
    """The dry run's device and host, from the config; checked before any estimate runs.

    ``device_profile`` names a card (:data:`torchtune_ext.memory.PROFILES`); ``device_memory_gb`` overrides its
    memory or, alone, describes a card with ``compute_capability`` (default 8.0); neither: the CUDA device here, if
    any. ``host_memory_gb`` (default: this machine's) and ``memory_headroom`` (default 0.05) are the other limits.
    Inside a per-rank dry run (a process group), the ranks on the host are the launcher's ``LOCAL_WORLD_SIZE``.

    Args:
        cfg (DictConfig): the recipe config.
        device (torch.device): the configured device.
        dtype (torch.dtype): the compute dtype.

    Returns:
        DryRunTarget: the target.

    Raises:
        ConfigError: on an unknown profile, a malformed capability, bf16 on a card without it, or a headroom
            outside [0, 1).
    """
    name = recipe_setting(cfg, "device_profile")
    memory = recipe_setting(cfg, "device_memory_gb")
    capability = recipe_setting(cfg, "compute_capability")
    if name is None and memory is None and device.type == "cuda":
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(device)
            memory, capability = props.total_memory / GIB, capability or f"{props.major}.{props.minor}"
    profile = device_profile(name, memory, capability)
    if profile is not None:
        profile.check_dtype(dtype)
    headroom = recipe_setting(cfg, "memory_headroom")
    if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not 0 <= headroom < 1:
        raise ConfigError(f"memory_headroom={headroom!r} must be a fraction in [0, 1), e.g. 0.05")
    host = recipe_setting(cfg, "host_memory_gb")
    host_gib = float(host) if host is not None else this_machine_memory_gib()
    return DryRunTarget(profile, host_gib, float(headroom), ranks_on_this_host())


def ranks_on_this_host() -> int:
    """Ranks sharing this host's RAM: ``LOCAL_WORLD_SIZE`` within a process group (a per-rank dry run sets it);
    1 without one."""
    if dist.is_available() and dist.is_initialized():
        return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return 1


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


def host_total(ranks: Sequence[HostMemory]) -> HostMemory:
    """The host RAM of ranks sharing one machine: each part summed over the ranks (they load at the same time, then
    train at the same time), so ``host_total(ranks).needed`` is the host's need.

    Args:
        ranks (Sequence[HostMemory]): each rank's own figures.

    Returns:
        HostMemory: the host's.
    """
    return HostMemory(sum(r.process for r in ranks), sum(r.loading for r in ranks), sum(r.pinned for r in ranks))


def loading_bytes(model: nn.Module, checkpoint_dtype: torch.dtype, compute_dtype: torch.dtype) -> int:
    """Host bytes while loading: a chunk of the checkpoint (at most the whole checkpoint) plus the largest tensor
    converted (an upper bound).

    Args:
        model (nn.Module): the model (meta is fine): its largest parameter stands for the checkpoint's largest tensor.
        checkpoint_dtype (torch.dtype): the checkpoint's dtype.
        compute_dtype (torch.dtype): the dtype tensors are converted to.

    Returns:
        int: bytes.
    """
    sizes = [p.numel() for p in model.parameters()]
    largest = max(sizes)
    chunk = min(max(LOAD_CHUNK_BYTES, largest * checkpoint_dtype.itemsize), sum(sizes) * checkpoint_dtype.itemsize)
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
    exact_pinned: bool = False,
) -> int:
    """The longest sequence whose step fits the card and the host, each with the headroom; with several ranks on the
    host (``target.ranks_per_host``), the host holds that many ranks like this one.

    Args:
        estimator (MemoryEstimator): the step's estimator.
        target (DryRunTarget): the limits.
        batch_size (int): sequences per step.
        host (HostMemory): the run's process and loading bytes (its ``pinned`` is ignored: each length's own).
        upper (Optional[int]): the longest length to consider; default the model's ``max_seq_len``.
        exact_pinned (bool): count the offload buffers at their own size (:func:`pinned_bytes`), not as torch's
            caching host allocator rounds them by default.

    Returns:
        int: the length (0 if nothing fits).
    """
    device_budget = usable_gib(target.profile.total_memory_gib, target.headroom) * GIB if target.profile else None
    host_budget = usable_gib(target.host_memory_gib, target.headroom) * GIB / target.ranks_per_host
    fixed: List[int] = []

    def need(seq_len: int) -> int:
        estimate = estimator.estimate(batch_size, seq_len)
        needed = replace(host, pinned=pinned_bytes(estimate, exact_pinned)).needed
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


def pinned_bytes(estimate: MemoryEstimate, exact: bool = False) -> int:
    """The pinned host memory of an estimate's offload buffers.

    By default as torch's caching host allocator reserves them: every block rounded up to a power of two. ``exact``:
    at their own size, what the allocator reserves when told not to round large blocks
    (``PYTORCH_CUDA_ALLOC_CONF=pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:1``, torch >= 2.13: blocks
    over 1 MB neither rounded nor cached; the few smaller tensors, such as a norm's row scales, are counted at their
    size too). Every offloaded tensor lives from its forward to its backward, so their sum (``host_bytes``) is the
    live peak. A model of the allocator's rule, not a measurement: pinned memory needs CUDA.

    Args:
        estimate (MemoryEstimate): the estimate.
        exact (bool): no power-of-two rounding.

    Returns:
        int: bytes.
    """
    return estimate.host_bytes if exact else estimate.pinned_host_bytes


@dataclass(frozen=True)
class RankHost:
    """One rank's host figures in a per-rank dry run (:func:`collect_rank_hosts`)."""

    host: HostMemory
    target: DryRunTarget
    longest: int


_COLLECTORS: List[List[RankHost]] = []


@contextmanager
def collect_rank_hosts() -> Iterator[List[RankHost]]:
    """Within: every :func:`fit_report` appends its rank's host figures to the list yielded (a per-rank dry run
    sums them into the host's, :func:`host_report`)."""
    ranks: List[RankHost] = []
    _COLLECTORS.append(ranks)
    try:
        yield ranks
    finally:
        _COLLECTORS.remove(ranks)


def _host_line(host: HostMemory, estimate_host_bytes: int) -> str:
    return (
        f"process {host.process / GIB:.2f} GiB (RSS now + {CUDA_HOST_ALLOWANCE_GIB:g} GiB CUDA libraries, assumed) + "
        f"max(loading {host.loading / GIB:.2f} GiB (checkpoint chunk + largest tensor converted), pinned offload "
        f"buffers {host.pinned / GIB:.2f} GiB (power-of-two blocks of torch's caching host allocator; "
        f"{estimate_host_bytes / GIB:.2f} GiB of tensors))"
    )


def fit_report(
    estimator: MemoryEstimator,
    estimate: MemoryEstimate,
    target: DryRunTarget,
    host: HostMemory,
    batch_size: int,
    label: Callable[[str], str] = str,
) -> List[str]:
    """The report's lines on the card, the host and the longest sequence that fits both.

    With several ranks on the host (``target.ranks_per_host``), the host line is this rank's and the host check is
    for that many ranks like it; inside :func:`collect_rank_hosts` the rank's figures are also collected.

    Args:
        estimator (MemoryEstimator): the step's estimator (for the search).
        estimate (MemoryEstimate): the estimate at the configured length.
        target (DryRunTarget): the limits.
        host (HostMemory): host RAM of the run (of this rank) at the configured length.
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
    ranks = target.ranks_per_host
    if ranks == 1:
        lines.append(label(f"host RAM: {_host_line(host, estimate.host_bytes)}"))
        lines.append(label(fits_line("host", host.needed, target.host_memory_gib, target.headroom)))
    else:
        lines.append(
            label(f"host RAM, this rank: {host.needed / GIB:.2f} GiB = {_host_line(host, estimate.host_bytes)}")
        )
        what = f"host ({ranks} ranks on it, this rank's figure x {ranks}; every rank's own summed after the last)"
        lines.append(label(fits_line(what, host_total([host] * ranks).needed, target.host_memory_gib, target.headroom)))
    exact = replace(host, pinned=pinned_bytes(estimate, exact=True))
    if exact.needed != host.needed:
        lines.append(
            label(
                f"host RAM{f' of the {ranks} ranks' if ranks > 1 else ''} if the offload buffers were pinned at "
                f"their own size (not what torch's default allocator does; pinned_max_round_threshold_mb, "
                f"docs/memory-estimates.md): {ranks * exact.needed / GIB:.2f} GiB"
            )
        )
    longest = longest_fitting_seq_len(estimator, target, batch_size, host)
    limits = "device and host" if profile is not None else "host"
    lines.append(
        label(
            f"longest sequence that fits ({limits}, {target.headroom:.0%} headroom each) at batch {batch_size}: "
            f"{longest} tokens (an estimate until a GPU measures it)"
        )
    )
    for collector in _COLLECTORS[-1:]:
        collector.append(RankHost(host, target, longest))
    return lines


def host_report(ranks: Sequence[RankHost]) -> List[str]:
    """The host's lines after a per-rank dry run: every rank's own host RAM, their sum against ``host_memory_gb``
    (with the headroom), and the longest sequence every rank fits.

    Args:
        ranks (Sequence[RankHost]): each rank's figures, rank 0 first (:func:`collect_rank_hosts`).

    Returns:
        List[str]: the lines.
    """
    target = ranks[0].target
    total = host_total([r.host for r in ranks])
    parts = ", ".join(f"rank {i} {r.host.needed / GIB:.2f}" for i, r in enumerate(ranks))
    return [
        f"host RAM per rank (GiB): {parts}",
        f"host RAM of the {len(ranks)} ranks on one machine: process {total.process / GIB:.2f} GiB + "
        f"max(loading {total.loading / GIB:.2f} GiB, pinned offload buffers {total.pinned / GIB:.2f} GiB), "
        "each summed over the ranks",
        fits_line(f"host ({len(ranks)} ranks)", total.needed, target.host_memory_gib, target.headroom),
        f"longest sequence every rank fits ({target.headroom:.0%} headroom on each device and on the host): "
        f"{min(r.longest for r in ranks)} tokens (an estimate until a GPU measures it)",
    ]


__all__ = [
    "CUDA_HOST_ALLOWANCE_GIB",
    "DryRunTarget",
    "HostMemory",
    "RankHost",
    "collect_rank_hosts",
    "dry_run_target",
    "fit_report",
    "host_report",
    "host_total",
    "loading_bytes",
    "longest_fitting_seq_len",
    "pinned_bytes",
    "process_bytes",
    "ranks_on_this_host",
    "this_machine_memory_gib",
]

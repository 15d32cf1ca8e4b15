"""Memory and throughput metrics for the recipes' logs: CUDA peaks (per logging window, and the run's), the
process's peak RSS, tokens/s."""

from __future__ import annotations

import resource
import sys
import time
from functools import partial
from typing import Callable, Dict, Optional

import psutil
import torch
import torch.distributed as dist

from torchtune_ext.distributed import group_device

_GIB = 1024**3


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (``ru_maxrss``: kilobytes on Linux, bytes on macOS).

    Returns:
        int: bytes.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rss_bytes() -> int:
    """
    Returns:
        int: the process's current resident set size in bytes.
    """
    return psutil.Process().memory_info().rss


def memory_stats(device: torch.device, reset_peaks: bool = False) -> Dict[str, float]:
    """Memory figures for the logs, in GiB.

    Always the host process's ``peak_rss`` / ``rss``; on CUDA also torchtune's names ``peak_memory_alloc``,
    ``peak_memory_reserved`` and ``peak_memory_active`` (peaks since the last reset).

    Args:
        device (torch.device): the training device.
        reset_peaks (bool): reset CUDA peak counters after reading them.

    Returns:
        Dict[str, float]: name -> GiB.
    """
    stats = {"peak_rss": peak_rss_bytes() / _GIB, "rss": rss_bytes() / _GIB}
    if device.type == "cuda":
        cuda = torch.cuda.memory_stats(device)
        stats.update(
            peak_memory_alloc=torch.cuda.max_memory_allocated(device) / _GIB,
            peak_memory_reserved=torch.cuda.max_memory_reserved(device) / _GIB,
            peak_memory_active=cuda.get("active_bytes.all.peak", 0) / _GIB,
        )
        if reset_peaks:
            torch.cuda.reset_peak_memory_stats(device)
    return stats


def _reset_cuda_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class MemoryPeaks:
    """Memory figures per logging window and for the whole run.

    CUDA's peak counters are reset after each window is read (:meth:`window`), so each logged peak is its window's
    (the first window's holds the load); :meth:`overall` keeps, for every ``peak_*`` figure, the largest of all
    windows and the current one. ``peak_rss`` (the process's peak; it cannot be reset) and ``rss`` pass through.

    Args:
        device (torch.device): the training device.
        read (Optional[Callable[[], Dict[str, float]]]): the figures now; default :func:`memory_stats` of ``device``.
        reset (Optional[Callable[[], None]]): resets the peak counters; default: CUDA's of ``device``.
    """

    def __init__(
        self,
        device: torch.device,
        read: Optional[Callable[[], Dict[str, float]]] = None,
        reset: Optional[Callable[[], None]] = None,
    ):
        self._read = read or partial(memory_stats, device)
        self._reset = reset or partial(_reset_cuda_peaks, device)
        self._run: Dict[str, float] = {}

    def window(self) -> Dict[str, float]:
        """
        Returns:
            Dict[str, float]: the figures since the last window (peaks of this window); starts the next one.
        """
        stats = self._read()
        self._reset()
        self._run = self._with_run_peaks(stats)
        return stats

    def overall(self) -> Dict[str, float]:
        """
        Returns:
            Dict[str, float]: the figures now, each ``peak_*`` the run's (every window's, this one's included).
        """
        return self._with_run_peaks(self._read())

    def _with_run_peaks(self, stats: Dict[str, float]) -> Dict[str, float]:
        return {
            name: max(value, self._run.get(name, value)) if name.startswith("peak_") else value
            for name, value in stats.items()
        }


def format_memory_stats(stats: Dict[str, float]) -> str:
    """
    Args:
        stats (Dict[str, float]): from :func:`memory_stats`.

    Returns:
        str: one line, e.g. ``peak_rss 1.20 GiB | rss 1.10 GiB``.
    """
    return " | ".join(f"{name} {value:.2f} GiB" for name, value in stats.items())


class Throughput:
    """Counts tokens between :meth:`reset` calls and reports tokens per second."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Starts a new interval."""
        self.tokens = 0
        self._start = time.perf_counter()

    def add(self, num_tokens: int) -> None:
        """
        Args:
            num_tokens (int): tokens processed.
        """
        self.tokens += int(num_tokens)

    def tokens_per_second(self) -> float:
        """
        Returns:
            float: tokens / seconds since the last reset.
        """
        return self.tokens / max(time.perf_counter() - self._start, 1e-9)


def gather_memory_stats(
    device: torch.device, reset_peaks: bool = False, stats: Optional[Dict[str, float]] = None
) -> Dict[str, float]:
    """Every rank's memory figures (:func:`memory_stats`), on every rank.

    Collective: call it on all ranks.

    Args:
        device (torch.device): the training device.
        reset_peaks (bool): reset CUDA peak counters after reading them.
        stats (Optional[Dict[str, float]]): this rank's figures, read already (e.g. :class:`MemoryPeaks`'); the
            same names on every rank. Default: :func:`memory_stats` now.

    Returns:
        Dict[str, float]: ``"<name>/rank<r>"`` -> GiB for every rank ``r``.
    """
    if stats is None:
        stats = memory_stats(device, reset_peaks=reset_peaks)
    names = sorted(stats)
    local = torch.tensor([stats[name] for name in names], dtype=torch.float64)
    if not dist.is_initialized():
        return {f"{name}/rank0": stats[name] for name in names}
    gathered = [torch.empty_like(local, device=group_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local.to(group_device()))
    return {
        f"{name}/rank{rank}": float(values[i]) for rank, values in enumerate(gathered) for i, name in enumerate(names)
    }

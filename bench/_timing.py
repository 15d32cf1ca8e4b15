"""Timing helpers shared by the NF4 benchmarks (imported as ``_timing``: the scripts run from bench/)."""

import platform
import time
from typing import Callable, List

import torch


def sync(device: torch.device) -> None:
    """Waits for queued CUDA work (no-op on CPU).

    Args:
        device (torch.device): the device being timed.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, reps: int, min_time: float) -> float:
    """Best wall time of ``fn`` after one warm-up call.

    Args:
        fn (Callable[[], object]): the work to time.
        device (torch.device): synchronised around each call.
        reps (int): minimum timed repetitions.
        min_time (float): keep repeating (up to 10x ``reps``) until this many seconds have passed.

    Returns:
        float: the fastest repetition in seconds.
    """
    fn()
    sync(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 10 * reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def machine(device: torch.device) -> str:
    """
    Args:
        device (torch.device): the benchmarked device.

    Returns:
        str: the GPU name, or the CPU model and torch's thread count.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"

"""Starting and ending the process group, and the launch checks of the distributed recipe: the backend follows the
device (NCCL on GPUs, gloo on CPUs; torchtune's recipes assume NCCL)."""

from __future__ import annotations

import datetime
import os
import time
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from torchtune_ext.config import ConfigError

#: device type -> process-group backend.
BACKENDS: Dict[str, str] = {"cuda": "nccl", "cpu": "gloo", "xpu": "xccl", "hpu": "hccl"}

#: Seconds the main thread leaves the GIL to gloo's worker threads after destroying the group (see
#: :func:`destroy_distributed`).
GLOO_DRAIN_S = 0.2


def backend_for(device: torch.device) -> str:
    """The process-group backend for a training device: NCCL on CUDA, gloo on CPU.

    Args:
        device (torch.device): the training device.

    Returns:
        str: the backend name.
    """
    return BACKENDS.get(device.type, "gloo")


def launched_world_size() -> int:
    """The world size the launcher (torchrun / ``tune run --nproc_per_node``) set, before any process group exists.

    Returns:
        int: ``WORLD_SIZE``.

    Raises:
        ConfigError: if the process was not started by a distributed launcher (a usage error: one line, exit 2).
    """
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(
            f"the distributed recipe must be started by a distributed launcher ({', '.join(missing)} not set): "
            "tune run --nproc_per_node <N> recipes/qlora_finetune_distributed.py --config <config> "
            "(or torchrun --nproc_per_node <N> ...); for one device use recipes/qlora_finetune_single_device.py."
        )
    return int(os.environ["WORLD_SIZE"])


def init_distributed(device: torch.device, timeout_s: float) -> Tuple[int, int]:
    """Creates the default process group for ``device`` (NCCL on CUDA, gloo on CPU).

    Args:
        device (torch.device): the training device (``cuda:<LOCAL_RANK>`` on GPUs).
        timeout_s (float): collective timeout in seconds: a rank that fails makes the others fail after this
            long instead of hanging.

    Returns:
        Tuple[int, int]: world size and rank.

    Raises:
        ValueError: on a non-positive timeout.
    """
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"process_group_timeout_s={timeout_s} must be a positive number of seconds.")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend=backend_for(device), timeout=datetime.timedelta(seconds=float(timeout_s)), **kwargs
        )
    return dist.get_world_size(), dist.get_rank()


def destroy_distributed() -> None:
    """Destroys the default process group if there is one; on gloo, then lets its worker threads go idle.

    ``destroy_process_group`` joins gloo's worker threads only when nothing else holds the group, and after any
    DTensor work torch's sharding caches keep a ``DeviceMesh`` that does. A worker still dropping the tensors of the
    last collective needs the GIL for each; if the interpreter is finalizing by then, the process aborts with
    "terminate called without an active exception" (a finished run failing at exit). Sleeping
    :data:`GLOO_DRAIN_S` hands the GIL to them first (measured: 11 of 40 two-rank runs aborted without it,
    none with it; ``tests/torchtune_ext/distributed/test_launch.py``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    gloo = "gloo" in str(dist.get_backend())
    dist.destroy_process_group()
    if gloo:
        time.sleep(GLOO_DRAIN_S)


def check_fsdp_cpu_offload(fsdp_cpu_offload: bool, device: torch.device, world_size: int = 2) -> None:
    """FSDP CPU offload moves sharded params to the host and streams them to an accelerator, so it needs one, and
    a sharded model (one rank is not sharded, see :func:`shard_model`).

    Args:
        fsdp_cpu_offload (bool): the config's ``fsdp_cpu_offload``.
        device (torch.device): the training device.
        world_size (int): number of ranks.

    Raises:
        ConfigError: if offload is requested while training on the CPU or on one rank.
    """
    if fsdp_cpu_offload and device.type == "cpu":
        raise ConfigError(
            "fsdp_cpu_offload=True needs an accelerator (it offloads params from the GPU to the host), but "
            "device=cpu: set fsdp_cpu_offload=False (the params already live on the CPU) or train on device=cuda.",
            "fsdp_cpu_offload",
        )
    if fsdp_cpu_offload and world_size == 1:
        raise ConfigError(
            "fsdp_cpu_offload=True needs at least 2 ranks (one rank is not sharded): use --nproc_per_node 2 or more, "
            "or set fsdp_cpu_offload=False.",
            "fsdp_cpu_offload",
        )


def per_rank_batch_size(batch_size: int, global_batch_size: Optional[int], world_size: int) -> int:
    """The per-rank micro-batch size from the config.

    ``batch_size`` is per rank (torchtune's convention); ``global_batch_size``, when set, is the number of samples
    per micro-batch over all ranks and must split evenly across them.

    Args:
        batch_size (int): per-rank batch size.
        global_batch_size (Optional[int]): samples per micro-batch over all ranks, or None.
        world_size (int): number of ranks.

    Returns:
        int: the per-rank batch size.

    Raises:
        ConfigError: if ``global_batch_size`` is not a multiple of ``world_size``, or disagrees with ``batch_size``.
    """
    if global_batch_size is None:
        if batch_size is None or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be a positive integer (samples per rank).", "batch_size")
        return int(batch_size)
    if global_batch_size < world_size or global_batch_size % world_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} cannot be split evenly over {world_size} ranks "
            f"(--nproc_per_node x nnodes); use a multiple of {world_size} or change --nproc_per_node.",
            "global_batch_size",
        )
    return global_batch_size // world_size


def check_dataset_size(num_samples: int, batch_size: int, world_size: int) -> None:
    """Every rank needs at least one full micro-batch, or ranks would wait on each other forever.

    Args:
        num_samples (int): samples in the training set.
        batch_size (int): per-rank batch size.
        world_size (int): number of ranks.

    Raises:
        ConfigError: if the data set has fewer than ``batch_size * world_size`` samples.
    """
    if num_samples < batch_size * world_size:
        raise ConfigError(
            f"the training set has {num_samples} samples, fewer than one batch per rank ({world_size} ranks x "
            f"batch_size {batch_size} = {batch_size * world_size}): use fewer processes (--nproc_per_node), a "
            "smaller batch_size or more data.",
            "batch_size",
        )

"""The distributed recipe's dry run: each rank's peak under FSDP2, in one process, without a launcher.

For each rank in turn, a fake process group of ``world_size`` ranks (torch's ``fake`` backend: collectives that
allocate their outputs and move no data) stands in for the launcher's; the recipe is built as that rank would build
it, and its own step runs on fake tensors with the model sharded by the recipe's own ``_parallelize`` (FSDP2 per
decoder layer), so the estimate sees that rank's shards, the all-gathered layer in use (and the one prefetched), the
reduce-scatter buffers and its per-rank batch. The tracker follows FSDP2's frees and re-gathers, which resize
storages in place (:meth:`torchtune_ext.memory.LiveStorageTracker`).

The ranks share one machine (Kaggle's 2x T4): after the last rank, the host's report sums every rank's own host RAM
(process, loading, pinned offload buffers) and checks it against ``host_memory_gb``
(:func:`torchtune_ext.memory.host_report`).
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List

import torch.distributed as dist
from omegaconf import DictConfig

from torchtune_ext.config import ConfigError, recipe_setting
from torchtune_ext.memory._dry_run import collect_rank_hosts, host_report

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Within: the default process group is a fake one of ``world_size`` ranks in which this process is ``rank``,
    and the launcher's environment variables say so (restored after).

    Args:
        rank (int): this process's rank.
        world_size (int): the number of ranks.

    Raises:
        RuntimeError: if a process group exists already (a dry run inside a launched job).
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers torch's "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a per-rank dry run makes its own fake process group: run it without a launcher")
    saved: Dict[str, Any] = {name: os.environ.get(name) for name in _LAUNCHER_ENV}
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="localhost",
        MASTER_PORT="0",
    )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def dry_run_world_size(cfg: DictConfig) -> int:
    """``world_size`` of a per-rank dry run (default 2).

    Raises:
        ConfigError: if it is not an integer >= 2.
    """
    world_size = recipe_setting(cfg, "world_size")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
        raise ConfigError(f"world_size={world_size!r}: a per-rank dry run needs an integer >= 2 (e.g. world_size=2)")
    return world_size


def per_rank_dry_run(recipe_factory: Callable[[DictConfig], Any], cfg: DictConfig) -> List[str]:
    """Each rank's dry-run report (``recipe.dry_run(cfg)`` with that rank's fake process group), then the host's
    (every rank on one machine).

    Args:
        recipe_factory (Callable[[DictConfig], Any]): builds the recipe from the config: the recipe file's class
            (the step is its; the library's ``QLoRARecipe`` is refused).
        cfg (DictConfig): the config (``world_size``: ranks, default 2).

    Returns:
        List[str]: the reports: rank 0 first, the host's last.
    """
    world_size = dry_run_world_size(cfg)
    reports = []
    with collect_rank_hosts() as ranks:
        for rank in range(world_size):
            with fake_process_group(rank, world_size), warnings.catch_warnings():
                # torchao's NF4 all-gather compares the storages' data pointers; fake tensors have none to compare.
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                print(f"\n=== rank {rank} of {world_size} (FSDP2, fake process group) ===", flush=True)
                reports.append(recipe_factory(cfg).dry_run(cfg))
    host = "\n".join(
        [f"\n=== the host: {world_size} ranks on one machine ===", *(f"  {line}" for line in host_report(ranks))]
    )
    print(host, flush=True)
    return [*reports, host]


__all__ = ["dry_run_world_size", "fake_process_group", "per_rank_dry_run"]

"""Shared test helpers. ``run_distributed`` runs a function on a real multi-process gloo group."""

import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

DIST_TIMEOUT_S = 120


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous or a process group)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    from torchtune_ext.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"), DIST_TIMEOUT_S)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        destroy_distributed()


def run_distributed(fn: Callable, world_size: int = 2, *args: Any) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes on a gloo group.

    ``fn`` must be a module-level function (it is pickled). Assertion errors in any rank fail the caller with
    that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(DIST_TIMEOUT_S + 60)
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or any(p.exitcode != 0 for p in procs):
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures)
        raise AssertionError(f"distributed run failed (exit codes {[p.exitcode for p in procs]}):\n{details}")

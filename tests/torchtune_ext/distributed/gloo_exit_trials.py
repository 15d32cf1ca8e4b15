"""One rank of ``test_launch.py``'s exit trials: ``python gloo_exit_trials.py <port>,<port>,...`` with ``RANK``,
``WORLD_SIZE`` (2) and ``MASTER_ADDR`` set. Imports once, then forks one child per port; each child joins a fresh
gloo group on that port, does DTensor work (torch's sharding caches then hold the group, as after FSDP training),
a last all-gather whose tensors only gloo's worker still references, ``destroy_distributed()``, and exits through
the interpreter's finalization. Prints ``trial <i> exit <code>`` per child (a negative code is a signal); the first
child also prints how many gloo worker threads outlive ``destroy_process_group`` (printing hands the GIL over, so
the later trials do not).

``--no-drain``: ``dist.destroy_process_group()`` alone, to measure what ``destroy_distributed`` prevents.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchtune_ext.distributed import destroy_distributed, init_distributed


def _gloo_threads() -> int:
    names = [open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")


def _trial(port: str, probe: bool, drain: bool) -> None:
    os.environ["MASTER_PORT"] = port
    # The worker waits this long for the GIL before asking for it: the main thread reaches finalization first.
    sys.setswitchinterval(1.0)
    init_distributed(torch.device("cpu"), timeout_s=60)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    (distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) * 2).full_tensor()
    del mesh
    # The last collective's tensors and work are dropped at once: gloo's worker then holds their last references.
    dist.all_gather([torch.empty(8) for _ in range(dist.get_world_size())], torch.ones(8), async_op=True)
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:  # holding the GIL while the collective completes
        pass
    destroy_distributed() if drain else dist.destroy_process_group()
    if probe:
        print(f"gloo threads after destroy: {_gloo_threads()}", flush=True)


def main() -> None:
    ports = sys.argv[1].split(",")
    drain = "--no-drain" not in sys.argv
    for i, port in enumerate(ports):
        pid = os.fork()
        if pid == 0:
            _trial(port, probe=i == 0, drain=drain)
            sys.exit(0)  # the child ends as a process does: atexit, then finalization
        _, status = os.waitpid(pid, 0)
        print(f"trial {i} exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()

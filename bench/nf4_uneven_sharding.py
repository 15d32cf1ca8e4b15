"""Benchmark: NF4 bytes per rank when the weights do not split evenly: kept whole on every rank vs sharded unevenly.

For every shipped builder (bf16, LoRA on q/k/v/o and the MLP, real shapes on the meta device) and world sizes that
its rows or scale groups do not all divide, the MiB per rank of its NF4 weights:

- kept whole: the weights that do not split evenly are whole on every rank (the layout before issue 23's uneven
  sharding), the others split evenly;
- uneven: those weights split by whole scale groups, the trailing shards padded (``torchtune_ext.nf4.UnevenNF4Tensor``,
  what ``shard_model`` does now); the padding (at most) is shown apart;
Computed from shapes (``torchtune_ext.distributed.check_nf4_sharding``'s plan), not measured on a device: an NF4
shard is its inner tensors, so these are the bytes FSDP2 holds. Run (about a minute: the 70B models' layers)::

    python bench/nf4_uneven_sharding.py [--world-sizes 3 5 6 7]
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from torchtune_ext import models
from torchtune_ext.distributed import NF4ShardingPlan, check_nf4_sharding, nf4_nbytes, nf4_weights

MIB = 2**20


def _layout(model: torch.nn.Module, world_size: int) -> NF4ShardingPlan:
    """``check_nf4_sharding``'s plan, without its log line."""
    return check_nf4_sharding(model, world_size)


def kept_whole_bytes(model: torch.nn.Module, world_size: int) -> int:
    """Bytes per rank when every weight that does not split evenly is kept whole (the others split evenly)."""
    plan = _layout(model, world_size)
    uneven = set(plan.uneven)
    whole = sum(nf4_nbytes(w) for name, w in nf4_weights(model).items() if name in uneven)
    even = sum(nf4_nbytes(w) // world_size for name, w in nf4_weights(model).items() if name not in uneven)
    return whole + even + plan.whole_bytes


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[3, 5, 6, 7])
    args = parser.parse_args(argv)
    header = " | ".join(f"@{n}: whole / uneven (padding) MiB" for n in args.world_sizes)
    print(f"| builder | NF4 MiB (1 rank) | {header} |")
    print("|---|---|" + "---|" * len(args.world_sizes))
    for builder in models.QLORA_BUILDERS:
        model = builder(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, dtype=torch.bfloat16)
        total = _layout(model, 1).sharded_bytes
        cells = []
        for n in args.world_sizes:
            plan = _layout(model, n)
            uneven = plan.sharded_bytes + plan.whole_bytes
            whole = kept_whole_bytes(model, n)
            cells.append(f"{whole / MIB:.0f} / {uneven / MIB:.0f} ({plan.padding_bytes / MIB:.1f})")
        print(f"| {builder.__name__} | {total / MIB:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

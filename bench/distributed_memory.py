"""Per-rank device memory of the distributed recipe, ESTIMATED from the single-device estimator (no GPU needed).

The single-device recipe's own estimator (``QLoRAFinetuneRecipeSingleDevice(cfg).memory_estimator(cfg)``, see
bench/memory.py) gives the peak of one training step and what is live at it. Under FSDP2 (FULL_SHARD, one unit per
decoder layer, the root kept gathered after forward) a rank holds 1/N of the decoder layers' NF4 weights, of the
adapters, their gradients and optimizer state, plus the gathered weights of the layer in use and of the one being
prefetched, plus NF4 weights kept whole (``torchtune_ext.distributed.check_nf4_sharding``); activations are those of
its own per-rank batch. So, per rank::

    peak - (1 - 1/N) * (sharded layer NF4 + adapters + grads + optimizer state) + 2 * largest layer's NF4

It is an estimate of an estimate: no GPU has measured the distributed recipe yet (``bench/gpu.sh`` is where it
would). Run (about 1-2 minutes per sequence length for an 8B model on 2 shared cores)::

    .venv/bin/python bench/distributed_memory.py --config configs/llama3_1/8B_qlora_2xT4.yaml \
        --world-size 2 --seq-len 8192 16384 --dtype fp16

``--nf4-layout`` prints instead, for every shipped builder and 2-8 ranks, the MiB per rank of NF4 weights kept whole
(their rows or scale groups do not divide the world size) next to the NF4 MiB per rank of a fully sharded layout
(meta device, seconds)::

    .venv/bin/python bench/distributed_memory.py --nf4-layout
"""

from __future__ import annotations

import argparse
from typing import List

GIB = 1 << 30
SHARDED = ("adapters", "grads", "optimizer_state")


def _estimator(config: str, dtype: str, batch: int):
    from omegaconf import OmegaConf

    from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipeSingleDevice

    cfg = OmegaConf.load(config)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["dry_run=True", f"dtype={dtype}", f"batch_size={batch}"]))
    cfg.pop("fsdp_cpu_offload", None)
    return QLoRAFinetuneRecipeSingleDevice(cfg).memory_estimator(cfg), cfg


def _layer_nf4_bytes(cfg, world_size: int):
    """(bytes of the decoder layers' NF4 weights, of the largest layer's, of those kept whole on every rank)."""
    from torchtune import config as tt_config

    from torchtune_ext.distributed import check_nf4_sharding, nf4_nbytes
    from torchtune_ext.nf4 import NF4Tensor

    model = tt_config.instantiate(cfg.model, device="meta")
    per_layer = [sum(nf4_nbytes(p) for p in layer.parameters() if isinstance(p, NF4Tensor)) for layer in model.layers]
    return sum(per_layer), max(per_layer), check_nf4_sharding(model, world_size).whole_bytes


def nf4_layout_table(world_sizes=range(2, 9)) -> None:
    """Markdown table: per builder, NF4 MiB per rank if fully sharded, then MiB kept whole at each world size."""
    import torch

    from torchtune_ext import models
    from torchtune_ext.distributed import check_nf4_sharding

    print("| builder | NF4 MiB (1 rank) | " + " | ".join(f"whole MiB/rank @{n}" for n in world_sizes) + " |")
    print("|---|---|" + "---|" * len(world_sizes))
    for builder in models.QLORA_BUILDERS:
        model = builder(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, dtype=torch.bfloat16)
        total = check_nf4_sharding(model, 1).sharded_bytes
        whole = [check_nf4_sharding(model, n).whole_bytes / 2**20 for n in world_sizes]
        print(f"| {builder.__name__} | {total / 2**20:.0f} | " + " | ".join(f"{w:.0f}" for w in whole) + " |")


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config")
    parser.add_argument("--nf4-layout", action="store_true", help="the NF4 layout table of every builder")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[8192])
    parser.add_argument("--batch-size", type=int, default=1, help="per rank")
    parser.add_argument("--dtype", default="fp16")
    args = parser.parse_args(argv)
    if args.nf4_layout:
        return nf4_layout_table()
    if args.config is None:
        parser.error("--config is required (or --nf4-layout)")
    estimator, cfg = _estimator(args.config, args.dtype, args.batch_size)
    layers, largest, whole = _layer_nf4_bytes(cfg, args.world_size)
    n = args.world_size
    print(f"{args.config} dtype={args.dtype} batch {args.batch_size}/rank, {n} ranks (ESTIMATES, GiB)")
    print("seq_len  one_device  per_rank")
    for seq_len in args.seq_len:
        estimate = estimator.estimate(args.batch_size, seq_len)
        sharded = layers - whole + sum(estimate.breakdown.get(k, 0) for k in SHARDED)
        per_rank = estimate.device_bytes - (1 - 1 / n) * sharded + 2 * largest
        print(f"{seq_len:7d}  {estimate.device_bytes / GIB:10.2f}  {per_rank / GIB:8.2f}")


if __name__ == "__main__":
    main()

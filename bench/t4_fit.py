"""What fits on a T4: our recipe's memory estimate (``bench/memory.py``'s estimator and setting) for shipped
single-device configs, in fp16 and fp32 (a T4 has no bf16), against a T4's usable memory.

The setting is ``bench/memory.py``'s (LoRA rank 32 on q/k/v/o and the MLP, activation checkpointing, batch 1 x
``--seq-len`` tokens, no offloading); "device" is the estimator's peak plus the recipe's allowance (CUDA context,
fragmentation); the longest sequence is the estimator's search for the longest batch-1 sequence whose device
figure fits in 15 GiB (at most the config's model ``max_seq_len``). Under fp32 the frozen embedding/output are
stored in the checkpoint's 16-bit dtype (bf16 when it is not downloaded). Estimates, not measurements: no GPU is
used.

Run::

    .venv/bin/python bench/t4_fit.py configs/qwen3/0.6B_qlora_single_device.yaml ... [--seq-len 2048] [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory  # noqa: E402  bench/memory.py

#: a T4's 16 GB less what the driver keeps (the README's "15 GiB usable").
T4_GIB = 15.0
DTYPE_NAMES = ("fp16", "fp32")


def _estimate(task: Tuple[str, str, int]) -> Dict[str, Any]:
    """Worker: ``bench/memory.py``'s ``run_task`` for one config (registered as a model of its own)."""
    config, dtype_name, seq_len = task
    memory.MODELS[config] = (config, None)
    return memory.run_task((config, "ours", dtype_name, False, 1, seq_len, T4_GIB))


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="shipped *_qlora_single_device.yaml configs")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    tasks = [(config, dtype_name, args.seq_len) for config in args.configs for dtype_name in DTYPE_NAMES]
    results = memory._run_all(_estimate, tasks, args.jobs)
    print(f"# batch 1 x {args.seq_len} tokens, rank 32 on q/k/v/o + MLP, checkpointing; T4 = {T4_GIB:g} GiB\n")
    longest = f"longest sequence in {T4_GIB:g} GiB"
    print(f"| config | dtype | peak GiB | device GiB | fits a T4 at {args.seq_len} | {longest} |")
    print("|---|---|---|---|---|---|")
    for (config, dtype_name, _), result in zip(tasks, results):
        device = result["device"] / memory.GIB
        fits = "yes" if device <= T4_GIB else "no"
        peak = result["peak"] / memory.GIB
        print(f"| {config} | {dtype_name} | {peak:.2f} | {device:.2f} | {fits} | {result['max_ctx']} |")


if __name__ == "__main__":
    main()

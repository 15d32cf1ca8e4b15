"""Benchmark: NF4 dequantization and quantization throughput, ours vs torchao's, on the same tensors.

- dequantize: ``torchtune_ext.nf4.dequantize_nf4(w)`` vs torchao's ``w.get_original_weight()``, and to another
  dtype (``dequantize_nf4(w, dtype)`` vs ``w.get_original_weight().to(dtype)``: bf16 storage, fp32 compute);
- quantize: ``torchtune_ext.nf4.quantize_nf4(w)`` vs torchao's ``to_nf4(w)``.

Before timing, every pair is checked bit for bit (dequantized values compared as integers, so signed zeros and NaNs
count; quantized NF4 tensors compared inner tensor by inner tensor). Shapes are 7B/8B layers (4096x4096,
11008x4096, 14336x4096), dtypes fp32, bf16, fp16. Prints best-of-N times, Gparam/s and the speedup (torchao time
/ ours). On a CPU shared with other processes, pass ``--threads 1`` (see bench/nf4_linear.py). Run::

    python bench/nf4_dequant.py [--quick] [--device cpu|cuda] [--dtypes fp32,bf16,fp16] [--threads N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from typing import Dict, List, Tuple

import torch
from _timing import best_seconds, machine, sync

from torchtune_ext.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4, to_nf4

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(4096, 4096), (11008, 4096), (14336, 4096)]
NF4_INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _check_same_nf4(a: NF4Tensor, b: NF4Tensor) -> None:
    for name in NF4_INNER:
        if not torch.equal(_bits(getattr(a, name)), _bits(getattr(b, name))):
            raise AssertionError(f"quantize_nf4 differs from torchao's to_nf4 in {name}")


def _run_case(out_dim: int, in_dim: int, dtype: torch.dtype, device: torch.device, args) -> List[Dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    dense = (torch.randn(out_dim, in_dim, device=device, generator=gen) * 0.02).to(dtype)
    numel = dense.numel()
    rows = []
    # torchao's quantizer takes seconds per 7B layer on CPU: time one call (no warm-up: it has no caches) and
    # check and reuse its result.
    sync(device)
    t0 = time.perf_counter()
    nf4 = to_nf4(dense)
    sync(device)
    torchao_quantize = time.perf_counter() - t0
    if args.quick or device.type != "cpu":
        torchao_quantize = min(torchao_quantize, best_seconds(lambda: to_nf4(dense), device, args.reps, 0.0))
    _check_same_nf4(quantize_nf4(dense), nf4)
    ours_quantize = best_seconds(lambda: quantize_nf4(dense), device, args.reps, args.min_time)
    rows.append(dict(what="quantize", ours=ours_quantize, torchao=torchao_quantize))
    targets = [dtype] + ([torch.float32] if dtype != torch.float32 else [])
    for target in targets:
        if not torch.equal(_bits(dequantize_nf4(nf4, target)), _bits(nf4.get_original_weight().to(target))):
            raise AssertionError(f"dequantize_nf4 differs from torchao's get_original_weight ({dtype} -> {target})")
        rows.append(
            dict(
                what="dequantize" + ("" if target == dtype else f"->{_name(target)}"),
                ours=best_seconds(lambda t=target: dequantize_nf4(nf4, t), device, args.reps, args.min_time),
                torchao=best_seconds(
                    lambda t=target: nf4.get_original_weight().to(t), device, args.reps, args.min_time
                ),
            )
        )
    for row in rows:
        row.update(shape=f"{out_dim}x{in_dim}", dtype=_name(dtype), numel=numel)
    return rows


def _name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _print_table(rows: List[Dict]) -> None:
    header = (
        f"{'what':>15} {'shape':>10} {'dtype':>5} | {'ours ms':>9} {'torchao ms':>10} | "
        f"{'ours Gp/s':>9} {'torchao Gp/s':>12} | {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['what']:>15} {r['shape']:>10} {r['dtype']:>5} | {r['ours'] * 1e3:9.2f} {r['torchao'] * 1e3:10.2f} | "
            f"{r['numel'] / r['ours'] / 1e9:9.3f} {r['numel'] / r['torchao'] / 1e9:12.3f} | "
            f"{r['torchao'] / r['ours']:7.1f}x"
        )


def _shape(text: str) -> Tuple[int, int]:
    out_dim, _, in_dim = text.partition("x")
    return int(out_dim), int(in_dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only 4096x4096, 3 reps")
    parser.add_argument("--shape", type=_shape, default=None, help="OUTxIN: this weight shape alone")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated subset of fp32,bf16,fp16")
    parser.add_argument("--reps", type=int, default=5, help="minimum timed repetitions")
    parser.add_argument("--min-time", type=float, default=1.0, help="keep repeating (up to 10x reps) for this long")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.reps, args.min_time = 3, 0.0
    device = torch.device(args.device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"nf4_dequant: {machine(device)}; torch {torch.__version__}; "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}; load average {load:.2f}"
    )
    rows = []
    for out_dim, in_dim in [args.shape] if args.shape else SHAPES[:1] if args.quick else SHAPES:
        for dtype in (DTYPES[d] for d in args.dtypes.split(",")):
            rows += _run_case(out_dim, in_dim, dtype, device, args)
            print(".", end="", flush=True)
    print()
    _print_table(rows)


if __name__ == "__main__":
    main()

"""Benchmark: NF4 linear forward+backward, ours vs torchao's ``linear_nf4`` vs a dense linear, side by side.

For each 7B/8B-layer shape (in -> out: 4096->4096, 4096->11008, 4096->14336), token count (512, 2048) and compute
dtype (fp32, bf16, fp16), all three run in one process on the same inputs:

- dense: ``F.linear(x, W)`` with the dequantized weight as a frozen dense tensor of the compute dtype;
- ours: ``torchtune_ext.modules.linear_nf4(x, W_nf4, dtype)``;
- torchao: ``torchao.dtypes.nf4tensor.linear_nf4(x, W_nf4)`` (it computes in the activation's dtype, here the same).

The NF4 weight is quantized from a random weight in the compute dtype and the dense baseline uses its dequantized
values, so all three compute the same product. Reported: best-of-N fwd+bwd wall time (grad w.r.t. the input
only: the weight is frozen; best of N as ``timeit`` recommends, since other processes only ever add time), the
ratios ours/dense and ours/torchao, and the bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``;
an NF4 weight counts its packed storage). On CUDA also the peak memory above the inputs.

On a CPU shared with other processes, pass ``--threads 1``: with more OpenMP threads than idle cores every parallel
region stalls on a preempted thread, which punishes code with many small ops (ours, slab by slab) far more than one
big GEMM. Run::

    python bench/nf4_linear.py [--quick] [--device cpu|cuda] [--dtypes fp32,bf16,fp16] [--threads N]
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from _timing import best_seconds, machine, sync
from torchao.dtypes.nf4tensor import linear_nf4 as torchao_linear_nf4

from torchtune_ext.modules import linear_nf4
from torchtune_ext.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(4096, 4096), (11008, 4096), (14336, 4096)]
TOKENS = [512, 2048]


def _nbytes(t: torch.Tensor) -> int:
    if isinstance(t, NF4Tensor):
        return sum(getattr(t, name).nbytes for name in t.__tensor_flatten__()[0])
    return t.untyped_storage().nbytes()


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    saved: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t) if isinstance(t, NF4Tensor) else t.untyped_storage().data_ptr()
        saved[key] = _nbytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(saved.values())


def _peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    if device.type != "cuda":
        return -1
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def _run_case(out_dim: int, in_dim: int, tokens: int, dtype: torch.dtype, device: torch.device, args) -> Dict:
    gen = torch.Generator(device=device).manual_seed(0)
    dense_init = (torch.randn(out_dim, in_dim, device=device, generator=gen) * 0.02).to(dtype)
    nf4 = quantize_nf4(dense_init)
    del dense_init
    weight = dequantize_nf4(nf4)
    x = torch.randn(tokens, in_dim, device=device, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(tokens, out_dim, device=device, generator=gen).to(dtype)
    ops = {
        "dense": lambda: F.linear(x, weight),
        "ours": lambda: linear_nf4(x, nf4, dtype),
        "torchao": lambda: torchao_linear_nf4(x, nf4),
    }
    row: Dict = {"shape": f"{in_dim}->{out_dim}", "tokens": tokens, "dtype": dtype}
    for name, op in ops.items():

        def step(op=op):
            x.grad = None
            op().backward(grad_out)

        row[f"{name}_s"] = best_seconds(step, device, args.reps, args.min_time)
        row[f"{name}_saved"] = _saved_bytes(op)
        row[f"{name}_peak"] = _peak_bytes(step, device)
    return row


def _fmt_bytes(n: int) -> str:
    return "-" if n < 0 else f"{n / 2**20:.1f}"


def _print_table(rows: List[Dict], device: torch.device) -> None:
    header = (
        f"{'in->out':>11} {'tok':>5} {'dtype':>5} | {'dense ms':>9} {'ours ms':>9} {'torchao ms':>10} | "
        f"{'ours/dense':>10} {'ours/torchao':>12} | {'saved MiB dense/ours/torchao':>28}"
    )
    if device.type == "cuda":
        header += f" | {'peak MiB dense/ours/torchao':>27}"
    print(header)
    print("-" * len(header))
    for r in rows:
        dtype = {v: k for k, v in DTYPES.items()}[r["dtype"]]
        saved = "/".join(_fmt_bytes(r[f"{n}_saved"]) for n in ("dense", "ours", "torchao"))
        line = (
            f"{r['shape']:>11} {r['tokens']:>5} {dtype:>5} | {r['dense_s'] * 1e3:9.1f} {r['ours_s'] * 1e3:9.1f} "
            f"{r['torchao_s'] * 1e3:10.1f} | {r['ours_s'] / r['dense_s']:10.2f} "
            f"{r['ours_s'] / r['torchao_s']:12.2f} | {saved:>28}"
        )
        if device.type == "cuda":
            line += " | " + "/".join(_fmt_bytes(r[f"{n}_peak"]) for n in ("dense", "ours", "torchao")).rjust(27)
        print(line)


def _shape(text: str) -> Tuple[int, int]:
    out_dim, _, in_dim = text.partition("x")
    return int(out_dim), int(in_dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only 4096x4096 at 512 tokens, 3 reps")
    parser.add_argument("--shape", type=_shape, default=None, help="OUTxIN: this weight shape alone")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated subset of fp32,bf16,fp16")
    parser.add_argument("--reps", type=int, default=5, help="minimum timed repetitions per op")
    parser.add_argument("--min-time", type=float, default=1.0, help="keep repeating (up to 10x reps) for this long")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes, tokens = (SHAPES[:1], TOKENS[:1]) if args.quick else (SHAPES, TOKENS)
    shapes = [args.shape] if args.shape else shapes
    if args.quick:
        args.reps, args.min_time = 3, 0.0
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"nf4_linear: {machine(device)}; torch {torch.__version__}; "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}; load average {load:.2f}"
    )
    rows = []
    for out_dim, in_dim in shapes:
        for n_tokens in tokens:
            for dtype in dtypes:
                rows.append(_run_case(out_dim, in_dim, n_tokens, dtype, device, args))
                print(".", end="", flush=True)
    print()
    _print_table(rows, device)


if __name__ == "__main__":
    main()

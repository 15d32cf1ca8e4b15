"""Benchmark: the native CPU kernels (``torchtune_ext.nf4._cpu_kernels``) against our torch path and bitsandbytes.

Per weight shape of SmolLM2-135M and Llama-3.2-1B (bf16 NF4, fp32 compute):

- a decoded token's product (1 token): ``linear_nf4`` with the kernels, the same with the kernels off (dequantize,
  then ``torch.mm``), and bitsandbytes' ``gemv_4bit`` on the same weight quantized by bitsandbytes (its CPU kernel
  computes in bf16);
- 4 tokens, kernels on and off;
- decoding the whole weight to fp32 (``dequantize_nf4``), kernels on and off, and torchao's ``get_original_weight``.

Every result is checked first: the products against a float64 product of torchao's dequantized weight, the decoded
weights bit for bit against torchao's. Prints best-of-N times and ratios (ours / peer). Run::

    python bench/cpu_kernels.py [--threads 1] [--reps 20]
"""

from __future__ import annotations

import argparse
import datetime
from typing import Callable, List

import torch
import torch.nn.functional as F
from _timing import best_seconds, machine

from torchtune_ext.modules import cached_nf4_scales, linear_nf4
from torchtune_ext.nf4 import (
    cpu_kernels_available,
    cpu_kernels_off,
    cpu_kernels_unavailable_reason,
    dequantize_nf4,
    quantize_nf4,
)

SHAPES = {
    "135m q/o": (576, 576),
    "135m gate/up": (1536, 576),
    "135m down": (576, 1536),
    "1b q/o": (2048, 2048),
    "1b gate/up": (8192, 2048),
    "1b down": (2048, 8192),
}
CPU = torch.device("cpu")


def _kernels_off(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with cpu_kernels_off():
            return fn()

    return run


def _bnb_gemv(dense: torch.Tensor, x: torch.Tensor) -> Callable[[], object]:
    import bitsandbytes.functional as bnb

    packed, state = bnb.quantize_4bit(dense, quant_type="nf4", blocksize=64)
    x16 = x.to(torch.bfloat16)
    return lambda: bnb.gemv_4bit(x16, packed.t(), state=state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-bnb", action="store_true", help="leave bitsandbytes out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels_available():
        raise SystemExit(f"the CPU kernels are unavailable here: {cpu_kernels_unavailable_reason()}")
    print(f"# {machine(CPU)}, torch {torch.__version__}, {datetime.date.today()}")
    print(
        "| weight | shape | 1 token: kernel / torch path / bnb gemv_4bit (ms) | kernel vs torch | kernel vs bnb | "
        "4 tokens: kernel / torch path (ms) | decode to fp32: kernel / torch / torchao (ms) | decode vs torch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for name, shape in SHAPES.items():
        cells = _shape_cells(shape, generator, args)
        print(f"| {name} | {shape[0]}x{shape[1]} | " + " | ".join(cells) + " |", flush=True)


def _product_cells(weight, dense: torch.Tensor, x: torch.Tensor, args) -> List[str]:
    """1 token: kernel / torch path / bnb and two ratios; more tokens: kernel / torch path."""
    expected = F.linear(x.double(), weight.get_original_weight().double())
    ours = lambda: linear_nf4(x, weight, torch.float32)  # noqa: E731
    torch_path = _kernels_off(ours)
    for fn in (ours, torch_path):
        torch.testing.assert_close(fn().double(), expected, rtol=1e-5, atol=1e-5)
    ours_ms, torch_ms = _ms(ours, args), _ms(torch_path, args)
    if x.shape[0] > 1:
        return [f"{ours_ms:.3f} / {torch_ms:.3f}"]
    bnb_ms = float("nan") if args.no_bnb else _ms(_bnb_gemv(dense, x), args)
    return [f"{ours_ms:.3f} / {torch_ms:.3f} / {bnb_ms:.3f}", f"{ours_ms / torch_ms:.2f}x", f"{ours_ms / bnb_ms:.2f}x"]


def _shape_cells(shape, generator: torch.Generator, args) -> List[str]:
    dense = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    weight = quantize_nf4(dense)
    cells: List[str] = []
    with torch.no_grad(), cached_nf4_scales():
        for tokens in (1, 4):
            cells += _product_cells(weight, dense, torch.randn(tokens, shape[1], generator=generator), args)
    ours = lambda: dequantize_nf4(weight, torch.float32)  # noqa: E731
    torch_path = _kernels_off(ours)
    for fn in (ours, torch_path):
        assert torch.equal(fn(), weight.get_original_weight().float())
    ours_ms, torch_ms = _ms(ours, args), _ms(torch_path, args)
    torchao_ms = _ms(lambda: weight.get_original_weight().float(), args)
    return cells + [f"{ours_ms:.3f} / {torch_ms:.3f} / {torchao_ms:.3f}", f"{ours_ms / torch_ms:.2f}x"]


def _ms(fn: Callable[[], object], args) -> float:
    return best_seconds(fn, CPU, args.reps, 0.2) * 1e3


if __name__ == "__main__":
    main()

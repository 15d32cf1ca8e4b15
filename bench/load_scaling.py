"""Benchmark: the base load is linear in the model (issue 25, item 2).

Prints two ratios:

1. time per tensor of ``load_base_`` at 128 layers over 8 layers, on a small Qwen-style model (dim 256) with random
   bf16 weights (target: within 1.5x);
2. ``load_base_`` of a real-shape Qwen2.5-1.5B (random bf16 weights, 3.1 GB, written once to ``--cache``) over the
   time to read its file (every tensor, page cache warm), with the NF4 quantization's own share (target: 1.5x).
   ``--device cuda`` loads onto the GPU, where the recipe quantizes (``bench/gpu.sh`` runs it).

Run::

    OMP_NUM_THREADS=1 python bench/load_scaling.py [--cache /tmp/torchtune_ext_load_scaling] [--skip-1p5b]
    python bench/load_scaling.py --device cuda --skip-small
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Tuple

import torch

from torchtune_ext.checkpoint import (
    QLoRAHFCheckpointer,
    iter_safetensors,
    load_base_,
    qwen2_hf_config,
    read_safetensors_header,
    write_random_hf_checkpoint,
)
from torchtune_ext.models import TINY_QWEN_ARGS, qlora_qwen2_5_1_5b_instruct, qlora_tiny_qwen
from torchtune_ext.nf4 import NF4Tensor, quantize_nf4

LORA = dict(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=8, lora_alpha=16)
QWEN2_5_1_5B = dict(
    vocab_size=151_936,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    embed_dim=1536,
    intermediate_dim=8960,
    max_seq_len=32_768,
    tie_word_embeddings=True,
)


def _checkpoint(path: Path, model: torch.nn.Module, args: dict) -> Path:
    if not (path / "config.json").is_file():
        print(f"writing {path} (once) ...", flush=True)
        write_random_hf_checkpoint(path, model, "QWEN2", qwen2_hf_config(**args), dtype=torch.bfloat16, seed=0)
    return path


def _timed_load(model: torch.nn.Module, checkpoint: Path, out: Path, device: torch.device) -> Tuple[float, int]:
    checkpointer = QLoRAHFCheckpointer(str(checkpoint), str(out), "QWEN2")
    checkpointer.validate(model)
    tensors = sum(len(read_safetensors_header(p)) for p in checkpointer.checkpoint_paths)
    start = time.perf_counter()
    load_base_(model, checkpointer, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, tensors


def per_tensor(cache: Path, layers: int, repeats: int) -> float:
    args = {**TINY_QWEN_ARGS, "num_layers": layers}
    checkpoint = _checkpoint(cache / f"qwen_small_{layers}", qlora_tiny_qwen(**LORA, num_layers=layers), args)
    best = float("inf")
    for _ in range(repeats):
        model = qlora_tiny_qwen(**LORA, num_layers=layers, dtype=torch.bfloat16, device="meta")
        seconds, tensors = _timed_load(model, checkpoint, cache / "out", torch.device("cpu"))
        best = min(best, seconds / tensors)
    print(f"  {layers:4d} layers: {tensors} tensors, {best * 1e3:.3f} ms per tensor (best of {repeats})", flush=True)
    return best


def read_seconds(checkpoint: Path) -> float:
    start = time.perf_counter()
    for path in sorted(checkpoint.glob("*.safetensors")):
        for _, tensor in iter_safetensors(path):
            del tensor
    return time.perf_counter() - start


def quantize_seconds(model: torch.nn.Module, device: torch.device) -> float:
    """Time to quantize every NF4 weight of the loaded model again from bf16 on ``device`` (the load's
    quantization share)."""
    total = 0.0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, NF4Tensor):
            dense = torch.empty(weight.shape, dtype=torch.bfloat16, device=device).normal_()
            start = time.perf_counter()
            quantize_nf4(dense, weight.block_size, weight.scaler_block_size)
            if device.type == "cuda":
                torch.cuda.synchronize()
            total += time.perf_counter() - start
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/torchtune_ext_load_scaling"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-1p5b", action="store_true")
    parser.add_argument("--skip-small", action="store_true", help="only the Qwen2.5-1.5B load (part 2)")
    parser.add_argument("--device", default="cpu", help="where part 2 loads and quantizes: cpu or cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, part 2 on {device}", flush=True)

    if not args.skip_small:
        print("1. load_base_ time per tensor, small Qwen-style model (dim 256), bf16:")
        small, large = per_tensor(args.cache, 8, args.repeats), per_tensor(args.cache, 128, args.repeats)
        print(f"  ratio 128 / 8 layers: {large / small:.2f}x (target <= 1.5x)", flush=True)
    if args.skip_1p5b:
        return

    print("2. Qwen2.5-1.5B shape, random bf16 weights:")
    checkpoint = _checkpoint(args.cache / "qwen2_5_1_5b", qlora_qwen2_5_1_5b_instruct(**LORA), QWEN2_5_1_5B)
    read_seconds(checkpoint)  # warm the page cache
    read = min(read_seconds(checkpoint) for _ in range(2))
    model = qlora_qwen2_5_1_5b_instruct(**LORA, dtype=torch.bfloat16, device="meta")
    load, tensors = _timed_load(model, checkpoint, args.cache / "out", device)
    quantize = quantize_seconds(model, device)
    print(f"  read every tensor of the file: {read:.2f} s")
    print(f"  load_base_ onto {device} (read + NF4 quantize + place): {load:.2f} s, {tensors} tensors")
    print(f"  of which NF4 quantization (measured alone): {quantize:.2f} s")
    print(f"  ratio load / read: {load / read:.2f}x (target <= 1.5x)")
    print(f"  ratio without the quantization: {(load - quantize) / read:.2f}x")


if __name__ == "__main__":
    main()

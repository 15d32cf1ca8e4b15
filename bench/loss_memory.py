"""Benchmark: memory and time of the loss alone (hidden -> loss -> grads), ours vs torchtune's chunked loss.

Setting: Llama 3.2 1B's output projection, a frozen 128,256 x 2048 weight (its tied embedding, as in QLoRA), hidden
states ``[1, tokens, 2048]`` that require grad, every token labelled (torchtune computes the logits of ignored
tokens too, ours skips them: that would only widen the gap).

- torchtune: the model's chunked output (``ContiguousChunksTransformerDecoder.chunked_output``, 8 chunks) and
  ``CEWithChunkedOutputLoss``, the logits list held until the loss is computed, as the recipe does;
- fused / checkpoint: ``LinearCrossEntropyLoss`` with its fused path (used for plain weights) or its checkpoint path
  (used for LoRA / pruned / sharded outputs, forced here with ``fused=False``), default chunk size.

Memory: live tensor bytes counted by a ``TorchDispatchMode`` (every op's output storage, freed when its storage
dies), peak during forward + backward above what is live before (hidden, weight, labels). "logits MiB" subtracts
the hidden states' gradient, which every method allocates. By default the memory runs replace each matmul by a
zero-filled output of the same shape and dtype (``--real-matmuls`` to compute them): the allocations are the same,
since no allocation depends on the matmul values, and a 4k-token fp32 run takes seconds instead of minutes on 2 CPU
cores. Time: wall time of a real forward + backward (CUDA synchronised; the fastest of ``--repeats``, methods
interleaved), for ``--time-tokens`` x ``--time-dtypes``. bf16 timing is not in the default run: on CPU, torchtune's
bf16 backward goes through a ``bmm`` that copies the 512 MB weight for each chunk (about 50 s per run on 2 cores,
whatever the length), which ours avoids.

Run (about 2 minutes on 2 idle CPU cores; the full grid of the report adds ``--time-tokens 1024 4096
--time-dtypes bf16 fp32``, about 15 minutes)::

    .venv/bin/python bench/loss_memory.py [--tokens 1024 4096] [--dtypes bf16 fp32]
        [--time-tokens 512] [--time-dtypes fp32] [--repeats 1] [--device cpu|cuda] [--real-matmuls]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import weakref
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_ext.modules import ContiguousChunksTransformerDecoder
from torchtune_ext.modules.loss import LinearCrossEntropyLoss

VOCAB_SIZE, DIM, NUM_OUTPUT_CHUNKS = 128_256, 2048, 8
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
METHODS = ("torchtune", "fused", "checkpoint")
MiB = 2**20
_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.mm.out,
    torch.ops.aten.addmm_.default,
}


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created inside it, and their peak.

    Args:
        skip_matmuls (bool): replace matmuls by zero-filled outputs (same shape, dtype and lifetime).
    """

    def __init__(self, skip_matmuls: bool = False):
        super().__init__()
        self.skip_matmuls = skip_matmuls
        self.live = 0
        self.peak = 0
        self._sizes: Dict[int, int] = {}
        self._external: set = set()

    def ignore(self, *tensors: torch.Tensor) -> None:
        """Leaves out the storages of tensors that exist already (views of them are not new memory)."""
        self._external.update(t.untyped_storage()._cdata for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _fake_matmul(func, args, kwargs) if self.skip_matmuls and func in _MATMULS else func(*args, **kwargs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._sizes or key in self._external:
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


def _fake_matmul(func, args, kwargs) -> torch.Tensor:
    if func is torch.ops.aten.addmm_.default:
        return args[0]
    if func is torch.ops.aten.mm.out:
        return kwargs["out"]
    a, b = (args[1], args[2]) if func is torch.ops.aten.addmm.default else (args[0], args[1])
    return torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)


def _torchtune_step(output: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    decoder = SimpleNamespace(output=output, num_output_chunks=NUM_OUTPUT_CHUNKS)
    logits = ContiguousChunksTransformerDecoder.chunked_output(decoder, hidden)
    loss = CEWithChunkedOutputLoss(num_output_chunks=NUM_OUTPUT_CHUNKS)(logits, labels)
    del logits
    return loss


def _ours_step(fused: bool) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(output: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_fn = LinearCrossEntropyLoss(fused=fused)
        loss_fn.set_output(output)
        return loss_fn(hidden, labels)

    return step


STEPS = {"torchtune": _torchtune_step, "fused": _ours_step(True), "checkpoint": _ours_step(False)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(method: str, tokens: int, dtype: torch.dtype, device: torch.device, skip_matmuls: bool) -> Dict[str, float]:
    """One forward + backward of a method.

    Returns:
        Dict[str, float]: ``peak_mib`` (above the inputs), ``logits_mib`` (minus the hidden grad), ``seconds``,
        ``loss`` (nan when matmuls are skipped) and, on CUDA, ``cuda_peak_mib`` (allocator, above the inputs).
    """
    generator = torch.Generator(device="cpu").manual_seed(0)
    output = nn.Linear(DIM, VOCAB_SIZE, bias=False, device=device, dtype=dtype).requires_grad_(False)
    with torch.no_grad():
        output.weight.copy_(torch.randn(VOCAB_SIZE, DIM, generator=generator).mul_(0.02))
    hidden = torch.randn(1, tokens, DIM, generator=generator).to(device, dtype).requires_grad_()
    labels = torch.randint(0, VOCAB_SIZE, (1, tokens), generator=generator).to(device)
    gc.collect()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    tracker = LiveBytes(skip_matmuls)
    tracker.ignore(output.weight, hidden, labels)
    start = time.perf_counter()
    with tracker:
        loss = STEPS[method](output, hidden, labels)
        loss.backward()
        loss = loss.detach()
    _sync(device)
    seconds = time.perf_counter() - start
    grad_bytes = hidden.numel() * hidden.element_size()
    result = {
        "peak_mib": tracker.peak / MiB,
        "logits_mib": (tracker.peak - grad_bytes) / MiB,
        "seconds": seconds,
        "loss": float("nan") if skip_matmuls else float(loss),
    }
    if device.type == "cuda":
        result["cuda_peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / MiB
    return result


def _row(cells: List[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096], help="memory runs: tokens")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--time-tokens", type=int, nargs="*", default=[512], help="timed (real) runs: tokens")
    parser.add_argument("--time-dtypes", nargs="*", default=["fp32"], choices=sorted(DTYPES), help="timed runs")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per method (the fastest is shown)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--real-matmuls", action="store_true", help="compute the matmuls in the memory runs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}")
    print(f"output {VOCAB_SIZE} x {DIM} (frozen), torchtune with {NUM_OUTPUT_CHUNKS} chunks\n")

    skip = not args.real_matmuls and device.type == "cpu"
    if args.tokens:
        print(_row(["dtype", "tokens", "method", "peak MiB", "logits MiB", "logits vs torchtune", "matmuls"]))
        print(_row(["---"] * 7))
    for name in args.dtypes:
        for tokens in args.tokens:
            results = {m: run(m, tokens, DTYPES[name], device, skip) for m in METHODS}
            ref = results["torchtune"]["logits_mib"]
            for method, r in results.items():
                cells = [name, str(tokens), method, f"{r['peak_mib']:.1f}", f"{r['logits_mib']:.1f}"]
                cells += [f"{r['logits_mib'] / ref:.3f}", "zeros" if skip else "real"]
                print(_row(cells), flush=True)

    if not args.time_tokens or not args.time_dtypes:
        return
    print()
    print(_row(["dtype", "tokens", "method", "seconds", "time vs torchtune", "loss", "peak MiB"]))
    print(_row(["---"] * 7))
    for name in args.time_dtypes:
        for tokens in args.time_tokens:
            results: Dict[str, Dict[str, float]] = {}
            for _ in range(args.repeats):  # interleaved, the fastest of each: the machine may be shared
                for m in METHODS:
                    r = run(m, tokens, DTYPES[name], device, skip_matmuls=False)
                    if m not in results or r["seconds"] < results[m]["seconds"]:
                        results[m] = r
            ref = results["torchtune"]["seconds"]
            for method, r in results.items():
                cells = [name, str(tokens), method, f"{r['seconds']:.2f}", f"{r['seconds'] / ref:.2f}"]
                cells += [f"{r['loss']:.5f}", f"{r.get('cuda_peak_mib', r['peak_mib']):.1f}"]
                print(_row(cells), flush=True)


if __name__ == "__main__":
    main()

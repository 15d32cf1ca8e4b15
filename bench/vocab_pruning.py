"""Benchmark: peak memory and tokens/s of QLoRA training steps with and without vocabulary pruning.

Model: a tiny Llama 3-style QLoRA decoder with Llama 3's 128,256-token vocabulary (torchtune's ``lora_llama3_2``
component builder through ``torchtune_ext.models.build_qlora``: 2 layers, dim 512, tied embeddings, NF4 base, LoRA
rank 8 on q/v, compute dtype bf16). Data: 64 synthetic samples of 512 tokens whose ids follow a Zipf law over a
random ordering of the vocabulary, so the data uses a few thousand distinct ids, as a small fine-tuning set does.
Each step trains on a batch of 2 x 512 tokens with AdamW.

- peer: the unpruned model trained as torchtune's recipes do (adapters only; logits in 8 chunks with
  ``CEWithChunkedOutputLoss``, torchtune's memory-saving default);
- ours: the same model after ``prune_vocab_`` to the ids the data uses (plus bos/eos/pad), the pruned rows trained
  in fp32 (adapters too), same chunked loss over the ``K`` kept logits.

Both models are built on the meta device (the pruned one pruned there) and materialised with random weights. Each
variant runs in a fresh subprocess with a fixed glibc mmap threshold (freed tensor buffers go back to the OS). Memory:
CPU peak RSS during the timed training steps (the kernel's high-water mark, reset after a warm-up step), above the
RSS measured after imports and also for the whole process, plus the process's lifetime peak RSS; on CUDA also
``torch.cuda.max_memory_allocated`` during the steps. Run::

    python bench/vocab_pruning.py [--steps 3] [--dtype bf16] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any, Dict, List

import torch

VOCAB_SIZE = 128_256
BOS_ID, EOS_ID, PAD_ID = 128_000, 128_001, 128_004  # Llama 3's <|begin_of_text|>, <|end_of_text|>, pad
MODEL_ARGS: Dict[str, Any] = dict(
    lora_attn_modules=["q_proj", "v_proj"],
    lora_rank=8,
    lora_alpha=16,
    vocab_size=VOCAB_SIZE,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    embed_dim=512,
    intermediate_dim=1024,
    max_seq_len=512,
    tie_word_embeddings=True,
)
BATCH, SEQ_LEN, NUM_SAMPLES, NUM_OUTPUT_CHUNKS = 2, 512, 64, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def synthetic_dataset(seed: int = 0) -> List[torch.Tensor]:
    """Samples of ``SEQ_LEN`` token ids, Zipf-distributed over a random ordering of the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, VOCAB_SIZE + 1, dtype=torch.float64)
    probs = 1.0 / ranks**1.1
    order = torch.randperm(VOCAB_SIZE, generator=generator)
    samples = []
    for _ in range(NUM_SAMPLES):
        ids = order[torch.multinomial(probs, SEQ_LEN, replacement=True, generator=generator)]
        ids[0] = BOS_ID
        samples.append(ids)
    return samples


def _batch(samples: List[torch.Tensor], step: int, device: torch.device):
    tokens = torch.stack([samples[(step * BATCH + i) % len(samples)] for i in range(BATCH)]).to(device)
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100, device=device)], dim=1)
    return tokens, labels


def worker(prune: bool, steps: int, dtype: torch.dtype) -> Dict[str, Any]:
    """One variant, in this process: build, (prune), train ``steps`` steps; returns the measurements."""
    from torchtune.models.llama3_2 import lora_llama3_2
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from torchtune_ext.models import build_qlora, materialize_
    from torchtune_ext.modules import collect_token_ids, prune_vocab_

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    samples = synthetic_dataset()
    gc.collect()
    rss_after_imports = _status_mb("VmRSS")

    # Built on the meta device and pruned there, as a recipe loading prune_state_dict(base) would: the full
    # embedding never exists in the pruned run, so allocator leftovers do not blur the comparison.
    model = build_qlora(lora_llama3_2, dtype=dtype, device="meta", **MODEL_ARGS)
    num_kept = VOCAB_SIZE
    pruning = None
    if prune:
        kept = collect_token_ids(samples, always_keep=(BOS_ID, EOS_ID, PAD_ID), vocab_size=VOCAB_SIZE)
        pruning = prune_vocab_(model, kept)
        num_kept = len(kept)
    materialize_(model, device, seed=0)
    set_trainable_params(model, get_adapter_params(model))
    model.set_num_output_chunks(NUM_OUTPUT_CHUNKS)
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=NUM_OUTPUT_CHUNKS)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    gc.collect()

    def step(index: int) -> float:
        tokens, labels = _batch(samples, index, device)
        if pruning is not None:
            labels = pruning.remap_labels(labels)
        loss = loss_fn(model(tokens), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step(0)  # warm-up: allocates the optimizer state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before_steps = _status_mb("VmRSS")
    peak_before_steps = _status_mb("VmHWM")
    _reset_peak_rss()
    start = time.perf_counter()
    losses = [step(i) for i in range(1, steps + 1)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = {
        "prune": prune,
        "device": str(device),
        "dtype": str(dtype),
        "kept": num_kept,
        "trainable_params": sum(p.numel() for p in trainable),
        "tokens_per_s": steps * BATCH * SEQ_LEN / elapsed,
        "rss_after_imports_mb": rss_after_imports,
        "rss_before_steps_mb": rss_before_steps,
        "train_peak_rss_mb": _status_mb("VmHWM"),
        "lifetime_peak_rss_mb": max(peak_before_steps, _status_mb("VmHWM")),
        "losses": losses,
    }
    result["train_peak_above_imports_mb"] = result["train_peak_rss_mb"] - rss_after_imports
    if device.type == "cuda":
        result["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def _run_variant(prune: bool, steps: int, dtype_name: str) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--prune", str(int(prune)), "--steps", str(steps)]
    cmd += ["--dtype", dtype_name]
    # A fixed mmap threshold makes glibc return every freed tensor buffer to the OS, so RSS follows live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"model name\s+:\s+(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    load = os.getloadavg()[0]
    return f"{cpu}, {os.cpu_count()} cores (load {load:.1f}){gpu}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per variant (after 1 warm-up)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype of the model")
    parser.add_argument("--out", default=None, help="append result rows to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prune", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(bool(args.prune), args.steps, DTYPES[args.dtype])))
        return

    peer = _run_variant(False, args.steps, args.dtype)
    ours = _run_variant(True, args.steps, args.dtype)
    command = f"python bench/vocab_pruning.py --steps {args.steps} --dtype {args.dtype}"
    what = f"tiny Llama 3 QLoRA ({args.dtype}), V={VOCAB_SIZE} -> K={ours['kept']}, batch {BATCH}x{SEQ_LEN}"
    metrics = [
        ("train-step peak RSS above imports (MB)", "train_peak_above_imports_mb"),
        ("train-step peak RSS, whole process (MB)", "train_peak_rss_mb"),
        ("lifetime peak RSS (MB)", "lifetime_peak_rss_mb"),
        ("tokens/s", "tokens_per_s"),
    ]
    if "cuda_peak_allocated_mb" in ours:
        metrics.insert(0, ("CUDA peak allocated during steps (MB)", "cuda_peak_allocated_mb"))
    machine, date = _machine(), datetime.date.today().isoformat()
    rows = []
    for label, key in metrics:
        ratio = ours[key] / peer[key]
        rows.append(
            f"| {what}: {label} | `{command}` | {ours[key]:.1f} | {peer[key]:.1f} | {ratio:.3f} | {machine} | {date} |"
        )
    print(json.dumps({"ours": ours, "peer": peer}, indent=1))
    print("\n".join(rows))
    if args.out:
        header = "| what | command | ours | peer | ratio | machine | date |\n|---|---|---|---|---|---|---|\n"
        exists = os.path.exists(args.out)
        with open(args.out, "a") as f:
            if not exists:
                f.write(
                    "# Vocab pruning benchmark\n\nours = `prune_vocab_` to the ids the data uses (pruned rows "
                    "trained in fp32); peer = the unpruned model (torchtune's chunked CE). ratio = ours / peer "
                    "(goal for peak memory: <= 0.5).\n\n" + header
                )
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()

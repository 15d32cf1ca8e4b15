"""Benchmark: our single-device QLoRA recipe vs torchtune's ``lora_finetune_single_device``: tokens/s and peak memory.

Both recipes train the same tiny Llama-style model (``configs/tiny/qlora_single_device.yaml``: its generated HF
checkpoint, tokenizer, data and LoRA settings; torchtune gets ``torchtune_ext.models.lora_tiny_llama`` with
``quantize_base=True`` and its own ``FullModelHFCheckpointer``) for the same steps, each in a fresh process, in
fp32 and bf16 (torchtune's recipe rejects fp16). Reported: tokens/s = median over the steps after a warm-up of
(label tokens / step wall time), the definition both recipes log; the runs alternate ours / torchtune
``--repeats`` times and the best run of each counts (the machine is shared, so the slower runs measure other
jobs). Peak memory: CUDA peak allocated, or on CPU the process's peak RSS; ratios ours / torchtune. Both runs see
identical batches; their first-step losses are printed side by side as a sanity check.

``--model 1b`` trains a Llama-3.2-1B-shaped model instead (``configs/llama3_2/1B_qlora_single_device.yaml``, LoRA
rank 64 on q/v/output_proj + MLP, activation checkpointing; the random-weight checkpoint of ``bench/load.py``;
torchtune gets ``torchtune.models.llama3_2.qlora_llama3_2_1b``) on the tiny tokenizer and data, batch 4 of up to 128
tokens, one step of warm-up. Run::

    python bench/recipe.py [--device cpu|cuda] [--dtypes fp32,bf16] [--steps 60] [--repeats 3]
    python bench/recipe.py --model 1b --steps 4 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
# model: (our config, torchtune's builder for the same architecture, warm-up steps left out of the median)
MODELS = {
    "tiny": (ROOT / "configs" / "tiny" / "qlora_single_device.yaml", "torchtune_ext.models.lora_tiny_llama", 5),
    "1b": (
        ROOT / "configs" / "llama3_2" / "1B_qlora_single_device.yaml",
        "torchtune.models.llama3_2.qlora_llama3_2_1b",
        1,
    ),
}

sys.path.insert(0, str(ROOT / "bench"))
from load import ensure_checkpoint, worker_env, write_notes_section  # noqa: E402


class _Capture:
    """Metric logger keeping every logged dict (instantiated by dotted path from the config)."""

    rows: List[Dict[str, float]] = []

    def __init__(self, **kwargs):
        type(self).rows = []

    def log_config(self, config):
        pass

    def log_dict(self, payload, step):
        type(self).rows.append({k: float(v) for k, v in payload.items()})

    def log(self, name, data, step):
        pass

    def close(self):
        pass


_DESCRIPTIONS = {
    "tiny": "Tiny default config (2 layers, dim 256, vocab 512, LoRA rank 16 on q/k/v/output_proj + MLP, batch 16, "
    "~16 tokens/sample)",
    "1b": "Llama-3.2-1B-shaped random-weight model (vocab 128256, tied), LoRA rank 64 on q/v/output_proj + MLP, "
    "activation checkpointing, batch 4 of the tiny data set (up to 128 tokens)",
}


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(which: str, model: str, dtype: str, device: str, steps: int, base: Path, out: Path, ours: List[str]):
    from omegaconf import OmegaConf

    config, torchtune_builder, _ = MODELS[model]
    cfg = OmegaConf.load(config)
    cfg.output_dir = str(out)
    cfg.checkpointer.checkpoint_dir = str(base)
    cfg.checkpointer.output_dir = str(out)
    cfg.dtype, cfg.device, cfg.max_steps_per_epoch = dtype, device, steps
    cfg.metric_logger = {"_component_": "__main__._Capture"}
    cfg.save_adapter_weights_only = True
    for key in ("generate_base_checkpoint", "dataset_val", "run_val_every_n_steps", "max_validation_steps"):
        cfg.pop(key, None)
    if model == "1b":
        cfg.tokenizer = {"_component_": "torchtune_ext.data.tiny_tokenizer", "max_seq_len": 128}
        cfg.dataset = {"_component_": "torchtune_ext.data.tiny_instruct_dataset"}
        cfg.batch_size, cfg.gradient_accumulation_steps = 4, 1
    if which == "ours":
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(ours))
    if which == "torchtune":
        cfg.loss = {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}
        cfg.model._component_ = torchtune_builder
        cfg.model.quantize_base = True
        cfg.checkpointer._component_ = "torchtune.training.FullModelHFCheckpointer"
        cfg.log_peak_memory_stats = device != "cpu"
        cfg.enable_activation_offloading = False
    return cfg


def worker(
    which: str, model: str, dtype: str, device: str, steps: int, base: Path, ours: List[str]
) -> Dict[str, float]:
    import resource

    import torch
    import torchtune

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        cfg = _config(which, model, dtype, device, steps, base, Path(out), ours)
        if which == "ours":
            module = _load(ROOT / "recipes" / "qlora_finetune_single_device.py", "ours")
            recipe = module.QLoRAFinetuneRecipeSingleDevice(cfg)
        else:
            path = Path(torchtune.__file__).parent.parent / "recipes" / "lora_finetune_single_device.py"
            recipe = _load(path, "theirs").LoRAFinetuneRecipeSingleDevice(cfg)
        recipe.setup(cfg)
        recipe.train()
        recipe.cleanup()
    rows = _Capture.rows
    key = "tokens_per_second" if which == "ours" else "tokens_per_second_per_gpu"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    return {
        "tokens_per_second": statistics.median(r[key] for r in rows[MODELS[model][2] :]),
        "peak_bytes": peak,
        "first_loss": rows[0]["loss"],
        "steps": len(rows),
    }


def _run_worker(
    which: str, model: str, dtype: str, device: str, steps: int, base: Path, ours: List[str]
) -> Dict[str, float]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        which,
        "--model",
        model,
        "--dtypes",
        dtype,
        "--device",
        device,
        "--steps",
        str(steps),
        "--base",
        str(base),
        *[f"--ours={item}" for item in ours],
    ]
    result = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{which} {dtype} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--base", default="/tmp/torchtune_ext_bench/tiny_base", help="tiny: its base checkpoint")
    parser.add_argument("--cache", default="/tmp/torchtune_ext_bench", help="1b: where its random checkpoint is")
    parser.add_argument(
        "--notes", default=None, help="also write the results into this markdown file (default: print only)"
    )
    parser.add_argument(
        "--ours",
        action="append",
        default=[],
        help="an override of our run's config (repeatable), e.g. a setting's cost",
    )
    parser.add_argument("--worker", choices=["ours", "torchtune"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker, args.model, args.dtypes, args.device, args.steps, Path(args.base), args.ours)
        print(json.dumps(result))
        return

    from torchtune_ext.data import write_tiny_checkpoint

    base = write_tiny_checkpoint(args.base) if args.model == "tiny" else ensure_checkpoint(Path(args.cache))
    rows = []
    for dtype in args.dtypes.split(","):
        results = {"ours": [], "torchtune": []}
        for _ in range(args.repeats):
            for which in results:
                results[which].append(_run_worker(which, args.model, dtype, args.device, args.steps, base, args.ours))
        ours, theirs = (max(results[w], key=lambda r: r["tokens_per_second"]) for w in ("ours", "torchtune"))
        for which, best in (("ours", ours), ("torchtune", theirs)):
            best["all_tokens_per_second"] = [round(r["tokens_per_second"]) for r in results[which]]
            best["peak_bytes"] = max(r["peak_bytes"] for r in results[which])
        rows.append((dtype, ours, theirs))
        print(f"{dtype}: ours {ours['all_tokens_per_second']} tok/s, torchtune {theirs['all_tokens_per_second']}")
        print(
            f"{dtype}: ours {ours['tokens_per_second']:.0f} tok/s, peak {ours['peak_bytes'] / GIB:.2f} GiB | "
            f"torchtune {theirs['tokens_per_second']:.0f} tok/s, peak {theirs['peak_bytes'] / GIB:.2f} GiB | "
            f"tok/s ratio {ours['tokens_per_second'] / theirs['tokens_per_second']:.2f}x, peak ratio "
            f"{ours['peak_bytes'] / theirs['peak_bytes']:.2f}x | first loss {ours['first_loss']:.4f} vs "
            f"{theirs['first_loss']:.4f}",
            flush=True,
        )

    memory = "CUDA peak allocated" if args.device == "cuda" else "peak RSS of the process"
    load = os.getloadavg()
    import torch

    lines = [
        "## bench/recipe.py — recipe throughput and peak memory, ours vs torchtune's lora_finetune_single_device",
        "",
        f"{_DESCRIPTIONS[args.model]}, {args.steps} steps, tokens/s = median over steps "
        f"{MODELS[args.model][2] + 1}..{args.steps} "
        f"(label tokens / step time), best of {args.repeats} alternating runs (all runs in brackets). Peak = "
        f"{memory} (max over runs). Device {args.device}; machine {platform.machine()}, "
        f"{os.cpu_count()} CPU cores shared with other jobs (load average {load[0]:.1f} at the end), torch "
        f"{torch.__version__}, torchtune 0.6.1. Date: {datetime.date.today()}. Command: "
        f"`python bench/recipe.py --model {args.model} --device {args.device} --dtypes {args.dtypes} "
        f"--steps {args.steps} --repeats {args.repeats}{''.join(f' --ours {o}' for o in args.ours)}`.",
        "",
        "| dtype | ours tok/s | torchtune tok/s | tok/s ratio (goal >= 1.0x) | ours peak | torchtune peak | "
        "peak ratio (goal <= 1.0x) | first loss ours / torchtune |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype, ours, theirs in rows:
        lines.append(
            f"| {dtype} | {ours['tokens_per_second']:.0f} {ours['all_tokens_per_second']} | "
            f"{theirs['tokens_per_second']:.0f} {theirs['all_tokens_per_second']} | "
            f"{ours['tokens_per_second'] / theirs['tokens_per_second']:.2f}x | {ours['peak_bytes'] / GIB:.3f} GiB | "
            f"{theirs['peak_bytes'] / GIB:.3f} GiB | {ours['peak_bytes'] / theirs['peak_bytes']:.2f}x | "
            f"{ours['first_loss']:.4f} / {theirs['first_loss']:.4f} |"
        )
    print("\n".join(lines))
    if args.notes:
        write_notes_section(Path(args.notes), f"bench/recipe.py {args.device}", "\n".join(lines))
        print(f"rows written to {args.notes}")


if __name__ == "__main__":
    main()

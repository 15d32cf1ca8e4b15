"""Benchmark: peak host RSS and time to build a 1B-shaped QLoRA model and load its HF checkpoint, ours vs torchtune.

A random-weight Llama-3.2-1B-shaped HF checkpoint (bf16, one 2.5 GB ``model.safetensors`` like the real one) is
generated once, one tensor at a time, into ``--cache``. Then each loader runs in a fresh process:

- ours: ``torchtune_ext.models.qlora_llama3_2_1b`` built on the meta device, then
  ``torchtune_ext.checkpoint.load_base_`` streams the file tensor by tensor, quantizing each frozen linear to NF4 as it
  arrives (plus adapter init), as ``recipes/qlora_finetune_single_device.py`` does;
- torchtune: the setup path of its ``lora_finetune_single_device`` recipe: ``FullModelHFCheckpointer
  .load_checkpoint()`` (the whole state dict in memory), the model built on the CPU under the compute dtype
  (``torchtune.models.llama3_2.qlora_llama3_2_1b``), then ``load_state_dict``.

Both load the same LoRA config (rank 64 on q/v/output_proj + MLP, torchtune's 1B QLoRA config) in the same compute
dtype. Reported: wall time, peak RSS above the process's RSS after imports (VmHWM reset through
``/proc/self/clear_refs``), the loaded model's own size, ratios ours / torchtune, and, as a correctness check, the
largest difference between the two models' logits on a short input (after the measurement).

``--device cuda`` loads onto the GPU as each recipe does there (ours quantizes each tensor on the GPU as it
arrives; torchtune's builds the model on the GPU and copies its CPU state dict in): the time then includes the
GPU work, and the GPU's peak allocated bytes (``torch.cuda.max_memory_allocated``) are reported beside the host's
peak RSS. ``--model tiny`` runs the same on the tiny default's architecture (a check of the script in seconds).
Run::

    python bench/load.py [--model 1b|tiny] [--device cpu|cuda] [--dtypes bf16,fp32] [--cache DIR] [--notes FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[1]
LORA = dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=64, lora_alpha=128)
#: model: (our builder, torchtune's builder of the same architecture), both in ``module:name`` form.
BUILDERS = {
    "1b": ("torchtune_ext.models:qlora_llama3_2_1b", "torchtune.models.llama3_2:qlora_llama3_2_1b"),
    "tiny": ("torchtune_ext.models:qlora_tiny_llama", "torchtune_ext.models:lora_tiny_llama"),
}
GIB = 1024**3
MIB = 1024**2


def _rss_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS


def _model_bytes(model) -> int:
    from torchtune_ext.nf4 import NF4Tensor

    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if isinstance(tensor, NF4Tensor):
            total += sum(
                getattr(tensor, n).numel() * getattr(tensor, n).element_size()
                for n in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
            )
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def worker_env() -> Dict[str, str]:
    """The environment of a benchmark's worker process: the caller's ``PYTHONPATH`` kept (``bench/gpu.sh`` puts the
    carried wheels' start-up hook there), and this clone appended only when torchtune_ext is not installed (a
    source tree ahead of an installed wheel would shadow it, and lacks the wheel's ``torchtune_ext.configs``)."""
    paths = list(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    if importlib.util.find_spec("torchtune_ext") is None:
        paths.append(str(ROOT))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _builder(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def model_checkpoint(model: str, cache: Path) -> Path:
    """The base checkpoint of ``model`` ("1b": the random 1B-shaped one; "tiny": the tiny default's), written once."""
    if model == "tiny":
        from torchtune_ext.data import write_tiny_checkpoint

        return write_tiny_checkpoint(cache / "tiny_base")
    return ensure_checkpoint(cache)


def ensure_checkpoint(cache: Path) -> Path:
    """Writes the random 1B-shaped checkpoint once (one tensor in memory at a time)."""
    import torch
    from torchtune.models.llama3_2 import llama3_2_1b
    from torchtune.training import set_default_dtype

    from torchtune_ext.checkpoint import llama3_2_hf_config, write_random_hf_checkpoint

    path = cache / "llama3_2_1b_random_bf16"
    if (path / "model.safetensors").is_file():
        return path
    print(f"writing a random Llama-3.2-1B-shaped checkpoint to {path} (once) ...", flush=True)
    with set_default_dtype(torch.bfloat16), torch.device("meta"):
        model = llama3_2_1b()
    config = llama3_2_hf_config(
        vocab_size=128_256,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=2048,
        intermediate_dim=8192,
        max_seq_len=131072,
    )
    write_random_hf_checkpoint(path, model, "LLAMA3_2", config, dtype=torch.bfloat16, seed=0)
    return path


def worker(which: str, model_name: str, dtype_name: str, device_name: str, checkpoint: Path, out: Path) -> Dict:
    import torch
    from torchtune import training

    import torchtune_ext  # noqa: F401
    from torchtune_ext.checkpoint import QLoRAHFCheckpointer, load_base_
    from torchtune_ext.models import init_adapters_

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    device = torch.device(device_name)
    builder = _builder(BUILDERS[model_name][0 if which == "ours" else 1])
    torch.manual_seed(0)
    baseline = _rss_status("VmRSS")
    _reset_peak()
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    if which == "ours":
        model = builder(**LORA, dtype=dtype)
        checkpointer = QLoRAHFCheckpointer(str(checkpoint), str(out), "LLAMA3_2")
        checkpointer.validate(model)
        load_base_(model, checkpointer, device)
        init_adapters_(model, device)
    else:
        from torchtune.training import FullModelHFCheckpointer

        state = FullModelHFCheckpointer(str(checkpoint), ["model.safetensors"], "LLAMA3_2", str(out)).load_checkpoint()
        extra = {"quantize_base": True} if model_name == "tiny" else {}
        with training.set_default_dtype(dtype), device:
            model = builder(**LORA, **extra)
        model.load_state_dict(state[training.MODEL_KEY], strict=False)
        del state
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = _rss_status("VmHWM") - baseline
    gpu_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    with torch.no_grad():
        logits = model(torch.arange(16, device=device).unsqueeze(0))[0, -1, :8].float().tolist()
    return {
        "seconds": seconds,
        "peak_bytes": peak,
        "gpu_peak_bytes": gpu_peak,
        "model_bytes": _model_bytes(model),
        "logits": logits,
    }


def _run_worker(which: str, model: str, dtype: str, device: str, cache: Path) -> Dict[str, float]:
    result = subprocess.run(
        [
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
            "--cache",
            str(cache),
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{which} {dtype} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def write_notes_section(path: Path, name: str, text: str) -> None:
    """Replaces (or appends) the section between ``<!-- name -->`` markers in a markdown file."""
    begin, end = f"<!-- {name} begin -->", f"<!-- {name} end -->"
    old = path.read_text() if path.exists() else "# Recipe benchmarks (bench/recipe.py, bench/load.py)\n"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + block + old[old.index(end) + len(end) + 1 :]
    else:
        new = old.rstrip() + "\n\n" + block
    path.write_text(new)


def _gpu_peaks(ours: Dict, theirs: Dict) -> str:
    if not ours["gpu_peak_bytes"]:
        return "-"
    return (
        f"{ours['gpu_peak_bytes'] / GIB:.2f} / {theirs['gpu_peak_bytes'] / GIB:.2f} GiB "
        f"({ours['gpu_peak_bytes'] / theirs['gpu_peak_bytes']:.3f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(BUILDERS), default="1b")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--cache", default="/tmp/torchtune_ext_bench")
    parser.add_argument(
        "--notes", default=None, help="also write the results into this markdown file (default: print only)"
    )
    parser.add_argument("--worker", choices=["ours", "torchtune"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache = Path(args.cache)
    if args.worker:
        checkpoint = model_checkpoint(args.model, cache)
        result = worker(args.worker, args.model, args.dtypes, args.device, checkpoint, cache / f"out_{args.worker}")
        print(json.dumps(result))
        return

    checkpoint = model_checkpoint(args.model, cache)
    size = (checkpoint / "model.safetensors").stat().st_size
    rows = []
    for dtype in args.dtypes.split(","):
        ours = _run_worker("ours", args.model, dtype, args.device, cache)
        theirs = _run_worker("torchtune", args.model, dtype, args.device, cache)
        max_logit_diff = max(abs(a - b) for a, b in zip(ours["logits"], theirs["logits"]))
        rows.append((dtype, ours, theirs, max_logit_diff))
        print(
            f"{args.model} {dtype} on {args.device}: ours {ours['seconds']:.2f} s, peak RSS "
            f"+{ours['peak_bytes'] / GIB:.2f} GiB (model {ours['model_bytes'] / GIB:.2f} GiB) | torchtune "
            f"{theirs['seconds']:.2f} s, peak RSS +{theirs['peak_bytes'] / GIB:.2f} GiB (model "
            f"{theirs['model_bytes'] / GIB:.2f} GiB) | time ratio {ours['seconds'] / theirs['seconds']:.3f}x, peak "
            f"RSS ratio {ours['peak_bytes'] / max(theirs['peak_bytes'], 1):.3f}x | GPU peak ours / torchtune "
            f"{_gpu_peaks(ours, theirs)} | logits max diff {max_logit_diff:.2e}",
            flush=True,
        )

    if args.model != "1b":
        return  # the tiny model checks the script; the table below describes the 1B-shaped run
    load = os.getloadavg()
    lines = [
        "## bench/load.py — build + load a Llama-3.2-1B-shaped QLoRA model from its HF checkpoint",
        "",
        f"Checkpoint: random weights, bf16, one model.safetensors of {size / GIB:.2f} GiB (largest tensor: the "
        f"128256x2048 embedding, {128256 * 2048 * 2 / MIB:.0f} MiB in bf16). LoRA rank 64 on q/v/output_proj + MLP. "
        "Peak = peak RSS above the RSS after imports. Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPU cores (load average {load[0]:.1f} at the end), torch "
        f"{__import__('torch').__version__}, torchtune 0.6.1. Date: {datetime.date.today()}. Command: "
        f"`python bench/load.py --model {args.model} --device {args.device} --dtypes {args.dtypes}`.",
        "",
        "| compute dtype | ours: time / peak RSS / model | torchtune recipe setup: time / peak RSS / model | "
        "time ratio | peak RSS ratio | GPU peak allocated, ours / torchtune | logits max diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype, ours, theirs, diff in rows:
        lines.append(
            f"| {dtype} | {ours['seconds']:.1f} s / {ours['peak_bytes'] / GIB:.2f} GiB / "
            f"{ours['model_bytes'] / GIB:.2f} GiB | {theirs['seconds']:.1f} s / {theirs['peak_bytes'] / GIB:.2f} GiB /"
            f" {theirs['model_bytes'] / GIB:.2f} GiB | {ours['seconds'] / theirs['seconds']:.3f}x | "
            f"{ours['peak_bytes'] / max(theirs['peak_bytes'], 1):.3f}x | {_gpu_peaks(ours, theirs)} | {diff:.1e} |"
        )
    lines += [
        "",
        "Ours peaks at the NF4 model plus about one tensor in flight; torchtune's holds the whole checkpoint as a "
        "state dict while it builds (and quantizes) the model. In fp32 the two models' logits differ: torchtune's "
        "`load_state_dict` quantizes the bf16 checkpoint tensors in bf16 (torchao's `NF4Tensor.copy_` uses the source "
        "dtype) while ours casts them to the compute dtype first; from an fp32 checkpoint both give identical models "
        "(tests/torchtune_ext/checkpoint/test_checkpointer.py). On CPU most of both loaders' time is NF4 quantization.",
    ]
    print("\n".join(lines))
    if args.notes:
        write_notes_section(Path(args.notes), "bench/load.py", "\n".join(lines))
        print(f"rows written to {args.notes}")


if __name__ == "__main__":
    main()

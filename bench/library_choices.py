"""Where the project keeps its own code instead of a well-kept library's, the measurement behind each choice.

Each case runs ours and the library's in their own fresh process (peak RSS is per process) and prints time, the peak
RSS above the process's start and the ratios:

- ``read``: a safetensors shard read tensor by tensor: ``checkpoint.iter_safetensors`` (``readinto`` per tensor)
  against ``safetensors.safe_open`` (memory-mapped: every touched page stays resident until the file closes).
- ``random``: a random-weight HF checkpoint of a Qwen2.5-0.5B shape in bf16: ``checkpoint.write_random_hf_checkpoint``
  (one tensor at a time) against transformers' ``AutoModelForCausalLM.from_config(...).save_pretrained``.

Run: ``python bench/library_choices.py [--cases read,random] [--shard-gib 1]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict

QWEN2_5_0_5B = dict(
    vocab_size=151936,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    embed_dim=896,
    intermediate_dim=4864,
    max_seq_len=32768,
    rope_base=1_000_000.0,
    norm_eps=1e-6,
    tie_word_embeddings=True,
)


def _write_shard(path: Path, gib: float) -> None:
    import torch
    from safetensors.torch import save_file

    numel = 32 * 1024 * 1024  # 128 MiB of fp32 per tensor
    save_file({f"t{i}": torch.randn(numel) for i in range(max(1, round(gib * 8)))}, str(path))


def _read(side: str, path: Path) -> None:
    if side == "library":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                float(f.get_tensor(key).sum())
    else:
        from torchtune_ext.checkpoint import iter_safetensors

        for _, tensor in iter_safetensors(path):
            float(tensor.sum())


def _random(side: str, out: Path) -> None:
    import torch

    from torchtune_ext.checkpoint import qwen2_hf_config

    hf_config = qwen2_hf_config(**QWEN2_5_0_5B, dtype=torch.bfloat16)
    if side == "library":
        import transformers

        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(**hf_config)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    else:
        from torchtune.models.qwen2_5 import lora_qwen2_5_0_5b
        from torchtune.training import set_default_dtype

        from torchtune_ext.checkpoint import write_random_hf_checkpoint

        with set_default_dtype(torch.bfloat16), torch.device("meta"):
            model = lora_qwen2_5_0_5b(lora_attn_modules=["q_proj"])
        write_random_hf_checkpoint(out, model, "QWEN2", hf_config, dtype=torch.bfloat16, seed=0)


def _status_mib(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (peak RSS) of this process, in MiB. Not ``getrusage``'s ``ru_maxrss``: it survives
    ``exec``, so a worker would start at its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _import_side(case: str, side: str) -> None:
    import torch  # noqa: F401

    if case == "read":
        import safetensors  # noqa: F401
    elif side == "library":
        import transformers  # noqa: F401
    else:
        import torchtune.models.qwen2_5  # noqa: F401
    import torchtune_ext.checkpoint  # noqa: F401


def _worker(case: str, side: str, path: Path) -> Dict[str, float]:
    _import_side(case, side)  # modules are not the case's memory: imported before the start
    start_rss = _status_mib("VmRSS")
    start = time.perf_counter()
    (_read if case == "read" else _random)(side, path)
    return {"seconds": time.perf_counter() - start, "peak_mib": _status_mib("VmHWM") - start_rss}


def _measure(case: str, side: str, path: Path) -> Dict[str, float]:
    command = [sys.executable, __file__, "--worker", case, side, str(path)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="read,random")
    parser.add_argument("--shard-gib", type=float, default=1.0)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        case, side, path = args.worker
        print(json.dumps(_worker(case, side, Path(path))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "shard.safetensors"
        print(f"{'case':8} {'side':8} {'seconds':>8} {'peak MiB':>9}")
        for case in args.cases.split(","):
            if case == "read":
                _write_shard(shard, args.shard_gib)
            rows = {}
            for side in ("ours", "library"):
                target = shard if case == "read" else Path(tmp) / f"random_{side}"
                rows[side] = _measure(case, side, target)
                shutil.rmtree(Path(tmp) / f"random_{side}", ignore_errors=True)
                print(f"{case:8} {side:8} {rows[side]['seconds']:8.2f} {rows[side]['peak_mib']:9.0f}")
            ours, lib = rows["ours"], rows["library"]
            print(
                f"{case:8} ours/library: time {ours['seconds'] / lib['seconds']:.2f}x, "
                f"peak {ours['peak_mib'] / max(lib['peak_mib'], 1.0):.2f}x"
            )


if __name__ == "__main__":
    main()

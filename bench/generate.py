"""Benchmark: generation with the model as it trained (NF4 base + adapter) and ``tune-ext merge``, on this machine.

Reported per model: the load time (base streamed into NF4 + adapter), decode tokens/s with KV caches and without
(re-running the whole sequence per token; greedy, ``--new-tokens`` after a ``--prompt-tokens`` random prompt,
EOS ignored, best of ``--repeats``), the process's peak RSS, and the time ``merge_adapter`` takes to write the
merged folder. ``tiny``: the tiny default's architecture with a random rank-16 adapter; ``1b``: the
Llama-3.2-1B-shaped random checkpoint of ``bench/load.py`` with a random rank-64 adapter (q/v/output_proj + MLP).
Run::

    python bench/generate.py [--model tiny|1b] [--dtype fp32] [--new-tokens 64] [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from load import ensure_checkpoint  # noqa: E402

from torchtune_ext.checkpoint import QLoRAHFCheckpointer, load_base_  # noqa: E402
from torchtune_ext.data import write_tiny_checkpoint  # noqa: E402
from torchtune_ext.distributed import get_full_state_dict  # noqa: E402
from torchtune_ext.export import merge_adapter  # noqa: E402
from torchtune_ext.generation import Generator, SamplingSettings, load_model_with_adapter  # noqa: E402
from torchtune_ext.models import init_adapters_, qlora_llama3_2_1b, qlora_tiny_llama  # noqa: E402
from torchtune_ext.training import peak_rss_bytes  # noqa: E402

LORA = {
    "tiny": dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, rank=16),
    "1b": dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, rank=64),
}


class _NoTokenizer:
    eos_id = -1

    def decode(self, ids):
        return ""


def _adapter(base: Path, model_name: str, folder: Path) -> Path:
    """A random adapter (non-zero B) for ``base``, written by the recipe's checkpointer."""
    lora = dict(LORA[model_name])
    rank = lora.pop("rank")
    builder = qlora_tiny_llama if model_name == "tiny" else qlora_llama3_2_1b
    model = builder(**lora, lora_rank=rank, lora_alpha=2 * rank, dtype=torch.float32, device="meta")
    checkpointer = QLoRAHFCheckpointer(str(base), str(folder), "LLAMA3_2")
    checkpointer.validate(model)
    load_base_(model, checkpointer, torch.device("cpu"))
    init_adapters_(model, torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:
                param.normal_(0, 0.01)
    state = get_full_state_dict(model, adapter_weights_only=True, keep_nf4=True, cpu_offload=False)
    targets = [*lora["lora_attn_modules"], "w1", "w2", "w3"]
    config = dict(target_modules=targets, rank=rank, alpha=2 * rank, dropout=0.0, use_dora=False)
    return checkpointer.save(state, 0, config, save_merged=False, dtype=torch.float32) / "adapter"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(LORA), default="tiny")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default="/tmp/torchtune_ext_bench", help="1b: where its random checkpoint is")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    if args.model == "tiny":
        base = write_tiny_checkpoint(tmp / "base", family="llama", dtype="fp32")
    else:
        base = ensure_checkpoint(Path(args.cache))
    adapter = _adapter(base, args.model, tmp / "run")
    start = time.perf_counter()
    model = load_model_with_adapter(base, adapter, dtype=args.dtype)
    load_seconds = time.perf_counter() - start
    dtype = next(p.dtype for p in model.norm.parameters())
    generator = Generator(model, _NoTokenizer(), dtype, torch.device("cpu"))
    prompt = torch.randint(3, 500, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    rates = {}
    for use_cache in (True, False):
        settings = SamplingSettings(max_new_tokens=args.new_tokens, ignore_eos=True, use_cache=use_cache)
        best = min(generator.generate(prompt, settings).seconds for _ in range(args.repeats))
        rates[use_cache] = args.new_tokens / best
    start = time.perf_counter()
    merge_adapter(base, adapter, tmp / "merged", merged_dtype="bf16")
    merge_seconds = time.perf_counter() - start
    print(
        f"model={args.model} dtype={args.dtype} prompt={args.prompt_tokens} new={args.new_tokens} "
        f"threads={torch.get_num_threads()}: load {load_seconds:.2f} s | KV-cached {rates[True]:.1f} tokens/s | "
        f"uncached {rates[False]:.1f} tokens/s ({rates[True] / rates[False]:.1f}x) | peak RSS "
        f"{peak_rss_bytes() / 1024**3:.2f} GiB | merge (bf16) {merge_seconds:.2f} s"
    )


if __name__ == "__main__":
    main()

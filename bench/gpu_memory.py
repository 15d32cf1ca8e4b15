"""The memory estimate against a real GPU: our recipe's training step on a fixed-shape batch, estimated (fake
tensors, ``QLoRARecipe.memory_estimator``) and measured (``torch.cuda.max_memory_allocated`` / ``_reserved``) in one
run, for the settings the estimate is used for (bf16 / fp16 / fp32, activation offloading, tiled MLP).

The model is a random-weight HF checkpoint of the given config's shape (written once into ``--cache``), loaded by
the recipe's own set-up; each measured step is the recipe's ``forward_backward`` + ``optimizer_step`` on
``batch x seq`` random tokens, all of them labels (the estimate's batch). Prints one line per setting::

    python bench/gpu_memory.py --config configs/llama3_2/1B_qlora_single_device.yaml --seq 2048 --steps 3

On a machine without CUDA it runs the same code on the CPU and prints the estimate only (a check of the script).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import List

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
SETTINGS = {
    "bf16": ["dtype=bf16"],
    "fp16": ["dtype=fp16"],
    "fp32": ["dtype=fp32"],
    "bf16+offload+tiled": ["dtype=bf16", "enable_activation_offloading=True", "tiled_mlp_tokens=4096"],
    "fp32+offload+tiled": ["dtype=fp32", "enable_activation_offloading=True", "tiled_mlp_tokens=4096"],
    "bf16+compile": ["dtype=bf16", "compile=True"],
    "fp16+offload+compile": ["dtype=fp16", "enable_activation_offloading=True", "compile=True"],
}


def _cfg(config: Path, checkpoint: Path, out: Path, seq: int, batch: int, device: str, extra: List[str]):
    overrides = [
        f"checkpointer.checkpoint_dir={checkpoint}",
        "checkpointer.checkpoint_files=[model.safetensors]",
        f"output_dir={out}",
        f"device={device}",
        f"batch_size={batch}",
        "gradient_accumulation_steps=1",
        f"tokenizer.max_seq_len={seq}",
        "tokenizer._component_=torchtune_ext.data.tiny_tokenizer",
        "~tokenizer.path",
        "dataset._component_=torchtune_ext.data.tiny_instruct_dataset",
        "~dataset.packed",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        "enable_activation_checkpointing=True",
        *extra,
    ]
    cfg = OmegaConf.load(config)
    for item in overrides:
        if item.startswith("~"):
            parent, _, key = item[1:].rpartition(".")
            OmegaConf.select(cfg, parent).pop(key, None)
        else:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
    return cfg


def _checkpoint(cfg, cache: Path) -> Path:
    """A random bf16 HF checkpoint of the config's model (written once)."""
    from torchtune import config as tune_config

    from torchtune_ext.checkpoint import llama3_2_hf_config, write_random_hf_checkpoint

    path = cache / f"random_{Path(str(cfg.model._component_)).suffix.lstrip('.')}"
    if not (path / "model.safetensors").is_file():
        model = tune_config.instantiate(cfg.model, dtype=torch.bfloat16, adapter_dtype=torch.bfloat16, device="meta")
        attn = model.layers[0].attn
        hf_config = llama3_2_hf_config(
            vocab_size=model.tok_embeddings.num_embeddings,
            num_layers=len(model.layers),
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            embed_dim=attn.embed_dim,
            intermediate_dim=model.layers[0].mlp.w1.out_dim,
            max_seq_len=model.max_seq_len,
        )
        write_random_hf_checkpoint(path, model, "LLAMA3_2", hf_config, dtype=torch.bfloat16, seed=0)
    return path


def _measure(recipe, cfg, batch: int, seq: int, steps: int) -> tuple:
    device = recipe.settings.device
    recipe.setup(cfg)
    vocab = recipe._model.tok_embeddings.num_embeddings
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq), device=device)
        _, batch_tokens = recipe.forward_backward({"tokens": tokens, "labels": tokens.clone()})
        recipe.optimizer_step(batch_tokens)
    if device.type != "cuda":
        return None, None, (time.perf_counter() - start) / steps
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "llama3_2" / "1B_qlora_single_device.yaml"))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--cache", default="/tmp/torchtune_ext_bench")
    args = parser.parse_args()

    from torchtune_ext.training import QLoRARecipe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    print(f"command: python bench/gpu_memory.py --config {args.config} --seq {args.seq} --batch {args.batch}")
    print(f"{'setting':<22} {'estimate':>10} {'measured':>10} {'est/meas':>9} {'reserved':>10} {'s/step':>8}")
    checkpoint = None
    for name in args.settings.split(","):
        estimate_cfg = _cfg(
            Path(args.config), cache / "none", cache / "out", args.seq, args.batch, device, SETTINGS[name]
        )
        estimate_cfg.dry_run = True
        if device == "cpu" and "offload" in name:
            estimate_cfg.device = "cuda"  # what the estimate is for; it needs no GPU
        estimate = QLoRARecipe(estimate_cfg).memory_estimator(estimate_cfg).estimate(args.batch, args.seq)
        checkpoint = checkpoint or _checkpoint(estimate_cfg, cache)
        measured = reserved = seconds = None
        if device == "cuda":
            cfg = _cfg(
                Path(args.config), checkpoint, cache / f"out_{name}", args.seq, args.batch, device, SETTINGS[name]
            )
            measured, reserved, seconds = _measure(QLoRARecipe(cfg), cfg, args.batch, args.seq, args.steps)
            torch.cuda.empty_cache()
        ratio = f"{estimate.peak_bytes / measured:9.3f}" if measured else f"{'-':>9}"
        print(
            f"{name:<22} {estimate.peak_bytes / GIB:9.2f}G "
            + (
                f"{measured / GIB:9.2f}G {ratio} {reserved / GIB:9.2f}G {seconds:8.2f}"
                if measured
                else f"{'-':>10} {ratio}"
            )
        )


if __name__ == "__main__":
    main()

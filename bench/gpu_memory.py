"""The memory estimate against a real GPU: our recipe's training step on a fixed-shape batch, estimated (fake
tensors, the recipe file's ``memory_estimator``) and measured (``torch.cuda.max_memory_allocated`` /
``_reserved``) in one run, for the settings the estimate is used for (bf16 / fp16 / fp32, activation offloading,
tiled MLP).

The model is a random-weight HF checkpoint of the given config's shape (written once into ``--cache``), loaded by
the recipe's own set-up; each measured step is the recipe's ``forward_backward`` + ``optimizer_step`` on
``batch x seq`` random tokens, all of them labels (the estimate's batch). Prints one line per setting::

    python bench/gpu_memory.py --config configs/llama3_2/1B_qlora_single_device.yaml --seq 2048 --steps 3

Each measured row also prints the per-token loss of the first and last step, the last grad norm, the optimizer's
``fused`` / ``foreach`` settings (the configs ship ``fused: True``) and, in fp16, the loss scale and skipped steps.
On a machine without CUDA it prints the estimates only; ``--device cpu`` also runs the steps there (a check of the
script at tiny sizes, e.g. ``--config configs/tiny/qlora_single_device.yaml --seq 64``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import List, Optional

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
SETTINGS = {
    "bf16": ["dtype=bf16"],
    "fp16": ["dtype=fp16"],
    "fp32": ["dtype=fp32"],
    "bf16+offload+tiled": ["dtype=bf16", "enable_activation_offloading=True", "tiled_mlp_tokens=4096"],
    "fp16+offload": ["dtype=fp16", "enable_activation_offloading=True"],
    "fp16+offload+tiled": ["dtype=fp16", "enable_activation_offloading=True", "tiled_mlp_tokens=4096"],
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


def _measure(recipe, cfg, batch: int, seq: int, steps: int) -> dict:
    """Runs ``steps`` training steps; returns the peak allocated / reserved bytes (CUDA only), seconds per step,
    the per-token losses, the last step's metrics (fp16: loss scale and skipped steps) and the optimizer's
    ``fused`` / ``foreach`` settings."""
    device = recipe.settings.device
    recipe.setup(cfg)
    vocab = recipe._model.tok_embeddings.num_embeddings
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    losses, metrics = [], {}
    start = time.perf_counter()
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq), device=device)
        loss, batch_tokens = recipe.forward_backward({"tokens": tokens, "labels": tokens.clone()})
        metrics, _ = recipe.optimizer_step(batch_tokens)
        losses.append(float(loss) / float(batch_tokens))
    result = {"losses": losses, "metrics": metrics, "optimizer": dict(recipe._optimizer.defaults)}
    if device.type == "cuda":
        torch.cuda.synchronize()
        result.update(
            allocated=torch.cuda.max_memory_allocated(device), reserved=torch.cuda.max_memory_reserved(device)
        )
    result["seconds"] = (time.perf_counter() - start) / steps
    return result


def _row(name: str, estimate_bytes: int, measured: Optional[dict]) -> str:
    line = f"{name:<22} {estimate_bytes / GIB:9.2f}G "
    if measured is None:
        return line + f"{'-':>10} {'-':>9}"
    if "allocated" in measured:
        allocated, reserved = measured["allocated"], measured["reserved"]
        line += f"{allocated / GIB:9.2f}G {estimate_bytes / allocated:9.3f} {reserved / GIB:9.2f}G "
    else:
        line += f"{'-':>10} {'-':>9} {'-':>10} "
    optimizer = measured["optimizer"]
    scaler = measured["metrics"]
    fp16 = f" loss_scale={scaler['loss_scale']:g} skipped={scaler['skipped_steps']}" if "loss_scale" in scaler else ""
    return (
        line + f"{measured['seconds']:8.2f}  loss {measured['losses'][0]:.3f} -> {measured['losses'][-1]:.3f} "
        f"grad_norm={scaler['grad_norm']:.3g} fused={optimizer.get('fused')} foreach={optimizer.get('foreach')}{fp16}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "llama3_2" / "1B_qlora_single_device.yaml"))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--cache", default="/tmp/torchtune_ext_bench")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="a config override for every setting (repeatable), e.g. optimizer.fused=True",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="default: cuda if available, else the estimates alone; cpu: also runs the steps on the CPU (no "
        "memory figures: a check of the script at tiny sizes)",
    )
    args = parser.parse_args()

    from torchtune_ext.recipes.qlora_finetune_single_device import QLoRAFinetuneRecipe

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    print(f"command: python bench/gpu_memory.py --config {args.config} --seq {args.seq} --batch {args.batch}")
    print(f"{'setting':<22} {'estimate':>10} {'measured':>10} {'est/meas':>9} {'reserved':>10} {'s/step':>8}")
    checkpoint = None
    for name in args.settings.split(","):
        estimate_cfg = _cfg(
            Path(args.config),
            cache / "none",
            cache / "out",
            args.seq,
            args.batch,
            device,
            SETTINGS[name] + args.override,
        )
        estimate_cfg.dry_run = True
        if device == "cpu" and "offload" in name:
            estimate_cfg.device = "cuda"  # what the estimate is for; it needs no GPU
        estimate = QLoRAFinetuneRecipe(estimate_cfg).memory_estimator(estimate_cfg).estimate(args.batch, args.seq)
        checkpoint = checkpoint or _checkpoint(estimate_cfg, cache)
        measured = None
        if device == "cuda" or (args.device == "cpu" and "offload" not in name):
            cfg = _cfg(
                Path(args.config),
                checkpoint,
                cache / f"out_{name}",
                args.seq,
                args.batch,
                device,
                SETTINGS[name] + args.override,
            )
            measured = _measure(QLoRAFinetuneRecipe(cfg), cfg, args.batch, args.seq, args.steps)
            if device == "cuda":
                torch.cuda.empty_cache()
        print(_row(name, estimate.peak_bytes, measured), flush=True)


if __name__ == "__main__":
    main()

"""Runs a shipped recipe config for a few fp32 CPU steps on a small transformers-written checkpoint, with the tiny
tokenizer and data set (the family interop tests: SmolLM2, Qwen3, Gemma 2, Phi)."""

import os
import subprocess
import sys
from pathlib import Path
from typing import List

from _hf_runner import ROOT
from conftest import run_recipe_in_process
from omegaconf import DictConfig, OmegaConf

TUNE = Path(sys.executable).parent / "tune"
#: tokenizer / data keys of the shipped configs that the tiny tokenizer and data set do not take.
REMOVED = ["~tokenizer.path", "~tokenizer.merges_file", "~tokenizer.special_tokens_path", "~dataset.packed"]


def tiny_training_args(out: Path, steps: int) -> List[str]:
    """The overrides every family test trains with: fp32 on the CPU, ``steps`` steps of batch 4, logs under ``out``."""
    return [
        "dtype=fp32",
        "device=cpu",
        "optimizer.fused=False",
        "batch_size=4",
        "gradient_accumulation_steps=1",
        f"max_steps_per_epoch={steps}",
        "lr_scheduler.num_warmup_steps=0",
        "optimizer.lr=3e-3",
        "tokenizer._component_=torchtune_ext.data.tiny_tokenizer",
        "tokenizer.max_seq_len=48",
        "dataset._component_=torchtune_ext.data.tiny_instruct_dataset",
        "dataset.num_samples=64",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs",
    ]


def run_recipe(config: str, args: List[str], timeout_s: int, nproc: int = 0) -> DictConfig:
    """``tune run`` of the single-device recipe, in this process (``nproc`` > 0: the distributed one launched on that
    many gloo ranks, within ``timeout_s``) with ``config`` and ``args`` (keys in :data:`REMOVED` that the config has
    are dropped); returns the config it ran."""
    present = OmegaConf.load(ROOT / config)
    removed = [key for key in REMOVED if OmegaConf.select(present, key[1:]) is not None]
    if not nproc:
        run_recipe_in_process(ROOT / "recipes/qlora_finetune_single_device.py", ["--config", config, *args, *removed],
                              cwd=ROOT)  # fmt: skip
        return OmegaConf.merge(present, OmegaConf.from_dotlist(args))
    args = args + ["process_group_timeout_s=120"]
    launch = ["--nproc_per_node", str(nproc), "recipes/qlora_finetune_distributed.py"]
    result = subprocess.run(
        [str(TUNE), "run", *launch, "--config", config, *args, *removed],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"recipe run failed (rc {result.returncode}):\n{result.stderr[-6000:]}"
    return OmegaConf.merge(present, OmegaConf.from_dotlist(args))

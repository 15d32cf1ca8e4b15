"""The dry run of a QLoRA recipe: its own training step estimated on fake tensors, and the report (peak device
memory and its breakdown, host RAM, disk, the data pass; whether it fits and the longest sequence that does).

The step runs on a copy of the recipe (``torchtune_ext.memory.recipe_step_estimator``), which gets the estimate's
model, loss, loss scaler and optimizer and prepares the model with the recipe's own methods: a subclass's step and
preparation are what is estimated, and the live recipe is never rewritten. That binding lives here, not in
``torchtune_ext.memory``, because it builds the recipe's own pieces (the model builder, the loss scaler, the
settings), and ``memory`` sits below ``training`` in the layers.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torchtune import utils

from torchtune_ext.checkpoint import read_hf_config
from torchtune_ext.config import instantiate_component, recipe_setting
from torchtune_ext.memory import (
    DeviceAllowance,
    DryRunTarget,
    HostMemory,
    MemoryEstimate,
    MemoryEstimator,
    OffloadedActivations,
    check_recipe_step,
    compile_for_estimate,
    dry_run_target,
    fit_report,
    loading_bytes,
    process_bytes,
    recipe_step_estimator,
)
from torchtune_ext.modules import LinearCrossEntropyLoss
from torchtune_ext.modules.vocab_pruning import scan_estimate_line
from torchtune_ext.training._builders import build_dataset, build_optimizer, build_qlora_model, build_tokenizer
from torchtune_ext.training._checkpointing import disk_plan
from torchtune_ext.training._precision import LossScaler
from torchtune_ext.training._settings import dtype_or_checkpoints, frozen_weights_dtype
from torchtune_ext.training._setup import RecipeSetup

log = utils.get_logger("INFO")

#: The dry run's allowance beyond torch's allocator: the CUDA context, and fragmentation of 10% of the transient
#: peak, since the recipes run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (an assumption until
#: bench/gpu.sh measures it; torchtune's default allocator with variable-length batches needs about 100%).
RECIPE_ALLOWANCE = DeviceAllowance(fragmentation=0.1)


def recipe_memory_estimator(recipe: RecipeSetup, cfg: DictConfig, model: Optional[nn.Module] = None) -> MemoryEstimator:
    """``recipe``'s training step for its config, ready to estimate; see
    :meth:`torchtune_ext.training.QLoRARecipe.memory_estimator`.

    Raises:
        TypeError: if ``recipe`` has no step (the library's ``QLoRARecipe``: the step is the recipe file's).
    """
    check_recipe_step(recipe)  # before the model is built
    settings = recipe.settings
    frozen_dtype = frozen_weights_dtype(settings.frozen_dtype, settings.dtype, checkpoint_config(cfg))
    fake = model is None
    if fake:
        model = build_qlora_model(cfg.model, settings.dtype, settings.adapter_dtype, frozen_dtype)
    return recipe_step_estimator(
        recipe,
        model,
        bind=partial(_bind, cfg=cfg, frozen_dtype=frozen_dtype),
        optimizer=partial(_optimizer, cfg=cfg),
        loss_fn=instantiate_component(cfg.loss, "loss"),
        activation_checkpointing=settings.enable_activation_checkpointing,
        dtype=settings.dtype,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        allowance=RECIPE_ALLOWANCE,
        fake=fake,
    )


def _bind(step: RecipeSetup, model: nn.Module, loss_fn: Any, *, cfg: DictConfig, frozen_dtype: torch.dtype) -> None:
    """Gives the estimate's copy of the recipe its model and loss, prepared as the recipe prepares them to train."""
    step._model, step._loss_fn, step._frozen_dtype = model, loss_fn, frozen_dtype
    compile = step.settings.compile  # the estimate's own compiled graphs replace torch.compile (last, below)
    step.settings = replace(step.settings, compile=False)
    # On fake CPU tensors; what the device would hold is what the estimate counts.
    step._loss_scaler = LossScaler(
        step.settings.dtype == torch.float16, torch.device("cpu"), **(recipe_setting(cfg, "loss_scaler") or {})
    )
    step._prepare_model(model)
    if step.settings.enable_activation_offloading:  # last, as the recipe's _prepare_model sets up the real one
        step._activation_offloading = OffloadedActivations.for_model(model)
    if step.world_size > 1:  # a per-rank dry run: its fake tensors and batches are on the CPU, whatever the host has
        step._device_mesh = init_device_mesh("cpu", (step.world_size,))
    step._parallelize()  # FSDP2 on a fake process group (a per-rank dry run); no-op on one rank
    step._setup_loss()
    if compile:  # what the recipe compiles: every decoder layer, and the loss unless LinearCrossEntropyLoss
        compile_for_estimate(model, None if isinstance(step._loss_fn, LinearCrossEntropyLoss) else step._loss_fn)


def _optimizer(step: RecipeSetup, model: nn.Module, *, cfg: DictConfig) -> torch.optim.Optimizer:
    """The copy's optimizer and LR schedule, over the model's trainable params."""
    step._trainable_params = [p for p in model.parameters() if p.requires_grad]
    step._replicated_params = []
    step._optimizer, step._lr_scheduler = build_optimizer(cfg.optimizer, cfg.lr_scheduler, step._trainable_params)
    return step._optimizer


def checkpoint_config(cfg: DictConfig) -> Dict[str, Any]:
    """The base checkpoint's ``config.json`` if it is there already, else a bf16 one (every supported model's HF
    checkpoint is bf16): a dry run is for before the download."""
    path = Path(str(cfg.checkpointer.get("checkpoint_dir", ""))) / "config.json"
    if path.is_file():
        return read_hf_config(path.parent)
    utils.log_rank_zero(log, f"{path} not found: assuming a bf16 checkpoint (set frozen_dtype to say otherwise).")
    return {"dtype": "bfloat16"}


def dry_run_report(
    recipe: RecipeSetup, cfg: DictConfig, memory_estimator: Callable[[DictConfig], MemoryEstimator]
) -> str:
    """The dry run's report; see :meth:`torchtune_ext.training.QLoRARecipe.dry_run`.

    Args:
        recipe (RecipeSetup): the recipe (the recipe file's class: the step is its).
        cfg (DictConfig): the recipe config.
        memory_estimator (Callable[[DictConfig], MemoryEstimator]): the recipe's ``memory_estimator``.

    Raises:
        TypeError: if ``recipe`` has no step (the library's ``QLoRARecipe``).
        ValueError: without ``tokenizer.max_seq_len``.
    """
    check_recipe_step(recipe)
    settings = recipe.settings
    if settings.max_seq_len is None:
        raise ValueError("dry_run=True estimates batches padded to tokenizer.max_seq_len: set it.")
    target = dry_run_target(cfg, settings.device, settings.dtype)  # device profile, host, headroom
    estimator = memory_estimator(cfg)
    estimator.attention_backend = target.profile.sdpa_backend(settings.dtype) if target.profile else None
    estimate = estimator.estimate(settings.batch_size, settings.max_seq_len)
    lines = [
        estimate.format(),
        f"  settings: dtype={settings.dtype}, frozen embedding/output in "
        f"{estimator.model.tok_embeddings.weight.dtype}, "
        f"activation checkpointing {settings.enable_activation_checkpointing}, activation offloading "
        f"{settings.enable_activation_offloading}, tiled_mlp_tokens={settings.tiled_mlp_tokens}, "
        f"loss {type(estimator.loss_fn).__name__}, "
        f"gradient_accumulation_steps={settings.gradient_accumulation_steps}",
    ]
    if settings.compile:
        loss = "" if isinstance(estimator.loss_fn, LinearCrossEntropyLoss) else " and the loss's cross-entropy"
        lines.append(
            f"  compile=True: the decoder layers{loss} estimated as torch.compile runs them (AOTAutograd's partition, "
            "inductor's buffers; an upper bound: its later fusions not modelled)"
        )
    lines += _costs(recipe, cfg)
    lines += _fits(recipe, cfg, estimator, estimate, target)
    return "\n".join(lines)


def _fits(
    recipe: RecipeSetup, cfg: DictConfig, estimator: MemoryEstimator, estimate: MemoryEstimate, target: DryRunTarget
) -> List[str]:
    """Whether the step fits the card and the host (with the headroom), and the longest that does."""
    checkpoint_dtype = dtype_or_checkpoints(None, checkpoint_config(cfg))
    loading = loading_bytes(estimator.model, checkpoint_dtype, recipe.settings.dtype)
    host = HostMemory(process_bytes(), loading, estimate.pinned_host_bytes)
    return [f"  {line}" for line in fit_report(estimator, estimate, target, host, recipe.settings.batch_size)]


def _costs(recipe: RecipeSetup, cfg: DictConfig) -> List[str]:
    """The disk the run will use and, when vocab pruning scans the data, the pass's time (from a
    measured sample of rows); the data set's size when the tokenizer and data can be read already."""
    settings = recipe.settings
    hf_config = checkpoint_config(cfg)
    frozen_dtype = frozen_weights_dtype(settings.frozen_dtype, settings.dtype, hf_config)
    model = build_qlora_model(cfg.model, settings.dtype, settings.adapter_dtype, frozen_dtype)
    lines, datasets = [], []
    try:
        tokenizer = build_tokenizer(cfg.tokenizer)
        datasets = [build_dataset(cfg.dataset, tokenizer)]
        if recipe_setting(cfg, "dataset_val") is not None:
            datasets.append(build_dataset(cfg.dataset_val, tokenizer, "dataset_val"))
    except (FileNotFoundError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        lines.append(f"  data not readable yet, so disk counts epoch-end saves only: {reason}")
    num_rows = len(datasets[0]) if datasets else None
    merged_dtype = dtype_or_checkpoints(settings.merged_dtype, hf_config)
    plan = disk_plan(
        settings,
        recipe.world_size,
        settings.max_steps_per_epoch,
        model,
        cfg.checkpointer.output_dir,
        num_rows,
        merged_dtype,
    )
    lines.append("  " + plan.format())
    vocab_size = model.tok_embeddings.num_embeddings
    scan = scan_estimate_line(settings.vocab_pruning, datasets, vocab_size, recipe.world_size) if datasets else None
    return lines + ([scan] if scan else [])

"""``tune-ext validate``: every start-up check of a recipe, without loading weights or data and without writing."""

from __future__ import annotations

from pathlib import Path
from typing import List

from omegaconf import DictConfig

from torchtune_ext.config._check import check_config
from torchtune_ext.config._instantiate import instantiate_component


def validate(cfg: DictConfig) -> List[str]:
    """Runs the recipe's start-up checks on ``cfg``: :func:`check_config`, the settings the recipe reads in its
    constructor (dtypes, counts, ``merge_base``, vocab pruning, activation offloading), then, where the model is
    already downloaded, the model built on the meta device and checked against the checkpoint's headers (shapes,
    keys, dtypes: no tensor is read).

    Args:
        cfg (DictConfig): the recipe config.

    Returns:
        List[str]: what was checked, one line each.

    Raises:
        ConfigError: on the first failing check (one line per problem); other errors as the recipe raises them.
    """
    from torchtune_ext.training import QLoRARecipe, build_qlora_model, frozen_weights_dtype

    dry_run = bool(cfg.get("dry_run", False))
    check_config(cfg, dry_run=dry_run)
    done = ["keys, value ranges" + ("" if dry_run else ", device, tokenizer and data files, data columns")]
    settings = QLoRARecipe(cfg).settings
    done.append(f"recipe settings (dtype {settings.dtype}, batch_size {settings.batch_size})")
    checkpoint_dir = Path(str(cfg.checkpointer.get("checkpoint_dir", "")))
    if cfg.get("generate_base_checkpoint", None) is not None and not checkpoint_dir.is_dir():
        done.append(f"checkpoint: {checkpoint_dir} is written on the first run (generate_base_checkpoint)")
        return done
    checkpointer = instantiate_component(cfg.checkpointer, "checkpointer")
    frozen = frozen_weights_dtype(settings.frozen_dtype, settings.dtype, checkpointer.hf_config)
    model = build_qlora_model(cfg.model, settings.dtype, settings.adapter_dtype, frozen)
    checkpointer.validate(model)
    done.append(f"model {cfg.model._component_} (meta) matches the checkpoint headers in {checkpoint_dir}")
    return done

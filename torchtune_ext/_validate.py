"""``tune-ext validate``: the start-up checks of a config's recipe, run as the recipe runs them, without loading weights
and without writing. It builds the recipe, so it sits at the top beside the CLI (``torchtune_ext.cli``)."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List

from omegaconf import DictConfig, OmegaConf

from torchtune_ext._shipped import EVAL_RECIPE, GENERATION_RECIPE, SINGLE_DEVICE_RECIPE

if TYPE_CHECKING:
    import torch


def validate(cfg: DictConfig, recipe: str = SINGLE_DEVICE_RECIPE) -> List[str]:
    """Runs the start-up checks of ``recipe`` on ``cfg``: what the recipe checks before its first write or load.

    - the QLoRA recipes (``qlora_finetune_*``): the recipe's constructor (keys, ranges, device, files, data columns;
      the settings: dtypes, counts, ``device_profile``), then its
      :meth:`~torchtune_ext.training.QLoRARecipe.check_start`: writable folders, ``output_dir`` (in use, or
      holding another run's checkpoints), the model on the meta device against the checkpoint's headers, tokenizer,
      loss, the data sets and their checks, and on ``resume_from_checkpoint=True`` the saved recipe state against
      this run. The tiny base of
      ``generate_base_checkpoint``, when not there yet, is written to a temporary folder (deleted) instead. With
      ``dry_run=True``: the constructor and the dry run's device checks (the dry run needs no checkpoint or data);
    - ``generate`` and ``eleuther_eval``: their recipe's constructor (keys, device, tokenizer files, settings).

    Args:
        cfg (DictConfig): the config.
        recipe (str): the recipe it is for, a name of ``tune-ext ls``.

    Returns:
        List[str]: what was checked, one line each.

    Raises:
        ConfigError: on the first failing check (one line per problem); other errors as the recipe raises them.
    """
    if recipe == GENERATION_RECIPE:
        from torchtune_ext.generation import GenerationRecipe

        generation = GenerationRecipe(cfg)
        done = ["the generate recipe's settings: keys, device, tokenizer files, dtype, sampling, prompts"]
        return done + ([] if generation._dry_run else _check_model_and_adapter(cfg, generation._dtype))
    if recipe == EVAL_RECIPE:
        from torchtune_ext.evaluation import EleutherEvalRecipe

        evaluation = EleutherEvalRecipe(cfg)
        done = ["the eleuther_eval recipe's settings: keys, device, tokenizer files, dtype, tasks, folders"]
        return done + ([] if evaluation._merged_dir else _check_model_and_adapter(cfg, evaluation._dtype))
    return _validate_training(cfg)


def _check_model_and_adapter(cfg: DictConfig, dtype: torch.dtype) -> List[str]:
    """What ``load_model_with_adapter`` checks before it reads a weight: the model on the meta device against the
    base checkpoint's headers and the adapter's config and headers."""
    from torchtune_ext.checkpoint import read_peft_adapter
    from torchtune_ext.config import instantiate_component
    from torchtune_ext.generation import build_model_for

    checkpointer = instantiate_component(cfg.checkpointer, "checkpointer")
    adapter_dir = cfg.get("adapter_dir", None)
    adapter = read_peft_adapter(adapter_dir) if adapter_dir is not None else None
    build_model_for(checkpointer, adapter, cfg.get("model", None), dtype)
    fits = f" and the adapter in {adapter_dir}" if adapter is not None else " (no adapter: the base alone)"
    return [f"model (meta) matches the checkpoint headers in {checkpointer.checkpoint_dir}{fits}"]


def _validate_training(cfg: DictConfig) -> List[str]:
    from torchtune_ext.memory import dry_run_target
    from torchtune_ext.training import QLoRARecipe

    training = QLoRARecipe(cfg)
    settings = training.settings
    done = [
        "keys, value ranges" + ("" if settings.dry_run else ", device, tokenizer and data files, data columns"),
        f"recipe settings (dtype {settings.dtype}, batch_size {settings.batch_size})",
    ]
    if settings.dry_run:
        target = dry_run_target(cfg, settings.device, settings.dtype)
        card = target.profile.name if target.profile is not None else "none (no device answer)"
        return done + [f"dry run: device profile {card}, host {target.host_memory_gib:.1f} GiB"]
    with _tiny_base_elsewhere(cfg) as checked:
        dataset, val_dataset, state = training.check_start(checked)
        base = training._checkpointer.checkpoint_dir
        done.append(f"output_dir {checked.checkpointer.output_dir}: writable, not in use by another run")
        where = f"in {base}"
        if checked is not cfg:
            where = f"of the tiny base generate_base_checkpoint writes on the first run (made in {base}, deleted)"
        done.append(f"model {cfg.model._component_} (meta) matches the checkpoint headers {where}")
    sizes = f"{len(dataset)} samples" + (f", {len(val_dataset)} validation samples" if val_dataset is not None else "")
    done.append(f"data: {sizes}; labels within max_seq_len; enough batches for a step")
    if state is not None:
        done.append(f"resume: {state.source} (step {state.global_step}) is this run's recipe state")
    return done


@contextlib.contextmanager
def _tiny_base_elsewhere(cfg: DictConfig) -> Iterator[DictConfig]:
    """``cfg``, or, where ``generate_base_checkpoint`` would write the base checkpoint on the first run, a copy
    that writes it to a temporary folder (deleted on exit)."""
    base = cfg.get("generate_base_checkpoint", None)
    if base is None or Path(str(cfg.checkpointer.checkpoint_dir)).is_dir():
        yield cfg
        return
    with tempfile.TemporaryDirectory(prefix="tune-ext-validate-") as folder:
        copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        copy.checkpointer.checkpoint_dir = copy.generate_base_checkpoint.checkpoint_dir = f"{folder}/base"
        yield copy

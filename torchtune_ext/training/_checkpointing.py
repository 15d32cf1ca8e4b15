"""What a recipe's saves need beyond the checkpointer: the disk plan of a run, the state dict as exported (the full
vocabulary back under vocab pruning), and the plain values a recipe state records."""

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from torchtune_ext.checkpoint import DiskPlan, QLoRAHFCheckpointer, count_saves, plan_disk
from torchtune_ext.modules.vocab_pruning import VocabPruning, export_full_vocab_state_dict
from torchtune_ext.training._settings import RecipeSettings


def disk_plan(
    settings: RecipeSettings,
    world_size: int,
    max_steps_per_epoch: Optional[int],
    model: nn.Module,
    output_dir: str,
    num_rows: Optional[int],
    merged_dtype: torch.dtype,
) -> DiskPlan:
    """The disk a run will use.

    Args:
        settings (RecipeSettings): the run's settings.
        world_size (int): the number of ranks.
        max_steps_per_epoch (Optional[int]): the run's (a resumed run keeps the saved one).
        model (nn.Module): the model as built, unpruned.
        output_dir (str): the output folder.
        num_rows (Optional[int]): the training rows; None: unknown, epoch-end saves only.
        merged_dtype (torch.dtype): the merged export's dtype.

    Returns:
        DiskPlan: the plan.
    """
    steps = max_steps_per_epoch or 0
    if num_rows is not None:
        steps = num_rows // (settings.batch_size * world_size * settings.gradient_accumulation_steps)
        steps = min(steps, max_steps_per_epoch or steps)
    return plan_disk(
        model,
        output_dir,
        saves=count_saves(settings.epochs, steps, settings.save_every_n_steps if num_rows is not None else None),
        keep_last_n=settings.keep_last_n,
        merged_dtype=None if settings.save_adapter_weights_only else merged_dtype,
        epochs=settings.epochs,
        merge_every_epoch=settings.merge_every_epoch,
    )


def exportable(
    state_dict: Dict[str, torch.Tensor],
    checkpointer: QLoRAHFCheckpointer,
    pruning: Optional[VocabPruning],
    kept_ids: Optional[List[int]],
) -> Dict[str, torch.Tensor]:
    """A full state dict under the unpruned model's keys and shapes (under vocab pruning, the trained rows written
    into the base's full-vocabulary tensors)."""
    if pruning is None:
        return state_dict
    return export_full_vocab_state_dict(state_dict, checkpointer.read_vocab(), kept_ids)


def log_dir_name(metric_logger: Any) -> Optional[str]:
    """The metric logger's folder as a plain string (a recipe state holds plain data only), if it has one."""
    log_dir = getattr(metric_logger, "log_dir", None)
    return None if log_dir is None else str(log_dir)

"""Bounded disk: keep the newest ``keep_last_n_checkpoints`` step folders, write the merged model once at the end of
the run (or every epoch on request), and say before the run how much disk it will take beside the free space."""

from __future__ import annotations

import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

import torch
from torch import nn
from torchtune.modules.peft import get_adapter_params

from torchtune_ext.checkpoint._writes import free_bytes
from torchtune_ext.config import ConfigError

PathLike = Union[str, Path]

#: how many step folders a run keeps unless its config says otherwise.
DEFAULT_KEEP_LAST_N = 2
#: bytes of optimizer state per trainable element (AdamW: two fp32 moments).
OPTIMIZER_BYTES_PER_ELEMENT = 8
_STEP_FOLDER = re.compile(r"^step_(\d+)$")
GIB = 1024**3


def parse_keep_last_n(value: Any) -> Optional[int]:
    """Reads ``keep_last_n_checkpoints``.

    Args:
        value (Any): the config value: a positive integer, or null to keep every step folder.

    Returns:
        Optional[int]: the count, None to keep all.

    Raises:
        ConfigError: on anything else.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ConfigError(
        f"keep_last_n_checkpoints={value!r} must be a positive integer (the newest step folders kept; default "
        f"{DEFAULT_KEEP_LAST_N}) or null to keep every one.",
        "keep_last_n_checkpoints",
    )


def merge_at_epoch_end(epochs_run: int, total_epochs: int, merge_every_epoch: bool) -> bool:
    """Whether the end-of-epoch save writes the merged model: at the end of the run, or every epoch on request.

    Args:
        epochs_run (int): epochs finished, the one just ended included.
        total_epochs (int): the run's epochs.
        merge_every_epoch (bool): the config's ``merge_every_epoch``.

    Returns:
        bool: write it.
    """
    return merge_every_epoch or epochs_run >= total_epochs


def step_folders(output_dir: PathLike) -> List[Tuple[int, Path]]:
    """The complete ``step_N`` folders under ``output_dir`` (a folder only gets its name once written), by step.

    Args:
        output_dir (PathLike): the run's output folder.

    Returns:
        List[Tuple[int, Path]]: ``(N, folder)``, oldest first.
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _STEP_FOLDER.match(p.name))]
    return sorted(found)


def remove_old_checkpoints(output_dir: PathLike, keep_last_n: Optional[int], newest: PathLike) -> List[Path]:
    """Deletes all but the newest ``keep_last_n`` step folders, once ``newest`` (the save just completed, which the
    recipe state points at) is written; ``newest`` itself is never deleted.

    Each folder is first renamed to a ``.step_N.old-XXXXXXXX`` temporary (so a kill mid-deletion never leaves a
    partial folder under a checkpoint's name; ``remove_stale_temporaries`` deletes the rest at the next start).

    Args:
        output_dir (PathLike): the run's output folder.
        keep_last_n (Optional[int]): step folders to keep; None keeps all.
        newest (PathLike): the folder just saved.

    Returns:
        List[Path]: the folders deleted (their former names).

    Raises:
        ValueError: if ``newest`` is not a complete step folder of ``output_dir``.
    """
    newest = Path(newest)
    folders = step_folders(output_dir)
    if newest.resolve() not in [p.resolve() for _, p in folders]:
        raise ValueError(f"{newest} is not a complete step folder of {output_dir}; nothing was deleted.")
    if keep_last_n is None:
        return []
    others = [p for _, p in folders if p.resolve() != newest.resolve()]
    doomed = others[: max(0, len(others) - (keep_last_n - 1))]
    for folder in doomed:
        trash = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
        folder.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def count_saves(epochs: int, steps_per_epoch: int, save_every_n_steps: Optional[int]) -> int:
    """Step folders a run writes: one per epoch, plus one every ``save_every_n_steps`` steps within an epoch.

    Args:
        epochs (int): the run's epochs.
        steps_per_epoch (int): optimizer steps per epoch.
        save_every_n_steps (Optional[int]): the config's ``save_every_n_steps``.

    Returns:
        int: the count (at most; a mid-epoch save that falls on an epoch's end is that epoch's save).
    """
    mid_epoch = (epochs * steps_per_epoch - 1) // save_every_n_steps if save_every_n_steps else 0
    return epochs + max(0, mid_epoch)


@dataclass(frozen=True)
class DiskPlan:
    """The disk a run will use under ``output_dir``.

    Attributes:
        adapter_bytes (int): one step folder's adapter.
        kept (int): step folders kept at once.
        recipe_state_bytes (int): the recipe state (one, overwritten in place: twice that while it is replaced).
        merged_bytes (int): one merged model.
        merged_count (int): merged models on disk at the end.
        free_bytes (int): free space where ``output_dir`` goes.
    """

    adapter_bytes: int
    kept: int
    recipe_state_bytes: int
    merged_bytes: int
    merged_count: int
    free_bytes: int

    @property
    def total_bytes(self) -> int:
        """int: the most the run holds at once (the recipe state counted twice, as while it is replaced)."""
        return self.adapter_bytes * self.kept + 2 * self.recipe_state_bytes + self.merged_bytes * self.merged_count

    def format(self) -> str:
        """
        Returns:
            str: one line for the start-up log and the dry run.
        """
        verdict = "fits" if self.total_bytes <= self.free_bytes else "does NOT fit: free space or lower the counts"
        return (
            f"Disk: up to {self.total_bytes / GIB:.2f} GiB under output_dir ({self.kept} step folder(s) x "
            f"{self.adapter_bytes / GIB:.3f} GiB adapter + recipe state {self.recipe_state_bytes / GIB:.3f} GiB (x2 "
            f"while replaced) + {self.merged_count} merged model(s) x {self.merged_bytes / GIB:.2f} GiB); "
            f"{self.free_bytes / GIB:.1f} GiB free: {verdict}."
        )


def _numel_bytes(tensors: List[torch.Tensor], dtype: Optional[torch.dtype] = None) -> int:
    return sum(t.numel() * (dtype or t.dtype).itemsize for t in tensors)


def plan_disk(
    model: nn.Module,
    output_dir: PathLike,
    *,
    saves: int,
    keep_last_n: Optional[int],
    merged_dtype: Optional[torch.dtype],
    epochs: int = 1,
    merge_every_epoch: bool = False,
) -> DiskPlan:
    """The disk a run will use, from its (meta-device, unpruned) model.

    Args:
        model (nn.Module): the QLoRA model as built (meta is fine).
        output_dir (PathLike): the run's output folder.
        saves (int): step folders the run writes.
        keep_last_n (Optional[int]): ``keep_last_n_checkpoints`` (None: all kept).
        merged_dtype (Optional[torch.dtype]): dtype of the merged export; None: no merged model is written.
        epochs (int): the run's epochs.
        merge_every_epoch (bool): a merged model every epoch.

    Returns:
        DiskPlan: the plan.
    """
    adapters = list(get_adapter_params(model).values())
    adapter_ids = {id(p) for p in adapters}
    trainable = [p for p in adapters if p.requires_grad] or adapters
    base_tensors = [p for p in model.parameters() if id(p) not in adapter_ids]  # tied weights once
    kept = max(1, min(saves, keep_last_n) if keep_last_n is not None else saves)
    merged_count = 0 if merged_dtype is None else (min(epochs, kept) if merge_every_epoch else 1)
    return DiskPlan(
        adapter_bytes=_numel_bytes(adapters),
        kept=kept,
        recipe_state_bytes=_numel_bytes(adapters) + sum(t.numel() for t in trainable) * OPTIMIZER_BYTES_PER_ELEMENT,
        merged_bytes=_numel_bytes(base_tensors, merged_dtype) if merged_dtype is not None else 0,
        merged_count=merged_count,
        free_bytes=free_bytes(output_dir),
    )

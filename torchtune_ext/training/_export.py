"""Saving safely: the folders a run writes are checked at start-up, and the big merged export comes last, after the
adapter and the recipe state, so that a full disk or a file-size limit never costs what fitted.

Before the merged export, the free space is checked against its known size; if it does not fit, the export is
skipped with a message naming the standalone merge command (the run goes on). A merged export that fails anyway
keeps the adapter and the recipe state and stops the run with a :class:`~torchtune_ext.checkpoint.WriteError` that
says so and names the same command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import utils

from torchtune_ext._finite import NonFiniteError
from torchtune_ext.checkpoint import (
    ADAPTER_DIRNAME,
    MERGED_DIRNAME,
    RECIPE_STATE_DIRNAME,
    WriteError,
    check_writable_folders,
    format_bytes,
    free_bytes,
)

log = utils.get_logger("INFO")

#: room left for the merged model's headers, index, config and tokenizer files.
MERGED_OVERHEAD_BYTES = 1 << 20


def run_folders(cfg: DictConfig) -> Dict[str, Path]:
    """Every folder a run writes: ``output_dir``, its existing recipe-state and step folders, and the metric
    logger's ``log_dir``."""
    folders: Dict[str, Path] = {}
    for key, value in (
        ("output_dir", cfg.get("output_dir")),
        ("checkpointer.output_dir", cfg.checkpointer.get("output_dir")),
    ):
        if value is not None and Path(str(value)).absolute() not in {p.absolute() for p in folders.values()}:
            folders[key] = Path(str(value))
    for key, root in list(folders.items()):
        if root.is_dir():
            for sub in [root / RECIPE_STATE_DIRNAME, *sorted(root.glob("step_*"))]:
                if sub.is_dir():
                    folders[f"{key}/{sub.name}"] = sub
    log_dir = cfg.get("metric_logger", {}).get("log_dir")
    if log_dir is not None:
        folders["metric_logger.log_dir"] = Path(str(log_dir))
    return folders


def check_run_folders(cfg: DictConfig) -> None:
    """Fails before anything is written if a folder the run writes cannot be written (see :func:`run_folders`).

    Raises:
        PermissionError: naming each such folder and why.
    """
    check_writable_folders(run_folders(cfg))


def merge_command(checkpoint_dir: Path, step_dir: Path) -> str:
    """The standalone command that merges a saved adapter onto its base."""
    return (
        f"tune-ext merge --base {checkpoint_dir} --adapter {step_dir / ADAPTER_DIRNAME} "
        f"--output {step_dir / MERGED_DIRNAME}"
    )


def export_merged(
    checkpointer: Any,
    state_dict: Dict[str, torch.Tensor],
    step: int,
    adapter_config: Dict[str, Any],
    dtype: torch.dtype,
    merge_base: str,
) -> Optional[str]:
    """Writes the merged model of a step whose adapter and recipe state are saved, if the disk has room for it.

    Args:
        checkpointer (Any): the run's :class:`~torchtune_ext.checkpoint.QLoRAHFCheckpointer`.
        state_dict (Dict[str, torch.Tensor]): the full state dict (as for its ``save``).
        step (int): the step (its folder holds the adapter).
        adapter_config (Dict[str, Any]): as for its ``save``.
        dtype (torch.dtype): the merged model's dtype.
        merge_base (str): as for its ``save``.

    Returns:
        Optional[str]: why the export was skipped (it was logged), or None if it was written.

    Raises:
        WriteError: if the export failed (the adapter and the recipe state are kept; the message says so and names
            the merge command).
        NonFiniteError: if a merged tensor is not finite (nothing of the merged model is written).
    """
    step_dir = checkpointer.output_dir / f"step_{step}"
    command = merge_command(checkpointer.checkpoint_dir, step_dir)
    needed = checkpointer.merged_nbytes(state_dict, dtype) + MERGED_OVERHEAD_BYTES
    free = free_bytes(step_dir)
    if needed > free:
        note = (
            f"merged model needs {format_bytes(needed)}, {format_bytes(free)} free in {step_dir}; the adapter is saved "
            f"({step_dir / ADAPTER_DIRNAME}); run `{command}` to merge later"
        )
        log.warning(f"Skipped the merged export: {note}.")
        return note
    kept = (
        f"The merged export failed; the adapter ({step_dir / ADAPTER_DIRNAME}) and the recipe state "
        f"({checkpointer.output_dir / RECIPE_STATE_DIRNAME}) are saved."
    )
    try:
        checkpointer.save_merged(state_dict, step, adapter_config, dtype, merge_base)
    except WriteError as err:
        raise err.with_note(
            f"{kept} Free some space (or lift the limit) and run `{command}` to merge them; or resume with "
            "resume_from_checkpoint=True save_adapter_weights_only=True."
        ) from err.__cause__
    except NonFiniteError as err:
        raise NonFiniteError(f"{err} {kept}") from err
    return None

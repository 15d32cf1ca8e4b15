"""Out of device memory during training: one message instead of torch's traceback, saying where it happened, how
much memory there was, and which settings lower the peak (those a resume accepts first), with the command that
resumes from the last checkpoint. The failed step's tensors are released before the message is raised: a notebook
keeps the last exception and its frames alive, and with them the step's activations and (torch < 2.12) the
saved-tensor hooks of an activation-checkpointed layer the error left, which would apply to the next run there."""

from __future__ import annotations

import gc
import traceback
from pathlib import Path
from typing import List, Optional

import torch

from torchtune_ext.config import UserFacingError
from torchtune_ext.training._interrupt import resume_command
from torchtune_ext.training._settings import RecipeSettings

__all__ = ["DeviceOutOfMemoryError", "out_of_memory_error"]

_GIB = 1 << 30
#: the MLP tile the message suggests for sequences longer than it.
TILED_MLP_TOKENS = 4096


class DeviceOutOfMemoryError(UserFacingError):
    """The device ran out of memory in a training step; the message names the settings that lower the peak."""


def release_frames(error: BaseException) -> None:
    """Clears the local variables of the frames ``error`` left (and of the errors it chains to), so that the tensors
    they held are freed while ``error`` itself is still referenced (a notebook's ``sys.last_value``); a generator
    such as ``torch.utils.checkpoint``'s is closed on the way, which exits its context managers."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()


def _device_memory(device: torch.device) -> str:
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    total = torch.cuda.get_device_properties(device).total_memory
    peak = torch.cuda.max_memory_reserved(device)
    return f" (peak {peak / _GIB:.2f} GiB reserved of the device's {total / _GIB:.2f} GiB)"


def _resumable_fixes(settings: RecipeSettings, fsdp_cpu_offload: bool, distributed: bool) -> List[str]:
    """Settings a resume accepts that lower the peak, those not in use yet, the largest saving first."""
    fixes = []
    if not settings.enable_activation_checkpointing:
        fixes.append("enable_activation_checkpointing=True")
    if settings.device.type == "cuda" and not settings.enable_activation_offloading:
        fixes.append("enable_activation_offloading=True")
    if settings.tiled_mlp_tokens is None and (settings.max_seq_len or 0) > TILED_MLP_TOKENS:
        fixes.append(f"tiled_mlp_tokens={TILED_MLP_TOKENS}")
    if distributed and settings.device.type == "cuda" and not fsdp_cpu_offload:
        fixes.append("fsdp_cpu_offload=True")
    return fixes


def out_of_memory_error(
    error: torch.OutOfMemoryError,
    step: Optional[int],
    settings: RecipeSettings,
    last_checkpoint: Optional[Path],
    fsdp_cpu_offload: bool = False,
    distributed: bool = False,
) -> DeviceOutOfMemoryError:
    """The message for ``error``; releases the failed step's tensors first.

    Args:
        error (torch.OutOfMemoryError): the allocator's error.
        step (Optional[int]): the training step that failed (1-based); None: before training (the set-up).
        settings (RecipeSettings): the run's settings.
        last_checkpoint (Optional[Path]): the last checkpoint this run saved (None: none yet).
        fsdp_cpu_offload (bool): whether FSDP2 already offloads the params.
        distributed (bool): whether the run is on several ranks.

    Returns:
        DeviceOutOfMemoryError: its lines: what happened, the settings to change, the command to run next.
    """
    release_frames(error)
    if settings.device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = "during the set-up" if step is None else f"in training step {step}"
    lines = [f"{settings.device.type} ran out of memory {where}{_device_memory(settings.device)}: {first_line}"]
    fixes = _resumable_fixes(settings, fsdp_cpu_offload, distributed)
    if fixes:
        lines.append(f"Settings that lower the peak and keep the run resumable: {' '.join(fixes)}.")
    lines.append(
        f"Or start a new run with a smaller batch_size (now {settings.batch_size}; a larger "
        "gradient_accumulation_steps keeps the batch) or a smaller tokenizer.max_seq_len"
        + (f" (now {settings.max_seq_len})" if settings.max_seq_len else "")
        + "; add dry_run=True to the command to see a setting's estimated peak without loading the model."
    )
    if last_checkpoint is not None and fixes:
        command = resume_command()
        lines.append(f"Resume from {last_checkpoint} with, e.g.: {command} {fixes[0]}")
    return DeviceOutOfMemoryError("\n".join(lines))

"""The CUDA caching allocator's settings for training: growable (expandable) segments unless the user chose others.

torch's allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_ALLOC_CONF`` in newer releases) once, when CUDA
initialises, and ``import torchtune`` initialises CUDA already (its import guard asks for the device capability).
So the setting goes through torch's runtime allocator settings, which apply to every segment allocated from then
on, whenever CUDA initialised; the environment variable is set too, for the processes this one starts.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

#: Growable segments instead of fixed blocks: little fragmentation when batch shapes vary (the memory estimate's
#: fragmentation allowance, ``torchtune_ext.training.RECIPE_ALLOWANCE``, assumes it).
EXPANDABLE_SEGMENTS = "expandable_segments:True"
_USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _runtime_setter() -> Callable[[str], None]:
    """torch's runtime allocator settings: ``torch._C._accelerator_setAllocatorSettings`` where torch has it
    (2.9 and later), else ``torch.cuda.memory._set_allocator_settings`` (2.6-2.8; later ones deprecate it)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    return setter if setter is not None else torch.cuda.memory._set_allocator_settings


def use_expandable_segments(device: torch.device) -> Optional[str]:
    """On CUDA, turns on the allocator's expandable segments, unless ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` is set (the user's own settings are kept as torch read them).

    Args:
        device (torch.device): the training device.

    Returns:
        Optional[str]: the settings applied, or None (not CUDA, or the user's own).
    """
    if device.type != "cuda" or any(os.environ.get(name) for name in _USER_SETTINGS):
        return None
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    _runtime_setter()(EXPANDABLE_SEGMENTS)
    return EXPANDABLE_SEGMENTS

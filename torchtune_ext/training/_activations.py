"""Activation offloading: saved activations to pinned host memory during forward, back for backward.

torchtune's ``OffloadActivations`` (``training.get_act_offloading_ctx_manager``, CUDA streams, pinned buffers; its
output projection excluded), around the model's forward. With activation checkpointing the activations saved outside
the checkpointed layers are each layer's input, which torch's non-reentrant checkpoint saves through the
saved-tensor hooks (``_NoopSaveInputs``), so exactly those go to the host: what Unsloth calls offloaded gradient
checkpointing; the device then holds one layer's recomputed activations at a time. Without checkpointing every
saved activation is offloaded. Parameters (NF4 weights included) and buffers stay where they are.

It needs CUDA (streams, pinned memory, a device distinct from the host): elsewhere the recipes refuse
``enable_activation_offloading`` at start-up.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn
from torchtune import training

from torchtune_ext.config import bad_value


def check_activation_offloading(enabled: bool, device: torch.device) -> None:
    """
    Args:
        enabled (bool): the config's ``enable_activation_offloading``.
        device (torch.device): the training device.

    Raises:
        ConfigError: if offloading is requested on a device that is not CUDA (the entry points print its line and
            exit 2).
    """
    if enabled and device.type != "cuda":
        raise bad_value(
            "enable_activation_offloading",
            True,
            "needs a CUDA device (it copies activations to pinned host memory on a side stream), but "
            f"device={device.type}",
            "set enable_activation_offloading=False (on the CPU activations already live in host memory), or train "
            "on device=cuda",
        )


def activation_offloading(model: nn.Module, enabled: bool) -> ContextManager:
    """The context to run the model's forward in.

    Args:
        model (nn.Module): the model (its output projection is not offloaded: it is used again right away).
        enabled (bool): offload (CUDA only, see :func:`check_activation_offloading`).

    Returns:
        ContextManager: torchtune's ``OffloadActivations`` context, or a null context.
    """
    if not enabled:
        return contextlib.nullcontext()
    return training.get_act_offloading_ctx_manager(model, True)

"""Activation offloading as an estimate sees it: what torchtune's ``OffloadActivations`` moves to host memory."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtune_ext.memory._tracker import count_as_host

#: torchtune's ``OffloadActivations`` leaves tensors smaller than this on the device (``min_offload_size``).
MIN_OFFLOAD_BYTES = 1024


class OffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that move what torchtune's ``OffloadActivations`` moves (saved tensors of at least
    :data:`MIN_OFFLOAD_BYTES` that are not parameters or buffers) to host memory in forward (:func:`count_as_host`)
    and copy it back to the device in backward, on fake tensors, so that an estimate counts the device memory of an
    offloading step: the recipes' ``enable_activation_offloading``, whose real context needs CUDA."""

    def __init__(self) -> None:
        super().__init__(_pack, _unpack)


def _pack(tensor: torch.Tensor) -> Any:
    if tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES or isinstance(tensor, (nn.Parameter, nn.Buffer)):
        return tensor
    host = tensor.detach().clone()
    count_as_host(host)
    return _OnHost(host)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor.clone() if isinstance(packed, _OnHost) else packed


class _OnHost:
    """An offloaded tensor (its storage counted as host memory)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

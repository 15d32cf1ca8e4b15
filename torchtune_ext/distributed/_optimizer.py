"""Full (unsharded) optimizer state of an FSDP2-sharded model, and loading it back onto any world size.

The state keeps ``optimizer.state_dict()``'s own layout (param indices, param groups), so a single-device run, an
N-rank run and an M-rank run read and write the same recipe state.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from torchtune_ext.distributed._utils import world_info


def get_full_optimizer_state(optimizer: Optimizer) -> Dict[str, Any]:
    """The optimizer state with every sharded (DTensor) tensor gathered, on the CPU, on rank 0. Collective.

    Args:
        optimizer (Optimizer): an optimizer over sharded and/or plain params.

    Returns:
        Dict[str, Any]: ``{"state", "param_groups"}`` in ``optimizer.state_dict()``'s layout on rank 0 (tensors
        are copies); ``{}`` on the other ranks.
    """
    is_rank_zero = world_info()[0] == 0
    local = optimizer.state_dict()
    full_state: Dict[int, Dict[str, Any]] = {}
    for index in sorted(local["state"]):
        entry = {}
        for name, value in local["state"][index].items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if is_rank_zero:
                entry[name] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        full_state[index] = entry
    return {"state": full_state, "param_groups": local["param_groups"]} if is_rank_zero else {}


def _like_param(value: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """A full optimizer-state tensor laid out like ``param``: this rank's shard for a DTensor param."""
    if isinstance(param, DTensor):
        local = param.to_local()
        return distribute_tensor(value.to(local.device), param.device_mesh, param.placements, src_data_rank=None)
    return value.to(param.device)


def load_full_optimizer_state(optimizer: Optimizer, full: Dict[str, Any]) -> None:
    """Loads a full optimizer state (:func:`get_full_optimizer_state`, from any world size) into ``optimizer``,
    each rank keeping its shard of every per-param tensor.

    Args:
        optimizer (Optimizer): the optimizer, over the same params in the same order as the saved one.
        full (Dict[str, Any]): the full state (every rank passes it).

    Raises:
        ValueError: if the saved optimizer has another number of params.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in full["param_groups"] for i in group["params"]]
    if len(saved) != len(params):
        raise ValueError(
            f"The recipe state's optimizer has {len(saved)} params, this model {len(params)}: resume with the "
            "same model, LoRA and vocab_pruning settings."
        )
    state = {}
    for index, entry in full["state"].items():
        param = params[index]
        state[index] = {
            name: _like_param(value, param) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            for name, value in entry.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})

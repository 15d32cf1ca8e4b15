"""The optimizer's param groups, the full (unsharded) optimizer state of an FSDP2-sharded model, and loading it
back onto any world size.

torch's fused and foreach optimizers need every tensor of a param group to be of one kind (DTensor or plain) and,
fused, on one device in one dtype; :func:`optimizer_param_groups` splits the trainable params so. The full state
keeps ``optimizer.state_dict()``'s layout (``state``, ``param_groups``) but numbers the params by their position in
the trainable params' own order, not by the groups', so a single-device run, an N-rank run and an M-rank run (whose
groups differ: sharded adapters beside replicated pruned rows) read and write the same recipe state. A state of one
group (before the groups were split) is that layout too.

Not torch DCP's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``: it keys the state by parameter name
where the recipe states saved so far number it by position, and it loads only into an optimizer whose state exists
(it takes a zero-gradient step first).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from torchtune_ext.distributed._utils import world_info


def _kind(param: torch.Tensor) -> Tuple[bool, torch.device, torch.dtype]:
    return isinstance(param, DTensor), param.device, param.dtype


def optimizer_param_groups(params: Sequence[nn.Parameter]) -> List[Dict[str, Any]]:
    """``params`` as param groups that torch's fused and foreach optimizers accept: one group per kind (DTensor or
    plain tensor), device and dtype, in the order each kind first appears, each keeping its params' order. The groups
    hold only ``params``: the optimizer's own arguments (the config's lr, weight_decay, ...) apply to every group.

    Args:
        params (Sequence[nn.Parameter]): the trainable params.

    Returns:
        List[Dict[str, Any]]: ``[{"params": [...]}, ...]``, for the optimizer's first argument.
    """
    groups: Dict[Tuple[bool, torch.device, torch.dtype], List[nn.Parameter]] = {}
    for param in params:
        groups.setdefault(_kind(param), []).append(param)
    return [{"params": group} for group in groups.values()]


def _positions(optimizer: Optimizer, params: Optional[Sequence[nn.Parameter]]) -> List[int]:
    """For each of ``optimizer``'s params, in its own order, its position in ``params`` (default: its own order)."""
    own = [p for group in optimizer.param_groups for p in group["params"]]
    if params is None:
        return list(range(len(own)))
    index = {id(p): i for i, p in enumerate(params)}
    missing = [i for i, p in enumerate(own) if id(p) not in index]
    if missing or len(own) != len(params):
        raise ValueError(f"the optimizer has {len(own)} params, {len(params)} given, {len(missing)} not among them")
    return [index[id(p)] for p in own]


def get_full_optimizer_state(optimizer: Optimizer, params: Optional[Sequence[nn.Parameter]] = None) -> Dict[str, Any]:
    """The optimizer state with every sharded (DTensor) tensor gathered, on the CPU, on rank 0. Collective.

    Args:
        optimizer (Optimizer): an optimizer over sharded and/or plain params.
        params (Optional[Sequence[nn.Parameter]]): the optimizer's params in the order that numbers them in the
            state (the trainable params, whatever the groups); default: the optimizer's own order.

    Returns:
        Dict[str, Any]: ``{"state", "param_groups"}`` in ``optimizer.state_dict()``'s layout on rank 0, params
        numbered by their position in ``params`` (tensors are copies); ``{}`` on the other ranks.
    """
    is_rank_zero = world_info()[0] == 0
    positions = _positions(optimizer, params)
    local = optimizer.state_dict()
    full_state: Dict[int, Dict[str, Any]] = {}
    for index in sorted(local["state"]):
        entry = {}
        for name, value in local["state"][index].items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if is_rank_zero:
                entry[name] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        full_state[positions[index]] = entry
    if not is_rank_zero:
        return {}
    param_groups = [{**group, "params": [positions[i] for i in group["params"]]} for group in local["param_groups"]]
    return {"state": dict(sorted(full_state.items())), "param_groups": param_groups}


def _like_param(value: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """A full optimizer-state tensor laid out like ``param``: this rank's shard for a DTensor param."""
    if isinstance(param, DTensor):
        local = param.to_local()
        return distribute_tensor(value.to(local.device), param.device_mesh, param.placements, src_data_rank=None)
    return value.to(param.device)


def load_full_optimizer_state(
    optimizer: Optimizer, full: Dict[str, Any], params: Optional[Sequence[nn.Parameter]] = None
) -> None:
    """Loads a full optimizer state (:func:`get_full_optimizer_state`, from any world size and any grouping of the
    params) into ``optimizer``, each rank keeping its shard of every per-param tensor. Each of ``optimizer``'s
    groups takes the hyperparameters of the saved group that held its first param.

    Args:
        optimizer (Optimizer): the optimizer, over the saved params (grouped in any way).
        full (Dict[str, Any]): the full state (every rank passes it).
        params (Optional[Sequence[nn.Parameter]]): the params in the order that numbers them in ``full`` (as
            given when it was saved); default: the optimizer's own order.

    Raises:
        ValueError: if the saved optimizer has another number of params.
    """
    own = [p for group in optimizer.param_groups for p in group["params"]]
    saved_group_of = {i: group for group in full["param_groups"] for i in group["params"]}
    if len(saved_group_of) != len(own):
        raise ValueError(
            f"The recipe state's optimizer has {len(saved_group_of)} params, this model {len(own)}: resume with the "
            "same model, LoRA and vocab_pruning settings."
        )
    positions = _positions(optimizer, params)
    state = {}
    for index, param in enumerate(own):
        entry = full["state"].get(positions[index])
        if entry is not None:
            state[index] = {
                name: _like_param(value, param) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                for name, value in entry.items()
            }
    param_groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        saved = saved_group_of[positions[start]]
        param_groups.append({**saved, "params": list(range(start, start + count))})
        start += count
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})

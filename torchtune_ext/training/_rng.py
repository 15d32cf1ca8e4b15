"""RNG state: seeding every stream the recipes draw from, and the states a resume restores bit-exactly."""

import random
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist


def seed_everything(seed: int) -> None:
    """Seeds torch's, python's and numpy's global generators with ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_state(device: torch.device) -> Dict[str, Any]:
    """
    Args:
        device (torch.device): the training device (its CUDA generator is included on CUDA).

    Returns:
        Dict[str, Any]: the torch, python, numpy (and CUDA) RNG states, for a bit-exact resume.
    """
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Dict[str, Any], device: torch.device) -> None:
    """Restores what :func:`rng_state` returned.

    Args:
        state (Dict[str, Any]): the saved states.
        device (torch.device): the training device.
    """
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def all_rng_states(device: torch.device, world_size: int) -> List[Dict[str, Any]]:
    """Every rank's :func:`rng_state`, on every rank. Collective on several ranks.

    Args:
        device (torch.device): the training device.
        world_size (int): the number of ranks.

    Returns:
        List[Dict[str, Any]]: the states, by rank.
    """
    if world_size == 1:
        return [rng_state(device)]
    states: List[Any] = [None] * world_size
    dist.all_gather_object(states, rng_state(device))
    return states

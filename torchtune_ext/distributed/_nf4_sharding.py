"""Which NF4 weights FSDP2 can split over a world size, and which are kept whole on every rank.

torchao's ``NF4Tensor`` splits along rows only into equal shards of whole blocks and whole scale groups (its
``aten.split`` asserts that every inner tensor divides by the world size), and FSDP2 gathers shards by concatenating
their inner tensors. A weight whose rows or scale groups do not divide the world size (Qwen2.5-0.5B's 896x896 at 3
ranks; any weight whose last NF4 block is padded) cannot be split so; FSDP2's uneven sharding of plain tensors
(pad the last rank's shard) does not carry over, because a padded row shard would cut a scale group in two. Such a
weight is kept whole on every rank (``fully_shard(..., ignored_params=...)``; it is frozen, so no gradient has to
be reduced), and the start-up log says how many bytes per rank that keeps. :func:`nf4_scaler_block_size` picks scale
groups that split over 2, 4 and 8 ranks for every shipped builder (tests/torchtune_ext/distributed/
test_nf4_sharding.py), so only odd world sizes keep weights whole there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Set, Tuple

from torch import nn
from torchtune import utils

from torchtune_ext.distributed._utils import unwrap_key
from torchtune_ext.nf4 import NF4Tensor, nf4_even_world_sizes

log = utils.get_logger("INFO")

#: the largest world size :func:`check_nf4_sharding` lists as working in its error.
MAX_LISTED_WORLD_SIZE = 8


@dataclass(frozen=True)
class NF4ShardingPlan:
    """How the NF4 weights of a model are laid out over ``world_size`` ranks.

    Attributes:
        world_size (int): the number of ranks.
        whole (Tuple[str, ...]): the NF4 weights kept whole on every rank (unwrapped names).
        whole_bytes (int): bytes per rank those weights take.
        sharded_bytes (int): bytes per rank of the NF4 weights that are split (their full size over the world size).
    """

    world_size: int
    whole: Tuple[str, ...]
    whole_bytes: int
    sharded_bytes: int

    def summary(self) -> str:
        """
        Returns:
            str: one log line, e.g. "NF4 on 3 ranks: 168 weights kept whole on every rank (190.6 MiB per rank), ...".
        """
        return (
            f"NF4 on {self.world_size} ranks: {len(self.whole)} weight(s) kept whole on every rank "
            f"({self.whole_bytes / 2**20:.1f} MiB per rank: their rows or scale groups do not divide "
            f"{self.world_size}), {self.sharded_bytes / 2**20:.1f} MiB per rank sharded."
        )


def nf4_nbytes(weight: NF4Tensor) -> int:
    """
    Args:
        weight (NF4Tensor): a whole (unsharded) NF4 weight, on any device (meta included).

    Returns:
        int: the bytes of its inner tensors (packed codes, quantized scales, factors, mean, level table).
    """
    names, _ = weight.__tensor_flatten__()
    return sum(getattr(weight, name).numel() * getattr(weight, name).element_size() for name in names)


def _nf4_weights(model: nn.Module) -> Dict[str, NF4Tensor]:
    """The model's NF4 parameters by unwrapped name (one entry per tied parameter)."""
    seen: Set[int] = set()
    weights = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if isinstance(param, NF4Tensor) and id(param) not in seen:
            seen.add(id(param))
            weights[unwrap_key(model, name)] = param
    return weights


def check_nf4_sharding(model: nn.Module, world_size: int, *, allow_whole: bool = True) -> NF4ShardingPlan:
    """Checks, before anything is written or loaded, that every NF4 weight of ``model`` can be laid out over
    ``world_size`` ranks, and returns the layout; logs (rank 0) the bytes per rank kept whole, if any.

    Args:
        model (nn.Module): the QLoRA model, unsharded (the meta device suffices).
        world_size (int): the number of ranks.
        allow_whole (bool): keep a weight that does not split evenly whole on every rank; False: refuse it.

    Returns:
        NF4ShardingPlan: which weights are kept whole and the bytes per rank.

    Raises:
        ValueError: on a world size below 1, or (``allow_whole=False``) a weight that does not split evenly, naming
            the weight, its shape and the world sizes that work.
    """
    plan = _plan(model, world_size, allow_whole)
    if world_size > 1 and plan.whole:
        utils.log_rank_zero(log, plan.summary())
    return plan


def _plan(model: nn.Module, world_size: int, allow_whole: bool) -> NF4ShardingPlan:
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: NF4 sharding needs at least one rank.")
    whole, whole_bytes, sharded_bytes = [], 0, 0
    for name, weight in _nf4_weights(model).items():
        nbytes = nf4_nbytes(weight)
        even = nf4_even_world_sizes(tuple(weight.shape), weight.scaler_block_size, weight.block_size, world_size)
        if world_size in even:
            sharded_bytes += nbytes // world_size
            continue
        if not allow_whole:
            working = nf4_even_world_sizes(
                tuple(weight.shape), weight.scaler_block_size, weight.block_size, MAX_LISTED_WORLD_SIZE
            )
            raise ValueError(
                f"NF4 weight {name} of shape {tuple(weight.shape)} (scaler_block_size={weight.scaler_block_size}) "
                f"cannot be sharded over {world_size} ranks: its rows or scale groups do not divide {world_size}. "
                f"World sizes up to {MAX_LISTED_WORLD_SIZE} that work: {list(working)}; or keep it whole on every "
                "rank (allow_whole=True)."
            )
        whole.append(name)
        whole_bytes += nbytes
    return NF4ShardingPlan(world_size, tuple(whole), whole_bytes, sharded_bytes)


def whole_nf4_params(model: nn.Module, world_size: int) -> Set[nn.Parameter]:
    """
    Args:
        model (nn.Module): the QLoRA model, unsharded.
        world_size (int): the number of ranks.

    Returns:
        Set[nn.Parameter]: the NF4 parameters to keep whole on every rank (``fully_shard``'s ``ignored_params``).
    """
    whole = set(_plan(model, world_size, allow_whole=True).whole)
    return {param for name, param in _nf4_weights(model).items() if name in whole}

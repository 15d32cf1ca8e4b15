"""How FSDP2 lays out each NF4 weight over a world size: split evenly, split unevenly (padded), or kept whole.

torchao's ``NF4Tensor`` splits along rows only into equal shards of whole blocks and whole scale groups; that is
kept wherever the rows and scale groups divide the world size. Elsewhere (Qwen2.5-0.5B's 896x896 at 3 ranks; any
weight whose last NF4 block is padded) FSDP2's own split of the weight gives :class:`~torchtune_ext.nf4.UnevenNF4Tensor`
shards, by whole scale groups with the trailing ranks' shards padded, as it pads plain tensors (plain ``fully_shard``
does this; nothing to prepare). A weight whose padded shard would be as large as the whole weight (a single scale
group) saves nothing by sharding: :func:`~torchtune_ext.distributed.shard_model` keeps it whole on every rank
(``fully_shard(..., ignored_params=...)``; it is frozen, so no gradient has to be reduced). The
start-up log says how many bytes per rank are kept whole and how many are padding; BENCHMARKS.md ("NF4 sharding
that does not divide") has the measurement behind the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Set, Tuple

from torch import nn
from torchtune import utils

from torchtune_ext.distributed._utils import unwrap_key
from torchtune_ext.nf4 import NF4_SHARDED_TENSORS, NF4Tensor, nf4_shard_groups, nf4_uneven_groups

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
        sharded_bytes (int): bytes per rank of the NF4 weights that are split (the largest shard, padding included).
        uneven (Tuple[str, ...]): the split weights whose shards are padded (``UnevenNF4Tensor``).
        padding_bytes (int): bytes per rank of that padding, at most (included in ``sharded_bytes``).
    """

    world_size: int
    whole: Tuple[str, ...]
    whole_bytes: int
    sharded_bytes: int
    uneven: Tuple[str, ...] = ()
    padding_bytes: int = 0

    def summary(self) -> str:
        """
        Returns:
            str: one log line, e.g. "NF4 on 3 ranks: 0 weight(s) kept whole on every rank (0.0 MiB per rank), 168
            split unevenly (padded shards, at most 0.1 MiB of padding per rank), 79.3 MiB per rank sharded."
        """
        return (
            f"NF4 on {self.world_size} ranks: {len(self.whole)} weight(s) kept whole on every rank "
            f"({self.whole_bytes / 2**20:.1f} MiB per rank: a single scale group, nothing to split), "
            f"{len(self.uneven)} split unevenly (padded shards, at most {self.padding_bytes / 2**20:.1f} MiB of "
            f"padding per rank), {self.sharded_bytes / 2**20:.1f} MiB per rank sharded."
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


def nf4_shard_nbytes(weight: NF4Tensor, world_size: int) -> int:
    """
    Args:
        weight (NF4Tensor): a whole (unsharded) NF4 weight, on any device (meta included).
        world_size (int): the number of ranks.

    Returns:
        int: the bytes of one rank's shard when split by scale groups (the largest, padded, shard; its scale mean
        and level table included): for an even split, the whole weight's sharded inner tensors over the world size.
    """
    groups = weight.quantization_factor.numel()
    per_rank = nf4_shard_groups(weight, world_size)
    sharded = sum(getattr(weight, name).numel() * getattr(weight, name).element_size() for name in NF4_SHARDED_TENSORS)
    return nf4_nbytes(weight) - sharded + sharded * per_rank // groups


def nf4_weights(model: nn.Module) -> Dict[str, NF4Tensor]:
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
        allow_whole (bool): keep a weight that sharding would not make smaller whole on every rank; False: refuse it.

    Returns:
        NF4ShardingPlan: which weights are kept whole and the bytes per rank.

    Raises:
        ValueError: on a world size below 1, or (``allow_whole=False``) a weight that cannot be split (a single scale
            group), naming the weight, its shape and the world sizes that work.
    """
    plan = _plan(model, world_size, allow_whole)
    if world_size > 1 and (plan.whole or plan.uneven):
        utils.log_rank_zero(log, plan.summary())
    return plan


def _layout(weight: NF4Tensor, world_size: int) -> str:
    """``"even"`` (torchao's row split), ``"uneven"`` (padded shards of whole scale groups) or ``"whole"`` (a padded
    shard would be as large as the weight)."""
    if world_size == 1 or nf4_uneven_groups(weight, -(-weight.shape[0] // world_size)) is None:
        return "even"
    return "uneven" if nf4_shard_groups(weight, world_size) < weight.quantization_factor.numel() else "whole"


def _plan(model: nn.Module, world_size: int, allow_whole: bool) -> NF4ShardingPlan:
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: NF4 sharding needs at least one rank.")
    whole, uneven, whole_bytes, sharded_bytes, padding_bytes = [], [], 0, 0, 0
    for name, weight in nf4_weights(model).items():
        layout = _layout(weight, world_size)
        if layout != "whole":
            shard = nf4_shard_nbytes(weight, world_size)
            sharded_bytes += shard
            if layout == "uneven":
                uneven.append(name)
                padding_bytes += shard - nf4_nbytes(weight) // world_size
            continue
        if not allow_whole:
            working = [w for w in range(1, MAX_LISTED_WORLD_SIZE + 1) if w == 1 or _layout(weight, w) != "whole"]
            raise ValueError(
                f"NF4 weight {name} of shape {tuple(weight.shape)} (scaler_block_size={weight.scaler_block_size}) "
                f"cannot be sharded over {world_size} ranks: it holds a single scale group. World sizes up to "
                f"{MAX_LISTED_WORLD_SIZE} that work: {working}; or keep it whole on every rank (allow_whole=True)."
            )
        whole.append(name)
        whole_bytes += nf4_nbytes(weight)
    return NF4ShardingPlan(world_size, tuple(whole), whole_bytes, sharded_bytes, tuple(uneven), max(padding_bytes, 0))


def nf4_params_kept_whole(model: nn.Module, world_size: int) -> Set[nn.Parameter]:
    """
    Args:
        model (nn.Module): the QLoRA model, unsharded.
        world_size (int): the number of ranks.

    Returns:
        Set[nn.Parameter]: the NF4 parameters that sharding over ``world_size`` ranks would not make smaller (a
        single scale group), to keep whole on every rank (``fully_shard``'s ``ignored_params``).
    """
    weights = nf4_weights(model)
    return {weights[name] for name in _plan(model, world_size, allow_whole=True).whole}

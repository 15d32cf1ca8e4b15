"""NF4 weights sharded unevenly by FSDP2: whole scale groups per rank, the trailing ranks' shards padded.

Why a fork of torchao's NF4Tensor FSDP2 support: torchao (``nf4_tensor.py``) splits an NF4 weight only into equal
row shards: its ``aten.split`` asserts that every inner tensor divides by the number of chunks, its ``aten.new_zeros``
that the padded shard divides the weight, its ``aten.slice`` refuses an end short of the shard (FSDP2 narrows the
last rank's padded shard so), it has no ``aten.new_empty`` (FSDP2 makes the empty shards of ranks past the last row
so), and its ``fsdp_post_all_gather`` sizes the gathered weight as the local rows times the world size, which differs
per rank when the rows do not divide. FSDP2 shards a plain tensor unevenly: ``torch.chunk`` of the rows
(``ceil(rows / world_size)`` each), every rank's shard padded to the first one's size, the gathered tensor cut back.
A row shard of an NF4 weight would cut a scale group (or a block) in two, so the chunks of an NF4 weight that does
not split evenly are :class:`UnevenNF4Tensor` shards of its *inner* tensors, by whole scale groups: chunk ``i`` of
FSDP's row chunks holds scale groups ``[i * g, (i + 1) * g)`` with ``g = ceil(groups / n)`` over the ``n`` non-empty
row chunks (:func:`nf4_uneven_groups`), padded with zeros to ``g`` groups, so that every rank gathers inputs of one
size and the gathered inner tensors are the whole weight's plus zero padding at the end, which
:meth:`UnevenNF4Tensor.fsdp_post_all_gather` cuts off. A shard's row shape is FSDP's (for DTensor metadata), its
values are its scale groups: only the gather (and the state-dict tooling) reads them.

The layout depends only on the weight and FSDP's rows per chunk, so each rank decides alone: :func:`nf4_split` and
:func:`nf4_new_zeros` (the ops ``fully_shard`` applies to the whole weight) are registered for every ``NF4Tensor``
through :func:`torchtune_ext._compat.register_nf4_sharding_ops` when this module is imported, and return None
(torchao's own split) where the rows and scale groups split evenly. Plain ``fully_shard`` and torchtune's
``training.shard_model`` therefore shard any NF4 weight over any world size, and torchtune's
``training.load_from_full_model_state_dict`` loads it; the caller prepares nothing.

Forked on the shards: new_zeros, new_empty, slice and copy_ (the ops FSDP2 applies to an unevenly sharded
parameter, and torchtune's loader to each rank's chunk), and the two FSDP2 hooks. Every other op (and torchao's
torch-function handlers: narrow, to, ...) is torchao's, its NF4 result re-wrapped in the subclass.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtune_ext._compat import NF4Tensor, register_nf4_sharding_ops
from torchtune_ext.nf4._codec import (
    _NF4_LEVELS,
    NF4_SHARDED_TENSORS,
    _tensor_meta,
    dequantize_nf4,
    nf4_from_inner,
    nf4_n_blocks,
    nf4_scaler_mean,
    quantize_nf4,
)

aten = torch.ops.aten


def nf4_groups_per_rank(rows: int, groups: int, world_size: int) -> int:
    """The scale groups each rank holds (the last ones padded) when FSDP2 shards ``rows`` over ``world_size`` ranks.

    FSDP2's ``torch.chunk`` gives ``n = ceil(rows / ceil(rows / world_size))`` non-empty row chunks; the groups are
    spread over those ``n`` ranks (the others hold padding only, as FSDP's empty row shards do).

    Args:
        rows (int): the weight's rows.
        groups (int): its scale groups (blocks over ``scaler_block_size``).
        world_size (int): the number of ranks.

    Returns:
        int: ``ceil(groups / n)``.
    """
    return _groups_per_chunk(rows, groups, -(-rows // world_size))


def _groups_per_chunk(rows: int, groups: int, chunk_rows: int) -> int:
    """The scale groups of each (padded) chunk when ``rows`` are cut into chunks of ``chunk_rows``."""
    return -(-groups // -(-rows // chunk_rows))


def nf4_shard_groups(weight: NF4Tensor, world_size: int) -> int:
    """:func:`nf4_groups_per_rank` of a whole NF4 weight.

    Args:
        weight (NF4Tensor): the whole weight (meta is fine).
        world_size (int): the number of ranks.

    Returns:
        int: the scale groups per rank.
    """
    groups = nf4_n_blocks(weight.shape, weight.block_size) // weight.scaler_block_size
    return nf4_groups_per_rank(weight.shape[0], groups, world_size)


def nf4_uneven_groups(weight: NF4Tensor, shard_rows: int) -> Optional[int]:
    """The scale groups of each (padded) shard when FSDP2 chunks ``weight`` by ``shard_rows`` rows, or None where
    torchao's even split applies: the rows, whole blocks and scale groups divide into the chunks, and no rank can be
    left without rows (FSDP2 gives the ranks past the last chunk empty shards, which torchao's layout cannot pad; that
    happens only with no more rows per chunk than chunks, so where there are more the chunks are the world size).

    Args:
        weight (NF4Tensor): the whole weight (meta is fine).
        shard_rows (int): the rows of FSDP2's first (padded) chunk, ``ceil(rows / world_size)``.

    Returns:
        Optional[int]: ``ceil(groups / n)`` over the ``n`` non-empty chunks; None for torchao's layout.
    """
    rows, groups = weight.shape[0], weight.quantization_factor.numel()
    chunks = -(-rows // shard_rows)
    even = rows % shard_rows == 0 and groups % chunks == 0 and weight.numel() % weight.block_size == 0
    return None if even and shard_rows > chunks else _groups_per_chunk(rows, groups, shard_rows)


def _inner_sizes(weight: NF4Tensor, groups: int) -> Dict[str, int]:
    """The lengths of the sharded inner tensors that hold ``groups`` scale groups."""
    blocks = groups * weight.scaler_block_size
    data = blocks * weight.block_size // 2
    return {"quantized_scalers": blocks, "quantization_factor": groups, "quantized_data": data}


class UnevenNF4Tensor(NF4Tensor):
    """One rank's shard of an NF4 weight that FSDP2 shards by whole scale groups (see the module docstring).

    Attributes beyond ``NF4Tensor``'s:
        full_shape (torch.Size): the whole weight's shape.
        groups_per_rank (int): the scale groups of one (padded) shard.
    """

    full_shape: torch.Size
    groups_per_rank: int

    @classmethod
    @torch._dynamo.disable
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **(kwargs or {}))
        return _rewrap(super().__torch_dispatch__(func, types, args, kwargs), args)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torchao handles narrow, view_as, to and cpu here and returns plain NF4Tensors.
        return _rewrap(super().__torch_function__(func, types, args, kwargs), args)

    def fsdp_pre_all_gather(self, mesh: Any) -> Tuple[Tuple[torch.Tensor, ...], Any]:
        """The padded inner tensors of this shard (the same size on every rank) and what the gather needs."""
        inner = tuple(getattr(self, name) for name in NF4_SHARDED_TENSORS)
        return inner, (self.full_shape, self.scaler_mean, self.nf4)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: Tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> Optional[Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]]:
        """The whole weight, a plain ``NF4Tensor`` on views of the gathered inner tensors cut to its size; FSDP2
        frees and reallocates the full gathered tensors (returned second)."""
        if out is not None:
            return None  # the views in `out` share the gathered tensors' storage, which FSDP2 has refilled
        full_shape, scaler_mean, nf4 = metadata
        sizes = _inner_sizes(self, _whole_groups(self))
        inner = {name: gathered[: sizes[name]] for name, gathered in zip(NF4_SHARDED_TENSORS, all_gather_outputs)}
        return nf4_from_inner(self, full_shape, scaler_mean=scaler_mean, nf4=nf4, **inner), tuple(all_gather_outputs)


def _whole_groups(shard: UnevenNF4Tensor) -> int:
    """The scale groups of the whole weight ``shard`` is a shard of."""
    return nf4_n_blocks(shard.full_shape, shard.block_size) // shard.scaler_block_size


def _rewrap(out: Any, args: Sequence[Any]) -> Any:
    """``out`` of torchao's handler: an NF4Tensor becomes a shard like the first UnevenNF4Tensor of ``args``."""
    source = next((a for a in args if isinstance(a, UnevenNF4Tensor)), None)
    if type(out) is not NF4Tensor or source is None:
        return out
    return _wrap(out, source.full_shape, source.groups_per_rank)


def _wrap(
    weight: NF4Tensor, shape: Sequence[int], groups_per_rank: int, size: Optional[Sequence[int]] = None, **inner: Any
) -> UnevenNF4Tensor:
    """An :class:`UnevenNF4Tensor` of outer ``size`` (default ``weight``'s) on ``weight``'s tensors, ``inner``
    replacing some of them."""
    size = torch.Size(weight.shape if size is None else size)
    tensors = {name: inner.get(name, getattr(weight, name)) for name in (*NF4_SHARDED_TENSORS, "scaler_mean", "nf4")}
    meta = _tensor_meta(size, weight.dtype, tensors["quantized_data"].device)
    result = UnevenNF4Tensor(
        meta,
        weight.block_size,
        nf4_n_blocks(size, weight.block_size) if math.prod(size) else 0,
        weight.scaler_block_size,
        tensors["quantized_scalers"],
        tensors["quantization_factor"],
        tensors["scaler_mean"],
        tensors["quantized_data"],
        tensors["nf4"],
    )
    result.full_shape = torch.Size(shape)
    result.groups_per_rank = groups_per_rank
    return result


def nf4_split(weight: NF4Tensor, split_size: int, dim: int = 0) -> Optional[List[UnevenNF4Tensor]]:
    """FSDP2's ``torch.chunk`` of a whole NF4 weight that does not split evenly: row chunks of ``split_size``, each
    with its scale groups (:func:`nf4_uneven_groups`); None where torchao's even split applies.

    Args:
        weight (NF4Tensor): the whole, contiguous 2-D weight.
        split_size (int): rows per chunk.
        dim (int): the split dimension (only 0 is FSDP's; other dims are left to torchao, which refuses them).

    Returns:
        Optional[List[UnevenNF4Tensor]]: the chunks, or None.

    Raises:
        NotImplementedError: on a shard (shards are not split again).
    """
    if isinstance(weight, UnevenNF4Tensor):
        raise NotImplementedError("aten.split of an UnevenNF4Tensor (a shard of an NF4 weight)")
    if dim != 0 or weight.dim() != 2:
        return None
    groups = nf4_uneven_groups(weight, split_size)
    if groups is None:
        return None
    rows, lengths = weight.shape[0], _inner_sizes(weight, groups)
    chunks = []
    for index, start in enumerate(range(0, rows, split_size)):
        size = (min(split_size, rows - start), *weight.shape[1:])
        inner = {name: getattr(weight, name)[index * n : (index + 1) * n] for name, n in lengths.items()}
        chunks.append(_wrap(weight, weight.shape, groups, size, **inner))
    return chunks


def nf4_new_zeros(weight: NF4Tensor, size: Sequence[int], **kwargs: Any) -> Optional[UnevenNF4Tensor]:
    """FSDP2's padded shard of a whole NF4 weight that does not split evenly: ``size`` is its first chunk's (the
    rows per chunk, :func:`nf4_split`); zeros of whole scale groups. None where torchao's handler applies (an even
    split, or a size that is not a row chunk).

    Args:
        weight (NF4Tensor): the whole, contiguous 2-D weight.
        size (Sequence[int]): the padded shard's shape.
        **kwargs (Any): ``new_zeros``'s (``device``; the inner tensors keep their dtypes).

    Returns:
        Optional[UnevenNF4Tensor]: the padded shard, or None.
    """
    size = tuple(size)
    if weight.dim() != 2 or len(size) != 2 or size[1] != weight.shape[1] or not 0 < size[0] <= weight.shape[0]:
        return None
    groups = nf4_uneven_groups(weight, size[0])
    if groups is None:
        return None
    return _new_shard(weight, weight.shape, groups, size, torch.zeros, groups, **kwargs)


def _new_shard(
    weight: NF4Tensor,
    full_shape: Sequence[int],
    groups_per_rank: int,
    size: Sequence[int],
    make: Callable[..., torch.Tensor],
    groups: int,
    **kwargs: Any,
) -> UnevenNF4Tensor:
    """A shard of outer ``size`` on new inner tensors (``make``) of ``groups`` scale groups."""
    device = kwargs.get("device") or weight.device
    inner = {
        name: make(n, dtype=getattr(weight, name).dtype, device=device)
        for name, n in _inner_sizes(weight, groups).items()
    }
    return _wrap(weight, full_shape, groups_per_rank, size, **inner)


def _new_zeros(weight: UnevenNF4Tensor, size: Sequence[int], **kwargs: Any) -> UnevenNF4Tensor:
    """A padded shard of zeros: FSDP2 pads a shard shorter than its first chunk into one of ``size`` (that chunk's
    rows), whose scale groups follow from the whole weight's shape, not from the shard's own (a shard made from its
    own chunk's rows, as torchtune's ``load_from_full_model_state_dict`` makes the last rank's, may hold fewer)."""
    groups = _groups_per_chunk(weight.full_shape[0], _whole_groups(weight), size[0])
    return _new_shard(weight, weight.full_shape, groups, size, torch.zeros, groups, **kwargs)


def _new_empty(weight: UnevenNF4Tensor, size: Sequence[int], **kwargs: Any) -> UnevenNF4Tensor:
    """An empty shard (FSDP2's chunk of a rank past the last row)."""
    if math.prod(size) != 0:
        raise NotImplementedError(f"aten.new_empty(UnevenNF4Tensor) of size {list(size)}")
    return _new_shard(weight, weight.full_shape, weight.groups_per_rank, size, torch.empty, 0, **kwargs)


def _slice(weight: UnevenNF4Tensor, dim: int = 0, start: Optional[int] = 0, end: Optional[int] = None, step: int = 1):
    """FSDP2's ``narrow(0, 0, rows)`` of a padded shard: fewer rows, the same (padded) scale groups."""
    if dim != 0 or start not in (0, None) or step != 1:
        raise NotImplementedError(f"aten.slice(UnevenNF4Tensor, dim={dim}, start={start}, step={step})")
    rows = weight.shape[0] if end is None else min(end, weight.shape[0])
    return _wrap(weight, weight.full_shape, weight.groups_per_rank, (rows, *weight.shape[1:]))


def _copy(target: UnevenNF4Tensor, source: torch.Tensor, non_blocking: bool = False) -> UnevenNF4Tensor:
    """Copies a shard's scale groups into the head of ``target``'s (a padded shard), first growing ``target``'s
    padding where the source holds more groups (see :func:`_grow`)."""
    if not (
        isinstance(source, UnevenNF4Tensor)
        and source.full_shape == target.full_shape
        and source.scaler_block_size == target.scaler_block_size
    ):
        raise NotImplementedError("aten.copy_ into an UnevenNF4Tensor from anything but a shard of the same weight")
    if source.quantization_factor.numel() > target.quantization_factor.numel():
        _grow(target, source.quantization_factor.numel())
    for name in NF4_SHARDED_TENSORS:
        value = getattr(source, name)
        getattr(target, name)[: value.numel()].copy_(value)
    for name in ("scaler_mean", "nf4"):
        held, value = getattr(target, name), getattr(source, name)
        if held is not value:
            # In place: the copy often goes into a row slice (torch.distributed.checkpoint's load, torchtune's
            # loader), a wrapper that shares these tensors with the shard itself.
            held.copy_(value)
    return target


def _grow(shard: UnevenNF4Tensor, groups: int) -> None:
    """Grows ``shard``'s inner tensors in place to ``groups`` scale groups, zeros at the end.

    torchtune's ``load_from_full_model_state_dict`` makes each rank's shard with ``new_zeros`` of the whole weight
    at its own chunk's rows, then copies the chunk into it. :func:`nf4_new_zeros` reads rows as a first chunk's (all
    FSDP2 itself passes); the last chunk is shorter, and chunks of its rows would be more, each with fewer groups
    than it may hold (Qwen2.5-0.5B's 896 rows on 3 ranks: 298 rows, 14 groups; it holds 18). In place, because the
    copy goes into a row slice that shares the shard's inner tensors; FSDP2's post-load hook then pads the shard to
    the first chunk's rows (:func:`_new_zeros`), which sets its final size.

    Raises:
        NotImplementedError: if an inner tensor is a view (growing it would move its base's storage).
    """
    tensors = [getattr(shard, name) for name in NF4_SHARDED_TENSORS]
    if any(t._base is not None or t.untyped_storage().nbytes() != t.numel() * t.element_size() for t in tensors):
        raise NotImplementedError("aten.copy_ of a shard with more scale groups into a view of another shard")
    for name, length in _inner_sizes(shard, groups).items():
        tensor = getattr(shard, name)
        held = tensor.numel()
        tensor.resize_(length)[held:].zero_()


def _refuse_row_gather(*args: Any, **kwargs: Any) -> None:
    """DTensor's own gather of a row-sharded tensor (``full_tensor()``, ``redistribute``): refused on every rank
    before any communication (the ranks with short shards pad them first, the others gather at once), where one
    rank failing would leave the others waiting in the collective."""
    raise NotImplementedError(
        "DTensor.full_tensor() / redistribute() of an unevenly sharded NF4 weight: its shards hold whole scale "
        "groups, not rows, which DTensor's row padding and gather cannot join; gather it with "
        "torchtune_ext.distributed.get_full_state_dict (keep_nf4=True keeps it packed)"
    )


_HANDLERS: Dict[Any, Callable[..., Any]] = {
    aten.split.Tensor: nf4_split,
    aten.new_zeros.default: _new_zeros,
    aten.new_empty.default: _new_empty,
    aten.slice.Tensor: _slice,
    aten.copy_.default: _copy,
    aten.constant_pad_nd.default: _refuse_row_gather,
    torch.ops._c10d_functional.all_gather_into_tensor.default: _refuse_row_gather,
}


def quantize_nf4_shard(full: torch.Tensor, shard: UnevenNF4Tensor, rank: int) -> UnevenNF4Tensor:
    """Rank ``rank``'s padded shard of ``full`` quantized as ``shard`` is laid out: the same scale groups as in the
    whole tensor's quantization, bit for bit (the whole tensor's scale mean).

    Args:
        full (torch.Tensor): the whole dense weight (``shard.full_shape``).
        shard (UnevenNF4Tensor): this rank's shard (supplies dtype, block sizes, rows and groups per rank).
        rank (int): the rank's index in the shard's mesh.

    Returns:
        UnevenNF4Tensor: a shard of ``shard``'s shape on ``full``'s device.
    """
    values = shard.scaler_block_size * shard.block_size
    group = shard.groups_per_rank
    flat = full.to(shard.dtype).reshape(-1)
    start, stop = min(flat.numel(), rank * group * values), min(flat.numel(), (rank + 1) * group * values)
    padded = _new_shard(shard, shard.full_shape, group, shard.shape, torch.zeros, group, device=full.device)
    padded.scaler_mean = nf4_scaler_mean(full, shard.dtype, shard.block_size)
    padded.nf4 = torch.tensor(_NF4_LEVELS, dtype=shard.dtype, device=full.device)
    if stop > start:  # a rank past the last scale group holds padding only
        piece = flat[start:stop].view(1, -1)
        quantized = quantize_nf4(piece, shard.block_size, shard.scaler_block_size, scaler_mean=padded.scaler_mean)
        for name in NF4_SHARDED_TENSORS:
            value = getattr(quantized, name)
            getattr(padded, name)[: value.numel()].copy_(value)
    return padded


def dequantize_shard_rows(weight: DTensor, dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows of an FSDP2-sharded NF4 weight, dequantized to ``dtype``.

    A shard in torchao's even layout holds its rows. An :class:`UnevenNF4Tensor` holds whole scale groups, which
    need not line up with its rows: the whole weight is all-gathered packed (through the shard's FSDP2 hooks, a
    collective: every rank of the mesh must call this) and this rank's rows cut from it, one dequantized weight held
    for the moment.

    Args:
        weight (DTensor): the weight, sharded on dim 0 over a 1-D mesh, its local tensor NF4.
        dtype (torch.dtype): the output dtype.

    Returns:
        torch.Tensor: ``weight.to_local().shape`` in ``dtype``.
    """
    local = weight.to_local()
    if not isinstance(local, UnevenNF4Tensor):
        return dequantize_nf4(local, dtype)
    group = weight.device_mesh.get_group()
    world_size = dist.get_world_size(group)
    inputs, metadata = local.fsdp_pre_all_gather(weight.device_mesh)
    outputs = tuple(part.new_empty(part.numel() * world_size) for part in inputs)
    for part, out in zip(inputs, outputs):
        dist.all_gather_into_tensor(out, part.contiguous(), group=group)
    whole, _ = local.fsdp_post_all_gather(outputs, metadata, local.dtype)
    start = dist.get_rank(group) * -(-local.full_shape[0] // world_size)  # FSDP2's chunks of ceil(rows / n) rows
    return dequantize_nf4(whole, dtype)[start : start + local.shape[0]]


register_nf4_sharding_ops(split=nf4_split, new_zeros=nf4_new_zeros)
# As torchao allows NF4Tensor: torch.load(weights_only=True), which torch.distributed.checkpoint's load uses.
torch.serialization.add_safe_globals([UnevenNF4Tensor])

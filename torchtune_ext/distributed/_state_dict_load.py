"""Loading a full (plain-tensor) state dict into a sharded, NF4-quantized, mixed-precision model.

Each rank writes only its own shard: a DTensor parameter takes the box of the full tensor that its local shard
covers, an NF4 one quantizes just that box. FSDP all-gathers NF4 shards under one ``scaler_mean`` (the shard's),
so a shard is quantized with the scale mean of the *whole* tensor and equals the same rows of ``to_nf4(full)``
bit for bit (an unevenly sharded one: the same scale groups). Materialized parameters are written in place (ties,
optimizer references and FSDP's bookkeeping stay intact); parameters on the meta device are replaced through
``load_state_dict(assign=True)``, one new parameter per tie group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import _IncompatibleKeys

from torchtune_ext.distributed._utils import (
    Entry,
    group_device,
    local_box,
    mesh_device,
    model_entries,
    tie_roots,
    world_info,
)
from torchtune_ext.nf4 import (
    NF4_SHARDED_TENSORS,
    NF4Tensor,
    UnevenNF4Tensor,
    dequantize_nf4,
    nf4_scaler_mean,
    quantize_nf4,
    quantize_nf4_shard,
)

DeviceLike = Union[str, torch.device, None]


@dataclass(frozen=True)
class _Manifest:
    """What one rank tells the others: its model's keys (shape, dtype, tie group) and its state dict's keys."""

    model: Dict[str, Tuple[Tuple[int, ...], torch.dtype, str]]
    state_dict: Optional[Dict[str, Tuple[Tuple[int, ...], torch.dtype]]]
    raw_to_key: Dict[str, str]


def _target_dtype(value: torch.Tensor) -> torch.dtype:
    return value._local_tensor.dtype if isinstance(value, DTensor) else value.dtype


def _model_manifest(entries: Dict[str, Entry]) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype, str]]:
    roots = tie_roots(entries)
    return {key: (tuple(e.value.shape), _target_dtype(e.value), roots.get(key, key)) for key, e in entries.items()}


def _normalize_keys(full_sd: Mapping[str, Any], raw_to_key: Dict[str, str]) -> Dict[str, torch.Tensor]:
    """``full_sd`` under unwrapped keys (wrapped keys are accepted too), with NF4 values dequantized."""
    normalized = {}
    for key, value in full_sd.items():
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            raise ValueError(
                f"full_sd[{key!r}] is a {type(value).__name__}; load_full_state_dict takes plain tensors (a full "
                "state dict, e.g. from get_full_state_dict). Load sharded checkpoints with "
                "torch.distributed.checkpoint."
            )
        normalized[raw_to_key.get(key, key)] = dequantize_nf4(value) if isinstance(value, NF4Tensor) else value
    return normalized


def _check_keys(manifests: List[_Manifest], rank: int, strict: bool) -> Tuple[List[str], List[str]]:
    """Missing and unexpected keys of this rank; raises on every rank if any rank fails the check."""
    model_keys: Set[str] = {key for m in manifests for key in m.model}
    problems, mine = [], ([], [])
    for r, manifest in enumerate(manifests):
        state_dict = manifest.state_dict if manifest.state_dict is not None else manifests[0].state_dict
        present_groups = {manifest.model[k][2] for k in state_dict if k in manifest.model}
        missing = [k for k, (_, _, group) in manifest.model.items() if group not in present_groups]
        unexpected = [k for k in state_dict if k not in model_keys]
        shapes = [
            f"{k}: checkpoint {list(state_dict[k][0])} vs model {list(manifest.model[k][0])}"
            for k in state_dict
            if k in manifest.model and tuple(state_dict[k][0]) != manifest.model[k][0]
        ]
        if r == rank:
            mine = (missing, unexpected)
        if shapes:
            problems.append(f"rank {r}: shape mismatches: {shapes}")
        if strict and (missing or unexpected):
            problems.append(f"rank {r}: missing keys: {missing}; unexpected keys: {unexpected}")
    if problems:
        raise RuntimeError(
            "Error(s) in load_full_state_dict (keys are the unwrapped model's, as get_full_state_dict returns them; "
            "pass strict=False to skip missing/unexpected keys):\n  " + "\n  ".join(problems)
        )
    return mine


def _tie_groups(entries: Dict[str, Entry]) -> List[List[Entry]]:
    """The model's entries grouped by the tensor they hold (tied weights share one group), in state-dict order."""
    roots = tie_roots(entries)
    groups: Dict[str, List[Entry]] = {}
    for key, entry in entries.items():
        groups.setdefault(roots.get(key, key), []).append(entry)
    return list(groups.values())


def _sources(groups: List[List[Entry]], state_dict_keys: List[str]) -> Dict[str, List[Entry]]:
    """For each state-dict key that feeds this rank's model: the entries it loads (every key of its tie group).

    A tie group loads from its first key present in the state dict.
    """
    present = set(state_dict_keys)
    sources = {}
    for members in groups:
        source = next((e.key for e in members if e.key in present), None)
        if source is not None:
            sources[source] = members
    return sources


def _quantize_like(dense: torch.Tensor, template: NF4Tensor, scaler_mean: Optional[torch.Tensor] = None) -> NF4Tensor:
    dense = dense.to(template.dtype)
    return quantize_nf4(dense, template.block_size, template.scaler_block_size, scaler_mean=scaler_mean)


def _nf4_shard(full: torch.Tensor, piece: torch.Tensor, template: NF4Tensor, device: torch.device) -> NF4Tensor:
    return _quantize_like(piece.to(device), template, nf4_scaler_mean(full, template.dtype, template.block_size))


def _write_nf4(target: NF4Tensor, new: NF4Tensor) -> None:
    """Writes ``new``'s values into the NF4Tensor ``target`` in place (FSDP all-gathers from that object)."""
    for name in NF4_SHARDED_TENSORS:
        getattr(target, name).copy_(getattr(new, name))
    # Whole on every rank; `to_empty` of a sharded NF4 parameter leaves them on the meta device: rebind those.
    for name in ("scaler_mean", "nf4"):
        if getattr(target, name).is_meta:
            setattr(target, name, getattr(new, name))
        else:
            getattr(target, name).copy_(getattr(new, name))


def _new_local(full: torch.Tensor, value: torch.Tensor, device: Optional[torch.device]) -> Optional[torch.Tensor]:
    """This rank's part of ``full`` for ``value``, in its dtype (NF4 quantized); None if the rank holds none."""
    if isinstance(value, DTensor):
        mesh, local = value.device_mesh, value._local_tensor
        if mesh.get_coordinate() is None:
            return None
        device = device or (local.device if not local.is_meta else mesh_device(mesh))
        if isinstance(local, UnevenNF4Tensor):  # its scale groups, not its rows (torchtune_ext.nf4._uneven)
            return quantize_nf4_shard(full.to(device), local, mesh.get_local_rank())
        box = local_box(value.shape, mesh, value.placements)
        if box is not None:
            piece = full[box]
        else:
            piece = distribute_tensor(full.to(device), mesh, value.placements, src_data_rank=None).to_local()
        if isinstance(local, NF4Tensor):
            return _nf4_shard(full, piece, local, device)
        return piece.to(device=device, dtype=local.dtype)
    device = device or (value.device if not value.is_meta else torch.device("cpu"))
    if isinstance(value, NF4Tensor):
        return _quantize_like(full.to(device), value)
    return full.to(device=device, dtype=value.dtype)


def _load_one(
    full: torch.Tensor, members: List[Entry], device: Optional[torch.device], assign: Dict[str, torch.Tensor]
) -> None:
    """Writes ``full`` into the (tied) entries ``members``: in place, or into ``assign`` for meta targets."""
    value = members[0].value
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not local.is_meta:
        if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
            return
        if isinstance(local, NF4Tensor):
            _write_nf4(local, _new_local(full, value, device))
            return
        box = local_box(value.shape, value.device_mesh, value.placements) if isinstance(value, DTensor) else ()
        local.copy_(full[box] if box is not None else _new_local(full, value, device))
        return
    new = _new_local(full, value, device)
    if new is None:
        return
    if isinstance(value, DTensor):
        new = DTensor.from_local(
            new, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if isinstance(value, nn.Parameter):
        new = nn.Parameter(new, requires_grad=value.requires_grad)
    for member in members:
        assign[member.raw_key] = new


def _send_dtype(key: str, manifests: List[_Manifest]) -> torch.dtype:
    """Rank 0 casts before sending when every rank's target dtype for ``key`` is one narrower float dtype."""
    source = manifests[0].state_dict[key][1]
    targets = {m.model[key][1] for m in manifests if key in m.model}
    if len(targets) == 1:
        target = targets.pop()
        if source.is_floating_point and target.is_floating_point and target.itemsize < source.itemsize:
            return target
    return source


def _receive(key: str, tensor: Optional[torch.Tensor], manifests: List[_Manifest], rank: int) -> Optional[torch.Tensor]:
    """Sends rank 0's ``tensor`` to the ranks whose model has ``key``: a broadcast when all do, else point to point."""
    holders = [r for r, m in enumerate(manifests) if key in m.model]
    if rank != 0 and rank not in holders:
        return None
    device, dtype = group_device(), _send_dtype(key, manifests)
    if rank == 0:
        buf = tensor.to(device=device, dtype=dtype).contiguous()
    else:
        buf = torch.empty(manifests[0].state_dict[key][0], dtype=dtype, device=device)
    if len(holders) == len(manifests) or (len(holders) == len(manifests) - 1 and 0 not in holders):
        dist.broadcast(buf, src=0)
    elif rank == 0:
        for work in [dist.isend(buf, dst=r) for r in holders if r != 0]:
            work.wait()
    else:
        dist.irecv(buf, src=0).wait()
    return buf if rank in holders else None


class FullStateDictLoader:
    """Loads full state dicts of plain tensors into one (sharded, NF4-quantized or plain) model, any number of times:
    the model is walked once (a key -> parameter map), so loading a checkpoint in chunks costs time linear in the
    model. :func:`load_full_state_dict` is one such load; ``load_base_`` loads a checkpoint chunk by chunk.

    Args:
        model (nn.Module): the model (FSDP2-sharded or not; wrappers such as torch.compile are fine).
        device (DeviceLike): see :func:`load_full_state_dict`.
        strict (bool): see :func:`load_full_state_dict` (a chunk of a checkpoint: False).
        broadcast_from_rank0 (bool): see :func:`load_full_state_dict`.
    """

    def __init__(
        self, model: nn.Module, *, device: DeviceLike = None, strict: bool = True, broadcast_from_rank0: bool = False
    ):
        self.model = model
        self.rank, self.world_size = world_info()
        self.broadcast = broadcast_from_rank0 and self.world_size > 1
        self.device = torch.device(device) if device is not None else None
        self.strict = strict
        self.entries = model_entries(model, unwrap=True)
        self.raw_to_key = {e.raw_key: e.key for e in self.entries.values() if e.raw_key != e.key}
        self.model_manifest = _model_manifest(self.entries)
        self.groups = _tie_groups(self.entries)

    @torch.no_grad()
    def load(self, full_sd: Optional[Mapping[str, torch.Tensor]]) -> _IncompatibleKeys:
        """Loads one full state dict (all of the model's keys, or with ``strict=False`` some of them).

        Args:
            full_sd (Optional[Mapping[str, torch.Tensor]]): the state dict (see :func:`load_full_state_dict`).

        Returns:
            _IncompatibleKeys: ``missing_keys`` and ``unexpected_keys`` of this rank (empty when ``strict``).
        """
        rank, broadcast = self.rank, self.broadcast
        if full_sd is None and (rank == 0 or not broadcast):
            raise ValueError(
                "full_sd is None; every rank needs the state dict, or pass broadcast_from_rank0=True and the state "
                "dict on rank 0."
            )
        mine = (
            _normalize_keys(full_sd, self.raw_to_key) if full_sd is not None and (rank == 0 or not broadcast) else None
        )
        sd_meta = {k: (tuple(v.shape), v.dtype) for k, v in mine.items()} if mine is not None else None
        manifest = _Manifest(self.model_manifest, sd_meta if (rank == 0 or not broadcast) else None, self.raw_to_key)
        manifests: List[Any] = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(manifests, manifest)
        else:
            manifests = [manifest]
        missing, unexpected = _check_keys(manifests, rank, self.strict)

        assign: Dict[str, torch.Tensor] = {}
        if broadcast:
            order = [k for k in manifests[0].state_dict if any(k in m.model for m in manifests)]
            sources = _sources(self.groups, order)
            # Every rank walks rank 0's keys in order; each key is sent once even if it feeds no tie group here.
            for key in order:
                full = _receive(key, mine.get(key) if mine is not None else None, manifests, rank)
                if full is not None and key in sources:
                    _load_one(full, sources[key], self.device, assign)
        else:
            for key, members in _sources(self.groups, list(mine)).items():
                _load_one(mine[key], members, self.device, assign)
        if assign:
            result = self.model.load_state_dict(assign, strict=False, assign=True)
            not_loaded = [k for k in assign if k in result.missing_keys or k in result.unexpected_keys]
            if not_loaded:
                raise RuntimeError(f"load_state_dict(assign=True) did not take keys {not_loaded}.")
        return _IncompatibleKeys(missing, unexpected)


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module,
    full_sd: Optional[Mapping[str, torch.Tensor]],
    *,
    device: DeviceLike = None,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> _IncompatibleKeys:
    """Loads a full state dict of plain tensors into a sharded, NF4-quantized or plain model (the inverse of
    :func:`get_full_state_dict`).

    Call it on every rank. A DTensor parameter receives its own shard of the full tensor; an NF4 one (sharded or
    not) is quantized on this rank for its shard only, bit for bit as ``to_nf4`` quantizes the whole tensor; plain
    parameters and buffers are copied. Each parameter keeps its own dtype (an fp32 module stays fp32, an NF4 weight
    is quantized in its compute dtype). Materialized parameters are written in place; parameters on the meta device
    are replaced (``load_state_dict(assign=True)``, FSDP2-aware) and tied weights get one shared new parameter. A
    tie group loads from its first key present in ``full_sd`` (a checkpoint may omit a tied output weight).

    Args:
        model (nn.Module): the model (FSDP2-sharded or not; wrappers such as torch.compile are fine).
        full_sd (Optional[Mapping[str, torch.Tensor]]): the full state dict, keyed like the unwrapped model (wrapped
            keys work too); NF4Tensor values are dequantized first. With ``broadcast_from_rank0``, only rank 0's is
            read and the other ranks may pass None.
        device (DeviceLike): device to build new shards on (and to quantize on). None: each parameter's own
            device; for meta parameters the mesh device (DTensor) or the CPU.
        strict (bool): raise if the model has keys that ``full_sd`` lacks or ``full_sd`` has keys that no rank's
            model has. Default: True.
        broadcast_from_rank0 (bool): only rank 0 holds ``full_sd``; it is sent tensor by tensor (a broadcast when
            every rank needs the key), so other ranks hold one full tensor at a time. Default: False.

    Returns:
        _IncompatibleKeys: ``missing_keys`` and ``unexpected_keys`` of this rank (empty when ``strict``).

    Raises:
        RuntimeError: on shape mismatches, or with ``strict`` on missing or unexpected keys; the message lists
            them for every rank.
        ValueError: if ``full_sd`` holds DTensors or non-tensors, or rank 0 has no ``full_sd``.

    Example (one process; with FSDP2, ``fully_shard`` each layer and the model first, and pass
    ``broadcast_from_rank0=True`` with the state dict on rank 0 only):
        >>> from torchtune_ext.models import qlora_tiny_llama
        >>> trained = qlora_tiny_llama(["q_proj", "v_proj"], dtype=torch.bfloat16, device="cpu")
        >>> full_sd = trained.state_dict()
        >>> model = qlora_tiny_llama(["q_proj", "v_proj"], dtype=torch.bfloat16)  # on the meta device
        >>> load_full_state_dict(model, full_sd, device="cpu")
        <All keys matched successfully>
        >>> torch.equal(model.layers[0].attn.q_proj.lora_a.weight, trained.layers[0].attn.q_proj.lora_a.weight)
        True
    """
    loader = FullStateDictLoader(model, device=device, strict=strict, broadcast_from_rank0=broadcast_from_rank0)
    return loader.load(full_sd)

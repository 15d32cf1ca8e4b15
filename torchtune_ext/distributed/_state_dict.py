"""Full and sharded state dicts of FSDP2-sharded, NF4-quantized, mixed-precision models.

:func:`get_full_state_dict` turns any mix of DTensor parameters (on any mesh, NF4 or dense), bare NF4Tensors and
plain tensors (held by any subset of ranks) into plain tensors on one rank:

1. every rank describes its entries (key, kind, mesh, shape, dtype, adapter, tie) and one ``all_gather_object``
   gives every rank the same plan: which rank produces each key, in which dtype, which keys are ties;
2. a DTensor is gathered on its own mesh to one of the mesh's ranks (the destination if it is in the mesh):
   dense shards as they are, NF4 shards packed (their inner tensors), dequantized once gathered;
3. a tensor that the destination lacks (a sub-mesh without it, a key held only by other ranks) is sent to it
   point to point; nothing waits on a barrier.

Keys are taken from the model's own ``state_dict()`` (after FSDP's state-dict hooks), then unwrapped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.distributed._utils import (
    Entry,
    Patterns,
    as_patterns,
    group_device,
    is_plain_shard0,
    match_patterns,
    mesh_device,
    mesh_ranks,
    model_entries,
    tie_roots,
    world_info,
)
from torchtune_ext.nf4 import (
    NF4_SHARDED_TENSORS,
    NF4Tensor,
    UnevenNF4Tensor,
    dequantize_nf4,
    nf4_from_inner,
    nf4_n_blocks,
)

DeviceLike = Union[str, torch.device, None]


@dataclass(frozen=True)
class _KeyInfo:
    """What one rank knows about one of its state-dict entries (sent in the plan exchange)."""

    kind: str
    mesh: Optional[Tuple[int, ...]]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    is_adapter: bool
    tie_root: Optional[str]
    is_nf4: bool


@dataclass
class _Plan:
    """How one key of the result is produced: by rank ``src`` (on ``mesh`` for a DTensor), in ``dtype``, or kept an
    NF4Tensor (``keep_nf4``)."""

    key: str
    src: int
    mesh: Optional[Tuple[int, ...]]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    alias_of: Optional[str] = None
    keep_nf4: bool = False


def _local_infos(entries: Dict[str, Entry]) -> Dict[str, _KeyInfo]:
    roots = tie_roots(entries)
    infos = {}
    for key, entry in entries.items():
        value = entry.value
        mesh = mesh_ranks(value.device_mesh) if isinstance(value, DTensor) else None
        local = value._local_tensor if isinstance(value, DTensor) else value
        infos[key] = _KeyInfo(
            entry.kind,
            mesh,
            tuple(value.shape),
            value.dtype,
            entry.is_adapter,
            roots.get(key),
            isinstance(local, NF4Tensor),
        )
    return infos


def _destination(wants: List[bool]) -> int:
    chosen = [rank for rank, want in enumerate(wants) if want]
    if len(chosen) != 1:
        raise ValueError(
            f"get_full_state_dict needs exactly one rank with is_rank_zero=True (the rank that receives the "
            f"state dict), got ranks {chosen}. Pass is_rank_zero=(rank == 0) on every rank, or leave it None."
        )
    return chosen[0]


def _source(key: str, reports: Dict[int, _KeyInfo], dst: int) -> Tuple[int, Optional[Tuple[int, ...]]]:
    """The rank that produces ``key`` (and its mesh): a DTensor's mesh rank, preferring ``dst``; for a plain tensor,
    ``dst`` if it has the key, else the lowest rank that has it."""
    meshes = {info.mesh for info in reports.values() if info.kind == "dtensor"}
    if not meshes:
        return (dst if dst in reports else min(reports)), None
    if len(meshes) > 1:
        raise ValueError(f"{key!r} is a DTensor on different meshes on different ranks: {sorted(meshes)}.")
    mesh = meshes.pop()
    lacking = [rank for rank in mesh if rank not in reports or reports[rank].kind != "dtensor"]
    if lacking:
        raise ValueError(
            f"{key!r} is a DTensor on the mesh of ranks {list(mesh)}, but ranks {lacking} of that mesh do not hold "
            "it as a DTensor; every rank of a mesh must hold the same sharded module."
        )
    return (dst if dst in mesh else min(mesh)), mesh


def _make_plans(
    gathered: List[Dict[str, _KeyInfo]],
    dst: int,
    dtype: Optional[torch.dtype],
    keep_dtype: List[str],
    include_keys: List[str],
    ignore_keys: List[str],
    adapter_weights_only: bool,
    keep_nf4: bool,
) -> List[_Plan]:
    """The same plan on every rank, from every rank's entries; raises (on every rank) on bad patterns."""
    reports: Dict[str, Dict[int, _KeyInfo]] = {}
    for rank, infos in enumerate(gathered):
        for key, info in infos.items():
            reports.setdefault(key, {})[rank] = info
    keys = [k for k in reports if not adapter_weights_only or any(i.is_adapter for i in reports[k].values())]
    if adapter_weights_only and not keys:
        raise ValueError("adapter_weights_only=True, but the model has no adapter params (AdapterModule).")
    kept: Set[str] = match_patterns(keys, include_keys, "include_keys") if include_keys else set(keys)
    kept -= match_patterns(keys, ignore_keys, "ignore_keys") if ignore_keys else set()
    keep_matched = match_patterns(reports, keep_dtype, "keep_dtype") if keep_dtype else set()

    # A tie group (one tensor under several keys) is produced once, under its first kept key.
    group_of: Dict[str, str] = {}
    first_kept: Dict[str, str] = {}
    for key in (k for k in keys if k in kept):
        root = next((i.tie_root for i in reports[key].values() if i.tie_root is not None), key)
        group_of[key] = first_kept.setdefault(root, key)
    members: Dict[str, List[str]] = {}
    for key, first in group_of.items():
        members.setdefault(first, []).append(key)
    plans = []
    for key in (k for k in keys if k in kept):
        root = group_of[key]
        if root != key:
            plans.append(_Plan(key, dst, None, (), torch.float32, alias_of=root))
            continue
        src, mesh = _source(key, reports[key], dst)
        info = reports[key][src]
        out_dtype = info.dtype
        if dtype is not None and info.dtype.is_floating_point and not keep_matched.intersection(members[root]):
            out_dtype = dtype
        # A kept NF4 weight travels packed only within its mesh; one that another rank must send goes dense.
        plans.append(_Plan(key, src, mesh, info.shape, out_dtype, keep_nf4=keep_nf4 and info.is_nf4 and src == dst))
    return plans


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.size(0) == rows:
        return tensor.contiguous()
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.size(0)].copy_(tensor)
    return padded


def _gather_rows(local: torch.Tensor, rows: int, group: dist.ProcessGroup, group_dst: int, is_dst: bool):
    """Gathers equal-size ``local`` row blocks of ``group`` into one tensor on ``group_dst`` (None elsewhere)."""
    local = _pad_rows(local, rows)
    size = dist.get_world_size(group)
    out = torch.empty((size * rows, *local.shape[1:]), dtype=local.dtype, device=local.device) if is_dst else None
    gather_list = list(out.chunk(size)) if is_dst else None
    work = dist.gather(local, gather_list, group=group, group_dst=group_dst, async_op=True)
    return out, work


def _gather_nf4(value: DTensor, plan: _Plan, device: torch.device, is_src: bool) -> Optional[torch.Tensor]:
    """All-gathers an NF4 row-sharded DTensor in packed form to the plan's source rank, then dequantizes there
    (unless the plan keeps it NF4)."""
    local: NF4Tensor = value._local_tensor
    group = value.device_mesh.get_group()
    size, group_dst = dist.get_world_size(group), dist.get_group_rank(group, plan.src)
    parts = [getattr(local, name).to(device).view(-1, 1) for name in NF4_SHARDED_TENSORS]
    parts.append(local.scaler_mean.to(device).view(1, 1))
    gathered = [_gather_rows(part, part.size(0), group, group_dst, is_src) for part in parts]
    for _, work in gathered:
        work.wait()
    if not is_src:
        return None
    inner = [out.view(size, -1) for out, _ in gathered]
    means = inner[3].view(-1)
    if bool((means == means[0]).all()):
        # Uneven shards end in padding: cut each inner tensor to the whole weight's length.
        blocks = nf4_n_blocks(value.shape, local.block_size)
        lengths = (blocks, blocks // local.scaler_block_size, blocks * local.block_size // 2)
        full = nf4_from_inner(
            local,
            value.shape,
            **{name: t.reshape(-1)[:n] for name, t, n in zip(NF4_SHARDED_TENSORS, inner[:3], lengths)},
            scaler_mean=means[0],
            nf4=local.nf4.to(device),
        )
        return full if plan.keep_nf4 else dequantize_nf4(full, plan.dtype)
    # Shards quantized with different scale means (not by FSDP's split of one NF4Tensor): each on its own.
    rows = value.shape[0] // size
    return torch.cat(
        [
            dequantize_nf4(
                nf4_from_inner(
                    local,
                    (rows, *value.shape[1:]),
                    **dict(zip(NF4_SHARDED_TENSORS, (t[r] for t in inner[:3]))),
                    scaler_mean=means[r],
                    nf4=local.nf4.to(device),
                ),
                plan.dtype,
            )
            for r in range(size)
        ]
    )


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype or not tensor.is_floating_point() else tensor.to(dtype)


def _gather_dtensor(value: DTensor, plan: _Plan, device: Optional[torch.device], rank: int) -> Optional[torch.Tensor]:
    """The full tensor of ``value`` on ``plan.src`` (None on the mesh's other ranks), in ``plan.dtype``."""
    mesh: DeviceMesh = value.device_mesh
    device = device or mesh_device(mesh)
    is_src = rank == plan.src
    local = value._local_tensor
    if math.prod(plan.shape) == 0:
        return torch.empty(plan.shape, dtype=plan.dtype, device=device) if is_src else None
    if not is_plain_shard0(value):
        full = value.full_tensor()
        if not is_src:
            return None
        return _densified(full, plan)
    if isinstance(local, NF4Tensor):
        return _gather_nf4(value, plan, device, is_src)
    if plan.dtype.itemsize < local.dtype.itemsize:
        local = _cast(local, plan.dtype)  # cast before the gather when it makes the transfer smaller
    group = mesh.get_group()
    rows = math.ceil(plan.shape[0] / dist.get_world_size(group))
    out, work = _gather_rows(local.to(device), rows, group, dist.get_group_rank(group, plan.src), is_src)
    work.wait()
    return _cast(out[: plan.shape[0]], plan.dtype) if is_src else None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _plain_full(value: torch.Tensor, plan: _Plan, device: Optional[torch.device]) -> torch.Tensor:
    value = value.detach()
    if device is not None:
        value = value.to(device)
    return _densified(value, plan)


def _densified(value: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """``value`` in the plan's dtype: NF4 dequantized (unless kept), other floats cast."""
    if isinstance(value, NF4Tensor):
        return value if plan.keep_nf4 else dequantize_nf4(value, plan.dtype)
    return _cast(value, plan.dtype)


@torch.no_grad()
def _execute(
    plans: List[_Plan],
    entries: Dict[str, Entry],
    rank: int,
    dst: int,
    device: Optional[torch.device],
    cpu_offload: bool,
) -> Dict[str, torch.Tensor]:
    result: Dict[str, torch.Tensor] = {}
    pending: List[Any] = []  # p2p works that can complete at the end
    p2p_device = group_device() if any(p.src != dst for p in plans) else None
    for plan in plans:
        if plan.alias_of is not None:
            if rank == dst:
                result[plan.key] = result[plan.alias_of]
            continue
        full = None
        if plan.mesh is not None and rank in plan.mesh:
            full = _gather_dtensor(entries[plan.key].value, plan, device, rank)
        elif plan.mesh is None and rank == plan.src:
            full = _plain_full(entries[plan.key].value, plan, device)
        if plan.src != dst and rank == plan.src:
            value = entries[plan.key].value
            full = full.to(p2p_device).contiguous()
            work = dist.isend(full, dst=dst)
            # A tensor made for this send is waited for now, so that one exists at a time.
            if plan.mesh is None and not isinstance(value, NF4Tensor) and _same_storage(full, value):
                pending.append(work)
            else:
                work.wait()
        elif plan.src != dst and rank == dst:
            full = torch.empty(plan.shape, dtype=plan.dtype, device=p2p_device)
            work = dist.irecv(full, src=plan.src)
            if cpu_offload and full.device.type != "cpu":
                work.wait()
            else:
                pending.append(work)
        if rank == dst:
            result[plan.key] = full.cpu() if cpu_offload else full
    for work in pending:
        work.wait()
    return result


def get_full_state_dict(
    model: nn.Module,
    *,
    is_rank_zero: Optional[bool] = None,
    device: DeviceLike = None,
    dtype: Union[torch.dtype, str, None] = None,
    keep_dtype: Patterns = None,
    include_keys: Patterns = None,
    ignore_keys: Patterns = None,
    adapter_weights_only: bool = False,
    cpu_offload: bool = True,
    unwrap: bool = True,
    keep_nf4: bool = False,
) -> Dict[str, torch.Tensor]:
    """Gathers the full, plain-tensor state dict of a sharded, quantized, mixed-precision model on rank 0.

    Works on FSDP2-sharded, partly sharded and unsharded models, with or without a process group. Call it on every
    rank. A DTensor is gathered on its own mesh (which may be a sub-mesh without rank 0) and delivered to rank 0;
    NF4 shards travel packed and are dequantized once gathered; a bare NF4Tensor is dequantized; a plain tensor that
    rank 0 lacks comes from a rank that has it. Tied weights (one tensor under several keys) are gathered once and
    the result holds the same tensor under each key. No barrier per parameter; the gathering device holds about one
    full tensor at a time. Tensors that need no conversion (plain, already on the CPU, in the right dtype) share
    storage with the model, as ``model.state_dict()`` does.

    Args:
        model (nn.Module): the model (FSDP2, torch.compile, activation checkpointing and DDP wrappers are fine).
        is_rank_zero (Optional[bool]): whether this rank receives the result; exactly one rank may say True.
            None: rank 0 receives it.
        device (DeviceLike): device to gather on. None: each DTensor's mesh device, plain tensors where they are.
        dtype (Union[torch.dtype, str, None]): cast floating tensors to this dtype ("fp32", "bf16", ... accepted).
            None: each tensor keeps its own dtype (an NF4 weight its compute dtype, an fp32 module fp32).
        keep_dtype (Patterns): fnmatch globs of keys that keep their dtype despite ``dtype``.
        include_keys (Patterns): fnmatch globs; only matching keys are gathered.
        ignore_keys (Patterns): fnmatch globs; matching keys are skipped. Exclusive with ``include_keys``.
        adapter_weights_only (bool): gather only adapter params (``AdapterModule.adapter_params``); the base is
            never gathered.
        cpu_offload (bool): move the result to the CPU. Default: True.
        unwrap (bool): strip ``_orig_mod.`` (torch.compile), ``_checkpoint_wrapped_module.`` (activation
            checkpointing) and ``module.`` (DDP) from the keys. Default: True.
        keep_nf4 (bool): return NF4 weights as whole NF4Tensors (gathered packed, never dequantized; 4 bits a value)
            instead of dense tensors; ``dtype`` does not apply to them. An NF4 weight that the receiving rank does
            not hold in its mesh, or whose shards were quantized separately, still comes dense. Default: False.

    Returns:
        Dict[str, torch.Tensor]: the full state dict (plain tensors, and NF4Tensors with ``keep_nf4``) on the
        receiving rank, ``{}`` on the others.

    Raises:
        ValueError: if both ``include_keys`` and ``ignore_keys`` are given, a pattern matches no key (the error
            shows the nearest keys), ``dtype`` is not a float dtype, ``adapter_weights_only`` finds no adapter, or
            not exactly one rank has ``is_rank_zero``. Raised on every rank (the checks use every rank's keys).
        TypeError: if a glob argument is neither a str nor a list of str.

    Example (one process; under FSDP2, every rank calls it and rank 0 gets the result):
        >>> from torchtune_ext.models import qlora_tiny_llama
        >>> from torchtune_ext.modules import prune_vocab_
        >>> model = qlora_tiny_llama(["q_proj", "v_proj"], dtype=torch.bfloat16, device="cpu")
        >>> pruning = prune_vocab_(model, list(range(64)))  # the kept rows train in fp32
        >>> sd = get_full_state_dict(model, dtype="bf16", keep_dtype="tok_embeddings.*")
        >>> sd["layers.0.attn.q_proj.weight"].dtype, sd["tok_embeddings.weight"].dtype  # NF4 dequantized
        (torch.bfloat16, torch.float32)
        >>> adapters = get_full_state_dict(model, adapter_weights_only=True)
        >>> sorted(adapters)[:2]
        ['layers.0.attn.q_proj.lora_a.weight', 'layers.0.attn.q_proj.lora_b.weight']
    """
    dtype = parse_dtype(dtype)
    include, ignore = as_patterns(include_keys, "include_keys"), as_patterns(ignore_keys, "ignore_keys")
    keep = as_patterns(keep_dtype, "keep_dtype")
    if include and ignore:
        raise ValueError("include_keys and ignore_keys are mutually exclusive; pass one of them.")
    device = torch.device(device) if device is not None else None
    rank, world_size = world_info()
    entries = model_entries(model, unwrap)
    local = (rank == 0 if is_rank_zero is None else bool(is_rank_zero), _local_infos(entries))
    everyone: List[Any] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(everyone, local)
    else:
        everyone = [local]
    dst = _destination([want for want, _ in everyone])
    plans = _make_plans(
        [infos for _, infos in everyone], dst, dtype, keep, include, ignore, adapter_weights_only, keep_nf4
    )
    result = _execute(plans, entries, rank, dst, device, cpu_offload)
    return result if rank == dst else {}


def _sharded_entry(value: torch.Tensor, precision: Optional[torch.dtype], keep_nf4: bool, cpu_offload: bool):
    """One rank's share of an entry, with ``precision`` applied locally; a DTensor stays a DTensor."""
    value = value.detach()
    local = value._local_tensor if isinstance(value, DTensor) else value
    if isinstance(local, UnevenNF4Tensor) and not keep_nf4:
        raise ValueError(
            f"An unevenly sharded NF4 weight of shape {tuple(value.shape)} holds scale groups, not rows, on each rank, "
            "so its shard has no dense rows to return; pass keep_nf4=True or take a full state dict."
        )
    if isinstance(local, NF4Tensor) and not keep_nf4:
        local = dequantize_nf4(local, precision)
    elif precision is not None and not isinstance(local, NF4Tensor):
        local = _cast(local, precision)
    if cpu_offload:
        local = local.cpu()
    if not isinstance(value, DTensor):
        return local
    if local is value._local_tensor:
        return value
    return DTensor.from_local(
        local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )


def get_model_state_dict(
    model: nn.Module,
    *,
    sharded_state_dict: bool = False,
    precision: Union[torch.dtype, str, None] = None,
    include_keys: Patterns = None,
    ignore_keys: Patterns = None,
    cpu_offload: Optional[bool] = None,
    unwrap: bool = True,
    keep_nf4: bool = False,
) -> Dict[str, torch.Tensor]:
    """Composer-style state dict of a (possibly FSDP2-sharded) model: sharded or full, in a chosen precision.

    Sharded: every rank returns its own shards, as DTensors with the parameters' meshes and placements, with
    ``precision`` applied locally; NF4 shards are dequantized locally (or kept packed with ``keep_nf4``); plain
    tensors are returned as they are on this rank. No communication beyond one exchange of key names (so that a bad
    pattern fails on every rank). Full: :func:`get_full_state_dict` (result on rank 0, ``{}`` elsewhere).

    Args:
        model (nn.Module): the model.
        sharded_state_dict (bool): return each rank's shards instead of the full dict on rank 0. Default: False.
        precision (Union[torch.dtype, str, None]): cast floating tensors ("fp32", "bf16", ... or a dtype). None:
            keep each tensor's dtype (NF4: its compute dtype).
        include_keys (Patterns): fnmatch globs of keys to include.
        ignore_keys (Patterns): fnmatch globs of keys to skip. Exclusive with ``include_keys``.
        cpu_offload (Optional[bool]): move tensors to the CPU. None: True for a full dict, False for a sharded one.
        unwrap (bool): strip wrapper prefixes from the keys (see :func:`get_full_state_dict`). Default: True.
        keep_nf4 (bool): keep NF4 weights packed (NF4Tensor shards, or whole NF4Tensors in a full state dict, see
            :func:`get_full_state_dict`) instead of dequantizing them.

    Returns:
        Dict[str, torch.Tensor]: the state dict (full: on rank 0 only).

    Raises:
        ValueError: on both ``include_keys`` and ``ignore_keys``, a pattern that matches nothing, or a non-float
            ``precision``.

    Example (one process: the "shards" are whole tensors; under FSDP2 they are DTensors, e.g. for
    ``torch.distributed.checkpoint.save``):
        >>> from torchtune_ext.models import qlora_tiny_llama
        >>> model = qlora_tiny_llama(["q_proj", "v_proj"], dtype=torch.bfloat16, device="cpu")
        >>> shards = get_model_state_dict(model, sharded_state_dict=True, precision="bf16", keep_nf4=True)
        >>> type(shards["layers.0.attn.q_proj.weight"]).__name__
        'NF4Tensor'
        >>> full = get_model_state_dict(model, precision=torch.float32, ignore_keys="*.lora_*")
        >>> full["layers.0.attn.q_proj.weight"].dtype, any("lora" in key for key in full)
        (torch.float32, False)
    """
    if not sharded_state_dict:
        return get_full_state_dict(
            model,
            dtype=precision,
            include_keys=include_keys,
            ignore_keys=ignore_keys,
            cpu_offload=True if cpu_offload is None else cpu_offload,
            unwrap=unwrap,
            keep_nf4=keep_nf4,
        )
    precision = parse_dtype(precision, what="precision")
    include, ignore = as_patterns(include_keys, "include_keys"), as_patterns(ignore_keys, "ignore_keys")
    if include and ignore:
        raise ValueError("include_keys and ignore_keys are mutually exclusive; pass one of them.")
    entries = model_entries(model, unwrap)
    rank, world_size = world_info()
    all_keys: Dict[str, None] = dict.fromkeys(entries)
    if world_size > 1 and (include or ignore):
        everyone: List[Any] = [None] * world_size
        dist.all_gather_object(everyone, list(entries))
        all_keys = {key: None for keys in everyone for key in keys}
    kept = match_patterns(all_keys, include, "include_keys") if include else set(all_keys)
    kept -= match_patterns(all_keys, ignore, "ignore_keys") if ignore else set()
    result: Dict[str, torch.Tensor] = {}
    converted: Dict[int, torch.Tensor] = {}  # tied weights: one converted tensor per parameter
    with torch.no_grad():
        for key, entry in entries.items():
            if key in kept:
                if id(entry.value) not in converted:
                    converted[id(entry.value)] = _sharded_entry(entry.value, precision, keep_nf4, bool(cpu_offload))
                result[key] = converted[id(entry.value)]
    return result

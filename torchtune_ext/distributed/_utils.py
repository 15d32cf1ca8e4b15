"""Shared pieces of the distributed tooling: model entries with unwrapped keys, key globs, DTensor local boxes and
process-group / device helpers."""

from __future__ import annotations

import difflib
import fnmatch
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel
from torchtune.modules.peft import get_adapter_params

from torchtune_ext.nf4 import NF4Tensor

Patterns = Union[str, Sequence[str], None]


@dataclass
class Entry:
    """One state-dict entry of the local model.

    Attributes:
        key (str): the key callers see (unwrapped when requested).
        raw_key (str): the key in ``model.state_dict()``.
        value (torch.Tensor): the parameter or buffer itself (``keep_vars=True``).
        is_adapter (bool): whether it is an adapter parameter (``AdapterModule.adapter_params``).
    """

    key: str
    raw_key: str
    value: torch.Tensor
    is_adapter: bool

    @property
    def kind(self) -> str:
        """``"dtensor"``, ``"nf4"`` (a bare NF4Tensor) or ``"tensor"``."""
        if isinstance(self.value, DTensor):
            return "dtensor"
        return "nf4" if isinstance(self.value, NF4Tensor) else "tensor"


def as_patterns(patterns: Patterns, what: str) -> List[str]:
    """Normalizes a glob argument (a str or a list of str) to a list.

    Raises:
        TypeError: if ``patterns`` is neither.
    """
    if patterns is None:
        return []
    if isinstance(patterns, str):
        return [patterns]
    patterns = list(patterns)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{what} must be a glob string or a list of glob strings, got {patterns!r}.")
    return patterns


def match_patterns(keys: Iterable[str], patterns: List[str], what: str) -> Set[str]:
    """The keys matching any of the fnmatch ``patterns``; every pattern must match at least one key.

    Raises:
        ValueError: naming the first pattern that matches nothing and the keys closest to it.
    """
    keys = list(keys)
    matched: Set[str] = set()
    for pattern in patterns:
        hits = {key for key in keys if fnmatch.fnmatchcase(key, pattern)}
        if not hits:
            nearest = difflib.get_close_matches(pattern, keys, n=5, cutoff=0.0)
            raise ValueError(
                f"{what} pattern {pattern!r} matches no state-dict key. Nearest keys: {nearest}. Patterns are "
                "fnmatch globs over the (unwrapped) keys, e.g. 'layers.*.attn.q_proj.*'."
            )
        matched |= hits
    return matched


def _wrapped_child(module: nn.Module) -> Optional[Tuple[str, nn.Module]]:
    """The attribute name and inner module of a wrapper that adds a key prefix, else None."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return "_orig_mod", module._orig_mod
    if isinstance(module, ActivationWrapper):
        return "_checkpoint_wrapped_module", module._checkpoint_wrapped_module
    if isinstance(module, DistributedDataParallel):
        return "module", module.module
    return None


def unwrap_key(model: nn.Module, key: str) -> str:
    """Removes the atoms that wrappers (torch.compile, activation checkpointing, DDP) add to a state-dict key.

    The key is resolved against the module tree, so only real wrapper atoms are dropped (a user submodule named
    ``module`` stays). Activation checkpointing's own state-dict hook may already have removed its atom.

    Args:
        model (nn.Module): the (possibly wrapped) model the key comes from.
        key (str): a key of ``model.state_dict()``.

    Returns:
        str: the key of the unwrapped model.
    """
    module: Optional[nn.Module] = model
    kept = []
    for atom in key.split("."):
        consumed = False
        while module is not None and (wrapped := _wrapped_child(module)) is not None:
            attr, module = wrapped
            if atom == attr:
                consumed = True
                break
        if consumed:
            continue
        kept.append(atom)
        module = module._modules.get(atom) if module is not None else None
    return ".".join(kept)


def model_entries(model: nn.Module, unwrap: bool) -> Dict[str, Entry]:
    """The model's own state dict (after FSDP's state-dict hooks), keyed by unwrapped keys when ``unwrap``.

    Args:
        model (nn.Module): the model.
        unwrap (bool): strip wrapper atoms from the keys (see :func:`unwrap_key`).

    Returns:
        Dict[str, Entry]: entries in state-dict order.

    Raises:
        ValueError: if two keys become equal once unwrapped.
    """
    state_dict = model.state_dict(keep_vars=True)
    adapter_ids = {id(param) for param in get_adapter_params(model).values()}
    entries: Dict[str, Entry] = {}
    for raw_key, value in state_dict.items():
        key = unwrap_key(model, raw_key) if unwrap else raw_key
        if key in entries:
            raise ValueError(
                f"State-dict keys {entries[key].raw_key!r} and {raw_key!r} both unwrap to {key!r}; "
                "pass unwrap=False to keep the wrapped keys."
            )
        entries[key] = Entry(key, raw_key, value, id(value) in adapter_ids)
    return entries


def tie_roots(entries: Dict[str, Entry]) -> Dict[str, str]:
    """Maps each key whose tensor is also held by an earlier key (tied weights) to that earlier key."""
    first_key_of: Dict[int, str] = {}
    roots = {}
    for key, entry in entries.items():
        root = first_key_of.setdefault(id(entry.value), key)
        if root != key:
            roots[key] = root
    return roots


def world_info() -> Tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _accelerator_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise RuntimeError("the process group's backend needs an accelerator, but none is available.")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def group_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device that tensors must live on to be sent over ``group`` (default: the world group)."""
    # "fake": the per-rank dry run's process group, on fake CPU tensors
    return torch.device("cpu") if dist.get_backend(group) in ("gloo", "fake") else _accelerator_device()


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device of ``mesh`` (with the current accelerator index)."""
    return torch.device("cpu") if mesh.device_type == "cpu" else _accelerator_device()


def mesh_ranks(mesh: DeviceMesh) -> Tuple[int, ...]:
    """The global ranks of ``mesh``, flattened in mesh order."""
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def is_plain_shard0(dtensor: DTensor) -> bool:
    """Whether ``dtensor`` is sharded FSDP-style: dim 0 over a 1-D mesh."""
    placements = dtensor.placements
    return dtensor.device_mesh.ndim == 1 and type(placements[0]) is Shard and placements[0].dim == 0


def local_box(shape: torch.Size, mesh: DeviceMesh, placements: Sequence) -> Optional[Tuple[slice, ...]]:
    """The slices of the global tensor that this rank holds as its local shard.

    Args:
        shape (torch.Size): the global shape.
        mesh (DeviceMesh): the DTensor's mesh.
        placements (Sequence): its placements.

    Returns:
        Optional[Tuple[slice, ...]]: one slice per dim; None when the placements are not plain ``Shard``/``Replicate``
        (a local shard that is not a box; callers fall back to ``distribute_tensor``).
    """
    if not all(type(p) in (Shard, Replicate) for p in placements):
        return None
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local_shape))

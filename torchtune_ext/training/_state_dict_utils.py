"""Shared pieces of the state-dict tooling: model entries with unwrapped keys, key globs, NF4 shard quantization,
DTensor local boxes and process-group helpers."""

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

from torchtune_ext._compat import NF4Tensor, SubclassTensorArgs
from torchtune_ext.modules.low_precision import check_float_dtype

Patterns = Union[str, Sequence[str], None]

_DTYPE_ALIASES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
}

# Elements quantized at once: bounds the temporaries of NF4 quantization (torchao uses 1M for the same reason).
_QUANT_CHUNK = 1 << 22
_CODE_LUTS: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}
# torchao's NF4 table (``NF4Tensor.from_tensor``), for templates on the meta device.
_NF4_VALUES = [
    -1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000,
]  # fmt: skip


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


def resolve_dtype(dtype: Union[torch.dtype, str, None], what: str = "dtype") -> Optional[torch.dtype]:
    """Turns ``"bf16"``-style names into dtypes and checks that the result is a float dtype.

    Args:
        dtype (Union[torch.dtype, str, None]): a dtype, a name such as ``"fp32"``/``"bfloat16"``, or None.
        what (str): the argument's name, used in errors.

    Returns:
        Optional[torch.dtype]: the dtype, or None.

    Raises:
        ValueError: on an unknown name or a non-float dtype.
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPE_ALIASES:
            raise ValueError(f"{what}={dtype!r} is not a dtype name; use one of {sorted(_DTYPE_ALIASES)}.")
        dtype = _DTYPE_ALIASES[dtype]
    check_float_dtype(dtype, what)
    return dtype


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
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else _accelerator_device()


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


def _code_lut(dtype: torch.dtype, nf4: torch.Tensor) -> torch.Tensor:
    """A table of torchao's NF4 code indexed by the top 16 bits of a value (all of a 16-bit value).

    For float32, the 65536 values sharing a prefix form an interval; the code is monotone in the value, so the
    interval has one code when its two ends do. The few intervals that straddle a decision boundary hold 255.
    """
    lut = _CODE_LUTS.get((dtype, nf4.device))
    if lut is None:
        table = nf4.cpu()
        prefixes = torch.arange(65536, dtype=torch.int32)
        if dtype.itemsize == 2:
            lut = NF4Tensor.quantize_tensor_nearest(prefixes.to(torch.uint16).view(dtype), table).to(torch.uint8)
        else:
            first = (prefixes.to(torch.int64) << 16).to(torch.int32)
            codes = [NF4Tensor.quantize_tensor_nearest(end.view(dtype), table) for end in (first, first | 0xFFFF)]
            lut = torch.where(codes[0] == codes[1], codes[0], 255).to(torch.uint8)
        lut = _CODE_LUTS[(dtype, nf4.device)] = lut.to(nf4.device)
    return lut


def _exact_codes(values: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """torchao's nearest code: one of the two table entries around the value (the table is sorted and its gaps far
    exceed the rounding of ``value - entry``), compared with torchao's arithmetic; the first index on ties."""
    low = (torch.searchsorted(nf4, values, right=True) - 1).clamp_(0, nf4.numel() - 2)
    codes = low + ((values - nf4[low + 1]).abs() < (values - nf4[low]).abs())
    nonfinite = ~torch.isfinite(values)
    if nonfinite.any():
        codes[nonfinite] = NF4Tensor.quantize_tensor_nearest(values[nonfinite], nf4)
    return codes.to(torch.uint8)


def _nf4_packed(scaled: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """torchao's nearest-NF4 codes of ``scaled``, two per byte (first value high), bit for bit, via :func:`_code_lut`.

    16-bit values: each int32 holds two values (little-endian: the first in the low half). float32: the top 16
    bits index the table; values in a straddling interval (255) are resolved by :func:`_exact_codes`.
    """
    lut = _code_lut(scaled.dtype, nf4)
    if scaled.element_size() == 2:
        pairs = scaled.view(torch.int32)
        first = pairs.bitwise_and(0xFFFF)
        second = pairs.bitwise_right_shift(16).bitwise_and_(0xFFFF)
        return (lut << 4).index_select(0, first).bitwise_or_(lut.index_select(0, second))
    if scaled.element_size() == 4:
        codes = lut.index_select(0, scaled.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF))
        straddling = codes == 255
        if straddling.any():
            codes[straddling] = _exact_codes(scaled[straddling], nf4)
    else:
        codes = _exact_codes(scaled, nf4)
    codes = codes.view(-1, 2)
    return (codes[:, 0] << 4).bitwise_or_(codes[:, 1])


def nf4_block_absmax(tensor: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute maximum of each block of ``block_size`` consecutive elements, in ``tensor``'s dtype."""
    blocks = tensor.reshape(-1, block_size)
    rows = max(1, _QUANT_CHUNK // block_size)
    return torch.cat([blocks[i : i + rows].abs().amax(dim=1) for i in range(0, blocks.size(0), rows)])


def nf4_scaler_mean(full: torch.Tensor, dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """The mean of the block scales that torchao's ``to_nf4(full.to(dtype))`` stores as ``scaler_mean``.

    Block absmax commutes with a float cast (rounding is monotone), so only the scales are cast.
    """
    return nf4_block_absmax(full, block_size).to(dtype).mean()


@torch.no_grad()
def quantize_nf4(dense: torch.Tensor, template: NF4Tensor, scaler_mean: Optional[torch.Tensor] = None) -> NF4Tensor:
    """Quantizes ``dense`` like ``to_nf4`` with ``template``'s block sizes and dtype, bit for bit.

    With ``scaler_mean`` (the scale mean of the whole tensor, :func:`nf4_scaler_mean`), ``dense`` may be a row shard:
    the result equals the same rows of the whole tensor's quantization, which FSDP's all-gather requires (it
    reassembles shards under one ``scaler_mean``).

    Args:
        dense (torch.Tensor): the values, cast to ``template.dtype`` here if needed; numel divisible by
            ``block_size * scaler_block_size``.
        template (NF4Tensor): supplies block sizes and dtype (may be on the meta device).
        scaler_mean (Optional[torch.Tensor]): the whole tensor's scale mean; None: this tensor's own.

    Returns:
        NF4Tensor: the quantized tensor on ``dense``'s device.
    """
    block, scaler_block = template.block_size, template.scaler_block_size
    dense = dense.to(template.dtype).contiguous()
    if template.nf4.is_meta:
        nf4 = torch.tensor(_NF4_VALUES, dtype=template.dtype, device=dense.device)
    else:
        nf4 = template.nf4.to(device=dense.device, dtype=template.dtype)
    blocks = dense.view(-1, block)
    absmax = nf4_block_absmax(dense, block)
    mean = absmax.mean() if scaler_mean is None else scaler_mean.to(device=dense.device, dtype=template.dtype)
    # torchao's double_quantize_scalers with the given mean, op for op.
    centered = (absmax - mean).view(-1, scaler_block)
    factor = 256 / (2 * centered.abs().max(dim=1).values)
    scalers = (centered * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
    data = torch.empty(dense.numel() // 2, dtype=torch.uint8, device=dense.device)
    rows = max(1, _QUANT_CHUNK // block)
    for start in range(0, blocks.size(0), rows):
        scaled = (blocks[start : start + rows] / absmax[start : start + rows].unsqueeze(-1)).view(-1)
        packed = _nf4_packed(scaled, nf4)
        data[start * block // 2 : start * block // 2 + packed.numel()] = packed
    return nf4_with_inner(
        template,
        dense.shape,
        quantized_scalers=scalers,
        quantization_factor=factor.contiguous(),
        scaler_mean=mean,
        quantized_data=data,
        nf4=nf4,
    )


def nf4_with_inner(
    template: NF4Tensor,
    shape: Sequence[int],
    *,
    quantized_scalers: torch.Tensor,
    quantization_factor: torch.Tensor,
    scaler_mean: torch.Tensor,
    quantized_data: torch.Tensor,
    nf4: torch.Tensor,
) -> NF4Tensor:
    """A contiguous NF4Tensor of ``shape`` with ``template``'s dtype and block sizes and the given inner tensors."""
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    meta = SubclassTensorArgs(shape, stride, 0, template.dtype, quantized_data.device, False)
    n_blocks = shape.numel() // template.block_size
    return NF4Tensor(
        meta,
        template.block_size,
        n_blocks,
        template.scaler_block_size,
        quantized_scalers,
        quantization_factor,
        scaler_mean,
        quantized_data,
        nf4,
    )

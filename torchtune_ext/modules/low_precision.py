"""NF4 linear with an explicit compute dtype, and fast NF4 (de)quantization.

Why this is a fork: torchao's ``LinearNF4`` (used by torchtune 0.6.1's ``FrozenNF4Linear`` and ``LoRALinear``)
computes in whatever dtype the activation happens to have, ignores the compute dtype the user asked for, and
dequantizes through ``NF4Tensor.get_original_weight``, which is slow (two gathers, int64 indices, a stack);
torchao's ``to_nf4`` is slower still (a 16-wide argmin per value). This module keeps torchao's ``NF4Tensor``
storage layout untouched (so FSDP2, ``to_nf4`` and torchtune's helpers keep working) and replaces the compute path:

- ``dequantize_nf4``: values identical to ``get_original_weight`` (same formula, same dtype at every step), but
  through one lookup table that decodes two packed bytes (four NF4 codes) at once.
- ``quantize_nf4`` / ``to_nf4_frozen``: the NF4Tensor of torchao's ``to_nf4``, bit for bit, without the argmin;
  never carries autograd history, and is free on the meta device.
- ``linear_nf4``: dequantizes to the compute ``dtype``, computes in it, and saves only the NF4 weight for backward;
  on CPU it dequantizes slab by slab into a reused buffer, so the dense weight never exists whole.
- ``FrozenNF4Linear``: an ``nn.Linear`` whose weight is a frozen NF4Tensor.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._prims_common import make_contiguous_strides_for

from torchtune_ext._compat import NF4Tensor, SubclassTensorArgs
from torchtune_ext.modules._huge_pages import empty_with_huge_pages

NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# The decoding table's rows hold four values, viewed as one wide element (8 bytes for 16-bit dtypes, 16 bytes
# for fp32) so that decoding is a 1-D gather; fp64 rows are two complex128 elements.
_WIDE_DTYPES = {2: torch.int64, 4: torch.complex128, 8: torch.complex128}
_QUAD_LUTS: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}
# torchao's NF4 levels, as torchao writes them (NF4Tensor.from_tensor); the tests check they stay equal.
# fmt: off
_NF4_LEVELS = [
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
]
# fmt: on
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_CODE_LUTS: Dict[Tuple[torch.dtype, torch.device], Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
# CPU dequantization works on chunks of this many values: no full-size temporaries, and few enough parallel
# regions (each one stalls when a core is busy with another process).
_CPU_CHUNK_NUMEL = 1 << 22
# Quantization makes four temporaries per chunk; chunks this small keep them in cache (2x faster than 1 << 22).
_CPU_QUANTIZE_CHUNK_NUMEL = 1 << 18
# Quantization makes five temporaries per chunk: small enough chunks keep them in cache (2x faster than 1 << 22).
_CPU_QUANTIZE_CHUNK_NUMEL = 1 << 18
# On accelerators quantization still chunks (as torchao does) to bound its temporaries (about 16 bytes a value).
_ACCELERATOR_CHUNK_NUMEL = 1 << 24
# CPU linear_nf4 dequantizes slabs of about this many weights (at least _MIN_SLAB_DIM rows/columns) per matmul.
_CPU_SLAB_NUMEL = 1 << 22
_MIN_SLAB_DIM = 256


def check_float_dtype(dtype: Optional[torch.dtype], what: str = "dtype") -> None:
    """Raises a ``ValueError`` unless ``dtype`` is None or a floating-point dtype.

    Args:
        dtype (Optional[torch.dtype]): the dtype to check.
        what (str): the argument's name, used in the error.

    Raises:
        ValueError: if ``dtype`` is not a float dtype.
    """
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{what}={dtype} is not a floating-point dtype; NF4 computes in torch.float32, torch.bfloat16 "
            "or torch.float16 (recipes: dtype=fp32|bf16|fp16)."
        )


def check_nf4_shape(
    shape: Tuple[int, ...],
    block_size: int = NF4_BLOCK_SIZE,
    scaler_block_size: int = NF4_SCALER_BLOCK_SIZE,
    name: str = "weight",
) -> None:
    """Raises a ``ValueError`` when a weight of ``shape`` cannot be NF4-quantized.

    NF4 quantizes blocks of ``block_size`` values, and double-quantizes the per-block scales in blocks of
    ``scaler_block_size``, so the weight's numel must be divisible by ``block_size * scaler_block_size``.

    Args:
        shape (Tuple[int, ...]): the weight's shape.
        block_size (int): NF4 block size.
        scaler_block_size (int): block size of the double quantization of the scales.
        name (str): the weight's name, used in the error.

    Raises:
        ValueError: if the shape is not quantizable.
    """
    numel = 1
    for dim in shape:
        numel *= dim
    multiple = block_size * scaler_block_size
    if len(shape) != 2 or numel % multiple != 0:
        raise ValueError(
            f"{name} of shape {tuple(shape)} ({numel} elements) cannot be NF4-quantized with "
            f"block_size={block_size} and scaler_block_size={scaler_block_size}: NF4 needs a 2-D weight whose "
            f"numel is divisible by block_size * scaler_block_size = {multiple}. Pick dims that are multiples "
            f"of 256 (e.g. 256x512), or leave this layer unquantized."
        )


def to_nf4_frozen(
    tensor: torch.Tensor,
    block_size: int = NF4_BLOCK_SIZE,
    scaler_block_size: int = NF4_SCALER_BLOCK_SIZE,
) -> NF4Tensor:
    """Quantizes ``tensor`` to an NF4Tensor that carries no autograd history and does not require grad.

    ``fully_shard`` makes views of every parameter; an NF4Tensor whose wrapper requires grad (as
    ``to_nf4(linear.weight)`` gives) makes those views differentiable and FSDP2 fails with
    "Attempted to make a tensor into a differentiable view". The values are torchao's ``to_nf4`` (see
    :func:`quantize_nf4`); a meta ``tensor`` gives a meta NF4Tensor with the inner tensors ``to_nf4`` would make,
    without running the quantizer.

    Args:
        tensor (torch.Tensor): 2-D dense weight; the NF4Tensor keeps its dtype as its dequantization dtype.
        block_size (int): NF4 block size.
        scaler_block_size (int): block size of the scale double quantization.

    Returns:
        NF4Tensor: the quantized weight.

    Raises:
        ValueError: if the dtype is not a float dtype or the shape cannot be NF4-quantized.
    """
    return quantize_nf4(tensor, block_size, scaler_block_size)


@torch.no_grad()
def quantize_nf4(
    tensor: torch.Tensor,
    block_size: int = NF4_BLOCK_SIZE,
    scaler_block_size: int = NF4_SCALER_BLOCK_SIZE,
) -> NF4Tensor:
    """Quantizes ``tensor`` to NF4; the same NF4Tensor as torchao's ``to_nf4``, bit for bit, much faster.

    torchao finds each value's NF4 code as the argmin of its 16 distances to the NF4 levels (a 16x wide
    temporary). Here the code is one lookup in a 65536-entry table indexed by the scaled value's top 16 bits, plus
    one comparison for fp32; the tables are built once per dtype from torchao's own nearest-level function (see
    :func:`_code_lut`), so the codes are its codes. The double quantization of the block
    scales is torchao's arithmetic, op for op. The work runs in chunks, so the temporaries stay small. A meta
    ``tensor`` gives a meta NF4Tensor with the inner tensors ``to_nf4`` would make.

    Args:
        tensor (torch.Tensor): 2-D float weight. The result does not require grad.
        block_size (int): NF4 block size.
        scaler_block_size (int): block size of the scale double quantization.

    Returns:
        NF4Tensor: the quantized weight.

    Raises:
        ValueError: if the dtype is not a float dtype or the shape cannot be NF4-quantized.
    """
    check_float_dtype(tensor.dtype, "weight dtype")
    check_nf4_shape(tuple(tensor.shape), block_size, scaler_block_size)
    if tensor.is_meta:
        return _meta_nf4(tensor.shape, tensor.dtype, block_size, scaler_block_size)
    flat = tensor.detach().flatten()
    nf4 = torch.tensor(_NF4_LEVELS, device=tensor.device, dtype=tensor.dtype)
    blocks = flat.view(-1, block_size)
    n_blocks = blocks.shape[0]
    absmax = torch.empty(n_blocks, dtype=tensor.dtype, device=tensor.device)
    packed = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=tensor.device)
    chunk_numel = _CPU_QUANTIZE_CHUNK_NUMEL if tensor.device.type == "cpu" else _ACCELERATOR_CHUNK_NUMEL
    chunk = max(1, chunk_numel // block_size)
    for start in range(0, n_blocks, chunk):
        stop = min(start + chunk, n_blocks)
        torch.amax(blocks[start:stop].abs(), dim=1, out=absmax[start:stop])
        codes = _nf4_codes((blocks[start:stop] / absmax[start:stop].unsqueeze(-1)).view(-1), nf4).view(-1, 2)
        torch.bitwise_or(codes[:, 0] << 4, codes[:, 1], out=packed[start * block_size // 2 : stop * block_size // 2])
    quantized_scalers, quantization_factor, scaler_mean = _double_quantize_scalers(absmax, scaler_block_size)
    tensor_meta = SubclassTensorArgs(
        tensor.size(), tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device, False
    )
    return NF4Tensor(
        tensor_meta,
        block_size,
        n_blocks,
        scaler_block_size,
        quantized_scalers,
        quantization_factor,
        scaler_mean,
        packed,
        nf4,
    )


def _double_quantize_scalers(
    absmax: torch.Tensor, scaler_block_size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's ``NF4Tensor.double_quantize_scalers``, op for op, given the block absmaxes."""
    mean = absmax.mean()
    centered = (absmax - mean).view(-1, scaler_block_size)
    factor = 256 / (2 * centered.abs().max(dim=1).values.unsqueeze(-1))
    quantized = (centered * factor).round().clamp(-128, 127)
    return quantized.flatten().to(torch.int8), factor[:, 0].contiguous(), mean


def _ordered_key(value: torch.Tensor) -> int:
    """An integer that orders like the float ``value`` (one element)."""
    bits = int(value.view(_INT_OF_SIZE[value.element_size()]).item())
    return bits if bits >= 0 else -(bits & ((1 << (8 * value.element_size() - 1)) - 1)) - 1


def _from_key(key: int, like: torch.Tensor) -> torch.Tensor:
    nbits = 8 * like.element_size()
    bits = key if key >= 0 else (-key - 1) - (1 << (nbits - 1))
    return torch.tensor([bits], dtype=_INT_OF_SIZE[like.element_size()], device=like.device).view(like.dtype)


def _code_lut(nf4: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Tables that give torchao's NF4 code of a scaled value from the value's top 16 bits (see :func:`_nf4_codes`).

    For 16-bit dtypes the top 16 bits are the whole value: ``codes[bits]`` is torchao's
    ``NF4Tensor.quantize_tensor_nearest`` of that value, evaluated once for all 65536 (so its rounding, tie-breaking
    and NaN handling are reproduced exactly), and the second table is None. For fp32, key ``k`` holds the 65536
    values whose bits are ``k << 16 | low``: ``codes[k]`` is the code of the smallest of them and ``thresholds[k]``
    the one value among them where the code goes up by one (NaN if none: the comparison is then false). Codes
    change at 15 thresholds 0.08 apart and a key spans at most 1/128 of its magnitude, so a key holds at most one.
    """
    key = (nf4.dtype, nf4.device)
    tables = _CODE_LUTS.get(key)
    if tables is not None:
        return tables
    int_type = _INT_OF_SIZE[nf4.element_size()]
    keys = torch.arange(65536, dtype=torch.int64)
    if nf4.element_size() == 2:
        values = torch.where(keys >= 2**15, keys - 2**16, keys).to(int_type).view(nf4.dtype).to(nf4.device)
        tables = (_nearest_codes(values, nf4), None)
    else:
        bits = torch.stack([keys << 16, keys << 16 | 0xFFFF], dim=1)
        ends = torch.where(bits >= 2**31, bits - 2**32, bits).to(int_type).view(nf4.dtype).to(nf4.device)
        low, high = ends.amin(dim=1), ends.amax(dim=1)
        low_codes, high_codes = _nearest_codes(low, nf4), _nearest_codes(high, nf4)
        # Scaled values lie in [-1, 1] or are NaN; beyond +-2 torchao's fp32 distances lose their precision and its
        # codes stop being monotonic, so those keys (never looked up) keep the code of their low end.
        in_range = (low >= -2) & (high <= 2)
        steps = high_codes.int() - low_codes.int()
        assert int(steps[in_range].max()) <= 1, "NF4 code thresholds closer than a key"
        thresholds = torch.full_like(low, float("nan"))
        for key_index in torch.nonzero((steps != 0) & in_range).flatten().tolist():
            thresholds[key_index] = _first_value_with_code(low[key_index], high[key_index], nf4)
        codes = torch.where(low.isnan(), _nearest_codes(nf4.new_full((1,), float("nan")), nf4), low_codes)
        tables = (codes, thresholds)
    _CODE_LUTS[key] = tables
    return tables


def _nearest_codes(values: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 codes of ``values`` (1-D), as uint8, in pieces that keep its 16-wide temporary small."""
    return torch.cat([NF4Tensor.quantize_tensor_nearest(piece, nf4) for piece in values.split(4096)]).to(torch.uint8)


def _first_value_with_code(low: torch.Tensor, high: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """The smallest value in ``(low, high]`` whose torchao code is that of ``high``, by bisection over the values."""
    code = _nearest_codes(high.view(1), nf4)
    low_key, high_key = _ordered_key(low), _ordered_key(high)
    while high_key - low_key > 1:
        mid = (low_key + high_key) // 2
        if _nearest_codes(_from_key(mid, nf4), nf4) == code:
            high_key = mid
        else:
            low_key = mid
    return _from_key(high_key, nf4)[0]


def _nf4_codes(scaled: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 codes (uint8) of the block-scaled values ``scaled`` (1-D, ``nf4.dtype``): one table lookup on
    the top 16 bits of each value, plus one comparison for fp32 (see :func:`_code_lut`)."""
    if nf4.element_size() > 4:
        return NF4Tensor.quantize_tensor_nearest(scaled, nf4).to(torch.uint8)
    codes, thresholds = _code_lut(nf4)
    top_bits = scaled.view(torch.uint16)
    if thresholds is None:
        return codes.index_select(0, top_bits.to(torch.int32))
    # Little-endian: the second uint16 of each fp32 holds its sign, exponent and top 7 mantissa bits.
    keys = top_bits.view(-1, 2)[:, 1].to(torch.int32)
    return codes.index_select(0, keys).add_(scaled >= thresholds.index_select(0, keys))


def _meta_nf4(shape: torch.Size, dtype: torch.dtype, block_size: int, scaler_block_size: int) -> NF4Tensor:
    """The NF4Tensor ``to_nf4(torch.empty(shape, dtype=dtype, device="meta"))`` returns, built directly."""
    numel = math.prod(shape)
    n_blocks = numel // block_size

    def meta(size, inner_dtype):
        return torch.empty(size, dtype=inner_dtype, device="meta")

    tensor_meta = SubclassTensorArgs(
        torch.Size(shape), make_contiguous_strides_for(shape), 0, dtype, torch.device("meta"), False
    )
    return NF4Tensor(
        tensor_meta,
        block_size,
        n_blocks,
        scaler_block_size,
        meta((n_blocks,), torch.int8),  # quantized_scalers
        meta((n_blocks // scaler_block_size,), dtype),  # quantization_factor
        meta((), dtype),  # scaler_mean
        meta((numel // 2,), torch.uint8),  # quantized_data: two codes per byte
        meta((16,), dtype),  # nf4 table
    )


def _quad_lut(nf4_values: torch.Tensor) -> torch.Tensor:
    """A 65536-row table: row ``v`` holds the four NF4 values packed in the uint16 ``v`` (two bytes).

    Cached per dtype and device: every NF4Tensor carries torchao's same 16 levels (see ``_NF4_LEVELS``).
    """
    key = (nf4_values.dtype, nf4_values.device)
    lut = _QUAD_LUTS.get(key)
    if lut is None:
        codes = torch.arange(65536, dtype=torch.int32, device=nf4_values.device)
        # Little-endian: the uint16 view puts byte 0 in the low bits; each byte packs (hi, lo) nibbles.
        low_byte, high_byte = codes & 0xFF, codes >> 8
        nibbles = torch.stack([low_byte >> 4, low_byte & 0xF, high_byte >> 4, high_byte & 0xF], dim=-1)
        lut = nf4_values[nibbles.long()].view(_WIDE_DTYPES[nf4_values.dtype.itemsize])
        lut = lut.view(-1) if lut.shape[-1] == 1 else lut
        _QUAD_LUTS[key] = lut
    return lut


def _dequantize_scalers(weight: NF4Tensor) -> torch.Tensor:
    # torchao's NF4Tensor.dequantize_scalers, op for op (same dtypes, same rounding).
    quantized = weight.quantized_scalers.view(-1, weight.scaler_block_size)
    scalers = (quantized / weight.quantization_factor.unsqueeze(-1)).flatten().to(weight.dtype)
    return scalers + weight.scaler_mean


def dequantize_nf4(weight: NF4Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Dequantizes an NF4Tensor; equal bit for bit to torchao's ``get_original_weight().to(dtype)``.

    Every value is computed as torchao computes it, ``nf4_table[code] * block_scale`` in the NF4Tensor's own
    dtype, then cast to ``dtype``, so the results are identical. Only the decoding is faster: a 65536-entry table
    turns each pair of packed bytes (four codes) into four values with one gather, and on CPU the work runs in
    chunks written straight into the output (no full-size temporaries).

    Args:
        weight (NF4Tensor): the quantized weight (2-D, contiguous or transposed).
        dtype (Optional[torch.dtype]): output dtype; None keeps the NF4Tensor's dtype.

    Returns:
        torch.Tensor: dense weight of ``weight.shape`` in ``dtype``.
    """
    out_dtype = dtype or weight.dtype
    if not weight.is_contiguous():
        return dequantize_nf4(weight.t(), dtype).t()
    if weight.is_meta:
        return torch.empty(weight.shape, dtype=out_dtype, device=weight.device)
    if weight.device.type == "cpu":
        out = empty_with_huge_pages(weight.shape, out_dtype)
    else:
        out = torch.empty(weight.shape, dtype=out_dtype, device=weight.device)
    _dequantize_into(weight, out.view(-1, weight.block_size))
    return out


def _dequantize_into(weight: NF4Tensor, out_blocks: torch.Tensor) -> None:
    """Writes ``dequantize_nf4(weight)`` into ``out_blocks`` of shape ``(n_blocks, block_size)``."""
    scalers = _dequantize_scalers(weight)
    # numel is a multiple of 64 * 256, so the packed bytes always pair up; block_size is a multiple of 4.
    packed = weight.quantized_data.view(torch.uint16)
    n_blocks, block_size = out_blocks.shape
    quads = block_size // 4
    chunk = n_blocks if weight.device.type != "cpu" else max(1, _CPU_CHUNK_NUMEL // block_size)
    chunk = min(chunk, n_blocks)
    staging = None
    if out_blocks.dtype != weight.dtype:
        staging = torch.empty(chunk, block_size, dtype=weight.dtype, device=weight.device)
    for start in range(0, n_blocks, chunk):
        stop = min(start + chunk, n_blocks)
        values = out_blocks[start:stop] if staging is None else staging[: stop - start]
        _decode_(weight, packed[start * quads : stop * quads], scalers[start:stop], values)
        if staging is not None:
            out_blocks[start:stop].copy_(values)


def _decode_(weight: NF4Tensor, packed: torch.Tensor, scalers: torch.Tensor, out: torch.Tensor) -> None:
    """Dequantizes a block-aligned piece of ``weight`` into ``out`` (contiguous, ``weight.dtype``).

    Args:
        weight (NF4Tensor): the weight the piece belongs to (for its NF4 table and block size).
        packed (torch.Tensor): the piece's packed codes as uint16 (four codes each), any shape and strides.
        scalers (torch.Tensor): its block scales, shaped like ``packed`` with ``block_size // 4`` times fewer
            elements in the last dim.
        out (torch.Tensor): ``packed.numel() * 4`` values, written in ``packed``'s logical order.
    """
    lut = _quad_lut(weight.nf4)
    indices = packed.to(torch.int32).view(-1)
    torch.index_select(lut, 0, indices, out=out.view(-1).view(lut.dtype).view(indices.numel(), *lut.shape[1:]))
    out.view(*scalers.shape, weight.block_size).mul_(scalers.unsqueeze(-1))


def _slab_plan(weight: NF4Tensor) -> Optional[Tuple[int, int]]:
    """Rows per forward slab and columns per backward slab for the slab-wise CPU path, or None to use the whole
    dequantized weight (accelerators, where the caching allocator makes it cheap; small or unaligned weights)."""
    out_dim, in_dim = weight.shape
    if weight.device.type != "cpu" or not weight.is_contiguous() or in_dim % weight.block_size != 0:
        return None
    if weight.numel() < 2 * _CPU_SLAB_NUMEL:
        return None
    rows = max(_MIN_SLAB_DIM, _CPU_SLAB_NUMEL // in_dim)
    cols = max(_MIN_SLAB_DIM, _CPU_SLAB_NUMEL // out_dim) // weight.block_size * weight.block_size
    return rows, cols


def _slab_buffers(weight: NF4Tensor, shape: Tuple[int, int], dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    decoded = torch.empty(shape, dtype=weight.dtype, device=weight.device)
    return decoded, decoded if dtype == weight.dtype else torch.empty(shape, dtype=dtype, device=weight.device)


def _linear_slabs(x: torch.Tensor, weight: NF4Tensor, rows: int) -> torch.Tensor:
    """``x @ dequant(W).T`` in ``x.dtype``, a slab of ``rows`` rows of W at a time (never the whole dense W)."""
    out_dim, in_dim = weight.shape
    scalers = _dequantize_scalers(weight).view(out_dim, in_dim // weight.block_size)
    packed = weight.quantized_data.view(torch.uint16).view(out_dim, in_dim // 4)
    out = torch.empty(x.shape[0], out_dim, dtype=x.dtype, device=x.device)
    decoded, slab = _slab_buffers(weight, (rows, in_dim), x.dtype)
    for start in range(0, out_dim, rows):
        stop = min(start + rows, out_dim)
        _decode_(weight, packed[start:stop], scalers[start:stop], decoded[: stop - start])
        if slab is not decoded:
            slab[: stop - start].copy_(decoded[: stop - start])
        torch.mm(x, slab[: stop - start].t(), out=out[:, start:stop])
    return out


def _grad_input_slabs(grad: torch.Tensor, weight: NF4Tensor, cols: int) -> torch.Tensor:
    """``grad @ dequant(W)`` in ``grad.dtype``, a slab of ``cols`` columns of W at a time."""
    out_dim, in_dim = weight.shape
    block_size = weight.block_size
    scalers = _dequantize_scalers(weight).view(out_dim, in_dim // block_size)
    packed = weight.quantized_data.view(torch.uint16).view(out_dim, in_dim // 4)
    grad_input = torch.empty(grad.shape[0], in_dim, dtype=grad.dtype, device=grad.device)
    decoded, slab = _slab_buffers(weight, (out_dim * cols,), grad.dtype)
    for start in range(0, in_dim, cols):
        stop = min(start + cols, in_dim)
        width = stop - start
        piece = decoded[: out_dim * width].view(out_dim, width)
        _decode_(weight, packed[:, start // 4 : stop // 4], scalers[:, start // block_size : stop // block_size], piece)
        if slab is not decoded:
            slab[: out_dim * width].copy_(decoded[: out_dim * width])
        torch.mm(grad, slab[: out_dim * width].view(out_dim, width), out=grad_input[:, start:stop])
    return grad_input


def _compute_dtype(input: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        return dtype
    if torch.is_autocast_enabled(input.device.type):
        return torch.get_autocast_dtype(input.device.type)
    return input.dtype


class LinearNF4(torch.autograd.Function):
    """``y = x @ dequant(W).T`` in an explicit compute dtype, saving only the NF4 weight for backward.

    The weight is frozen, so backward needs no input: ``grad_input = grad_out @ dequant(W)``. On CPU, large
    weights are dequantized a slab at a time into a reused buffer that the matmuls consume, so the whole dense
    weight never exists and no fresh memory is faulted in per call (on accelerators, where the caching allocator
    makes that free, it is dequantized whole, then freed).
    """

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: NF4Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.compute_dtype = dtype
        plan = _slab_plan(weight)
        if plan is None:
            return F.linear(input.to(dtype), dequantize_nf4(weight, dtype))
        x = input.to(dtype).reshape(-1, weight.shape[1])
        return _linear_slabs(x, weight, plan[0]).view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        dtype = ctx.compute_dtype
        plan = _slab_plan(weight)
        if plan is None:
            return grad_output.to(dtype) @ dequantize_nf4(weight, dtype), None, None
        grad = grad_output.to(dtype).reshape(-1, weight.shape[0])
        grad_input = _grad_input_slabs(grad, weight, plan[1])
        return grad_input.view(*grad_output.shape[:-1], weight.shape[1]), None, None


def linear_nf4(input: torch.Tensor, weight: NF4Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Linear layer with a frozen NF4 weight, computed in ``dtype``.

    Args:
        input (torch.Tensor): activations of shape ``(..., in_dim)``, any float dtype.
        weight (NF4Tensor): quantized weight of shape ``(out_dim, in_dim)``.
        dtype (Optional[torch.dtype]): compute and output dtype. None: the autocast dtype when autocast is
            enabled on the input's device, else the input's dtype.

    Returns:
        torch.Tensor: output of shape ``(..., out_dim)`` in the compute dtype.

    Example:
        >>> w = to_nf4_frozen(torch.randn(512, 256))
        >>> y = linear_nf4(torch.randn(4, 256, dtype=torch.bfloat16), w, dtype=torch.float32)
        >>> y.dtype
        torch.float32
    """
    check_float_dtype(dtype)
    compute_dtype = _compute_dtype(input, dtype)
    with torch.autocast(input.device.type, enabled=False):
        return LinearNF4.apply(input, weight, compute_dtype)


def _quantize_incoming_weight(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: quantize a dense incoming weight in the module's own dtype.

    torchao's ``NF4Tensor.copy_`` quantizes in the *source* dtype (e.g. bf16 from an HF checkpoint) even when
    the module computes in fp32; casting first makes the loaded weight equal to ``to_nf4(w.to(dtype))``.
    """
    key = prefix + "weight"
    incoming = state_dict.get(key)
    if isinstance(module.weight, NF4Tensor) and incoming is not None and not isinstance(incoming, NF4Tensor):
        state_dict[key] = to_nf4_frozen(
            incoming.to(device=module.weight.device, dtype=module.weight.dtype),
            module.weight.block_size,
            module.weight.scaler_block_size,
        )


class FrozenNF4Linear(nn.Linear):
    """``nn.Linear`` with a frozen NF4 weight and an explicit compute dtype.

    Args:
        in_dim (int): input dimension.
        out_dim (int): output dimension.
        bias (bool): whether to add a (frozen) bias. Default: False.
        device (Optional[torch.device]): device; "meta" builds without memory (load or materialize later).
        dtype (Optional[torch.dtype]): compute dtype, and the dtype the weight dequantizes to in a state dict.
            None: torch's default dtype.
        block_size (int): NF4 block size. Default: 64.
        scaler_block_size (int): block size of the scale double quantization. Default: 256.

    Raises:
        ValueError: if ``dtype`` is not a float dtype or the weight shape cannot be NF4-quantized.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        bias: bool = False,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        block_size: int = NF4_BLOCK_SIZE,
        scaler_block_size: int = NF4_SCALER_BLOCK_SIZE,
    ):
        check_float_dtype(dtype)
        check_nf4_shape((out_dim, in_dim), block_size, scaler_block_size)
        super().__init__(in_dim, out_dim, bias=bias, device=device, dtype=dtype)
        self.compute_dtype = self.weight.dtype
        self.weight = nn.Parameter(to_nf4_frozen(self.weight, block_size, scaler_block_size), requires_grad=False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.register_load_state_dict_pre_hook(_quantize_incoming_weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input (torch.Tensor): shape ``(..., in_dim)``.

        Returns:
            torch.Tensor: shape ``(..., out_dim)`` in the compute dtype.
        """
        out = linear_nf4(input, self.weight, self.compute_dtype)
        return out if self.bias is None else out + self.bias.to(self.compute_dtype)

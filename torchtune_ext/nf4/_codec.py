"""NF4 (de)quantization: torchao's NF4Tensor values, bit for bit, much faster; the one place NF4 tensors are made.

torchao's ``NF4Tensor`` storage layout is kept untouched (so FSDP2, ``to_nf4`` and torchtune's helpers keep working);
only the arithmetic is replaced:

- :func:`quantize_nf4`: the NF4Tensor of torchao's ``to_nf4``, bit for bit, without its 16-wide argmin per value; never
  carries autograd history; free on the meta device; given the scale mean of a whole tensor (``scaler_mean``), a row
  shard quantizes to the same rows as the whole tensor (what FSDP2's all-gather of NF4 shards needs).
- :func:`dequantize_nf4`: values identical to ``get_original_weight`` (same formula, same dtype at every step), through
  one lookup table that decodes a packed byte (two NF4 codes) at once on CPU, two bytes (four codes) elsewhere.
- :func:`nf4_from_inner`: an NF4Tensor from its inner tensors (gathered or quantized shards).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor

from torchtune_ext._compat import _INNER_TENSOR_NAMES_FOR_SHARDING, NF4Tensor, SubclassTensorArgs
from torchtune_ext.nf4._cpu_kernels import nf4_decode, nf4_decode_supports
from torchtune_ext.nf4._huge_pages import empty_with_huge_pages

NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256
#: the inner tensors FSDP2 shards along dim 0 (torchao's list); ``scaler_mean`` and ``nf4`` are whole on every rank.
NF4_SHARDED_TENSORS = tuple(_INNER_TENSOR_NAMES_FOR_SHARDING)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# The accelerators' decoding table's rows hold four values, viewed as one wide element (8 bytes for 16-bit dtypes,
# 16 bytes for fp32) so that decoding is a 1-D gather; fp64 rows are two complex128 elements.
_WIDE_DTYPES = {2: torch.int64, 4: torch.complex128, 8: torch.complex128}
# The CPU table's rows hold two values: 4, 8 or 16 bytes.
_PAIR_DTYPES = {2: torch.int32, 4: torch.int64, 8: torch.complex128}
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
# Quantization makes five temporaries per chunk: small enough chunks keep them in cache (BENCHMARKS.md).
_CPU_QUANTIZE_CHUNK_NUMEL = 1 << 18
# On accelerators quantization still chunks (as torchao does) to bound its temporaries (about 16 bytes a value).
_ACCELERATOR_CHUNK_NUMEL = 1 << 24


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


def nf4_n_blocks(shape: Sequence[int], block_size: int = NF4_BLOCK_SIZE) -> int:
    """The number of NF4 blocks of a weight of ``shape``: its numel over ``block_size``, the last block padded.

    Args:
        shape (Sequence[int]): the weight's shape.
        block_size (int): NF4 block size.

    Returns:
        int: ``ceil(numel / block_size)``.
    """
    return -(-math.prod(shape) // block_size)


def nf4_scaler_block_size(shape: Sequence[int], block_size: int = NF4_BLOCK_SIZE) -> int:
    """The scaler block size (blocks per double-quantization group) that quantizes a weight of ``shape`` and keeps
    its scale groups divisible by as many ranks as possible.

    torchao's 256 wherever its group count splits evenly over 8 ranks (its own layout, bit for bit); otherwise the
    largest divisor of the block count, at most 256, whose group count splits over 8 ranks, else 4, else 2, else
    any: SmolLM2-135M's 576x576 (5,184 blocks) gets 24 groups of 216, Qwen2.5-0.5B's 896x896 (12,544 blocks) 56 of
    224. A divisor always exists (1), so every shape quantizes.

    Args:
        shape (Sequence[int]): the weight's shape.
        block_size (int): NF4 block size.

    Returns:
        int: a divisor of :func:`nf4_n_blocks` of at most 256.
    """
    n_blocks = nf4_n_blocks(shape, block_size)
    divisors = [d for d in range(min(NF4_SCALER_BLOCK_SIZE, n_blocks), 0, -1) if n_blocks % d == 0]
    for ranks in (8, 4, 2):
        for divisor in divisors:
            if (n_blocks // divisor) % ranks == 0:
                return divisor
    return divisors[0]


def nf4_even_world_sizes(
    shape: Sequence[int],
    scaler_block_size: Optional[int] = None,
    block_size: int = NF4_BLOCK_SIZE,
    max_world_size: int = 8,
) -> Tuple[int, ...]:
    """The world sizes up to ``max_world_size`` over which FSDP2 splits an NF4 weight of ``shape`` evenly: each rank
    then holds whole rows, whole blocks and whole scale groups (torchao's ``NF4Tensor`` split and all-gather).

    Args:
        shape (Sequence[int]): the 2-D weight shape.
        scaler_block_size (Optional[int]): its scaler block size; None: :func:`nf4_scaler_block_size`.
        block_size (int): NF4 block size.
        max_world_size (int): the largest world size considered.

    Returns:
        Tuple[int, ...]: the world sizes (1 always; none above 1 for a weight whose last block is padded).
    """
    scaler_block_size = scaler_block_size or nf4_scaler_block_size(shape, block_size)
    if math.prod(shape) % block_size != 0:
        return (1,)
    groups = nf4_n_blocks(shape, block_size) // scaler_block_size
    return tuple(w for w in range(1, max_world_size + 1) if shape[0] % w == 0 and groups % w == 0)


def check_nf4_shape(
    shape: Tuple[int, ...],
    block_size: int = NF4_BLOCK_SIZE,
    scaler_block_size: Optional[int] = None,
    name: str = "weight",
) -> None:
    """Raises a ``ValueError`` when a weight of ``shape`` cannot be NF4-quantized with these block sizes.

    Any 2-D shape quantizes (the last block is zero-padded); an explicit ``scaler_block_size`` must divide the
    block count (None picks one that does: :func:`nf4_scaler_block_size`).

    Args:
        shape (Tuple[int, ...]): the weight's shape.
        block_size (int): NF4 block size.
        scaler_block_size (Optional[int]): block size of the double quantization of the scales; None: per shape.
        name (str): the weight's name, used in the error.

    Raises:
        ValueError: if the shape is not quantizable.
    """
    if len(shape) != 2 or math.prod(shape) == 0 or block_size % 4 != 0:
        raise ValueError(
            f"{name} of shape {tuple(shape)} with block_size={block_size} cannot be NF4-quantized: NF4 needs a "
            "non-empty 2-D weight and a block_size divisible by 4. Leave this layer unquantized."
        )
    n_blocks = nf4_n_blocks(shape, block_size)
    if scaler_block_size is not None and n_blocks % scaler_block_size != 0:
        raise ValueError(
            f"{name} of shape {tuple(shape)} ({n_blocks} blocks of block_size={block_size}) cannot be NF4-quantized "
            f"with scaler_block_size={scaler_block_size}: the block count must be divisible by it. Pass "
            f"scaler_block_size=None (picks {nf4_scaler_block_size(shape, block_size)} for this shape)."
        )


def quantize_nf4(
    tensor: torch.Tensor,
    block_size: int = NF4_BLOCK_SIZE,
    scaler_block_size: Optional[int] = None,
    *,
    scaler_mean: Optional[torch.Tensor] = None,
) -> NF4Tensor:
    """Quantizes ``tensor`` to NF4 in its own dtype; the NF4Tensor of torchao's ``to_nf4``, bit for bit, much faster.

    torchao finds each value's NF4 code as the argmin of its 16 distances to the NF4 levels (a 16x wide
    temporary). Here the code is one lookup in a 65536-entry table indexed by the scaled value's top 16 bits, plus
    one comparison for fp32; the tables are built once per dtype from torchao's own nearest-level function (see
    :func:`_code_lut`), so the codes are its codes. The double quantization of the block scales is torchao's
    arithmetic, op for op. The work runs in chunks, so the temporaries stay small. The result carries no autograd
    history and does not require grad (``fully_shard`` makes views of every parameter, and an NF4Tensor that
    requires grad makes those views differentiable: "Attempted to make a tensor into a differentiable view"). A meta
    ``tensor`` gives a meta NF4Tensor with the inner tensors ``to_nf4`` would make.

    Any shape quantizes: a numel that is not a multiple of ``block_size`` zero-pads the last block (zeros change
    neither its absmax nor any other block), and ``scaler_block_size=None`` picks a divisor of the block count
    (:func:`nf4_scaler_block_size`; torchao's 256 wherever that splits over 8 ranks, so ``to_nf4``'s layout).

    Args:
        tensor (torch.Tensor): 2-D float weight (or a row shard of one, with ``scaler_mean``).
        block_size (int): NF4 block size.
        scaler_block_size (Optional[int]): block size of the scale double quantization; None: per shape.
        scaler_mean (Optional[torch.Tensor]): the mean block scale of the whole tensor that ``tensor`` is a row shard
            of (:func:`nf4_scaler_mean`); the result then equals those rows of the whole tensor's quantization,
            which FSDP2 needs (it reassembles shards under one ``scaler_mean``). None: ``tensor``'s own.

    Returns:
        NF4Tensor: the quantized weight.

    Raises:
        ValueError: if the dtype is not a float dtype or the shape cannot be NF4-quantized.
    """
    check_float_dtype(tensor.dtype, "weight dtype")
    check_nf4_shape(tuple(tensor.shape), block_size, scaler_block_size)
    scaler_block_size = scaler_block_size or nf4_scaler_block_size(tensor.shape, block_size)
    if tensor.is_meta:
        return _meta_nf4(tensor.shape, tensor.dtype, block_size, scaler_block_size)
    flat = _padded_flat(tensor.detach(), block_size)
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
    mean = absmax.mean() if scaler_mean is None else scaler_mean.to(device=tensor.device, dtype=tensor.dtype)
    quantized_scalers, quantization_factor = _double_quantize_scalers(absmax, mean, scaler_block_size)
    return NF4Tensor(
        _tensor_meta(tensor.shape, tensor.dtype, tensor.device),
        block_size,
        n_blocks,
        scaler_block_size,
        quantized_scalers,
        quantization_factor,
        mean,
        packed,
        nf4,
    )


def _padded_flat(tensor: torch.Tensor, block_size: int) -> torch.Tensor:
    """``tensor`` flattened, zero-padded to whole blocks."""
    flat = tensor.contiguous().flatten()
    pad = -flat.numel() % block_size
    return flat if pad == 0 else torch.cat([flat, flat.new_zeros(pad)])


def _tensor_meta(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> SubclassTensorArgs:
    shape = torch.Size(shape)
    return SubclassTensorArgs(shape, make_contiguous_strides_for(shape), 0, dtype, device, False)


def _double_quantize_scalers(
    absmax: torch.Tensor, mean: torch.Tensor, scaler_block_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """torchao's ``NF4Tensor.double_quantize_scalers``, op for op, given the block absmaxes and their mean."""
    centered = (absmax - mean).view(-1, scaler_block_size)
    factor = 256 / (2 * centered.abs().max(dim=1).values.unsqueeze(-1))
    quantized = (centered * factor).round().clamp(-128, 127)
    return quantized.flatten().to(torch.int8), factor[:, 0].contiguous()


def nf4_scaler_mean(tensor: torch.Tensor, dtype: torch.dtype, block_size: int = NF4_BLOCK_SIZE) -> torch.Tensor:
    """The ``scaler_mean`` that ``quantize_nf4(tensor.to(dtype))`` stores: the mean of the block absmaxes.

    Block absmax commutes with a float cast (rounding is monotone), so only the scales are cast.

    Args:
        tensor (torch.Tensor): the whole dense tensor, any float dtype.
        dtype (torch.dtype): the dtype it is quantized in.
        block_size (int): NF4 block size.

    Returns:
        torch.Tensor: a 0-dim tensor of ``dtype``.
    """
    blocks = _padded_flat(tensor, block_size).view(-1, block_size)
    rows = max(1, _CPU_CHUNK_NUMEL // block_size)
    absmax = torch.cat([blocks[i : i + rows].abs().amax(dim=1) for i in range(0, blocks.size(0), rows)])
    return absmax.to(dtype).mean()


def nf4_from_inner(
    template: NF4Tensor,
    shape: Sequence[int],
    *,
    quantized_scalers: torch.Tensor,
    quantization_factor: torch.Tensor,
    scaler_mean: torch.Tensor,
    quantized_data: torch.Tensor,
    nf4: torch.Tensor,
) -> NF4Tensor:
    """A contiguous NF4Tensor of ``shape`` with ``template``'s dtype and block sizes and the given inner tensors
    (e.g. shards gathered from several ranks).

    Args:
        template (NF4Tensor): supplies dtype and block sizes (may be on the meta device).
        shape (Sequence[int]): the 2-D shape of the result.
        quantized_scalers (torch.Tensor): int8 double-quantized block scales.
        quantization_factor (torch.Tensor): per scaler block factors.
        scaler_mean (torch.Tensor): the mean block scale.
        quantized_data (torch.Tensor): uint8, two codes per byte.
        nf4 (torch.Tensor): the 16 NF4 levels.

    Returns:
        NF4Tensor: on ``quantized_data``'s device.
    """
    return NF4Tensor(
        _tensor_meta(shape, template.dtype, quantized_data.device),
        template.block_size,
        nf4_n_blocks(shape, template.block_size),
        template.scaler_block_size,
        quantized_scalers,
        quantization_factor,
        scaler_mean,
        quantized_data,
        nf4,
    )


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
    n_blocks = nf4_n_blocks(shape, block_size)

    def meta(size, inner_dtype):
        return torch.empty(size, dtype=inner_dtype, device="meta")

    return NF4Tensor(
        _tensor_meta(shape, dtype, torch.device("meta")),
        block_size,
        n_blocks,
        scaler_block_size,
        meta((n_blocks,), torch.int8),  # quantized_scalers
        meta((n_blocks // scaler_block_size,), dtype),  # quantization_factor
        meta((), dtype),  # scaler_mean
        meta((n_blocks * block_size // 2,), torch.uint8),  # quantized_data: two codes per byte
        meta((16,), dtype),  # nf4 table
    )


def _quad_lut(nf4_values: torch.Tensor) -> torch.Tensor:
    """The decoding table of ``nf4_values``' dtype and device, cached (every NF4Tensor carries torchao's same 16
    levels, see ``_NF4_LEVELS``; ``torchtune_ext.memory`` reads this function and ``_QUAD_LUTS`` by name).

    On CPU a 256-row table: row ``b`` holds the two NF4 values packed in byte ``b`` (2 KiB in fp32, so it stays in
    the L1 cache between the gathers, where the 1 MiB four-code table is evicted by every matmul: BENCHMARKS.md,
    "Peers"). Elsewhere a 65536-row table: row ``v`` holds the four values packed in the uint16 ``v`` (two bytes),
    one gather per four codes. Each row is one wide element (:data:`_PAIR_DTYPES`, :data:`_WIDE_DTYPES`), so
    decoding is a 1-D gather.
    """
    key = (nf4_values.dtype, nf4_values.device)
    lut = _QUAD_LUTS.get(key)
    if lut is None:
        if nf4_values.device.type == "cpu":
            codes = torch.arange(256, dtype=torch.int32, device=nf4_values.device)
            nibbles = torch.stack([codes >> 4, codes & 0xF], dim=-1)  # each byte packs (hi, lo) nibbles
            wide = _PAIR_DTYPES[nf4_values.dtype.itemsize]
        else:
            codes = torch.arange(65536, dtype=torch.int32, device=nf4_values.device)
            # Little-endian: the uint16 view puts byte 0 in the low bits.
            low_byte, high_byte = codes & 0xFF, codes >> 8
            nibbles = torch.stack([low_byte >> 4, low_byte & 0xF, high_byte >> 4, high_byte & 0xF], dim=-1)
            wide = _WIDE_DTYPES[nf4_values.dtype.itemsize]
        lut = nf4_values[nibbles.long()].view(wide)
        lut = lut.view(-1) if lut.shape[-1] == 1 else lut
        _QUAD_LUTS[key] = lut
    return lut


def cache_nf4_decoding_tables(model: nn.Module, device: torch.device) -> None:
    """Makes now the decoding tables that decoding ``model``'s NF4 weights on ``device`` reads (one per dtype,
    cached), so that no forward has to make one.

    torch.compile needs this: dynamo reads a cached table as a graph input, but cannot trace its making inside the NF4
    linear's autograd.Function once that is a subgraph, i.e. when the first compiled layer's input requires grad
    (trainable embedding rows): "An intermediate tensor ... created inside a higher-order op subgraph ...". Call it
    after the weights are loaded, before the first compiled forward.

    Args:
        model (nn.Module): the model; its NF4 weights may be FSDP2 shards (their dtype is what counts).
        device (torch.device): where the forward decodes (the training device, also under FSDP CPU offload).
    """
    locals_ = (p._local_tensor if isinstance(p, DTensor) else p for p in model.parameters())
    dtypes = {local.dtype for local in locals_ if isinstance(local, NF4Tensor)}
    for dtype in dtypes:
        _quad_lut(torch.tensor(_NF4_LEVELS, dtype=dtype, device=device))


def dequantize_nf4_scalers(weight: NF4Tensor) -> torch.Tensor:
    """The block scales of ``weight``, flat, in its dtype: torchao's ``NF4Tensor.dequantize_scalers``, op for op
    (same dtypes, same rounding).

    Args:
        weight (NF4Tensor): the quantized weight.

    Returns:
        torch.Tensor: one scale per block of ``weight.block_size`` values.
    """
    quantized = weight.quantized_scalers.view(-1, weight.scaler_block_size)
    scalers = (quantized / weight.quantization_factor.unsqueeze(-1)).flatten().to(weight.dtype)
    return scalers + weight.scaler_mean


def dequantize_nf4(weight: NF4Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Dequantizes an NF4Tensor; equal bit for bit to torchao's ``get_original_weight().to(dtype)``.

    Every value is computed as torchao computes it, ``nf4_table[code] * block_scale`` in the NF4Tensor's own
    dtype, then cast to ``dtype``, so the results are identical. Only the decoding is faster: a lookup table turns
    each packed byte (two codes; on accelerators each pair of bytes, four codes) into its values with one gather, and
    on CPU the work runs in chunks written straight into the output (no full-size temporaries).

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
    if weight.quantized_data.numel() * 2 != weight.numel():
        # The last block is padded: decode whole blocks, then drop the padding (n_blocks is not trusted: FSDP's
        # all-gather keeps a shard's).
        padded = torch.empty(
            weight.quantized_data.numel() * 2 // weight.block_size,
            weight.block_size,
            dtype=out_dtype,
            device=weight.device,
        )
        _dequantize_into(weight, padded)
        return padded.view(-1)[: weight.numel()].view(weight.shape).clone()
    if weight.device.type == "cpu":
        out = empty_with_huge_pages(weight.shape, out_dtype)
    else:
        out = torch.empty(weight.shape, dtype=out_dtype, device=weight.device)
    _dequantize_into(weight, out.view(-1, weight.block_size))
    return out


def _dequantize_into(weight: NF4Tensor, out_blocks: torch.Tensor) -> None:
    """Writes ``dequantize_nf4(weight)`` into ``out_blocks`` of shape ``(n_blocks, block_size)``."""
    scalers = dequantize_nf4_scalers(weight)
    # Whole (padded) blocks and a block_size divisible by 4, so the packed bytes always pair up.
    packed = weight.quantized_data.view(torch.uint16)
    n_blocks, block_size = out_blocks.shape
    quads = block_size // 4
    chunk = n_blocks if weight.device.type != "cpu" else max(1, _CPU_CHUNK_NUMEL // block_size)
    for start in range(0, n_blocks, chunk):
        stop = min(start + chunk, n_blocks)
        decode_nf4_(weight, packed[start * quads : stop * quads], scalers[start:stop], out_blocks[start:stop])


def decode_whole_nf4(weight: NF4Tensor, scalers: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``dequantize_nf4(weight, dtype)`` of a contiguous CPU weight of whole blocks, its block scales given: the same
    values in the fewest calls (a few decoded tokens' weights).

    Args:
        weight (NF4Tensor): the weight (CPU, contiguous, ``numel`` a multiple of its ``block_size``).
        scalers (torch.Tensor): its dequantized block scales, ``(n_blocks, 1)`` (``dequantize_nf4_scalers``).
        dtype (Optional[torch.dtype]): output dtype; None keeps the weight's.

    Returns:
        torch.Tensor: the dense weight, ``weight.shape``, in ``dtype``.
    """
    out = torch.empty(weight.shape, dtype=dtype or weight.dtype, device=weight.device)
    decode_nf4_(weight, weight.quantized_data.view(torch.uint16), scalers.view(-1), out)
    return out


def decode_nf4_(weight: NF4Tensor, packed: torch.Tensor, scalers: torch.Tensor, out: torch.Tensor) -> None:
    """Dequantizes a block-aligned piece of ``weight`` into ``out``: its values in ``weight.dtype``, converted to
    ``out``'s dtype as ``.to`` would (on x86-64 CPUs in one pass, :mod:`torchtune_ext.nf4._cpu_kernels`).

    Args:
        weight (NF4Tensor): the weight the piece belongs to (for its NF4 table and block size).
        packed (torch.Tensor): the piece's packed codes as uint16 (four codes each), 1-D or 2-D, unit stride in the
            last dim.
        scalers (torch.Tensor): its block scales, shaped like ``packed`` with ``block_size // 4`` times fewer
            elements in the last dim.
        out (torch.Tensor): ``packed.numel() * 4`` values (contiguous, any float dtype), written in ``packed``'s
            logical order.
    """
    codes = packed.view(torch.uint8)
    rows = out.view(-1) if codes.dim() == 1 else out.view(codes.shape[0], -1)
    if nf4_decode_supports(weight, codes, rows):
        nf4_decode(weight, codes, scalers.float(), rows)
        return
    values = out if out.dtype == weight.dtype else torch.empty(out.shape, dtype=weight.dtype, device=out.device)
    lut = _quad_lut(weight.nf4)
    indices = (codes if weight.nf4.device.type == "cpu" else packed).to(torch.int32).view(-1)
    torch.index_select(lut, 0, indices, out=values.view(-1).view(lut.dtype).view(indices.numel(), *lut.shape[1:]))
    values.view(*scalers.shape, weight.block_size).mul_(scalers.unsqueeze(-1))
    if values is not out:
        out.copy_(values)

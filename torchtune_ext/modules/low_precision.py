"""NF4 linear with an explicit compute dtype.

Why this is a fork: torchao's ``LinearNF4`` (used by torchtune 0.6.1's ``FrozenNF4Linear`` and ``LoRALinear``)
computes in whatever dtype the activation happens to have, ignores the compute dtype the user asked for, and
dequantizes through ``NF4Tensor.get_original_weight``, which is slow (two gathers, int64 indices, a stack).
This module keeps torchao's ``NF4Tensor`` storage layout untouched (so FSDP2, ``to_nf4`` and torchtune's helpers
keep working) and replaces only the compute path:

- ``dequantize_nf4``: values identical to ``get_original_weight`` (same formula, same dtype at every step), but
  through one lookup table that decodes two packed bytes (four NF4 codes) at once.
- ``linear_nf4``: dequantizes to the compute ``dtype``, computes in it, and saves only the NF4 weight for backward.
- ``FrozenNF4Linear``: an ``nn.Linear`` whose weight is a frozen NF4Tensor that never carries autograd history.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from torchtune_ext._compat import NF4Tensor, to_nf4

NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_QUAD_LUTS: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


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
    "Attempted to make a tensor into a differentiable view".

    Args:
        tensor (torch.Tensor): 2-D dense weight; the NF4Tensor keeps its dtype as its dequantization dtype.
        block_size (int): NF4 block size.
        scaler_block_size (int): block size of the scale double quantization.

    Returns:
        NF4Tensor: the quantized weight.
    """
    check_nf4_shape(tuple(tensor.shape), block_size, scaler_block_size)
    with torch.no_grad():
        return to_nf4(tensor.detach().contiguous(), block_size, scaler_block_size)


def _quad_lut(nf4_values: torch.Tensor) -> torch.Tensor:
    """A (65536, 4) table: row ``v`` holds the four NF4 values packed in the int16 ``v`` (two bytes)."""
    key = (nf4_values.dtype, nf4_values.device)
    lut = _QUAD_LUTS.get(key)
    if lut is None:
        codes = torch.arange(65536, dtype=torch.int32, device=nf4_values.device)
        # Little-endian: the int16 view puts byte 0 in the low bits; each byte packs (hi, lo) nibbles.
        low_byte, high_byte = codes & 0xFF, codes >> 8
        nibbles = torch.stack([low_byte >> 4, low_byte & 0xF, high_byte >> 4, high_byte & 0xF], dim=-1)
        lut = nf4_values[nibbles].contiguous()
        _QUAD_LUTS[key] = lut
    return lut


def _dequantize_scalers(weight: NF4Tensor) -> torch.Tensor:
    quantized = weight.quantized_scalers.view(-1, weight.scaler_block_size)
    scalers = (quantized / weight.quantization_factor.unsqueeze(-1)).flatten().to(weight.dtype)
    return scalers + weight.scaler_mean


def dequantize_nf4(weight: NF4Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Dequantizes an NF4Tensor; equal bit for bit to torchao's ``get_original_weight().to(dtype)``.

    Every step runs in the NF4Tensor's own dtype as torchao's does (value = nf4_table[code] * block_scale), so
    the results are identical; only the decoding is faster: a 65536-row table decodes two bytes at once.

    Args:
        weight (NF4Tensor): the quantized weight.
        dtype (Optional[torch.dtype]): output dtype; None keeps the NF4Tensor's dtype.

    Returns:
        torch.Tensor: dense weight of ``weight.shape`` in ``dtype``.
    """
    scalers = _dequantize_scalers(weight)
    # numel is a multiple of 64 * 256, so the packed bytes always pair up into int16s.
    packed_pairs = weight.quantized_data.view(torch.int16).to(torch.int32) & 0xFFFF
    quads = F.embedding(packed_pairs, _quad_lut(weight.nf4))
    dense = (quads.view(-1, weight.block_size) * scalers.unsqueeze(-1)).view(weight.shape)
    return dense if dtype is None or dtype == dense.dtype else dense.to(dtype)


def _compute_dtype(input: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        return dtype
    if torch.is_autocast_enabled(input.device.type):
        return torch.get_autocast_dtype(input.device.type)
    return input.dtype


class LinearNF4(torch.autograd.Function):
    """``y = x @ dequant(W).T`` in an explicit compute dtype, saving only the NF4 weight for backward.

    The weight is frozen, so backward needs no input: ``grad_input = grad_out @ dequant(W)``.
    """

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: NF4Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.compute_dtype = dtype
        return F.linear(input.to(dtype), dequantize_nf4(weight, dtype))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        dtype = ctx.compute_dtype
        return grad_output.to(dtype) @ dequantize_nf4(weight, dtype), None, None


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
        self.weight = nn.Parameter(
            to_nf4_frozen(self.weight, block_size, scaler_block_size), requires_grad=False
        )
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

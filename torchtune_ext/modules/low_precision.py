"""NF4 linear layers with an explicit compute dtype.

Why this is a fork: torchao's ``LinearNF4`` (used by torchtune 0.6.1's ``FrozenNF4Linear`` and ``LoRALinear``)
computes in whatever dtype the activation happens to have, ignores the compute dtype the user asked for, and
dequantizes through ``NF4Tensor.get_original_weight``, which is slow (two gathers, int64 indices, a stack). Here:

- ``linear_nf4``: dequantizes to the compute ``dtype`` (:func:`torchtune_ext.nf4.dequantize_nf4`, exact and
  faster), computes in it, and saves only the NF4 weight for backward; on CPU it dequantizes slab by slab into a
  reused buffer, so the dense weight never exists whole.
- ``FrozenNF4Linear``: an ``nn.Linear`` whose weight is a frozen NF4Tensor.
- ``FrozenLinear`` / ``FrozenEmbedding`` / ``FrozenTiedLinear``: the frozen weights that are not NF4 (the token
  embedding, an untied output projection) stored in the checkpoint's 16-bit dtype while computing in fp32 (a T4 has
  no bf16 compute but stores bf16 fine), upcast per use a block at a time: an fp32 run holds them at bf16's memory.
- :func:`dense_state_dict_post_hook`: the state-dict hook of our QLoRA models (torchtune's contract: ``state_dict()``
  returns dense weights in the compute dtype, on the CPU).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from torchtune.modules import TiedLinear

from torchtune_ext.modules._cpu_gemm import mm_t, use_onednn
from torchtune_ext.nf4 import (
    NF4_BLOCK_SIZE,
    NF4Tensor,
    check_float_dtype,
    check_nf4_shape,
    decode_nf4_,
    decode_whole_nf4,
    dense16_mv,
    dense16_mv_supports,
    dequantize_nf4,
    dequantize_nf4_scalers,
    nf4_mv,
    nf4_mv_supports,
    quantize_nf4,
)

# CPU linear_nf4 dequantizes slabs of about this many weights (at least _MIN_SLAB_DIM rows/columns) per matmul
# (4 MiB of fp32: bench/peers.py measured 4x more per slab slower, its fresh pages faulted in per call).
_CPU_SLAB_NUMEL = 1 << 20
# At most this many tokens (decoding) go through slabs whatever the weight's size: a fresh whole dense weight per
# token costs more than its decoding.
_SMALL_BATCH_TOKENS = 16
_MIN_SLAB_DIM = 256
# The dequantized block scales kept by ``cached_nf4_scales`` (None outside it).
_SCALES_CACHE: Optional[WeakIdKeyDictionary] = None


def _slab_plan(weight: NF4Tensor) -> Optional[Tuple[int, int]]:
    """Rows per forward slab and columns per backward slab for the slab-wise CPU path, or None to use the whole
    dequantized weight (accelerators, where the caching allocator makes it cheap; small or unaligned weights)."""
    out_dim, in_dim = weight.shape
    if torch.compiler.is_compiling():  # dynamo cannot write a product into a slab's strided out=
        return None
    if weight.device.type != "cpu" or not weight.is_contiguous() or in_dim % weight.block_size != 0:
        return None
    if weight.numel() < 2 * _CPU_SLAB_NUMEL:
        return None
    rows = max(_MIN_SLAB_DIM, _CPU_SLAB_NUMEL // in_dim)
    cols = max(_MIN_SLAB_DIM, _CPU_SLAB_NUMEL // out_dim) // weight.block_size * weight.block_size
    return rows, cols


def _small_batch_rows(weight: NF4Tensor, tokens: int) -> Optional[int]:
    """Rows per forward slab for ``tokens`` tokens through a CPU weight too small for :func:`_slab_plan` (decoding),
    or None for the whole dequantized weight."""
    out_dim, in_dim = weight.shape
    if torch.compiler.is_compiling():  # as in _slab_plan
        return None
    if tokens > _SMALL_BATCH_TOKENS or weight.device.type != "cpu" or not weight.is_contiguous():
        return None
    return min(out_dim, max(1, _CPU_SLAB_NUMEL // in_dim)) if in_dim % weight.block_size == 0 else None


@contextmanager
def cached_nf4_scales() -> Iterator[None]:
    """Within: CPU decoding (no more than 16 tokens through a weight decoded in one slab, or the NF4 kernel's few
    tokens, e.g. generating) dequantizes each NF4 weight's block scales once and keeps them until the context ends, in
    the weight's dtype and/or fp32 (the kernel's): at most 6 bytes per block of 64 weights (under a fifth of the NF4
    weights' own bytes) for fewer torch calls per decoded token (BENCHMARKS.md, "Peers").
    Nested contexts share the outermost one's scales.
    """
    global _SCALES_CACHE
    outer = _SCALES_CACHE
    _SCALES_CACHE = WeakIdKeyDictionary() if outer is None else outer
    try:
        yield
    finally:
        _SCALES_CACHE = outer


def _block_scales(weight: NF4Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``weight``'s dequantized block scales as ``(n_blocks, 1)`` in ``dtype`` (None: the weight's), kept within
    :func:`cached_nf4_scales`."""
    dtype = dtype or weight.dtype
    cache = _SCALES_CACHE
    kept = {} if cache is None else cache.get(weight, {})
    scales = kept.get(dtype)
    if scales is None:
        scales = kept[dtype] = dequantize_nf4_scalers(weight).unsqueeze(-1).to(dtype)
        if cache is not None:
            cache[weight] = kept
    return scales


def _linear_slabs(x: torch.Tensor, weight: NF4Tensor, rows: int) -> torch.Tensor:
    """``x @ dequant(W).T`` in ``x.dtype``, a slab of ``rows`` rows of W at a time (never the whole dense W)."""
    out_dim, in_dim = weight.shape
    if rows >= out_dim:  # one slab (a decoded token's small weights): the fewest torch calls
        return mm_t(x, decode_whole_nf4(weight, _block_scales(weight), x.dtype))
    scalers = dequantize_nf4_scalers(weight).view(out_dim, in_dim // weight.block_size)
    packed = weight.quantized_data.view(torch.uint16).view(out_dim, in_dim // 4)
    slab = torch.empty(rows, in_dim, dtype=x.dtype, device=weight.device)
    out = torch.empty(x.shape[0], out_dim, dtype=x.dtype, device=x.device)
    for start in range(0, out_dim, rows):
        stop = min(start + rows, out_dim)
        decode_nf4_(weight, packed[start:stop], scalers[start:stop], slab[: stop - start])
        mm_t(x, slab[: stop - start], out=out[:, start:stop])
    return out


def _grad_input_slabs(grad: torch.Tensor, weight: NF4Tensor, cols: int) -> torch.Tensor:
    """``grad @ dequant(W)`` in ``grad.dtype``, a slab of ``cols`` columns of W at a time."""
    out_dim, in_dim = weight.shape
    block_size = weight.block_size
    scalers = dequantize_nf4_scalers(weight).view(out_dim, in_dim // block_size)
    packed = weight.quantized_data.view(torch.uint16).view(out_dim, in_dim // 4)
    grad_input = torch.empty(grad.shape[0], in_dim, dtype=grad.dtype, device=grad.device)
    slab = torch.empty(out_dim * cols, dtype=grad.dtype, device=weight.device)
    for start in range(0, in_dim, cols):
        stop = min(start + cols, in_dim)
        piece = slab[: out_dim * (stop - start)].view(out_dim, stop - start)
        blocks = slice(start // block_size, stop // block_size)
        decode_nf4_(weight, packed[:, start // 4 : stop // 4], scalers[:, blocks], piece)
        mm_t(grad, piece.t(), out=grad_input[:, start:stop])
    return grad_input


def _compute_dtype(input: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        return dtype
    if torch.is_autocast_enabled(input.device.type):
        return torch.get_autocast_dtype(input.device.type)
    return input.dtype


def _linear_nf4_forward(input: torch.Tensor, weight: NF4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``input @ dequant(weight).T`` in ``dtype``: a few tokens on CPU through the NF4 kernel where it applies, else
    slab by slab on CPU (see :class:`LinearNF4`)."""
    if nf4_mv_supports(input, weight, dtype):
        return nf4_mv(input, weight, _block_scales(weight, torch.float32), dtype)
    x = input.to(dtype).reshape(-1, weight.shape[1])
    plan = _slab_plan(weight)
    rows = plan[0] if plan is not None else _small_batch_rows(weight, x.shape[0])
    out = mm_t(x, dequantize_nf4(weight, dtype)) if rows is None else _linear_slabs(x, weight, rows)
    return out.view(*input.shape[:-1], weight.shape[0])


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
        return _linear_nf4_forward(input, weight, dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        dtype = ctx.compute_dtype
        plan = _slab_plan(weight)
        grad = grad_output.to(dtype).reshape(-1, weight.shape[0])
        if plan is None:
            grad_input = mm_t(grad, dequantize_nf4(weight, dtype).t())
        else:
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
        >>> w = quantize_nf4(torch.randn(512, 256))
        >>> y = linear_nf4(torch.randn(4, 256, dtype=torch.bfloat16), w, dtype=torch.float32)
        >>> y.dtype
        torch.float32
    """
    check_float_dtype(dtype)
    compute_dtype = _compute_dtype(input, dtype)
    if not torch.is_grad_enabled() and not torch.is_autocast_enabled(input.device.type):
        # inference: no graph to record (the autograd.Function's bookkeeping costs a decoded token's small linears
        # more than their matmuls)
        return _linear_nf4_forward(input, weight, compute_dtype)
    with torch.autocast(input.device.type, enabled=False):
        return LinearNF4.apply(input, weight, compute_dtype)


# CPU and accelerators: a frozen dense weight is upcast this many values at a time (4 MiB of fp32), never whole:
# bench/peers.py measured 64 MiB blocks 10x slower when decoding (one token through a 49152-row output).
_FROZEN_BLOCK_NUMEL = 1 << 20


class FrozenLinearFunction(torch.autograd.Function):
    """``y = x @ W.T`` in ``dtype`` for a frozen dense ``W`` stored in another dtype (e.g. a bf16 output projection
    of an fp32 run), saving only ``W`` (not an upcast copy) for backward and upcasting a block of rows at a time, so
    no full-size copy of ``W`` ever exists (a 128k-vocabulary output weight is 2 GiB in fp32)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.compute_dtype = dtype
        out_dim, in_dim = weight.shape
        out = mm_weight_t(input.to(dtype).reshape(-1, in_dim), weight, dtype)
        return out.view(*input.shape[:-1], out_dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        out_dim, in_dim = weight.shape
        grad_input = mm_weight(grad_output.to(ctx.compute_dtype).reshape(-1, out_dim), weight, ctx.compute_dtype)
        return grad_input.view(*grad_output.shape[:-1], in_dim), None, None


def _row_blocks(weight: torch.Tensor) -> List[Tuple[int, int]]:
    rows = max(1, _FROZEN_BLOCK_NUMEL // weight.shape[1])
    return [(start, min(start + rows, weight.shape[0])) for start in range(0, weight.shape[0], rows)]


def mm_weight_t(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None):
    """``x @ weight.T`` in ``dtype`` (``x`` already in it) for a weight stored in any dtype, upcast a block of rows
    at a time (never a full-size copy); a weight already in ``dtype`` is one product (:func:`mm_t`).

    Args:
        x (torch.Tensor): ``(n, in_dim)`` in ``dtype``.
        weight (torch.Tensor): ``(out_dim, in_dim)``.
        dtype (torch.dtype): compute dtype.
        out (Optional[torch.Tensor]): ``(n, out_dim)`` to write into.

    Returns:
        torch.Tensor: ``(n, out_dim)``.
    """
    if weight.dtype == dtype:
        return mm_t(x, weight, out=out)
    if dtype == torch.float32 and dense16_mv_supports(x, weight):  # a few tokens on CPU: read as stored
        return dense16_mv(x, weight) if out is None else out.copy_(dense16_mv(x, weight))
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=dtype, device=x.device)
    for start, stop in _row_blocks(weight):
        mm_t(x, weight[start:stop].to(dtype), out=out[:, start:stop])
    return out


def mm_weight(grad: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None):
    """``grad @ weight`` in ``dtype`` (``grad`` already in it), the weight upcast a block of rows at a time.

    Args:
        grad (torch.Tensor): ``(n, out_dim)`` in ``dtype``.
        weight (torch.Tensor): ``(out_dim, in_dim)``.
        dtype (torch.dtype): compute dtype.
        out (Optional[torch.Tensor]): ``(n, in_dim)`` to write into.

    Returns:
        torch.Tensor: ``(n, in_dim)``.
    """
    if weight.dtype == dtype:
        return mm_t(grad, weight.t(), out=out)
    if out is None:
        out = torch.zeros(grad.shape[0], weight.shape[1], dtype=dtype, device=grad.device)
    else:
        out.zero_()
    for start, stop in _row_blocks(weight):
        block = weight[start:stop].to(dtype)
        if use_onednn(grad, block):  # no out= there: a block's product, then added
            out.add_(mm_t(grad[:, start:stop], block.t()))
        else:
            out.addmm_(grad[:, start:stop], block)
    return out


def frozen_linear(input: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer with a frozen dense weight, computed in ``dtype`` whatever the weight's storage dtype.

    Args:
        input (torch.Tensor): ``(..., in_dim)``, any float dtype.
        weight (torch.Tensor): ``(out_dim, in_dim)``, frozen; stored in any float dtype.
        dtype (torch.dtype): compute and output dtype.

    Returns:
        torch.Tensor: ``(..., out_dim)`` in ``dtype``; equal to ``F.linear(input.to(dtype), weight.to(dtype))``.
    """
    if weight.dtype == dtype:
        return F.linear(input.to(dtype), weight)
    return FrozenLinearFunction.apply(input, weight, dtype)


class FrozenLinear(nn.Linear):
    """``nn.Linear`` with a frozen weight stored in ``storage_dtype`` (e.g. the checkpoint's bf16) that computes in
    ``dtype`` (e.g. fp32 on a T4), upcasting per use: the fp32 run's frozen untied output projection at the
    memory of bf16, and the same values (a bf16 weight upcast to fp32 is exact).

    Args:
        in_dim (int): input dimension.
        out_dim (int): output dimension.
        dtype (torch.dtype): compute (and output) dtype.
        storage_dtype (torch.dtype): dtype the weight is stored in.
        device (Optional[torch.device]): device ("meta" builds without memory).
    """

    def __init__(self, in_dim: int, out_dim: int, dtype: torch.dtype, storage_dtype: torch.dtype, device=None) -> None:
        check_float_dtype(dtype)
        check_float_dtype(storage_dtype, "storage_dtype")
        super().__init__(in_dim, out_dim, bias=False, device=device, dtype=storage_dtype)
        self.weight.requires_grad_(False)
        self.compute_dtype = dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input (torch.Tensor): ``(..., in_dim)``.

        Returns:
            torch.Tensor: ``(..., out_dim)`` in the compute dtype.
        """
        return frozen_linear(input, self.weight, self.compute_dtype)


class FrozenEmbedding(nn.Embedding):
    """``nn.Embedding`` with a frozen table stored in ``storage_dtype`` whose rows come out in ``dtype`` (a lookup,
    so the upcast is of the looked-up rows only).

    Args:
        num_embeddings (int): vocabulary size.
        embedding_dim (int): embedding dimension.
        dtype (torch.dtype): output (compute) dtype.
        storage_dtype (torch.dtype): dtype the table is stored in.
        device (Optional[torch.device]): device ("meta" builds without memory).
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, storage_dtype: torch.dtype, device=None
    ) -> None:
        check_float_dtype(dtype)
        check_float_dtype(storage_dtype, "storage_dtype")
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=storage_dtype)
        self.weight.requires_grad_(False)
        self.compute_dtype = dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input (torch.Tensor): token ids.

        Returns:
            torch.Tensor: their embeddings in the compute dtype.
        """
        return super().forward(input).to(self.compute_dtype)


class FrozenTiedLinear(TiedLinear):
    """torchtune's ``TiedLinear`` (the output projection tied to the token embedding) computing in ``dtype`` whatever
    the shared table's storage dtype (see :class:`FrozenEmbedding`).

    Args:
        tied_module (nn.Module): the module whose ``weight`` is shared (the token embedding).
        dtype (torch.dtype): compute (and output) dtype.
    """

    def __init__(self, tied_module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(tied_module)
        self.compute_dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): ``(..., embed_dim)``.

        Returns:
            torch.Tensor: ``(..., vocab_size)`` in the compute dtype.
        """
        return frozen_linear(x, self.tied_module.weight, self.compute_dtype)


def _quantize_incoming_weight(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: quantize a dense incoming weight in the module's own dtype.

    torchao's ``NF4Tensor.copy_`` quantizes in the *source* dtype (e.g. bf16 from an HF checkpoint) even when
    the module computes in fp32; casting first makes the loaded weight equal to ``to_nf4(w.to(dtype))``.
    """
    key = prefix + "weight"
    incoming = state_dict.get(key)
    if isinstance(module.weight, NF4Tensor) and incoming is not None and not isinstance(incoming, NF4Tensor):
        state_dict[key] = quantize_nf4(
            incoming.to(device=module.weight.device, dtype=module.weight.dtype),
            module.weight.block_size,
            module.weight.scaler_block_size,
        )


def dense_state_dict_post_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """State-dict hook of our QLoRA models: torchtune's contract (its ``reparametrize_as_dtype_state_dict_post_hook``
    on ``lora_*(quantize_base=True)`` models): ``model.state_dict()`` holds dense weights, each in its NF4Tensor's own
    dtype (the compute dtype; torchtune's hook always gives bf16), on the CPU, so that ``get_merged_lora_ckpt`` and
    loading into a dense torchtune model work. ``state_dict(keep_vars=True)`` gives the live parameters (NF4Tensors),
    as PyTorch promises and as the state-dict tooling (``torchtune_ext.distributed``) needs; so does
    ``get_full_state_dict(model, keep_nf4=True)``.

    Args:
        module (nn.Module): the model.
        state_dict (Dict[str, Any]): its state dict, modified in place.
        prefix (str): the module's key prefix.
        *args (Any): the hook's other arguments (unused).
    """
    for key, value in state_dict.items():
        if isinstance(value, NF4Tensor) and not isinstance(value, nn.Parameter):
            dense = dequantize_nf4(value)
            state_dict[key] = dense if dense.is_meta else dense.cpu()


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
        scaler_block_size (Optional[int]): block size of the scale double quantization. None (default): per
            shape, :func:`torchtune_ext.nf4.nf4_scaler_block_size` (torchao's 256 wherever it splits over 8 ranks).

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
        scaler_block_size: Optional[int] = None,
    ):
        check_float_dtype(dtype)
        check_nf4_shape((out_dim, in_dim), block_size, scaler_block_size)
        super().__init__(in_dim, out_dim, bias=bias, device=device, dtype=dtype)
        self.compute_dtype = self.weight.dtype
        self.weight = nn.Parameter(quantize_nf4(self.weight, block_size, scaler_block_size), requires_grad=False)
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

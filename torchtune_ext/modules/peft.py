"""LoRA and DoRA linears with an NF4 base in an explicit compute dtype.

Why this is a fork of torchtune's ``LoRALinear``/``DoRALinear``: torchtune's versions compute the NF4 base in the
activation's dtype through torchao's ``linear_nf4`` and keep the adapters in that same dtype, so fp32 master
adapters under fp16 compute are impossible. Parameter names, ``adapter_params()``, ``to_empty`` (adapters only)
and initialisation are torchtune's, so ``get_adapter_params``, ``set_trainable_params``, ``get_adapter_state_dict``,
``get_merged_lora_ckpt`` and ``validate_missing_and_unexpected_for_lora`` work on these unchanged (torchtune's own
tests for these layers run on ours: tests/torchtune_ext/upstream/).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune.modules.peft import AdapterModule

from torchtune_ext.modules._cpu_gemm import linear, mm_t
from torchtune_ext.modules.low_precision import _quantize_incoming_weight, linear_nf4
from torchtune_ext.nf4 import check_float_dtype, check_nf4_shape, dequantize_nf4, dequantize_shard_rows, quantize_nf4


@torch.no_grad()
def init_lora_weights_(lora_a: torch.Tensor, lora_b: torch.Tensor, generator: Optional[torch.Generator] = None) -> None:
    """torchtune's (and Microsoft LoRA's) initialisation: Kaiming-uniform ``A`` (``a=sqrt(5)``, i.e.
    U(-1/sqrt(in_dim), 1/sqrt(in_dim))), zero ``B``, so the layer starts equal to its base.

    Args:
        lora_a (torch.Tensor): ``(rank, in_dim)``, drawn from ``generator`` (None: the global RNG).
        lora_b (torch.Tensor): ``(out_dim, rank)``, zeroed.
        generator (Optional[torch.Generator]): RNG for ``A``.
    """
    nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
    nn.init.zeros_(lora_b)


class _LoRAProduct(torch.autograd.Function):
    """``scaling * (x @ A.T) @ B.T`` with its backward, every product through :func:`mm_t` (oneDNN for CPU fp32
    batches): the values of ``scaling * F.linear(F.linear(x, A), B)`` (the same roundings, another summation order
    on CPU), saving what autograd saves (``x`` and ``x @ A.T``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        hidden = mm_t(flat, lora_a)
        ctx.save_for_backward(flat, hidden, lora_a, lora_b)
        ctx.scaling = scaling
        ctx.input_shape = x.shape
        return mm_t(hidden, lora_b).mul_(scaling).view(*x.shape[:-1], lora_b.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        flat, hidden, lora_a, lora_b = ctx.saved_tensors
        grad = grad.reshape(-1, lora_b.shape[0]) * ctx.scaling
        grad_hidden = mm_t(grad, lora_b.t())
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = mm_t(grad_hidden, lora_a.t()).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_a = mm_t(grad_hidden.t(), flat.t())
        if ctx.needs_input_grad[2]:
            grad_b = mm_t(grad.t(), hidden.t())
        return grad_x, grad_a, grad_b, None


class LoRALinear(nn.Module, AdapterModule):
    """LoRA linear: ``y = W0 x + (alpha / rank) * B A dropout(x)``, with an optional NF4-quantized ``W0``.

    Args:
        in_dim (int): input dimension.
        out_dim (int): output dimension.
        rank (int): rank of the low-rank update.
        alpha (float): scaling numerator; the update is scaled by ``alpha / rank``.
        dropout (float): dropout on the adapter input. Default: 0.0.
        use_bias (bool): whether the base linear has a bias. Default: False.
        quantize_base (bool): store the base weight as a frozen NF4Tensor. Default: False.
        dtype (Optional[torch.dtype]): compute dtype, and the dtype of the base weight and bias. None: the
            input's dtype at call time (base params in torch's default dtype).
        adapter_dtype (Optional[torch.dtype]): dtype of the adapter params (e.g. fp32 master adapters while
            computing in fp16). None: ``dtype``.
        **quantization_kwargs: ``block_size`` / ``scaler_block_size`` for NF4 (only with ``quantize_base``).

    Raises:
        ValueError: on quantization kwargs without ``quantize_base``, a non-float dtype, or a base weight shape
            that cannot be NF4-quantized.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_bias: bool = False,
        quantize_base: bool = False,
        dtype: Optional[torch.dtype] = None,
        adapter_dtype: Optional[torch.dtype] = None,
        **quantization_kwargs,
    ):
        super().__init__()
        check_float_dtype(dtype)
        check_float_dtype(adapter_dtype, "adapter_dtype")
        if not quantize_base and any(quantization_kwargs.values()):
            raise ValueError(
                "``quantize_base`` is False, but received the following quantization arguments: "
                f"{quantization_kwargs}; pass quantize_base=True or drop them."
            )
        if quantize_base:
            check_nf4_shape((out_dim, in_dim), **quantization_kwargs)
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.use_bias = use_bias
        self.compute_dtype = dtype
        self._quantize_base = quantize_base
        self.disabled = False
        self.merged = False

        base = nn.Linear(in_dim, out_dim, bias=use_bias, dtype=dtype)
        weight = quantize_nf4(base.weight, **quantization_kwargs) if quantize_base else base.weight
        self.weight = nn.Parameter(weight, requires_grad=not quantize_base)
        self.bias = base.bias
        self.dropout = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        adapter_dtype = adapter_dtype or dtype
        self.lora_a = nn.Linear(in_dim, rank, bias=False, dtype=adapter_dtype)
        self.lora_b = nn.Linear(rank, out_dim, bias=False, dtype=adapter_dtype)
        self.initialize_parameters()
        if quantize_base:
            self.register_load_state_dict_pre_hook(_quantize_incoming_weight)

    def initialize_parameters(self) -> None:
        """Kaiming-uniform ``lora_a``, zero ``lora_b`` (torchtune's init, :func:`init_lora_weights_`)."""
        init_lora_weights_(self.lora_a.weight, self.lora_b.weight)

    def to_empty(self, *, device: Optional[Union[str, torch.device, int]], recurse: bool = True) -> LoRALinear:
        """Moves only the adapter params off the meta device (torchtune's contract): the base weight and bias stay
        where they are, so a base weight that no checkpoint filled is still on meta and is caught.

        Args:
            device (Optional[Union[str, torch.device, int]]): the target device.
            recurse (bool): passed to the adapter linears.

        Returns:
            LoRALinear: self.
        """
        self.lora_a.to_empty(device=device, recurse=recurse)
        self.lora_b.to_empty(device=device, recurse=recurse)
        return self

    def adapter_params(self) -> List[str]:
        """
        Returns:
            List[str]: names of the adapter params: ``lora_a.weight`` and ``lora_b.weight``.
        """
        return ["lora_a.weight", "lora_b.weight"]

    def _dtype_for(self, x: torch.Tensor) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def _base_forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._quantize_base:
            out = linear_nf4(x, self.weight, dtype)
        else:
            out = linear(x.to(dtype), self.weight.to(dtype))
        return out if self.bias is None else out + self.bias.to(dtype)

    def _lora_forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``B A dropout(x)`` in ``dtype``, unscaled."""
        hidden = F.linear(self.dropout(x).to(dtype), self.lora_a.weight.to(dtype))
        return F.linear(hidden, self.lora_b.weight.to(dtype))

    def _scaled_lora(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``scaling * B A dropout(x)`` in ``dtype``: under autograd through :class:`_LoRAProduct` (CPU fp32
        products through oneDNN, one graph node instead of five)."""
        lora_a, lora_b = self.lora_a.weight.to(dtype), self.lora_b.weight.to(dtype)
        x = self.dropout(x).to(dtype)
        if torch.is_grad_enabled() and (x.requires_grad or lora_a.requires_grad or lora_b.requires_grad):
            return _LoRAProduct.apply(x, lora_a, lora_b, self.scaling)
        return self.scaling * F.linear(F.linear(x, lora_a), lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): input of shape ``(..., in_dim)``.

        Returns:
            torch.Tensor: output of shape ``(..., out_dim)`` in the compute dtype.
        """
        dtype = self._dtype_for(x)
        out = self._base_forward(x, dtype)
        if self.disabled:
            return out
        return out + self._scaled_lora(x, dtype)


class DoRALinear(LoRALinear):
    """DoRA linear: LoRA whose merged weight's per-output-row norm is replaced by a learned ``magnitude``.

    Same arguments as :class:`LoRALinear`. Call ``initialize_dora_magnitude()`` after the base and adapter
    weights are loaded, so that the layer starts equal to its base.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.magnitude = nn.Parameter(torch.empty(self.out_dim, dtype=self.lora_a.weight.dtype))

    def adapter_params(self) -> List[str]:
        """
        Returns:
            List[str]: ``lora_a.weight``, ``lora_b.weight`` and ``magnitude``.
        """
        return ["lora_a.weight", "lora_b.weight", "magnitude"]

    def _merged_weight_norm(self, dtype: torch.dtype) -> torch.Tensor:
        base = dequantize_nf4(self.weight, dtype) if self._quantize_base else self.weight.to(dtype)
        lora_weight = self.lora_b.weight.to(dtype) @ self.lora_a.weight.to(dtype)
        return torch.linalg.norm(base + self.scaling * lora_weight, dim=1)

    def to_empty(self, *, device: Optional[Union[str, torch.device, int]], recurse: bool = True) -> DoRALinear:
        """Moves the adapter params and the magnitude off the meta device, not the base (torchtune's contract).

        Args:
            device (Optional[Union[str, torch.device, int]]): the target device.
            recurse (bool): passed to the adapter linears.

        Returns:
            DoRALinear: self.
        """
        super().to_empty(device=device, recurse=recurse)
        magnitude = nn.Parameter(
            torch.empty_like(self.magnitude, device=device), requires_grad=self.magnitude.requires_grad
        )
        torch.utils.swap_tensors(self.magnitude, magnitude)
        return self

    @torch.no_grad()
    def initialize_dora_magnitude(self) -> None:
        """Sets ``magnitude`` to the row norms of ``W0 + scaling * B A``; on an FSDP2-sharded layer each rank
        computes its own rows (the base, ``lora_b`` and ``magnitude`` are sharded alike on dim 0; ``lora_a``, sharded
        on its rank dim, is gathered, and so is an NF4 base sharded unevenly, whose shard holds whole scale groups,
        not its rows: a collective, called on every rank).

        Raises:
            RuntimeError: if the base or adapter params are still on the meta device.
        """
        if any(p.is_meta for p in (self.weight, self.lora_a.weight, self.lora_b.weight)):
            raise RuntimeError("Cannot initialize DoRA magnitude while base or LoRA params are on meta device.")
        if not isinstance(self.magnitude, DTensor):
            self.magnitude.copy_(self._merged_weight_norm(self.magnitude.dtype))
            return
        dtype = self.magnitude.dtype
        base = dequantize_shard_rows(self.weight, dtype) if self._quantize_base else self.weight.to_local().to(dtype)
        lora_a = self.lora_a.weight.full_tensor().to(dtype)
        lora_b = self.lora_b.weight.to_local().to(dtype)
        self.magnitude.to_local().copy_(torch.linalg.norm(base + self.scaling * (lora_b @ lora_a), dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): input of shape ``(..., in_dim)``.

        Returns:
            torch.Tensor: output of shape ``(..., out_dim)`` in the compute dtype.
        """
        dtype = self._dtype_for(x)
        base_out = self._base_forward(x, dtype)
        if self.disabled:
            return base_out
        lora_out = self._lora_forward(x, dtype)
        # The norm is detached, as in the DoRA paper (section 4.3) and torchtune.
        weight_norm = self._merged_weight_norm(dtype).detach()
        mag_norm_scale = (self.magnitude.to(dtype) / weight_norm).view(1, -1)
        base_without_bias = base_out if self.bias is None else base_out - self.bias.to(dtype)
        return base_out + (mag_norm_scale - 1) * base_without_bias + mag_norm_scale * lora_out * self.scaling

"""Turn any torchtune ``lora_*`` model builder into a QLoRA builder with an explicit compute dtype.

The smallest fork of torchtune's component builders: torchtune builds the architecture on the meta device
(no memory), then every torchtune LoRA/DoRA linear becomes ours (NF4 base, compute ``dtype``, adapters in
``adapter_dtype``) and every other linear inside the decoder layers becomes a ``FrozenNF4Linear``: the same
modules, names and parameter counts as torchtune's ``quantize_base=True`` models. Materialising allocates NF4
bases at 4 bits and fills them one weight at a time, so the whole model never exists in high precision.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import DoRALinear as TorchtuneDoRALinear
from torchtune.modules.peft import LoRALinear as TorchtuneLoRALinear
from torchtune.training import set_default_dtype

from torchtune_ext._compat import NF4Tensor
from torchtune_ext.modules.low_precision import FrozenNF4Linear, check_float_dtype, dequantize_nf4, to_nf4_frozen
from torchtune_ext.modules.peft import DoRALinear, LoRALinear
from torchtune_ext.modules.transformer import use_contiguous_chunks_

DeviceLike = Union[str, torch.device, None]
# The NF4Tensor inner tensors that FSDP2 shards (torchao's _INNER_TENSOR_NAMES_FOR_SHARDING).
_INNER_TENSORS = ("quantized_scalers", "quantization_factor", "quantized_data")


def _ours_for_lora(module: TorchtuneLoRALinear, dtype: torch.dtype, adapter_dtype: torch.dtype) -> LoRALinear:
    cls = DoRALinear if isinstance(module, TorchtuneDoRALinear) else LoRALinear
    return cls(
        module.in_dim,
        module.out_dim,
        rank=module.lora_a.out_features,
        alpha=module.lora_a.out_features * module.scaling if cls is DoRALinear else module.alpha,
        dropout=module.dropout.p if isinstance(module.dropout, nn.Dropout) else 0.0,
        use_bias=module.use_bias,
        quantize_base=True,
        dtype=dtype,
        adapter_dtype=adapter_dtype,
    )


def _replace_linears(model: TransformerDecoder, dtype: torch.dtype, adapter_dtype: torch.dtype) -> None:
    """Swaps torchtune LoRA/DoRA linears for ours everywhere, and plain linears in the layers for NF4."""
    replacements: List[Tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        if isinstance(parent, (LoRALinear, TorchtuneLoRALinear, TorchtuneDoRALinear)):
            continue
        for name, child in parent.named_children():
            if isinstance(child, (TorchtuneLoRALinear, TorchtuneDoRALinear)):
                replacements.append((parent, name, _ours_for_lora(child, dtype, adapter_dtype)))
    for layer in model.layers:
        for parent in layer.modules():
            if isinstance(parent, (TorchtuneLoRALinear, TorchtuneDoRALinear)):
                continue
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    nf4 = FrozenNF4Linear(child.in_features, child.out_features, child.bias is not None, dtype=dtype)
                    replacements.append((parent, name, nf4))
    for parent, name, module in replacements:
        setattr(parent, name, module)


@torch.no_grad()
def _write_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Writes the full-size value ``full`` into ``param``: a plain tensor, an NF4Tensor, or their DTensor shard.

    An NF4 ``param`` takes ``full`` quantized (as is when ``full`` is already an NF4Tensor). A sharded param
    (FSDP2) keeps its object identity: its local shard is written in place, so the values do not depend on the
    sharding and equal those of the unsharded model built with the same seed.
    """
    local = _local(param)
    if isinstance(local, NF4Tensor) and not isinstance(full, NF4Tensor):
        full = to_nf4_frozen(full.to(local.dtype), local.block_size, local.scaler_block_size)
    shard = _shard(full, param) if isinstance(param, DTensor) else full
    if shard.shape != local.shape:
        raise RuntimeError(f"shard of shape {tuple(shard.shape)} for a local tensor of shape {tuple(local.shape)}")
    if not isinstance(local, NF4Tensor):
        local.copy_(shard)
        return
    for name in _INNER_TENSORS:
        getattr(local, name).copy_(getattr(shard, name))
    # Not sharded, so ``to_empty`` left them on the meta device: rebind instead of copying.
    local.scaler_mean = shard.scaler_mean
    local.nf4 = shard.nf4


def _local(param: torch.Tensor) -> torch.Tensor:
    # Not ``to_local()``: for an NF4 shard that returns a new wrapper (NF4Tensor's view_as), and the NF4 metadata
    # rebound in ``_write_`` must land on the object FSDP2 all-gathers from.
    return param._local_tensor if isinstance(param, DTensor) else param


def _shard(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` under ``param``'s placements, chunked as FSDP2 chunks (``torch.chunk``)."""
    mesh = param.device_mesh
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunks = list(torch.chunk(full, mesh.size(mesh_dim), dim=placement.dim))
            rank = mesh.get_local_rank(mesh_dim)
            full = chunks[rank] if rank < len(chunks) else full.narrow(placement.dim, 0, 0)
    return full


def _normal(param: torch.Tensor, std: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    return torch.empty(param.shape, dtype=param.dtype, device=_device_of(param)).normal_(0, std, generator=generator)


def _device_of(param: torch.Tensor) -> torch.device:
    return _local(param).device


def _init_lora_(module: LoRALinear, std: float, generator: Optional[torch.Generator]) -> None:
    """Base ~ N(0, std), zero bias, torchtune's adapter init (Kaiming-uniform A, zero B), DoRA magnitude = norms."""
    weight = _normal(module.weight, std, generator)
    local_weight = _local(module.weight)
    if isinstance(local_weight, NF4Tensor):
        weight = to_nf4_frozen(weight, local_weight.block_size, local_weight.scaler_block_size)
    _write_(module.weight, weight)
    if module.bias is not None:
        _write_(module.bias, torch.zeros_like(module.bias, device=_device_of(module.bias)))
    # kaiming_uniform_(a=sqrt(5)) as in torchtune's _lora_a_init_params: U(-1/sqrt(in_dim), 1/sqrt(in_dim)).
    bound = 1.0 / math.sqrt(module.in_dim)
    lora_a = torch.empty(module.lora_a.weight.shape, dtype=module.lora_a.weight.dtype, device=weight.device)
    _write_(module.lora_a.weight, lora_a.uniform_(-bound, bound, generator=generator))
    _write_(module.lora_b.weight, torch.zeros(module.lora_b.weight.shape, dtype=lora_a.dtype, device=weight.device))
    if isinstance(module, DoRALinear):
        # lora_b is zero, so the merged weight is the (quantized) base.
        dtype = module.magnitude.dtype
        base = dequantize_nf4(weight, dtype) if isinstance(weight, NF4Tensor) else weight.to(dtype)
        _write_(module.magnitude, torch.linalg.norm(base, dim=1))


@torch.no_grad()
def init_weights_(module: nn.Module, std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
    """Random-initialises a materialised module in place, one param at a time, in module order.

    Dense matrices and NF4 bases ~ N(0, std) (NF4 bases quantized from it), norm scales = 1, biases = 0; LoRA
    adapters get torchtune's init (Kaiming-uniform A, zero B) and DoRA magnitudes their initial norms; RoPE
    caches are rebuilt. Works on FSDP2-sharded modules: every param is drawn at full size and its shard written,
    so a sharded model gets the same values as the unsharded one.

    Args:
        module (nn.Module): the module (or model) to initialise, not on the meta device.
        std (float): standard deviation of the normal init. Default: 0.02.
        generator (Optional[torch.Generator]): RNG for reproducible weights.
    """
    inside_lora = {id(m) for lora in module.modules() if isinstance(lora, LoRALinear) for m in lora.modules()}
    for sub in module.modules():
        if isinstance(sub, LoRALinear):
            _init_lora_(sub, std, generator)
        if id(sub) in inside_lora:
            continue
        for name, param in sub.named_parameters(recurse=False):
            if param.dim() >= 2:
                full = _normal(param, std, generator)
            elif name.endswith("bias"):
                full = torch.zeros(param.shape, dtype=param.dtype, device=_device_of(param))
            else:
                full = torch.ones(param.shape, dtype=param.dtype, device=_device_of(param))
            _write_(param, full)
    for sub in module.modules():
        if hasattr(sub, "rope_init"):
            with torch.device(_rope_device(sub, module)):
                sub.rope_init()


def _rope_device(rope: nn.Module, model: nn.Module) -> torch.device:
    for tensor in [*rope.buffers(), *model.parameters()]:
        device = _device_of(tensor)
        if device.type != "meta":
            return device
    return torch.device("cpu")


def materialize_(
    model: TransformerDecoder, device: DeviceLike, seed: Optional[int] = 0, std: float = 0.02
) -> TransformerDecoder:
    """Materialises a meta-device model (plain or FSDP2-sharded) on ``device`` with random weights.

    ``to_empty`` allocates the params in their final formats (NF4 bases take 4 bits per value), then
    :func:`init_weights_` fills them one at a time, so no more than one dense weight exists in high precision.

    Args:
        model (TransformerDecoder): a model built on the meta device, optionally already ``fully_shard``-ed.
        device (DeviceLike): target device.
        seed (Optional[int]): seed for the init RNG; None uses torch's global RNG.
        std (float): init standard deviation.

    Returns:
        TransformerDecoder: the same model, materialised.
    """
    device = torch.device(device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    model.to_empty(device=device)
    init_weights_(model, std=std, generator=generator)
    return model


def build_qlora(
    torchtune_builder: Callable[..., TransformerDecoder],
    *,
    dtype: torch.dtype = torch.bfloat16,
    adapter_dtype: Optional[torch.dtype] = None,
    device: DeviceLike = "meta",
    seed: Optional[int] = 0,
    **builder_kwargs,
) -> TransformerDecoder:
    """Builds a QLoRA model from a torchtune ``lora_*`` builder.

    Args:
        torchtune_builder (Callable[..., TransformerDecoder]): e.g. ``torchtune.models.llama3_2.lora_llama3_2_1b``.
        dtype (torch.dtype): compute dtype; also the dtype of embeddings, norms, output and biases.
        adapter_dtype (Optional[torch.dtype]): LoRA/DoRA param dtype (None: ``dtype``); fp16 training wants fp32.
        device (DeviceLike): "meta" (default) leaves the model unmaterialised for a checkpoint loader or FSDP;
            any other device materialises it layer by layer with random weights.
        seed (Optional[int]): init seed when materialising.
        **builder_kwargs: the torchtune builder's arguments (``lora_attn_modules``, ``lora_rank``, ...).

    Returns:
        TransformerDecoder: the QLoRA model.

    Raises:
        ValueError: on a non-float dtype or a layer shape that cannot be NF4-quantized.
    """
    check_float_dtype(dtype)
    check_float_dtype(adapter_dtype, "adapter_dtype")
    with set_default_dtype(dtype), torch.device("meta"):
        model = torchtune_builder(quantize_base=False, **builder_kwargs)
        _replace_linears(model, dtype, adapter_dtype or dtype)
        use_contiguous_chunks_(model)
    if torch.device(device).type != "meta":
        materialize_(model, device, seed=seed)
    return model


def qlora_builder(torchtune_builder: Callable[..., TransformerDecoder]) -> Callable[..., TransformerDecoder]:
    """Wraps a torchtune ``lora_*`` builder into a QLoRA builder with ``dtype``/``adapter_dtype``/``device``.

    Args:
        torchtune_builder (Callable[..., TransformerDecoder]): the torchtune builder.

    Returns:
        Callable[..., TransformerDecoder]: ``builder(**torchtune_args, dtype=..., adapter_dtype=..., device=...)``.
    """

    def builder(lora_attn_modules: List[str], **kwargs) -> TransformerDecoder:
        return build_qlora(torchtune_builder, lora_attn_modules=lora_attn_modules, **kwargs)

    builder.__name__ = builder.__qualname__ = "q" + torchtune_builder.__name__
    builder.__doc__ = (
        f"QLoRA version of ``{torchtune_builder.__module__}.{torchtune_builder.__name__}``: same arguments "
        "(``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``, ``lora_rank``, ``lora_alpha``, "
        "``lora_dropout``, ``use_dora``) plus ``dtype``, ``adapter_dtype``, ``device`` and ``seed`` of "
        ":func:`build_qlora`.\n\nReturns:\n    TransformerDecoder: the QLoRA model (NF4 base, compute ``dtype``)."
    )
    return builder

"""Turn any torchtune ``lora_*`` model builder into a QLoRA builder with an explicit compute dtype.

The smallest fork of torchtune's component builders: torchtune builds the architecture on the meta device
(no memory), then every torchtune LoRA/DoRA linear becomes ours (NF4 base, compute ``dtype``, adapters in
``adapter_dtype``) and every other linear inside the decoder layers becomes a ``FrozenNF4Linear``: the same
modules, names and parameter counts as torchtune's ``quantize_base=True`` models. Materialising happens one
decoder layer at a time, so the whole model never exists in high precision.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import DoRALinear as TorchtuneDoRALinear
from torchtune.modules.peft import LoRALinear as TorchtuneLoRALinear
from torchtune.training import set_default_dtype

from torchtune_ext._compat import NF4Tensor
from torchtune_ext.modules.low_precision import FrozenNF4Linear, check_float_dtype, to_nf4_frozen
from torchtune_ext.modules.peft import DoRALinear, LoRALinear

DeviceLike = Union[str, torch.device, None]


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
                    nf4 = FrozenNF4Linear(
                        child.in_features, child.out_features, child.bias is not None, dtype=dtype
                    )
                    replacements.append((parent, name, nf4))
    for parent, name, module in replacements:
        setattr(parent, name, module)


def _nf4_params(module: nn.Module, recurse: bool = True) -> Iterator[Tuple[nn.Module, str, NF4Tensor]]:
    for owner in module.modules() if recurse else [module]:
        for name, param in owner.named_parameters(recurse=False):
            if isinstance(param, NF4Tensor):
                yield owner, name, param


@torch.no_grad()
def init_weights_(module: nn.Module, std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
    """Random-initialises a materialised module in place, quantizing NF4 weights one at a time.

    Dense matrices and NF4 bases ~ N(0, std), vectors that are norm scales = 1, biases = 0; LoRA adapters get
    torchtune's init (Kaiming A, zero B) and DoRA magnitudes their initial norms; RoPE caches are rebuilt.

    Args:
        module (nn.Module): the module (or model) to initialise, not on the meta device.
        std (float): standard deviation of the normal init. Default: 0.02.
        generator (Optional[torch.Generator]): RNG for reproducible weights.
    """
    for owner, name, param in list(_nf4_params(module)):
        dense = torch.empty(param.shape, dtype=param.dtype, device=param.device).normal_(
            0, std, generator=generator
        )
        setattr(
            owner,
            name,
            nn.Parameter(
                to_nf4_frozen(dense, param.block_size, param.scaler_block_size), requires_grad=False
            ),
        )
    for name, param in module.named_parameters():
        if isinstance(param, NF4Tensor):
            continue
        if param.dim() >= 2:
            param.normal_(0, std, generator=generator)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)
    for sub in module.modules():
        if isinstance(sub, LoRALinear):
            sub.initialize_parameters()
        if hasattr(sub, "rope_init"):
            sub.rope_init()
    for sub in module.modules():
        if isinstance(sub, DoRALinear):
            sub.initialize_dora_magnitude()


def materialize_(
    model: TransformerDecoder, device: DeviceLike, seed: Optional[int] = 0, std: float = 0.02
) -> TransformerDecoder:
    """Moves a meta-device model to ``device`` one top-level block / decoder layer at a time, randomly initialised.

    Args:
        model (TransformerDecoder): a model built on the meta device.
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
    blocks = [m for name, m in model.named_children() if name != "layers"] + list(model.layers)
    for block in blocks:
        block.to_empty(device=device)
        init_weights_(block, std=std, generator=generator)
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

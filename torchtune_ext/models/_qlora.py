"""Turn any torchtune ``lora_*`` model builder into a QLoRA builder with an explicit compute dtype.

The smallest fork of torchtune's component builders: torchtune builds the architecture on the meta device
(no memory), then every torchtune LoRA/DoRA linear becomes ours (NF4 base, compute ``dtype``, adapters in
``adapter_dtype``) and every other linear inside the decoder layers becomes a ``FrozenNF4Linear``: the same
modules, names and parameter counts as torchtune's ``quantize_base=True`` models, and the same state-dict contract
(``state_dict()`` gives dense weights in the compute dtype, see ``dense_state_dict_post_hook``). Materialising
allocates NF4 bases at 4 bits and fills them one weight at a time, so the whole model never exists in high
precision.
"""

from __future__ import annotations

import inspect
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import nn
from torchtune.modules import TiedLinear, TransformerDecoder
from torchtune.modules.peft import DoRALinear as TorchtuneDoRALinear
from torchtune.modules.peft import LoRALinear as TorchtuneLoRALinear
from torchtune.training import set_default_dtype

from torchtune_ext.models._gemma2 import store_gemma2_frozen_weights_in_
from torchtune_ext.models._init import materialize_
from torchtune_ext.modules.low_precision import (
    FrozenEmbedding,
    FrozenLinear,
    FrozenNF4Linear,
    FrozenTiedLinear,
    dense_state_dict_post_hook,
)
from torchtune_ext.modules.peft import DoRALinear, LoRALinear
from torchtune_ext.modules.rope import share_rope_
from torchtune_ext.modules.transformer import use_contiguous_chunks_
from torchtune_ext.nf4 import check_float_dtype

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
                    nf4 = FrozenNF4Linear(child.in_features, child.out_features, child.bias is not None, dtype=dtype)
                    replacements.append((parent, name, nf4))
    for parent, name, module in replacements:
        setattr(parent, name, module)


def _store_frozen_weights_in(model: TransformerDecoder, dtype: torch.dtype, storage_dtype: torch.dtype) -> None:
    """The token embedding and a plain output projection stored in ``storage_dtype``, computing in ``dtype``."""
    embedding = model.tok_embeddings
    if type(embedding) is nn.Embedding:
        vocab_size, embed_dim = embedding.num_embeddings, embedding.embedding_dim
        model.tok_embeddings = FrozenEmbedding(vocab_size, embed_dim, dtype, storage_dtype)
    if isinstance(model.output, TiedLinear):
        model.output = FrozenTiedLinear(model.tok_embeddings, dtype)
    elif type(model.output) is nn.Linear and model.output.bias is None:
        model.output = FrozenLinear(model.output.in_features, model.output.out_features, dtype, storage_dtype)


def build_qlora(
    torchtune_builder: Callable[..., TransformerDecoder],
    *,
    dtype: torch.dtype = torch.bfloat16,
    adapter_dtype: Optional[torch.dtype] = None,
    frozen_dtype: Optional[torch.dtype] = None,
    device: DeviceLike = "meta",
    seed: Optional[int] = 0,
    **builder_kwargs,
) -> TransformerDecoder:
    """Builds a QLoRA model from a torchtune ``lora_*`` builder.

    Args:
        torchtune_builder (Callable[..., TransformerDecoder]): e.g. ``torchtune.models.llama3_2.lora_llama3_2_1b``.
        dtype (torch.dtype): compute dtype; also the dtype of embeddings, norms, output and biases.
        adapter_dtype (Optional[torch.dtype]): LoRA/DoRA param dtype (None: ``dtype``); fp16 training wants fp32.
        frozen_dtype (Optional[torch.dtype]): storage dtype of the frozen weights that are not NF4 (the token
            embedding and a plain output projection), which compute in ``dtype`` all the same (upcast per use): e.g.
            bf16 in an fp32 run on a T4, the checkpoint's own dtype at half the memory. None: ``dtype``.
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
    check_float_dtype(frozen_dtype, "frozen_dtype")
    with set_default_dtype(dtype), torch.device("meta"):
        model = torchtune_builder(quantize_base=False, **builder_kwargs)
        _replace_linears(model, dtype, adapter_dtype or dtype)
        if frozen_dtype is not None and frozen_dtype != dtype:
            _store_frozen_weights_in(model, dtype, frozen_dtype)
            store_gemma2_frozen_weights_in_(model, dtype, frozen_dtype)  # its scaled embedding
        use_contiguous_chunks_(model)
        share_rope_(model)  # one RoPE cache per model, grown on demand (issue 25)
    model._register_state_dict_hook(dense_state_dict_post_hook)
    if torch.device(device).type != "meta":
        materialize_(model, device, seed=seed)
    return model


#: the arguments of :func:`build_qlora` that a QLoRA builder adds to the torchtune builder's.
_QLORA_ARGS = ("dtype", "adapter_dtype", "frozen_dtype", "device", "seed")


def _builder_signature(torchtune_builder: Callable[..., TransformerDecoder]) -> inspect.Signature:
    """The torchtune builder's arguments (less ``quantize_base``, which is always NF4 here) plus ours."""
    ours = inspect.signature(build_qlora).parameters
    theirs = [p for p in inspect.signature(torchtune_builder).parameters.values() if p.name != "quantize_base"]
    var_keyword = [p for p in theirs if p.kind == p.VAR_KEYWORD]
    theirs = [p for p in theirs if p.kind != p.VAR_KEYWORD]
    return inspect.Signature(
        [*theirs, *(ours[name] for name in _QLORA_ARGS), *var_keyword], return_annotation=TransformerDecoder
    )


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
    builder.__signature__ = _builder_signature(torchtune_builder)  # what config checks read (inspect.signature)
    builder.__doc__ = (
        f"QLoRA version of ``{torchtune_builder.__module__}.{torchtune_builder.__name__}``: same arguments "
        "(``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output``, ``lora_rank``, ``lora_alpha``, "
        "``lora_dropout``, ``use_dora``) plus ``dtype``, ``adapter_dtype``, ``frozen_dtype``, ``device`` and ``seed`` "
        "of "
        ":func:`build_qlora`.\n\nReturns:\n    TransformerDecoder: the QLoRA model (NF4 base, compute ``dtype``)."
    )
    return builder

"""Model surgery: replace a TransformerDecoder's embedding and output projection by a VocabPruning module."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune.modules import TiedLinear

from torchtune_ext.modules.peft import DoRALinear, LoRALinear
from torchtune_ext.modules.vocab_pruning._module import KeptIds, PrunedOutput, VocabPruning, validate_kept_ids
from torchtune_ext.modules.vocab_pruning._state_dict import kept_rows
from torchtune_ext.nf4 import check_float_dtype


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_a") and hasattr(module, "lora_b")


def _check_prunable(model: nn.Module) -> nn.Embedding:
    embedding = getattr(model, "tok_embeddings", None)
    if isinstance(embedding, VocabPruning):
        raise ValueError("the model's vocabulary is already pruned; prune_vocab_ applies once, to the base model.")
    if not isinstance(embedding, nn.Embedding):
        raise ValueError(
            f"prune_vocab_ expects a torchtune TransformerDecoder with an nn.Embedding tok_embeddings, got "
            f"{type(model).__name__} with tok_embeddings={type(embedding).__name__}."
        )
    if not hasattr(model, "output"):
        raise ValueError(f"prune_vocab_ expects a model with an output projection; {type(model).__name__} has none.")
    params = list(embedding.parameters())
    if isinstance(model.output, nn.Module):
        params += list(model.output.parameters())
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            "the embedding/output are already sharded (DTensor); apply prune_vocab_ before fully_shard, then shard "
            "the returned module on its own."
        )
    return embedding


def _is_tied(model: nn.Module, embedding: nn.Embedding) -> bool:
    output = model.output
    if isinstance(output, TiedLinear):
        if output.tied_module is not embedding:
            raise ValueError("model.output is a TiedLinear tied to a module other than model.tok_embeddings.")
        return True
    return isinstance(output, nn.Module) and getattr(output, "weight", None) is embedding.weight


def _prune_output(output: Any, kept: torch.Tensor, vocab_size: int, embed_dim: int, dtype: torch.dtype) -> nn.Module:
    """A ``dtype`` copy of the kept rows of an untied output projection (nn.Linear or LoRA/DoRA linear)."""
    if not isinstance(output, nn.Linear) and not _is_lora(output):
        raise ValueError(
            f"cannot prune model.output of type {type(output).__name__}: supported are TiedLinear, nn.Linear and "
            "LoRA/DoRA linears (torchtune's or torchtune_ext's)."
        )
    weight = output.weight
    if tuple(weight.shape) != (vocab_size, embed_dim):
        raise ValueError(
            f"model.output.weight has shape {tuple(weight.shape)}, expected {(vocab_size, embed_dim)} (vocab_size, "
            "embed_dim) like tok_embeddings."
        )
    device = weight.device
    bias = getattr(output, "bias", None)
    with torch.device(device):
        if _is_lora(output):
            cls = DoRALinear if hasattr(output, "magnitude") else LoRALinear
            dropout = output.dropout.p if isinstance(output.dropout, nn.Dropout) else 0.0
            pruned = cls(
                embed_dim,
                kept.numel(),
                rank=output.rank,
                alpha=output.alpha,
                dropout=dropout,
                use_bias=bias is not None,
                dtype=dtype,
                adapter_dtype=dtype,
            )
            pruned.disabled = getattr(output, "disabled", False)
        else:
            pruned = nn.Linear(embed_dim, kept.numel(), bias=bias is not None, dtype=dtype)
    if device.type == "meta":
        return pruned
    with torch.no_grad():
        pruned.weight.copy_(kept_rows(weight, kept, dtype))
        if bias is not None:
            pruned.bias.copy_(kept_rows(bias, kept, dtype))
        if _is_lora(output):
            pruned.lora_a.weight.copy_(output.lora_a.weight.to(dtype))
            pruned.lora_b.weight.copy_(kept_rows(output.lora_b.weight, kept, dtype))
            if hasattr(output, "magnitude"):
                pruned.magnitude.copy_(kept_rows(output.magnitude, kept, dtype))
    return pruned


def prune_vocab_(
    model: nn.Module,
    kept_ids: KeptIds,
    *,
    dtype: torch.dtype = torch.float32,
    unknown_token_id: Optional[int] = None,
    trainable: bool = True,
) -> VocabPruning:
    """Replaces a TransformerDecoder's token embedding and output projection by a :class:`VocabPruning` module.

    ``model.tok_embeddings`` becomes the module (a ``dtype`` copy of the kept rows, for both uses when tied) and
    ``model.output`` a :class:`PrunedOutput` calling it. The model then takes full-vocabulary token ids and
    returns logits over the kept tokens; labels must go through ``pruning.remap_labels``. Apply it after loading
    the base weights and before ``fully_shard``; on a meta-device model the pruned params stay on meta, to be
    loaded from :func:`prune_state_dict` of the base checkpoint.

    Pruned state-dict keys: ``tok_embeddings.weight`` (``K`` rows) and, when untied,
    ``tok_embeddings.output.*`` (``weight``, ``bias``, ``lora_a.weight``, ``lora_b.weight``, ``magnitude``).

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` whose output is a ``TiedLinear``, an ``nn.Linear``
            or a LoRA/DoRA linear (torchtune's or ours, NF4 base included).
        kept_ids (KeptIds): the ``K`` token ids to keep, e.g. from :func:`collect_token_ids` or
            :func:`load_kept_ids`; their order is the order of the pruned rows and logits.
        dtype (torch.dtype): dtype of the pruned params and logits. Default: fp32.
        unknown_token_id (Optional[int]): a kept id that other ids map to; None: other ids raise an error.
        trainable (bool): train the pruned rows (see :class:`VocabPruning`). Default: True.

    Returns:
        VocabPruning: the new module (also ``model.tok_embeddings``), e.g. to shard it on its own.

    Raises:
        ValueError: on invalid ``kept_ids`` (before any change to the model), an already pruned or sharded
            model, or an unsupported output projection.
    """
    check_float_dtype(dtype)
    embedding = _check_prunable(model)
    vocab_size, embed_dim = embedding.weight.shape
    kept = validate_kept_ids(kept_ids, vocab_size)
    tied = _is_tied(model, embedding)
    output = None if tied else _prune_output(model.output, kept, vocab_size, embed_dim, dtype)
    device = embedding.weight.device
    pruning = VocabPruning(
        kept,
        vocab_size,
        embed_dim,
        output=output,
        dtype=dtype,
        model_dtype=getattr(embedding, "compute_dtype", embedding.weight.dtype),
        unknown_token_id=unknown_token_id,
        trainable=trainable,
        device=device,
    )
    if device.type != "meta":
        with torch.no_grad():
            pruning.weight.copy_(kept_rows(embedding.weight, kept, dtype))
    del model.tok_embeddings
    model.tok_embeddings = pruning
    if "output" in model._modules:
        del model.output
    model.output = PrunedOutput(pruning)
    return pruning


def get_vocab_pruning(model: nn.Module) -> Optional[VocabPruning]:
    """
    Args:
        model (nn.Module): a model, pruned or not.

    Returns:
        Optional[VocabPruning]: its pruning module (``model.tok_embeddings``), or None if it is not pruned.
    """
    embedding = getattr(model, "tok_embeddings", None)
    return embedding if isinstance(embedding, VocabPruning) else None

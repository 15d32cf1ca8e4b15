"""Vocabulary pruning: fine-tune the token embedding and output projection over a subset of the vocabulary.

A Llama 3 model spends most of a small fine-tune's memory on its 128k-row embedding, its output projection and
the ``(batch, seq, vocab)`` logits. When the data only uses a few thousand token ids, :func:`prune_vocab_`
replaces both by copies of the ``K`` kept rows (in fp32 by default, while the rest of the model stays in its
compute dtype), remaps input ids and labels from the full vocabulary ``V`` to ``[0, K)``, and makes the model
produce logits over ``K``. :func:`export_full_vocab_state_dict` writes the trained rows back into the base
model's full-vocabulary tensors, giving a standard checkpoint.

Typical use::

    model.load_state_dict(base_state_dict)
    base_vocab = vocab_state_dict(base_state_dict)       # the base rows, to export into at the end
    kept_ids = collect_token_ids(dataset, always_keep=(tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id))
    pruning = prune_vocab_(model, kept_ids)              # fp32 copies of the kept rows
    logits = model(tokens)                               # tokens in the full vocabulary, logits over K
    loss = loss_fn(logits, pruning.remap_labels(labels))
    ...
    full_sd = export_full_vocab_state_dict(model.state_dict(), base_vocab, pruning.kept_ids)

Under FSDP2 the :class:`VocabPruning` module is one unit on its own (its ``forward`` embeds integer ids and
projects floating hidden states, so both uses go through FSDP's hooks)::

    fully_shard(pruning, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))

or it stays unsharded and replicated on every rank: keep it out of the root's ``fully_shard`` with
``ignored_params=set(pruning.parameters())`` and sum its gradients over the ranks after backward
(``torchtune_ext.distributed.all_reduce_grads``); ``torchtune_ext.distributed.shard_model`` does either.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune.modules import TiedLinear
from torchtune.modules.peft import AdapterModule

from torchtune_ext.modules.peft import DoRALinear, LoRALinear
from torchtune_ext.nf4 import NF4Tensor, check_float_dtype, dequantize_nf4

KeptIds = Union[Sequence[int], torch.Tensor]

#: state-dict prefix of the pruned output projection (untied models) inside the pruned model.
PRUNED_OUTPUT_PREFIX = "tok_embeddings.output."
_MAX_IDS_IN_ERROR = 8


def validate_kept_ids(kept_ids: KeptIds, vocab_size: int) -> torch.Tensor:
    """Checks kept token ids and returns them as a 1-D int64 CPU tensor, in the given order.

    Position ``k`` of the result is the id of row ``k`` of the pruned embedding and of logit ``k``.

    Args:
        kept_ids (KeptIds): token ids of the full vocabulary to keep.
        vocab_size (int): size ``V`` of the full vocabulary.

    Returns:
        torch.Tensor: the ids, shape ``(K,)``, dtype int64, on CPU.

    Raises:
        ValueError: if the ids are empty, not integers, not 1-D, outside ``[0, vocab_size)`` or duplicated.
    """
    ids = kept_ids.detach().cpu() if isinstance(kept_ids, torch.Tensor) else torch.tensor(list(kept_ids))
    if ids.numel() == 0:
        raise ValueError("kept_ids is empty: keep at least one token id (e.g. collect_token_ids(dataset)).")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"kept_ids must be integer token ids, got dtype {ids.dtype}.")
    if ids.dim() != 1:
        raise ValueError(f"kept_ids must be a flat list of token ids, got shape {tuple(ids.shape)}.")
    ids = ids.to(torch.int64)
    out_of_range = ids[(ids < 0) | (ids >= vocab_size)]
    if out_of_range.numel():
        raise ValueError(
            f"kept_ids has {out_of_range.numel()} id(s) outside the vocabulary [0, {vocab_size}): "
            f"{out_of_range[:_MAX_IDS_IN_ERROR].tolist()}; were they collected with another tokenizer?"
        )
    unique, counts = torch.unique(ids, return_counts=True)
    if unique.numel() != ids.numel():
        raise ValueError(
            f"kept_ids has {ids.numel() - unique.numel()} duplicated id(s): "
            f"{unique[counts > 1][:_MAX_IDS_IN_ERROR].tolist()}; each id must appear once."
        )
    return ids


class VocabPruning(nn.Module, AdapterModule):
    """Token embedding and output projection over ``K`` kept rows of a ``V``-token vocabulary.

    ``forward`` takes either token ids of the full vocabulary (any integer dtype) and returns their embeddings
    in ``model_dtype``, or hidden states (any float dtype) and returns logits over the ``K`` kept tokens in the
    parameters' dtype. Hidden states are cast to the parameters' dtype first, so the pruned rows can train in
    fp32 inside a bf16 model. With tied embeddings (``output=None``) one parameter, ``weight``, serves both.

    Args:
        kept_ids (KeptIds): the ``K`` kept token ids; position ``k`` is pruned row/logit ``k``.
        vocab_size (int): size ``V`` of the full vocabulary.
        embed_dim (int): embedding dimension.
        output (Optional[nn.Module]): the untied output projection ``(..., embed_dim) -> (..., K)`` (e.g. an
            ``nn.Linear`` or a :class:`~torchtune_ext.modules.peft.LoRALinear` in ``dtype``); None: tied to
            ``weight``.
        dtype (torch.dtype): dtype of ``weight`` (the output module carries its own). Default: fp32.
        model_dtype (Optional[torch.dtype]): dtype of the returned embeddings, i.e. the rest of the model's
            compute dtype. None: ``dtype``.
        unknown_token_id (Optional[int]): a kept id that ids outside the kept set are mapped to; None: such ids
            raise an error.
        trainable (bool): whether the pruned copies of the base rows (``weight`` and the output's weight and
            bias) are trained. They are then reported by ``adapter_params()``, so torchtune's
            ``get_adapter_params``/``set_trainable_params`` keep them trainable. Default: True.
        device (Optional[torch.device]): device of ``weight``.

    Raises:
        ValueError: on invalid ``kept_ids``, an ``unknown_token_id`` that is not kept, a non-float dtype or an
            output module of the wrong shape.
    """

    def __init__(
        self,
        kept_ids: KeptIds,
        vocab_size: int,
        embed_dim: int,
        *,
        output: Optional[nn.Module] = None,
        dtype: torch.dtype = torch.float32,
        model_dtype: Optional[torch.dtype] = None,
        unknown_token_id: Optional[int] = None,
        trainable: bool = True,
        device: Optional[Union[str, torch.device]] = None,
    ):
        super().__init__()
        check_float_dtype(dtype)
        check_float_dtype(model_dtype, "model_dtype")
        ids = validate_kept_ids(kept_ids, vocab_size)
        remap = torch.full((vocab_size,), -1, dtype=torch.int64)
        remap[ids] = torch.arange(ids.numel())
        if unknown_token_id is not None:
            if not 0 <= unknown_token_id < vocab_size or remap[unknown_token_id] < 0:
                raise ValueError(
                    f"unknown_token_id={unknown_token_id} is not one of the kept ids; add it to kept_ids "
                    "(e.g. always_keep=(tokenizer.unk_id, ...)) or pick a kept id."
                )
            remap[remap < 0] = remap[unknown_token_id]
        self.vocab_size = vocab_size
        self.num_embeddings = ids.numel()
        self.embedding_dim = embed_dim
        self.model_dtype = model_dtype
        self.unknown_token_id = unknown_token_id
        self.trainable = trainable
        # Plain attributes, not buffers: they must survive meta-device init, to_empty() and FSDP untouched.
        self._kept_ids = ids
        self._remap = remap
        self._remap_by_device: Dict[torch.device, torch.Tensor] = {}

        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings, embed_dim, dtype=dtype, device=device), requires_grad=trainable
        )
        nn.init.normal_(self.weight)
        self.output = output
        if output is not None:
            _check_output_shape(output, embed_dim, self.num_embeddings)
            for name in _base_param_names(output):
                getattr(output, name).requires_grad_(trainable)

    @property
    def kept_ids(self) -> torch.Tensor:
        """torch.Tensor: the kept token ids of the full vocabulary, shape ``(K,)``, int64, CPU."""
        return self._kept_ids.clone()

    @property
    def tied(self) -> bool:
        """bool: whether the output projection uses ``weight`` (tied embeddings)."""
        return self.output is None

    def adapter_params(self) -> List[str]:
        """
        Returns:
            List[str]: names of the trained pruned base rows (``weight``, and ``output.weight``/``output.bias``
            when untied) if ``trainable``, else an empty list. LoRA/DoRA params of the output report themselves.
        """
        if not self.trainable:
            return []
        return ["weight"] + [f"output.{name}" for name in _base_param_names(self.output)]

    def _remap_table(self, device: torch.device) -> torch.Tensor:
        table = self._remap_by_device.get(device)
        if table is None:
            table = self._remap_by_device[device] = self._remap.to(device)
        return table

    def remap_ids(self, ids: torch.Tensor, ignore_index: Optional[int] = None) -> torch.Tensor:
        """Maps token ids of the full vocabulary to pruned ids in ``[0, K)``.

        Args:
            ids (torch.Tensor): integer token ids of the full vocabulary, any shape.
            ignore_index (Optional[int]): a value passed through unchanged (e.g. -100 in labels).

        Returns:
            torch.Tensor: int64 pruned ids, same shape.

        Raises:
            ValueError: if an id is outside ``[0, V)``, or outside the kept set while there is no
                ``unknown_token_id``.
        """
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"remap_ids expects integer token ids, got dtype {ids.dtype}.")
        ids = ids.long()
        in_vocab = (ids >= 0) & (ids < self.vocab_size)
        pruned = self._remap_table(ids.device)[torch.where(in_vocab, ids, 0)]
        valid = in_vocab & (pruned >= 0)
        if ignore_index is not None:
            ignored = ids == ignore_index
            valid |= ignored
            pruned = torch.where(ignored, ignore_index, pruned)
        if not bool(valid.all()):
            self._raise_invalid_ids(ids[~valid])
        return pruned

    def _raise_invalid_ids(self, bad: torch.Tensor) -> None:
        bad = torch.unique(bad)
        shown = bad[:_MAX_IDS_IN_ERROR].tolist()
        outside = bad[(bad < 0) | (bad >= self.vocab_size)]
        if outside.numel():
            raise ValueError(
                f"token ids {shown} are outside the vocabulary [0, {self.vocab_size}); "
                "is the tokenizer the one the model was trained with?"
            )
        raise ValueError(
            f"{bad.numel()} token id(s) are not in the kept vocabulary ({self.num_embeddings} of "
            f"{self.vocab_size} ids), e.g. {shown}. Add them to kept_ids (collect_token_ids over all the data "
            "you train and evaluate on, plus the tokenizer's special ids) or pass unknown_token_id."
        )

    def remap_labels(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Maps labels of the full vocabulary to pruned ids, passing ``ignore_index`` through.

        Args:
            labels (torch.Tensor): integer labels, any shape.
            ignore_index (int): the loss's ignore index. Default: -100.

        Returns:
            torch.Tensor: int64 labels over ``[0, K)`` and ``ignore_index``.
        """
        return self.remap_ids(labels, ignore_index=ignore_index)

    def to_vocab_ids(self, pruned_ids: torch.Tensor) -> torch.Tensor:
        """Maps pruned ids (e.g. an argmax over the logits) back to token ids of the full vocabulary.

        Args:
            pruned_ids (torch.Tensor): integer ids in ``[0, K)``.

        Returns:
            torch.Tensor: int64 token ids of the full vocabulary, same shape and device.
        """
        return self._kept_ids.to(pruned_ids.device)[pruned_ids.long()]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeds full-vocabulary token ids.

        Args:
            tokens (torch.Tensor): integer token ids of the full vocabulary, shape ``(b, s)``.

        Returns:
            torch.Tensor: embeddings of shape ``(b, s, embed_dim)`` in ``model_dtype``.
        """
        out = F.embedding(self.remap_ids(tokens), self.weight)
        return out if self.model_dtype is None else out.to(self.model_dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Computes logits over the kept tokens.

        Args:
            hidden (torch.Tensor): hidden states of shape ``(..., embed_dim)``, any float dtype.

        Returns:
            torch.Tensor: logits of shape ``(..., K)`` in the parameters' dtype.
        """
        hidden = hidden.to(self.weight.dtype)
        return F.linear(hidden, self.weight) if self.output is None else self.output(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): integer token ids ``(b, s)`` of the full vocabulary, or float hidden states
                ``(..., embed_dim)``.

        Returns:
            torch.Tensor: embeddings ``(b, s, embed_dim)`` in ``model_dtype`` for ids; logits ``(..., K)``
            for hidden states.
        """
        return self.project(x) if x.is_floating_point() else self.embed(x)

    def extra_repr(self) -> str:
        return (
            f"kept={self.num_embeddings}/{self.vocab_size}, embed_dim={self.embedding_dim}, "
            f"dtype={self.weight.dtype}, model_dtype={self.model_dtype}, tied={self.tied}, "
            f"trainable={self.trainable}, unknown_token_id={self.unknown_token_id}"
        )


class PrunedOutput:
    """The model's ``output`` after pruning: calls the :class:`VocabPruning` module on hidden states.

    Like torchtune's ``TiedLinear`` it is not an ``nn.Module``: it holds a reference to the pruning module
    (registered as ``model.tok_embeddings``), so the parameters live in one place and FSDP's hooks on that
    module run for both uses.

    Args:
        pruning (VocabPruning): the pruning module.
    """

    def __init__(self, pruning: VocabPruning):
        self.pruning = pruning

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """
        Args:
            hidden (torch.Tensor): hidden states ``(..., embed_dim)``.

        Returns:
            torch.Tensor: logits ``(..., K)``.
        """
        return self.pruning(hidden)


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_a") and hasattr(module, "lora_b")


def _base_param_names(output: Optional[nn.Module]) -> List[str]:
    if output is None:
        return []
    return [name for name in ("weight", "bias") if getattr(output, name, None) is not None]


def _check_output_shape(output: nn.Module, embed_dim: int, num_kept: int) -> None:
    weight = getattr(output, "weight", None)
    if weight is None or tuple(weight.shape) != (num_kept, embed_dim):
        shape = None if weight is None else tuple(weight.shape)
        raise ValueError(
            f"output must project embed_dim={embed_dim} to the {num_kept} kept tokens (weight of shape "
            f"{(num_kept, embed_dim)}), got {type(output).__name__} with weight shape {shape}."
        )


def _dense(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(tensor, NF4Tensor):
        return dequantize_nf4(tensor, dtype)
    return tensor.detach().to(dtype)


def _rows(tensor: torch.Tensor, kept: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kept rows of a (possibly NF4) tensor, as a dense ``dtype`` copy on the tensor's device."""
    return _dense(tensor, dtype)[kept.to(tensor.device)].clone()


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
        pruned.weight.copy_(_rows(weight, kept, dtype))
        if bias is not None:
            pruned.bias.copy_(_rows(bias, kept, dtype))
        if _is_lora(output):
            pruned.lora_a.weight.copy_(output.lora_a.weight.to(dtype))
            pruned.lora_b.weight.copy_(_rows(output.lora_b.weight, kept, dtype))
            if hasattr(output, "magnitude"):
                pruned.magnitude.copy_(_rows(output.magnitude, kept, dtype))
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
            pruning.weight.copy_(_rows(embedding.weight, kept, dtype))
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


def _check_full_tensors(state_dict: Mapping[str, Any], what: str) -> None:
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            raise ValueError(f"{what}[{key!r}] is a DTensor; gather the full state dict first (get_full_state_dict).")


def _is_row_key(name: str) -> bool:
    """Whether an output param (name relative to the output module) has one row per vocabulary entry."""
    return name in ("weight", "bias", "lora_b.weight", "magnitude")


def prune_state_dict(
    state_dict: Mapping[str, Any], kept_ids: KeptIds, *, dtype: torch.dtype = torch.float32
) -> Dict[str, Any]:
    """Turns a full-vocabulary torchtune state dict into the keys and shapes of a pruned model.

    ``tok_embeddings.weight`` and the per-token rows of ``output.*`` keep their ``kept_ids`` rows (as dense
    ``dtype`` copies, NF4 dequantized); ``output.*`` moves to ``tok_embeddings.output.*``; the other keys are
    unchanged. Use it to load a base checkpoint into a pruned model built on the meta device (e.g. before
    ``load_from_full_model_state_dict`` in a distributed recipe).

    Args:
        state_dict (Mapping[str, Any]): full state dict with torchtune keys.
        kept_ids (KeptIds): the kept token ids.
        dtype (torch.dtype): dtype of the pruned tensors. Default: fp32.

    Returns:
        Dict[str, Any]: the pruned state dict (a new dict; untouched values are shared).

    Raises:
        ValueError: if ``tok_embeddings.weight`` is missing, on invalid ``kept_ids`` or a DTensor value.
    """
    check_float_dtype(dtype)
    _check_full_tensors(state_dict, "state_dict")
    if "tok_embeddings.weight" not in state_dict:
        raise ValueError("state_dict has no 'tok_embeddings.weight'; is it a torchtune-format model state dict?")
    kept = validate_kept_ids(kept_ids, state_dict["tok_embeddings.weight"].shape[0])
    pruned: Dict[str, Any] = {}
    for key, value in state_dict.items():
        if key == "tok_embeddings.weight":
            pruned[key] = _rows(value, kept, dtype)
        elif key.startswith("output."):
            name = key[len("output.") :]
            pruned[PRUNED_OUTPUT_PREFIX + name] = (
                _rows(value, kept, dtype) if _is_row_key(name) else _dense(value, dtype)
            )
        else:
            pruned[key] = value
    return pruned


def _full_rows(
    key: str, pruned: torch.Tensor, base: Optional[torch.Tensor], kept: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """``base`` (or zeros) with the rows at ``kept`` replaced by ``pruned``, in the base's dtype."""
    if pruned.shape[0] != kept.numel():
        raise ValueError(
            f"state_dict[{key!r}] has {pruned.shape[0]} rows but there are {kept.numel()} kept ids; are these "
            "the kept ids the model was pruned with?"
        )
    if base is None:
        full = pruned.new_zeros((vocab_size, *pruned.shape[1:]))
    else:
        full = _dense(base, torch.promote_types(base.dtype, pruned.dtype)).clone()  # [issue 23] rows at their precision
        if tuple(full.shape[1:]) != tuple(pruned.shape[1:]) or full.shape[0] != vocab_size:
            raise ValueError(
                f"base tensor for {key!r} has shape {tuple(full.shape)}, incompatible with the pruned "
                f"{tuple(pruned.shape)} and vocab_size {vocab_size}."
            )
    full[kept.to(full.device)] = pruned.detach().to(device=full.device, dtype=full.dtype)
    return full


def export_full_vocab_state_dict(
    state_dict: Mapping[str, Any], base_state_dict: Mapping[str, Any], kept_ids: KeptIds
) -> Dict[str, Any]:
    """Writes the trained rows of a pruned model's state dict back into the base's full-vocabulary tensors.

    The result has the keys of an unpruned torchtune model: ``tok_embeddings.weight`` (and ``output.*`` when
    untied) have ``V`` rows, the kept ones from ``state_dict`` and the others from ``base_state_dict``, in the
    base's dtype; other keys pass through. Works on model state dicts, merged checkpoints
    (``get_merged_lora_ckpt`` first) and adapter state dicts alike. Per-token tensors the base lacks (e.g.
    ``output.lora_b.weight``) get zero rows outside the kept set, LoRA's initial value.

    Args:
        state_dict (Mapping[str, Any]): full (gathered) state dict of the pruned model.
        base_state_dict (Mapping[str, Any]): base checkpoint with torchtune keys; only
            ``tok_embeddings.weight`` and ``output.*`` are read.
        kept_ids (KeptIds): the ids the model was pruned with (``VocabPruning.kept_ids``).

    Returns:
        Dict[str, Any]: the full-vocabulary state dict.

    Raises:
        ValueError: if the base has no ``tok_embeddings.weight``, on invalid ``kept_ids``, row counts that do not
            match them, or DTensor values.
    """
    _check_full_tensors(state_dict, "state_dict")
    base_embedding = base_state_dict.get("tok_embeddings.weight")
    if base_embedding is None:
        raise ValueError("base_state_dict has no 'tok_embeddings.weight'; pass the base model's torchtune state dict.")
    vocab_size = base_embedding.shape[0]
    kept = validate_kept_ids(kept_ids, vocab_size)
    full: Dict[str, Any] = {}
    for key, value in state_dict.items():
        if key == "tok_embeddings.weight":
            full[key] = _full_rows(key, value, base_embedding, kept, vocab_size)
        elif key.startswith(PRUNED_OUTPUT_PREFIX):
            name = key[len(PRUNED_OUTPUT_PREFIX) :]
            base = base_state_dict.get("output." + name)
            if _is_row_key(name):
                full["output." + name] = _full_rows(key, value, base, kept, vocab_size)
            else:
                full["output." + name] = value if base is None else value.to(base.dtype)
        else:
            full[key] = value
    return full


def is_vocab_key(key: str) -> bool:
    """
    Args:
        key (str): a torchtune state-dict key of an unpruned model.

    Returns:
        bool: whether vocab pruning replaces it (``tok_embeddings.weight`` and ``output.*``).
    """
    return key == "tok_embeddings.weight" or key.startswith("output.")


def vocab_state_dict(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """The entries of a full-vocabulary torchtune state dict that :func:`export_full_vocab_state_dict` reads.

    Keep these from the base checkpoint (``tok_embeddings.weight`` and ``output.*``) instead of the whole base
    state dict, to export at the end of training.

    Args:
        state_dict (Mapping[str, Any]): a base state dict with torchtune keys.

    Returns:
        Dict[str, Any]: its ``tok_embeddings.weight`` and ``output.*`` entries (the same tensors, not copies).
    """
    return {k: v for k, v in state_dict.items() if is_vocab_key(k)}


def collect_token_ids(
    data: Iterable[Any], always_keep: Iterable[int] = (), vocab_size: Optional[int] = None
) -> List[int]:
    """The sorted set of token ids a dataset uses, plus ``always_keep``.

    Args:
        data (Iterable[Any]): items that are token id sequences (lists or tensors) or dicts with ``"tokens"``
            (and optionally ``"labels"``, whose negative values, e.g. -100, are skipped), such as torchtune's
            SFT datasets.
        always_keep (Iterable[int]): ids to keep whether or not they occur: the tokenizer's bos, eos and pad ids
            (padding is added by the collator, not by the dataset), and any ids generation may need.
        vocab_size (Optional[int]): if given, ids must be in ``[0, vocab_size)``.

    Returns:
        List[int]: sorted unique token ids.

    Raises:
        ValueError: on an item of another type, a negative token id or an id outside the vocabulary.
    """
    seen = set(int(i) for i in always_keep if i is not None)
    for index, item in enumerate(data):
        if isinstance(item, Mapping):
            if "tokens" not in item:
                raise ValueError(f"data item {index} is a mapping without 'tokens' (keys: {sorted(item)}).")
            seen.update(_ids_of(item["tokens"], index))
            if "labels" in item:
                seen.update(i for i in _ids_of(item["labels"], index, skip_negative=True))
        elif isinstance(item, (torch.Tensor, Sequence)) and not isinstance(item, (str, bytes)):
            seen.update(_ids_of(item, index))
        else:
            raise ValueError(
                f"data item {index} is a {type(item).__name__}; expected a token id sequence or a dict with 'tokens'."
            )
    if seen and min(seen) < 0:
        raise ValueError(f"token id {min(seen)} is negative; token ids are in [0, vocab_size).")
    if vocab_size is not None and seen and max(seen) >= vocab_size:
        raise ValueError(f"token id {max(seen)} is outside the vocabulary [0, {vocab_size}).")
    return sorted(seen)


def _ids_of(values: Any, index: int, skip_negative: bool = False) -> List[int]:
    ids = values.flatten().tolist() if isinstance(values, torch.Tensor) else list(values)
    if any(isinstance(i, float) or isinstance(i, bool) for i in ids):
        raise ValueError(f"data item {index} holds non-integer token ids.")
    ids = [int(i) for i in ids]
    return [i for i in ids if i >= 0] if skip_negative else ids


def save_kept_ids(path: Union[str, Path], kept_ids: KeptIds) -> None:
    """Writes kept token ids atomically: a JSON list for ``*.json``, else one id per line.

    Args:
        path (Union[str, Path]): destination file.
        kept_ids (KeptIds): the ids (must be unique non-negative integers).

    Raises:
        ValueError: on empty, non-integer, negative or duplicated ids.
    """
    ids = validate_kept_ids(kept_ids, vocab_size=torch.iinfo(torch.int64).max).tolist()
    path = Path(path)
    text = json.dumps(ids) if path.suffix == ".json" else "".join(f"{i}\n" for i in ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_kept_ids(path: Union[str, Path], vocab_size: Optional[int] = None) -> List[int]:
    """Reads kept token ids from a JSON list (``*.json``) or a text file of integers.

    Text files hold integers separated by whitespace or commas; ``#`` starts a comment.

    Args:
        path (Union[str, Path]): the file.
        vocab_size (Optional[int]): if given, the ids are validated against ``[0, vocab_size)``.

    Returns:
        List[int]: the ids, in file order.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: on malformed content, or ids that :func:`validate_kept_ids` rejects.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"kept ids file {str(path)!r} does not exist (write one with save_kept_ids).")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            ids = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{path} must hold a JSON list of integer token ids.")
    else:
        ids = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            for word in line.split("#", 1)[0].replace(",", " ").split():
                try:
                    ids.append(int(word))
                except ValueError:
                    raise ValueError(f"{path}:{line_no}: {word!r} is not an integer token id.") from None
    validate_kept_ids(ids, vocab_size if vocab_size is not None else torch.iinfo(torch.int64).max)
    return ids

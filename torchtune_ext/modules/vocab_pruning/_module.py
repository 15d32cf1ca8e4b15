"""The vocab-pruning module: an embedding and output projection over the kept rows of a vocabulary."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules.peft import AdapterModule

from torchtune_ext.nf4 import check_float_dtype

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

"""Cross-entropy over the model's output projection that never holds the logits.

torchtune's ``CEWithChunkedOutputLoss`` takes the model's chunked logits: every chunk (and its fp32 log-softmax,
saved for backward) stays alive from the output projection until backward, about ``6 * tokens * vocab`` bytes in
bf16 (``8 *`` in fp32): 6.3 GB for 8k tokens of Llama 3's 128k vocabulary, more than a 1B model's weights.
:class:`LinearCrossEntropyLoss` takes the last hidden state instead (the model skips its output layer, see
:meth:`LinearCrossEntropyLoss.set_model_output`) and projects it here, a chunk of label tokens at a time, so that
only one chunk's logits exist at any time (the idea of Apple's Cut Cross-Entropy and Liger's fused linear
cross-entropy, in plain PyTorch). Ignored tokens (``ignore_index``) are dropped before the projection.

Two paths, chosen per call from the output projection:

- a plain weight (``nn.Linear`` without bias, torchtune's ``TiedLinear``, a pruned tied or ``nn.Linear`` output of
  :class:`~torchtune_ext.modules.VocabPruning`; a frozen weight stored in another dtype than the compute dtype,
  ``FrozenTiedLinear`` / ``FrozenLinear``, upcast a block of rows at a time for each matmul): a fused
  ``autograd.Function`` computes each chunk's logits, its fp32 softmax in place, and from it (``softmax -
  onehot``) the gradients of the hidden states and of the weight already in forward, so backward only scales
  them: 3 matmuls, as without chunking, and per chunk one fp32 logits buffer (plus its compute-dtype copy).
- any other output (our ``LoRALinear``/``DoRALinear`` with an NF4 or dense base, a pruned LoRA output, a sharded
  FSDP unit): each chunk runs ``output(hidden)`` and a cross-entropy with an fp32 softmax under a non-reentrant
  activation checkpoint, which saves only the chunk's hidden states; backward recomputes the chunk (4 matmuls),
  so every trainable parameter gets its exact gradient with no knowledge of the module.

The fused path holds one fp32 chunk of logits (plus its bf16 copy) and does 3 matmuls; the checkpoint path holds
the chunk's logits, an fp32 gradient buffer and its cast, and does 4 matmuls. So the fused path is used wherever
the weight is a plain tensor, and the checkpoint path for the rest. The default chunk (:func:`auto_chunk_size`)
makes a chunk's logits about the size of the hidden states, at least 128 tokens (smaller chunks were slower on CPU;
the measurements are in BENCHMARKS.md, "Loss that never holds the logits").

Numerics: the logits are computed in the weight's dtype (the model's compute dtype; the hidden states are cast to
it first, as :meth:`VocabPruning.project` does) and the log-softmax in fp32, as torchtune. The fused path rounds
``softmax - onehot`` once to the compute dtype before the gradient matmuls (torchtune rounds ``scale * (softmax -
onehot)``, with the loss scale and ``1 / tokens`` folded in; both then match in bf16/fp16 within the rounding of
that cast), accumulates the weight gradient of the mean over chunks in the weight's dtype (``1 / tokens`` applied
in the matmul's fp32 accumulator), as autograd does over torchtune's chunks, applies the incoming gradient (e.g. a
loss scale) in backward as a Python float (one host sync), and does not support a second backward through the same
graph (``retain_graph``). Dropping the ignored tokens costs a host sync too (``nonzero``).

Under FSDP2 (``fully_shard``): the loss calls the output outside the model's forward, so the output's parameters
must then be unsharded. Either the output belongs to the root unit and the root keeps its parameters gathered
after forward (``fully_shard``'s default for the root, ``reshard_after_forward=None``; or
``model.set_reshard_after_forward(False, recurse=False)``), and the loss sees plain tensors; or the output (or
the pruning module) is an FSDP unit of its own, and each chunk's call goes through its hooks: then every rank
must call it equally often, so the loss agrees on the number of chunks with an all-reduce (MAX) and pads with
empty chunks.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torchtune.modules import TiedLinear

from torchtune_ext.modules.low_precision import FrozenLinear, mm_weight, mm_weight_t
from torchtune_ext.modules.vocab_pruning import PrunedOutput
from torchtune_ext.nf4 import NF4Tensor

#: smallest automatic chunk (tokens): below it the matmuls of a chunk get memory-bound on the weight.
MIN_AUTO_CHUNK_SIZE = 128


class LinearCrossEntropyLoss(nn.Module):
    """Mean cross-entropy of the model's output projection over the non-ignored tokens, computed chunk by chunk
    from the last hidden state so that only one chunk's logits exist at a time (see the module docstring).

    Use it in place of torchtune's ``CEWithChunkedOutputLoss``::

        loss_fn = LinearCrossEntropyLoss()
        loss_fn.set_model_output(model)     # model now returns hidden states [b, s, d]
        hidden = model(tokens)
        loss = loss_fn(hidden, labels)      # labels already shifted, ignore_index for no label

    Args:
        chunk_size (Optional[int]): label tokens per chunk. None: the smallest power of two >= ``tokens / ceil(V / d)``
            (a chunk's logits then hold about as many values as the hidden states), at least
            :data:`MIN_AUTO_CHUNK_SIZE`.
        ignore_index (int): label value of tokens without a label. Default: -100.
        fused (bool): use the fused ``autograd.Function`` for plain weights; False: the checkpoint path for every
            output (slower, for comparison). Default: True.

    Raises:
        ValueError: if ``chunk_size`` is not positive.
    """

    def __init__(self, chunk_size: Optional[int] = None, ignore_index: int = -100, fused: bool = True):
        super().__init__()
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index
        self.fused = fused
        self._output: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def set_model_output(self, model: nn.Module) -> None:
        """Takes over the model's output projection: records ``model.output`` and sets
        ``model.skip_output_layer = True``, so that the model returns its last hidden state (after the final norm).

        The model must honour that switch, as torchtune's ``TransformerDecoder`` does after 0.6.1: a class
        attribute ``skip_output_layer = False`` and an ``unembed`` that returns ``self.norm(h)`` when it is set.

        Args:
            model (nn.Module): the decoder.

        Raises:
            TypeError: if the model has no ``skip_output_layer`` switch or no ``output``.
        """
        if not hasattr(model, "skip_output_layer"):
            raise TypeError(
                f"{type(model).__name__} has no skip_output_layer switch, so it cannot return hidden states for "
                "LinearCrossEntropyLoss; give the decoder a class attribute skip_output_layer = False and an unembed "
                "that returns self.norm(h) when it is True (or use CEWithChunkedOutputLoss)."
            )
        if getattr(model, "output", None) is None:
            raise TypeError(f"{type(model).__name__} has no output projection to compute the loss with.")
        model.skip_output_layer = True
        self.set_output(model.output)

    def set_output(self, output: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Records the output projection without touching a model (for models that return hidden states by
        other means).

        Args:
            output (Callable[[torch.Tensor], torch.Tensor]): maps hidden states ``(n, d)`` to logits ``(n, V)``:
                an ``nn.Linear``, ``TiedLinear``, LoRA/DoRA linear, :class:`PrunedOutput` or any module.
        """
        self._output = output

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """
        Args:
            hidden (torch.Tensor): last hidden state ``(..., d)``, e.g. ``(b, s, d)``.
            labels (torch.Tensor): labels ``(...)`` (already shifted), ``ignore_index`` where there is none.

        Returns:
            torch.Tensor: fp32 scalar, the mean loss over the non-ignored tokens; 0 (with zero gradients) if there
            are none, where torchtune's ``CEWithChunkedOutputLoss`` gives nan.

        Raises:
            RuntimeError: if no output projection was set, or its parameters are sharded (DTensors) while calling it
                runs no FSDP hooks to gather them (see the module docstring).
            ValueError: if ``hidden`` is not a tensor whose leading shape is ``labels``' shape.
        """
        if self._output is None:
            raise RuntimeError("LinearCrossEntropyLoss has no output projection; call set_model_output(model) first.")
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape[:-1]) != tuple(labels.shape):
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(
                f"expected hidden states (..., d) matching labels {tuple(labels.shape)}, got {shape}; does the model "
                "return hidden states (set_model_output)?"
            )
        _check_unsharded(self._output)
        hidden, labels = _label_tokens(hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), self.ignore_index)
        num_tokens = labels.numel()
        chunk_size = self.chunk_size or auto_chunk_size(num_tokens, _vocab_size(self._output), hidden.shape[-1])
        weight = _plain_weight(self._output) if self.fused else None
        if weight is not None:
            dtype = getattr(self._output, "compute_dtype", None) or weight.dtype
            return linear_cross_entropy(hidden, weight, labels, chunk_size, dtype)
        return self._checkpointed_loss(hidden, labels, chunk_size)

    def _checkpointed_loss(self, hidden: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        num_chunks = max(1, math.ceil(labels.numel() / chunk_size))
        if _has_fsdp_hooks(self._output):
            num_chunks = _max_over_ranks(num_chunks, hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for i in range(num_chunks):
            chunk = slice(i * chunk_size, (i + 1) * chunk_size)
            if torch.is_grad_enabled():
                total = total + checkpoint(_chunk_loss, self._output, hidden[chunk], labels[chunk], use_reentrant=False)
            else:
                total = total + _chunk_loss(self._output, hidden[chunk], labels[chunk])
        return total / max(labels.numel(), 1)


def auto_chunk_size(num_tokens: int, vocab_size: Optional[int], dim: int) -> int:
    """The default chunk: about ``num_tokens * dim / vocab_size`` tokens, so that a chunk's logits hold about as
    many values as the hidden states (Liger's rule), rounded up to a power of two, at least
    :data:`MIN_AUTO_CHUNK_SIZE`.

    Args:
        num_tokens (int): number of label tokens.
        vocab_size (Optional[int]): size of the output; None (unknown): :data:`MIN_AUTO_CHUNK_SIZE` * 16.
        dim (int): hidden dimension.

    Returns:
        int: tokens per chunk.
    """
    if vocab_size is None:
        return MIN_AUTO_CHUNK_SIZE * 16
    tokens = math.ceil(num_tokens / max(1, math.ceil(vocab_size / dim)))
    return max(MIN_AUTO_CHUNK_SIZE, 1 << max(0, tokens - 1).bit_length())


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Mean of ``F.cross_entropy(F.linear(hidden, weight).float(), labels)`` without materialising the logits.

    Computes ``chunk_size`` rows at a time, and the gradients already in forward (see the module docstring); the
    logits are computed in ``dtype`` (``hidden`` is cast to it).

    Args:
        hidden (torch.Tensor): hidden states ``(n, d)``.
        weight (torch.Tensor): output weight ``(V, d)``, a plain (not NF4, not DTensor) tensor.
        labels (torch.Tensor): int64 labels ``(n,)`` in ``[0, V)`` (no ignore index: drop those rows first).
        chunk_size (int): rows per chunk.
        dtype (Optional[torch.dtype]): compute dtype; None: ``weight``'s. A frozen weight stored in another dtype
            (an fp32 run's bf16 embedding) is upcast a block of rows at a time, as ``FrozenLinear`` does.

    Returns:
        torch.Tensor: fp32 scalar, the mean over the ``n`` rows (0 if there are none).

    Raises:
        ValueError: if ``weight`` is trainable and not in ``dtype``.
    """
    dtype = dtype or weight.dtype
    grad_enabled = torch.is_grad_enabled()
    if weight.dtype != dtype and grad_enabled and weight.requires_grad:
        raise ValueError(f"a trainable output weight must be in the compute dtype {dtype}, got {weight.dtype}.")
    return _LinearCrossEntropy.apply(
        hidden,
        weight,
        labels,
        chunk_size,
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        dtype,
    )


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T``, whose gradients are computed chunk by chunk in forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        needs_hidden_grad: bool,
        needs_weight_grad: bool,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        x = hidden.to(dtype)
        n = x.shape[0]
        grad_x = torch.empty_like(x) if needs_hidden_grad else None
        grad_w = torch.zeros_like(weight) if needs_weight_grad else None
        total = x.new_zeros((), dtype=torch.float32)
        for start in range(0, n, chunk_size):
            x_chunk, y_chunk = x[start : start + chunk_size], labels[start : start + chunk_size]
            loss, grad_logits = _chunk_loss_and_grad(x_chunk, weight, y_chunk, needs_hidden_grad or needs_weight_grad)
            total += loss
            if grad_x is not None:
                mm_weight(grad_logits, weight, dtype, out=grad_x[start : start + chunk_size])
            if grad_w is not None:
                grad_w.addmm_(grad_logits.t(), x_chunk, alpha=1.0 / n)
            del grad_logits
        ctx.hidden_dtype = hidden.dtype
        ctx.num_rows = n
        ctx.grads = (grad_x, grad_w)
        return total / max(n, 1)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy computes its gradients once: backward twice is not supported.")
        grad_x, grad_w = ctx.grads
        ctx.grads = None
        scale = float(grad_output)
        if grad_x is not None:
            # grad_x holds the gradient of the sum; the Python scale is applied in fp32 before rounding.
            grad_x = grad_x.mul_(scale / max(ctx.num_rows, 1)).to(ctx.hidden_dtype)
        if grad_w is not None and scale != 1.0:
            grad_w.mul_(scale)
        return grad_x, grad_w, None, None, None, None, None


def _chunk_loss_and_grad(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, needs_grad: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Summed cross-entropy of one chunk and, if needed, ``softmax - onehot`` in ``x``'s dtype."""
    logits = mm_weight_t(x, weight, x.dtype)
    fp32 = logits.float()
    del logits  # a copy unless the compute dtype is fp32
    target = fp32.gather(1, labels[:, None])
    row_max = fp32.amax(1, keepdim=True)
    fp32.sub_(row_max).exp_()
    sum_exp = fp32.sum(1, keepdim=True)
    loss = (row_max + sum_exp.log() - target).sum()
    if not needs_grad:
        return loss, None
    fp32.div_(sum_exp)
    fp32.scatter_add_(1, labels[:, None], fp32.new_full((labels.numel(), 1), -1.0))
    return loss, fp32.to(x.dtype)


def _chunk_loss(
    output: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    return _LogitsCrossEntropy.apply(output(hidden), labels)


class _LogitsCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of logits ``(n, V)`` in any float dtype, with an fp32 softmax.

    Same values as ``F.cross_entropy(logits.float(), labels, reduction="sum")``, but it saves the logits as they
    are (not an fp32 log-softmax) and its backward holds one fp32 buffer, where autograd's holds three.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        row_max = logits.amax(1, keepdim=True).float()
        shifted = logits - row_max  # fp32: the subtraction promotes
        lse = row_max + shifted.exp_().sum(1, keepdim=True).log()
        del shifted
        ctx.save_for_backward(logits, labels, lse)
        return (lse - logits.gather(1, labels[:, None]).float()).sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[torch.Tensor, None]:
        logits, labels, lse = ctx.saved_tensors
        grad = (logits - lse).exp_()
        grad.scatter_add_(1, labels[:, None], grad.new_full((labels.numel(), 1), -1.0))
        return grad.mul_(grad_output).to(logits.dtype), None


def _label_tokens(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``hidden`` (n, d) and ``labels`` (n,) whose label is not ``ignore_index``."""
    keep = labels != ignore_index
    if bool(keep.all()):  # also the memory estimate's path: fake tensors have no data-dependent shapes
        return hidden, labels
    index = keep.nonzero().squeeze(1)
    return hidden.index_select(0, index), labels.index_select(0, index)


def _plain_weight(output: Any) -> Optional[torch.Tensor]:
    """The weight of an output that is a bias-free linear map by a plain tensor, in its compute dtype or frozen
    (``FrozenLinear``'s, a ``FrozenTiedLinear``'s 16-bit table under fp32 compute: upcast per block), else None."""
    if isinstance(output, TiedLinear):
        weight = output.tied_module.weight
    elif isinstance(output, PrunedOutput):
        pruning = output.pruning
        if isinstance(pruning, FSDPModule):
            return None
        weight = pruning.weight if pruning.output is None else _plain_weight(pruning.output)
    elif type(output) in (nn.Linear, FrozenLinear) and output.bias is None and not isinstance(output, FSDPModule):
        weight = output.weight
    else:
        return None
    if weight is None or (weight.dtype != getattr(output, "compute_dtype", weight.dtype) and weight.requires_grad):
        return None
    # NF4 and sharded (DTensor) weights go through their module; other tensors (fake ones too) are plain.
    return None if isinstance(weight, (NF4Tensor, DTensor)) else weight


def _vocab_size(output: Any) -> Optional[int]:
    if getattr(output, "projection", None) is not None:  # an output around a projection (Gemma 2's capping)
        return _vocab_size(output.projection)
    if isinstance(output, TiedLinear):
        return output.tied_module.weight.shape[0]
    if isinstance(output, PrunedOutput):
        return output.pruning.num_embeddings
    weight = getattr(output, "weight", None)
    return None if weight is None else weight.shape[0]


def _has_fsdp_hooks(output: Any) -> bool:
    """Whether calling the output runs FSDP's hooks (and so collectives) of a unit of its own."""
    module = output.pruning if isinstance(output, PrunedOutput) else output
    return isinstance(module, FSDPModule)


def _check_unsharded(output: Any) -> None:
    if _has_fsdp_hooks(output):
        return
    if isinstance(output, TiedLinear):
        params = [output.tied_module.weight]
    elif isinstance(output, PrunedOutput):
        params = list(output.pruning.parameters())
    else:
        params = list(output.parameters()) if isinstance(output, nn.Module) else []
    if any(isinstance(p, DTensor) for p in params):
        raise RuntimeError(
            "the output projection's parameters are sharded (DTensor) outside the model's forward: keep the root "
            "FSDP unit gathered after forward (model.set_reshard_after_forward(False, recurse=False), or "
            "fully_shard's default reshard_after_forward=None for the root), or make the output an FSDP unit of "
            "its own (fully_shard(model.output))."
        )


def _max_over_ranks(value: int, device: torch.device) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())

"""What an estimate runs besides the model: a set-up, a training step and an optimizer, all arguments of
:class:`~torchtune_ext.memory.MemoryEstimator`.

A recipe passes its own, so that the estimate runs exactly its code: ours does in the recipe file's
``QLoRAFinetuneRecipe(cfg).memory_estimator(cfg)`` (its ``_prepare_model`` and ``_setup_loss``, its
``forward_backward`` and ``optimizer_step``, its configured optimizer). This module holds the peer the
benchmarks compare against, torchtune 0.6.1's ``lora_finetune_single_device`` recipe: its model
(:func:`torchtune_qlora_model`), its set-up of that model (:func:`torchtune_setup`), its step
(:func:`torchtune_train_step`) and its optimizer (:func:`adamw_factory` with ``trainable_only=False``);
:class:`TorchtuneStep` adds its activation offloading and packed batches (``enable_activation_offloading``,
``dataset.packed``).
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Callable, ContextManager, Dict, Optional, Tuple

import torch
from torch import nn
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch.nn.attention.flex_attention import BlockMask, _apply_kernel_options, _identity, create_block_mask
from torch.optim import AdamW, Optimizer
from torchtune import modules, training
from torchtune.modules.attention_utils import _get_document_ids_from_seq_lens
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from torchtune_ext.memory._offload import OffloadedActivations

#: ``step(model, loss_fn, optimizer, batch)``: one full training step (forward, loss, backward, optimizer step).
TrainStep = Callable[[nn.Module, Any, Optimizer, Dict[str, torch.Tensor]], None]
#: ``setup(model, loss_fn, activation_checkpointing)``: what the recipe does to the model before training.
Setup = Callable[[nn.Module, Any, bool], None]
#: ``factory(model) -> optimizer``.
OptimizerFactory = Callable[[nn.Module], Optimizer]


def torchtune_setup(model: nn.Module, loss_fn: Any, activation_checkpointing: bool) -> None:
    """torchtune 0.6.1 ``lora_finetune_single_device``'s set-up of its model (``_setup_model`` and the loss set-up
    of ``setup``): only the adapters train, each decoder layer is activation-checkpointed when asked, and its
    ``CEWithChunkedOutputLoss`` gets the model's chunked logits.

    Args:
        model (nn.Module): torchtune's model (e.g. from :func:`torchtune_qlora_model`).
        loss_fn (Any): the loss; ``CEWithChunkedOutputLoss`` sets the model's number of output chunks.
        activation_checkpointing (bool): wrap each ``TransformerSelfAttentionLayer`` in activation checkpointing.
    """
    set_trainable_params(model, get_adapter_params(model))
    if activation_checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    if isinstance(loss_fn, CEWithChunkedOutputLoss):
        model.set_num_output_chunks(loss_fn.num_output_chunks)


def adamw_factory(
    lr: float = 3e-4, weight_decay: float = 0.01, fused: Optional[bool] = True, trainable_only: bool = True
) -> OptimizerFactory:
    """AdamW as the configs build it (``fused: True``, ``weight_decay: 0.01``, ``lr: 3e-4``).

    Args:
        lr (float): learning rate.
        weight_decay (float): weight decay.
        fused (Optional[bool]): fused kernel (no per-step temporaries); None: torch's default (foreach on CUDA).
        trainable_only (bool): over the params that require grad (our recipes), else over all of
            ``model.parameters()`` (torchtune's recipe; params without a gradient get no state).

    Returns:
        OptimizerFactory: ``factory(model) -> AdamW``.
    """

    def factory(model: nn.Module) -> Optimizer:
        params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
        return AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)

    return factory


def torchtune_train_step(
    model: nn.Module,
    loss_fn: Any,
    optimizer: Optimizer,
    batch: Dict[str, Any],
    activations_handling_ctx: Optional[ContextManager] = None,
) -> None:
    """One step of torchtune 0.6.1's ``lora_finetune_single_device`` (``_loss_step`` and its ``train`` loop, one
    micro-batch that ends a gradient-accumulation step): ``model(**batch)`` in its activations context, shifted
    labels, the loss weighted by the token count, backward, ``scale_grads``, ``optimizer.step()``,
    ``zero_grad(set_to_none=True)``.

    Args:
        model (nn.Module): the model.
        loss_fn (Any): the loss.
        optimizer (Optimizer): the optimizer (torchtune's is over all of ``model.parameters()``).
        batch (Dict[str, Any]): ``tokens`` and ``labels``; packed: also ``input_pos`` and ``mask``.
        activations_handling_ctx (Optional[ContextManager]): the context of the model's forward (its
            ``activations_handling_ctx``: ``OffloadedActivations.for_model``); None: none.
    """
    ignore_index = loss_fn.ignore_index
    batch = dict(batch)
    ignore_labels_cache = torch.full((batch["labels"].shape[0], 1), ignore_index, device=batch["tokens"].device)
    num_tokens = (batch["labels"] != ignore_index).sum()
    labels = batch.pop("labels")
    with activations_handling_ctx or contextlib.nullcontext():
        logits = model(**batch)
    labels = torch.hstack((labels[..., 1:], ignore_labels_cache[: labels.shape[0]]))
    if not isinstance(logits, list):
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    loss = loss_fn(logits, labels)
    del logits
    current_loss = loss * num_tokens
    running_loss = current_loss
    current_loss.backward()
    training.scale_grads(model, 1 / num_tokens)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    running_loss.item() / num_tokens


def torchtune_qlora_model(
    lora_builder: Callable[..., nn.Module], dtype: torch.dtype, device: str = "meta", **builder_kwargs
) -> nn.Module:
    """torchtune's own QLoRA model (``quantize_base=True``: torchao NF4 bases computing in the activations' dtype),
    built as its recipe builds it: under ``set_default_dtype(dtype)`` and the device.

    Args:
        lora_builder (Callable[..., nn.Module]): e.g. ``torchtune.models.llama2.lora_llama2_7b``.
        dtype (torch.dtype): the recipe's ``dtype`` (model, adapters and compute).
        device (str): "meta" (default) for an estimate; "cpu" gives torchtune's random init.
        **builder_kwargs: ``lora_attn_modules``, ``apply_lora_to_mlp``, ``lora_rank``, ...

    Returns:
        nn.Module: the model.
    """
    with training.set_default_dtype(dtype), torch.device(device):
        return lora_builder(quantize_base=True, **builder_kwargs)


def packed_batch(batch_size: int, seq_len: int, device: torch.device) -> Dict[str, Any]:
    """What torchtune's ``padded_collate_packed`` adds to a batch of ``PackedDataset`` packs on a GPU where torchtune
    uses flex attention (``_SUPPORTS_FLEX_ATTENTION``: CUDA sm75+): ``input_pos`` (int64, one per token) and the
    block-causal ``BlockMask`` as ``packed_block_causal_mask`` makes it there (its ``create_block_mask`` of the
    document mask, on the device; its document ``mask_mod`` is written again here because torchtune's function takes
    the flex path only where CUDA is available). One document per pack: the mask's tensors have the same shapes for
    any documents.

    Args:
        batch_size (int): packs per batch.
        seq_len (int): tokens per pack (``tokenizer.max_seq_len``).
        device (torch.device): the batch's device.

    Returns:
        Dict[str, Any]: ``input_pos`` and ``mask``.
    """
    seq_lens = [torch.tensor([seq_len]) for _ in range(batch_size)]
    document_ids = _get_document_ids_from_seq_lens(seq_lens).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    input_pos = torch.arange(seq_len, device=device).repeat(batch_size, 1)
    return {"input_pos": input_pos, "mask": create_block_mask(mask_mod, batch_size, None, seq_len, seq_len, device)}


def captured_tensors(fn: Callable) -> Tuple[torch.Tensor, ...]:
    """The tensors ``fn``'s closure captures (a ``mask_mod``'s document ids), in the closure's order."""
    return tuple(cell.cell_contents for cell in fn.__closure__ or () if isinstance(cell.cell_contents, torch.Tensor))


def with_captured_tensors(fn: Callable, tensors: Tuple[torch.Tensor, ...]) -> Callable:
    """``fn`` with the tensors its closure captures replaced, in order, by ``tensors``
    (:func:`captured_tensors`'s order)."""
    replacements = iter(tensors)
    closure = tuple(
        types.CellType(next(replacements)) if isinstance(cell.cell_contents, torch.Tensor) else cell
        for cell in fn.__closure__ or ()
    )
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure or None)


def _lift_captured_tensors(mask_mod: Callable) -> Tuple[Callable, Tuple[torch.Tensor, ...]]:
    """``mask_mod`` with the tensors its closure captures turned into trailing arguments, and those tensors: what
    dynamo does before it calls flex attention's op. Written here, not taken from torch's private helpers, which
    torch 2.10 and 2.11 (Kaggle, Colab) lack."""

    def lifted(b, h, q_idx, kv_idx, *tensors):
        return with_captured_tensors(mask_mod, tensors)(b, h, q_idx, kv_idx)

    return lifted, captured_tensors(mask_mod)


def flex_or_sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float, is_causal: bool
) -> torch.Tensor:
    """torchtune's ``_attention_call`` where it supports flex attention (CUDA sm75+): flex attention for a
    ``BlockMask``, else SDPA. Flex attention is its op, ``torch.ops.higher_order.flex_attention``, called as
    ``torch.compile(flex_attention)`` calls it (on fake CPU tensors the public function refuses a backward): the
    tensors ``mask_mod`` captures (torchtune's document ids) passed as its buffers, as dynamo lifts them."""
    if isinstance(mask, BlockMask):
        if dropout_p > 0.0:
            raise ValueError("Flex attention does not support dropout. Please set dropout to 0.0.")
        mask_mod, buffers = _lift_captured_tensors(mask.mask_mod)
        options = _apply_kernel_options(q, k, v, False, None)
        scale = 1.0 / math.sqrt(q.size(-1))
        out, _, _ = flex_attention_hop(
            q, k, v, _identity, (*mask.as_tuple()[:-1], mask_mod), scale, options, (), buffers
        )
        return out
    if mask is not None:
        mask = mask[:, None, :, :]
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


class TorchtuneStep:
    """torchtune 0.6.1's ``lora_finetune_single_device`` set-up and step with its ``enable_activation_offloading``
    and ``dataset.packed`` settings, as an estimate's ``setup`` (:meth:`setup`, or ``compiled_setup(step.setup)``
    for ``compile=True``) and ``train_step`` (the instance).

    Args:
        activation_offloading (bool): its activation offloading (``OffloadedActivations.for_model``).
        packed (bool): packed batches (:func:`packed_batch`: each sequence a pack of ``seq_len`` tokens), the
            attention as torchtune calls it on such a GPU (:func:`flex_or_sdpa_attention`).
    """

    def __init__(self, activation_offloading: bool = False, packed: bool = False):
        self.activation_offloading = activation_offloading
        self.packed = packed
        self.activations_handling_ctx: Optional[ContextManager] = None

    def setup(self, model: nn.Module, loss_fn: Any, activation_checkpointing: bool) -> None:
        """:func:`torchtune_setup`, then (as its ``_setup_model`` does last) the activations context."""
        torchtune_setup(model, loss_fn, activation_checkpointing)
        if self.packed:
            for module in model.modules():
                if isinstance(module, modules.MultiHeadAttention):
                    module._attention_call = flex_or_sdpa_attention
        if self.activation_offloading:
            self.activations_handling_ctx = OffloadedActivations.for_model(model)

    def __call__(self, model: nn.Module, loss_fn: Any, optimizer: Optimizer, batch: Dict[str, Any]) -> None:
        if self.packed:
            tokens = batch["tokens"]
            batch = {**batch, **packed_batch(tokens.shape[0], tokens.shape[1], tokens.device)}
        torchtune_train_step(model, loss_fn, optimizer, batch, self.activations_handling_ctx)

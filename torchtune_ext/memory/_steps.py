"""What an estimate runs besides the model: a set-up, a training step and an optimizer, all arguments of
:class:`~torchtune_ext.memory.MemoryEstimator`.

A recipe passes its own, so that the estimate runs exactly its code: ours does in
``torchtune_ext.training.QLoRARecipe.memory_estimator`` (its ``_prepare_model`` and ``_setup_loss``, its
``forward_backward`` and ``optimizer_step``, its configured optimizer). This module holds the peer the
benchmarks compare against, torchtune 0.6.1's ``lora_finetune_single_device`` recipe: its model
(:func:`torchtune_qlora_model`), its set-up of that model (:func:`torchtune_setup`), its step
(:func:`torchtune_train_step`) and its optimizer (:func:`adamw_factory` with ``trainable_only=False``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from torch import nn
from torch.optim import AdamW, Optimizer
from torchtune import modules, training
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.modules.peft import get_adapter_params, set_trainable_params

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


def torchtune_train_step(model: nn.Module, loss_fn: Any, optimizer: Optimizer, batch: Dict[str, torch.Tensor]) -> None:
    """One step of torchtune 0.6.1's ``lora_finetune_single_device`` (``_loss_step`` and its ``train`` loop, one
    micro-batch that ends a gradient-accumulation step): ``model(tokens)``, shifted labels, the loss weighted by the
    token count, backward, ``scale_grads``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``.

    Args:
        model (nn.Module): the model.
        loss_fn (Any): the loss.
        optimizer (Optimizer): the optimizer (torchtune's is over all of ``model.parameters()``).
        batch (Dict[str, torch.Tensor]): ``tokens`` and ``labels``.
    """
    ignore_index = loss_fn.ignore_index
    batch = dict(batch)
    ignore_labels_cache = torch.full((batch["labels"].shape[0], 1), ignore_index, device=batch["tokens"].device)
    num_tokens = (batch["labels"] != ignore_index).sum()
    labels = batch.pop("labels")
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

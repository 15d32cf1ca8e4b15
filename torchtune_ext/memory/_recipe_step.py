"""The dry run's own step: a recipe's training step, estimated on a copy of the recipe so that the live one is
never rewritten."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Protocol, Tuple, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from torchtune_ext.memory._estimator import MemoryEstimator


class RecipeStep(Protocol):
    """What an estimate runs of a recipe: one micro-batch and the update (the recipe file's class,
    ``recipes/qlora_finetune_single_device.py``'s ``QLoRAFinetuneRecipe``, or a copy's)."""

    def forward_backward(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss and backward of a micro-batch: (weighted loss, label-token count)."""

    def optimizer_step(self, num_tokens: torch.Tensor) -> Any:
        """The optimizer step over ``num_tokens`` label tokens."""


R = TypeVar("R", bound=RecipeStep)

_STEP_METHODS = ("forward_backward", "optimizer_step")


def check_recipe_step(recipe: Any) -> None:
    """Refuses a recipe without a training step to estimate, such as the library's ``QLoRARecipe`` (the step is the
    recipe file's), naming the class to estimate instead.

    Args:
        recipe (Any): the recipe whose step is to be estimated.

    Raises:
        TypeError: if it lacks ``forward_backward`` or ``optimizer_step``.
    """
    missing = [name for name in _STEP_METHODS if not callable(getattr(recipe, name, None))]
    if missing:
        raise TypeError(
            f"{type(recipe).__name__} has no training step to estimate (no {' or '.join(missing)}): the step is the "
            "recipe file's. Estimate the recipe file's class instead: `from recipes.qlora_finetune_single_device "
            "import QLoRAFinetuneRecipe`, then `QLoRAFinetuneRecipe(cfg).memory_estimator(cfg)` (or your copy's class)."
        )


def recipe_step_estimator(
    recipe: R,
    model: nn.Module,
    *,
    bind: Callable[[R, nn.Module, Any], None],
    optimizer: Callable[[R, nn.Module], Optimizer],
    loss_fn: Any,
    **estimator_kwargs: Any,
) -> MemoryEstimator:
    """An estimator of ``recipe``'s own training step (its ``forward_backward`` and ``optimizer_step``, overrides
    included), run on a shallow copy of the recipe: the copy gets the estimate's model, loss and optimizer; the
    recipe keeps its own.

    Args:
        recipe (R): the recipe (any object with ``forward_backward`` and ``optimizer_step``).
        model (nn.Module): the model on the meta device, or a real one with ``fake=False`` (see
            :class:`MemoryEstimator`).
        bind (Callable[[R, nn.Module, Any], None]): ``bind(step_recipe, model, loss_fn)`` gives the copy the
            estimate's model (fake) and loss and prepares the model as the recipe does for training.
        optimizer (Callable[[R, nn.Module], Optimizer]): ``optimizer(step_recipe, model)``: the copy's optimizer
            (and whatever its ``optimizer_step`` uses with it).
        loss_fn (Any): the loss.
        **estimator_kwargs: the other :class:`MemoryEstimator` arguments (``activation_checkpointing``, ``dtype``,
            ``gradient_accumulation_steps``, ``allowance``, ``fake``).

    Returns:
        MemoryEstimator: the estimator.

    Raises:
        TypeError: if ``recipe`` has no training step (:func:`check_recipe_step`).
    """
    check_recipe_step(recipe)
    step = copy.copy(recipe)

    def setup(step_model: nn.Module, step_loss: Any, activation_checkpointing: bool) -> None:
        bind(step, step_model, step_loss)

    def train_step(step_model: nn.Module, step_loss: Any, step_optimizer: Any, batch: Dict[str, torch.Tensor]) -> None:
        _, batch_tokens = step.forward_backward(batch)
        step.optimizer_step(batch_tokens)

    return MemoryEstimator(
        model,
        setup=setup,
        optimizer_factory=lambda step_model: optimizer(step, step_model),
        train_step=train_step,
        loss_fn=loss_fn,
        **estimator_kwargs,
    )

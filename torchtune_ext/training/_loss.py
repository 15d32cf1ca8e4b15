"""The step's loss over a micro-batch's label tokens, whatever form the model's output takes."""

from typing import List, Union

import torch
from torch import nn

from torchtune_ext.modules.loss import LinearCrossEntropyLoss


def token_mean_loss(
    loss_fn: nn.Module, output: Union[torch.Tensor, List[torch.Tensor]], labels: torch.Tensor
) -> torch.Tensor:
    """The mean loss over the label tokens, 0 (with a gradient graph) where there are none.

    torchtune's losses give nan without label tokens; such a micro-batch still runs backward (FSDP's collectives) and
    must contribute zero. ``LinearCrossEntropyLoss`` gives 0 itself, keeping its output calls equal across ranks.

    Args:
        loss_fn (nn.Module): the recipe's loss (``ignore_index`` marks tokens without a label).
        output (Union[torch.Tensor, List[torch.Tensor]]): hidden states for ``LinearCrossEntropyLoss``, else logits,
            or their chunks for torchtune's ``CEWithChunkedOutputLoss``.
        labels (torch.Tensor): the shifted labels, ``[batch, seq_len]``.

    Returns:
        torch.Tensor: a scalar.
    """
    if not isinstance(output, list):
        labels = labels.reshape(-1)
        output = output.reshape(-1, output.size(-1))
    loss = loss_fn(output, labels)
    if not isinstance(loss_fn, LinearCrossEntropyLoss) and not (labels != loss_fn.ignore_index).any():
        loss = sum(chunk.sum() for chunk in (output if isinstance(output, list) else [output])) * 0.0
    return loss

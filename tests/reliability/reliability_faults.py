"""Test-only fault injection for the recipes, selected from the config (``loss._component_``) of a test run.

:class:`CEWithChunkedOutputLoss` is torchtune's chunked cross-entropy (the tiny configs' loss) plus one optional
fault at given training steps, on one rank or all:

- ``fault=pause``: write ``marker`` (this process's pid) and sleep forever: the test SIGKILLs the process there
  (a crash mid-training), or leaves it stalled (a hung rank).
- ``fault=raise``: raise a RuntimeError (a rank that fails in step k).
- ``fault=oom``: raise ``torch.OutOfMemoryError`` with the CUDA allocator's message (a step that does not fit).
- ``fault=scale_grad``: leave the loss value alone but multiply its gradient by ``grad_factor`` (fp16 overflow).
- ``fault=signal``: send this process the signal ``signum`` (an interrupt at an exact step).

A subclass, so that the recipes recognise the chunked loss (``isinstance``) and chunk the model's output. Steps
are counted as training forward calls (with gradients enabled, so validation does not count), which equals the
global step with ``gradient_accumulation_steps=1`` in a fresh (not resumed) run.
"""

import os
import signal
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from torchtune.modules import loss as tune_loss

FAULTS = ("pause", "raise", "oom", "scale_grad", "signal")
#: what the CUDA caching allocator says when a step does not fit (torch 2.13, a 16 GB T4).
CUDA_OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.74 GiB of which 1.12 GiB is "
    "free. Of the allocated memory 12.90 GiB is allocated by PyTorch, and 0.51 GiB is reserved by PyTorch but "
    "unallocated."
)


def pause_here(marker: str) -> None:
    """Announces this process's pid in ``marker`` (written atomically) and sleeps until killed."""
    path = Path(marker)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, path)
    while True:
        time.sleep(1)


def this_rank() -> int:
    """The process's global rank (0 outside a distributed launch)."""
    return int(os.environ.get("RANK", "0"))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` in backward."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class CEWithChunkedOutputLoss(tune_loss.CEWithChunkedOutputLoss):
    """torchtune's ``CEWithChunkedOutputLoss`` with an injected fault at ``steps`` (1-based training steps).

    Args:
        num_output_chunks (int): as torchtune's.
        ignore_index (int): as torchtune's.
        fault (Optional[str]): ``pause``, ``raise``, ``oom``, ``scale_grad``, ``signal`` or None (a plain loss).
        steps (Sequence[int]): the steps the fault happens at.
        rank (Optional[int]): only this rank injects the fault; None: every rank.
        marker (Optional[str]): file written by ``pause``.
        grad_factor (float): gradient multiplier of ``scale_grad``.
        signum (int): the signal of ``signal``.
    """

    def __init__(
        self,
        num_output_chunks: int = 8,
        ignore_index: int = -100,
        fault: Optional[str] = None,
        steps: Sequence[int] = (),
        rank: Optional[int] = None,
        marker: Optional[str] = None,
        grad_factor: float = 1e12,
        signum: int = signal.SIGINT,
    ):
        super().__init__(num_output_chunks=num_output_chunks, ignore_index=ignore_index)
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault={fault!r}; use one of {FAULTS}")
        if fault == "pause" and not marker:
            raise ValueError("fault=pause needs a marker file")
        self.fault = fault
        self.steps = {int(s) for s in steps}
        self.rank = rank
        self.marker = marker
        self.grad_factor = float(grad_factor)
        self.signum = int(signum)
        self.training_calls = 0

    def forward(self, logits: List[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        loss = super().forward(logits, labels)
        if not torch.is_grad_enabled():
            return loss
        self.training_calls += 1
        if self.fault is None or self.training_calls not in self.steps:
            return loss
        if self.rank is not None and self.rank != this_rank():
            return loss
        if self.fault == "pause":
            pause_here(self.marker)
        if self.fault == "signal":
            os.kill(os.getpid(), self.signum)
            return loss
        if self.fault == "raise":
            raise RuntimeError(f"injected fault: rank {this_rank()} fails in step {self.training_calls}")
        if self.fault == "oom":
            raise torch.OutOfMemoryError(CUDA_OOM_MESSAGE)
        return _ScaleGrad.apply(loss, self.grad_factor)

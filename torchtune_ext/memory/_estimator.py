"""Estimate the peak device memory of a training step by running it on fake tensors."""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_ext.memory._estimate import GIB, DeviceAllowance, MemoryEstimate, allowances
from torchtune_ext.memory._fake import accelerator_code_path, to_fake_model
from torchtune_ext.memory._steps import OptimizerFactory, Setup, TrainStep, adamw_factory
from torchtune_ext.memory._tracker import (
    ADAPTERS,
    BUFFERS,
    FROZEN_WEIGHTS,
    GRADS,
    NF4_WEIGHTS,
    LiveStorageTracker,
    TrackerResult,
)
from torchtune_ext.modules.rope import share_rope_

_NOTES_FAKE = (
    "ran on fake CPU tensors (FakeTensorMode): every op of the step ran with shapes and dtypes, no data; host "
    "reads (.item(), bool()) returned placeholders (every position has a label, the optimizer step is taken), or "
    "the value where FakeTensorMode knows it (an optimizer's step count)",
    "our NF4 linear ran its accelerator branch (whole-weight dequantization), as on a GPU; attention ran the CPU "
    "flash kernel, whose outputs (output, fp32 logsumexp) are those of the CUDA kernels",
)
_NOTE_WARM = (
    "steady state: a warm-up optimizer step allocated the optimizer state first (every step after the first "
    "holds it through forward and backward)"
)
_NOTE_FIRST = "first step: the optimizer state is allocated by this step's optimizer step"
_NOTES = (
    "counted analytically: the CUDA attention backward kernels' internal workspace (fp32 dQ accumulator and row "
    "sums, for the op's duration); the CUDA context, cuBLAS workspace and allocator fragmentation (allowances)",
)


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype NF4 weights dequantize to (our builders' compute dtype), else that of the first float param."""
    params = list(model.parameters())
    for param in params:
        if is_traceable_wrapper_subclass(param):
            return param.dtype
    return next(p.dtype for p in params if p.is_floating_point())


def _register_model(tracker: LiveStorageTracker, model: nn.Module) -> None:
    for param in model.parameters():
        if is_traceable_wrapper_subclass(param):
            kind = NF4_WEIGHTS
        else:
            kind = ADAPTERS if param.requires_grad else FROZEN_WEIGHTS
        tracker.register(param, kind)
    for buffer in model.buffers():
        tracker.register(buffer, BUFFERS)


def _head_after(model: nn.Module) -> Optional[nn.Module]:
    layers = getattr(model, "layers", None)
    return layers[-1] if isinstance(layers, nn.ModuleList) and len(layers) else None


def _max_seq_len(model: nn.Module) -> Optional[int]:
    value = getattr(model, "max_seq_len", None)
    return int(value) if isinstance(value, int) else None


class MemoryEstimator:
    """Estimates the peak device memory of a training step of ``model`` without allocating it.

    The model (built on the meta device, e.g. by ``torchtune_ext.models.qlora_llama3_1_8b(..., device="meta")``) is
    copied once onto fake CPU tensors and set up as the recipe sets it up (``setup``); each :meth:`estimate` then runs
    a warm-up optimizer step (to allocate the optimizer state every later step holds) and one full ``train_step`` on
    a batch of ``batch_size`` sequences padded to ``seq_len``, under a tracker that counts every storage the ops
    create and free.

    The set-up and the step are the recipe's own, never an imitation: our recipe's come with the recipe file's
    ``QLoRAFinetuneRecipe(cfg).memory_estimator(cfg)`` (:func:`~torchtune_ext.memory.recipe_step_estimator`),
    torchtune's are :func:`torchtune_setup` and :func:`torchtune_train_step`.

    Args:
        model (nn.Module): the model on the meta device (left untouched), or, with ``fake=False``, a real model (set
            up in place; for validation).
        train_step (TrainStep): ``step(model, loss_fn, optimizer, batch)``: the recipe's full training step.
        setup (Setup): ``setup(model, loss_fn, activation_checkpointing)``: the recipe's set-up of the model.
        activation_checkpointing (bool): checkpoint each decoder layer (``enable_activation_checkpointing``), passed
            to ``setup``.
        loss_fn (Optional[Any]): the loss; default ``CEWithChunkedOutputLoss()`` (8 chunks).
        optimizer_factory (Optional[OptimizerFactory]): ``factory(model) -> optimizer``; default fused AdamW over the
            trainable params (:func:`adamw_factory`).
        dtype (Optional[torch.dtype]): compute dtype (for the report); default: the NF4 weights'.
        gradient_accumulation_steps (int): > 1: the gradients of earlier micro-batches are live through the step.
        allowance (Optional[DeviceAllowance]): CUDA context and fragmentation allowances; default ``DeviceAllowance()``.
        fake (bool): run on fake tensors (default); False runs ``model``'s real tensors (validation on CPU).
        warm_start (bool): allocate the optimizer state before the step (the steady state); False: the first step.
        round_bytes (int): allocation granularity (512: CUDA's caching allocator).
        pad_id (int): token id of the batch.
        attention_backend (Optional[str]): the device's SDPA kernel for ``dtype`` (``"flash"``, ``"efficient"``:
            :meth:`torchtune_ext.memory.DeviceProfile.sdpa_backend`), whose backward workspace is counted; None:
            as on sm80+.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        train_step: TrainStep,
        setup: Setup,
        activation_checkpointing: bool = True,
        loss_fn: Optional[Any] = None,
        optimizer_factory: Optional[OptimizerFactory] = None,
        dtype: Optional[torch.dtype] = None,
        gradient_accumulation_steps: int = 1,
        allowance: Optional[DeviceAllowance] = None,
        fake: bool = True,
        warm_start: bool = True,
        round_bytes: int = 512,
        pad_id: int = 0,
        attention_backend: Optional[str] = None,
    ):
        self.dtype = dtype or _compute_dtype(model)
        self.loss_fn = loss_fn if loss_fn is not None else CEWithChunkedOutputLoss()
        self.optimizer_factory = optimizer_factory or adamw_factory()
        self.train_step = train_step
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.allowance = allowance or DeviceAllowance()
        self.warm_start = warm_start
        self.round_bytes = round_bytes
        self.pad_id = pad_id
        self.attention_backend = attention_backend
        self.activation_checkpointing = activation_checkpointing
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        self.model = to_fake_model(model, self.fake_mode) if fake else model
        setup(self.model, self.loss_fn, activation_checkpointing)
        self.max_seq_len = _max_seq_len(model)
        self._notes = (*(_NOTES_FAKE if fake else ()), _NOTE_WARM if warm_start else _NOTE_FIRST, *_NOTES)
        self._estimates: Dict[Tuple[int, int], MemoryEstimate] = {}

    # ------------------------------------------------------------------------------------------------ running

    def _batch(self, batch_size: int, seq_len: int) -> Dict[str, torch.Tensor]:
        tokens = torch.full((batch_size, seq_len), self.pad_id, dtype=torch.long)
        return {"tokens": tokens, "labels": torch.zeros((batch_size, seq_len), dtype=torch.long)}

    def _warm_up(self, tracker: LiveStorageTracker, optimizer: torch.optim.Optimizer) -> None:
        """Allocates the optimizer state as the first step does (zero gradients, one optimizer step); the
        gradients stay when gradient accumulation keeps earlier micro-batches' gradients through the step."""
        tracker.set_stage("warm-up")
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        for param in trainable:
            param.grad = torch.zeros_like(param)
            tracker.retag(param.grad, GRADS)
        optimizer.step()
        if self.gradient_accumulation_steps == 1:
            optimizer.zero_grad(set_to_none=True)
        tracker.set_stage("step")

    def _run(self, batch_size: int, seq_len: int) -> TrackerResult:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        tracker = LiveStorageTracker(round_bytes=self.round_bytes, attention_backend=self.attention_backend)
        tracker.watch(self.model, head_after=_head_after(self.model))
        handles = [p.register_post_accumulate_grad_hook(lambda p: tracker.retag(p.grad, GRADS)) for p in trainable]
        try:
            with ExitStack() as stack:
                if self.fake_mode is not None:
                    stack.enter_context(self.fake_mode)
                stack.enter_context(accelerator_code_path())
                stack.enter_context(torch.enable_grad())
                share_rope_(self.model, seq_len)  # the one RoPE cache of a run padded to seq_len (issue 25)
                stack.enter_context(tracker)
                _register_model(tracker, self.model)
                optimizer = self.optimizer_factory(self.model)
                if self.warm_start:
                    self._warm_up(tracker, optimizer)
                self.train_step(self.model, self.loss_fn, optimizer, self._batch(batch_size, seq_len))
                del optimizer
            return tracker.result()
        finally:
            for handle in handles:
                handle.remove()
            for param in trainable:
                param.grad = None

    def estimate(self, batch_size: int, seq_len: int) -> MemoryEstimate:
        """Runs one training step of ``batch_size`` sequences of ``seq_len`` tokens and reports its peak (estimates
        are kept: asking again for the same shape returns the same estimate).

        Args:
            batch_size (int): sequences per step.
            seq_len (int): tokens per sequence (every sample padded to it).

        Returns:
            MemoryEstimate: the peak, its breakdown by category and the allowances.

        Raises:
            ValueError: if ``seq_len`` exceeds the model's ``max_seq_len`` (its RoPE cache).
        """
        if self.max_seq_len is not None and seq_len > self.max_seq_len:
            raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={self.max_seq_len}")
        if (batch_size, seq_len) in self._estimates:
            return self._estimates[batch_size, seq_len]
        start = time.perf_counter()
        result = self._run(batch_size, seq_len)
        fragmentation, context = allowances(result.breakdown, self.allowance)
        estimate = MemoryEstimate(
            peak_bytes=result.peak_bytes,
            breakdown=result.breakdown,
            phase=result.phase,
            where=result.where,
            phase_peaks=result.phase_peaks,
            cuda_context_bytes=context,
            fragmentation_bytes=fragmentation,
            batch_size=batch_size,
            seq_len=seq_len,
            dtype=self.dtype,
            notes=self._notes,
            host_bytes=result.host_bytes,
            pinned_host_bytes=result.pinned_host_peak_bytes,
            seconds=time.perf_counter() - start,
        )
        self._estimates[batch_size, seq_len] = estimate
        return estimate

    # ------------------------------------------------------------------------------------------------- search

    def fits(self, memory_gib: float, batch_size: int, seq_len: int) -> bool:
        """Whether a step of ``batch_size`` x ``seq_len`` fits on a device of ``memory_gib`` GiB.

        Args:
            memory_gib (float): device memory in GiB (2**30 bytes).
            batch_size (int): sequences per step.
            seq_len (int): tokens per sequence.

        Returns:
            bool: True if the estimate, allowances included, fits.
        """
        return self.estimate(batch_size, seq_len).fits(memory_gib)

    def max_seq_len_that_fits(
        self,
        memory_gib: float,
        batch_size: int = 1,
        multiple_of: int = 1,
        upper: Optional[int] = None,
        allowance: Optional[DeviceAllowance] = None,
    ) -> int:
        """The longest sequence length (a multiple of ``multiple_of``) whose step fits in ``memory_gib`` GiB.

        Memory grows almost linearly with the sequence length, so each next length to try is where the line
        through the two nearest estimates crosses the budget (the first from the persistent memory and one
        estimate), rounded, then its neighbour: typically 3-5 estimates rather than a bisection's ~17; it bisects
        if interpolation stalls. Every answer is checked: the length fits and the next multiple does not.

        Args:
            memory_gib (float): device memory in GiB (2**30 bytes).
            batch_size (int): sequences per step.
            multiple_of (int): granularity of the answer.
            upper (Optional[int]): the longest length to consider; default the model's ``max_seq_len``.
            allowance (Optional[DeviceAllowance]): allowances for this search; default the estimator's.

        Returns:
            int: the length; 0 if not even ``multiple_of`` tokens fit.

        Raises:
            ValueError: if no upper bound is given and the model has no ``max_seq_len``.
        """
        upper = upper or self.max_seq_len
        if upper is None:
            raise ValueError("pass upper=: the model has no max_seq_len")
        top = upper // multiple_of
        fixed: List[int] = []

        def need(units: int) -> int:
            estimate = self.estimate(batch_size, units * multiple_of)
            if allowance is not None:
                estimate = estimate.with_allowance(allowance)
            fixed.append(estimate.persistent_bytes + estimate.cuda_context_bytes)
            return estimate.device_bytes

        start = min(top, max(1, 2048 // multiple_of))
        return _longest_fitting(need, memory_gib * GIB, top, start, fixed) * multiple_of


def _longest_fitting(need: Callable[[int], int], budget: float, top: int, start: int, fixed: List[int]) -> int:
    """The largest x in [1, top] with need(x) <= budget (0 if none), for a nondecreasing, nearly linear need.

    Secant steps through the last two evaluations (the first one anchored at x = 0 on ``fixed[0]``, the part of
    need that does not depend on x), kept inside the bracket of known answers; a bisection instead when a step is
    not at most half the previous one (Dekker's rule), so it never takes more than about twice a bisection's count.
    """
    values: Dict[int, float] = {}
    order: List[int] = []
    lo, hi = 0, top + 1  # need(lo) fits (0: nothing), need(hi) does not (top + 1: beyond the range)
    x, last_step = start, math.inf
    while hi - lo > 1:
        values[x] = need(x)
        order.append(x)
        if values[x] <= budget:
            lo = x
        else:
            hi = x
        if hi - lo <= 1:
            break
        x0, v0 = (order[-2], values[order[-2]]) if len(order) > 1 else (0, fixed[0])
        guess = _secant_guess(x0, v0, order[-1], values[order[-1]], budget, lo, hi)
        step = abs(guess - order[-1])
        if step > last_step / 2 and step > 1:  # interpolation is not converging: bisect (Dekker's rule)
            guess = (lo + hi) // 2
            step = abs(guess - order[-1])
        x, last_step = guess, step
    return lo


def _secant_guess(x0: int, v0: float, x1: int, v1: float, budget: float, lo: int, hi: int) -> int:
    """floor() of where the line through (x0, v0) and (x1, v1) crosses ``budget``, kept inside (lo, hi)."""
    root = x0 + (budget - v0) * (x1 - x0) / (v1 - v0) if v1 != v0 else float("nan")
    guess = math.floor(root) if math.isfinite(root) else (lo + hi) // 2
    return min(max(guess, lo + 1), hi - 1)


__all__: List[str] = ["MemoryEstimator"]

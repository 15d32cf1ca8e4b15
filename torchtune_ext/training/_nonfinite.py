"""The non-finite guard: a diverged run stops at the step it diverges, and nothing non-finite is ever written.

- fp32 / bf16: a NaN or infinite loss or gradient norm stops the run at that step (:class:`NonFiniteError`), before
  any later save: the last checkpoint written stays the latest, and it is finite.
- fp16: the loss scaler skips a step whose gradients overflow (that is its job); skipped steps are counted and shown
  in the progress bar and the summary. A run of them stops the same way: every step since the last save skipped (at
  least two), or the loss scale fallen below its floor (``loss_scaler.min_scale``).
- Before any save, the adapters are checked (NaN, infinity, or under fp16 beyond fp16's range, which the fp16
  compute cannot use). Collective: every rank stops together.
- After the load, the base weights are checked once: each NF4 weight's scale mean (a NaN or an infinity anywhere in
  the weight makes it non-finite) and each dense weight, naming the tensor.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ext._finite import NonFiniteError, all_finite
from torchtune_ext.checkpoint import is_adapter_key
from torchtune_ext.distributed import all_reduce_sum, unwrap_key
from torchtune_ext.nf4 import NF4Tensor
from torchtune_ext.training._precision import LossScaler

__all__ = ["NonFiniteError", "NonFiniteGuard", "check_base_finite", "nonfinite_adapters"]

#: the gradient-norm limit the advice suggests where the run clips at no lower one.
SUGGESTED_CLIP_GRAD_NORM = 1.0
#: a run of at least this many skipped fp16 steps covering every step since the last save stops the run.
MIN_SKIPPED_RUN = 2


class NonFiniteGuard:
    """Watches each optimizer step and each save of a run for non-finite values (see the module docstring).

    Args:
        loss_scaler (LossScaler): the run's loss scaler (enabled: fp16).
        clip_grad_norm (Optional[float]): the run's ``clip_grad_norm`` (the advice suggests clipping only above
            :data:`SUGGESTED_CLIP_GRAD_NORM` or without it).
    """

    def __init__(self, loss_scaler: LossScaler, clip_grad_norm: Optional[float]):
        self._scaler = loss_scaler
        self.advice = _advice(clip_grad_norm)
        self.fp16 = loss_scaler.enabled
        self.steps = 0  # optimizer steps of this run
        self.skipped = 0  # of which skipped (fp16)
        self._skipped_before = self._skipped_total = loss_scaler.skipped_steps
        self._consecutive = 0
        self._since_save = 0

    def check_step(self, step: int, loss: float, metrics: Dict[str, float], lr: float, last: Optional[Path]) -> None:
        """Call after each optimizer step.

        Args:
            step (int): the global step just taken.
            loss (float): its loss.
            metrics (Dict[str, float]): its metrics (``grad_norm``).
            lr (float): its learning rate.
            last (Optional[Path]): the last checkpoint written (for the message).

        Raises:
            NonFiniteError: on a non-finite loss or gradient norm (fp32/bf16), or a run of skipped steps (fp16).
        """
        self.steps += 1
        self._since_save += 1
        if not self.fp16:
            grad_norm = metrics.get("grad_norm", 0.0)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteError(
                    _message(step, f"the loss is {loss} and the gradient norm {grad_norm}", lr, last)
                    + f" {self.advice}."
                )
            return
        skipped = self._scaler.skipped_steps > self._skipped_total
        self._skipped_total = self._scaler.skipped_steps
        self.skipped += int(skipped)
        self._consecutive = self._consecutive + 1 if skipped else 0
        scale = self._scaler.get_scale()
        if skipped and scale < self._scaler.min_scale:
            raise NonFiniteError(
                _message(
                    step,
                    f"fp16 gradients overflowed in the last {self._consecutive} steps (all skipped) and the loss scale "
                    f"fell to {scale:g}, below its floor loss_scaler.min_scale={self._scaler.min_scale:g}",
                    lr,
                    last,
                )
                + f" {self.advice}; or dtype=bf16 where the GPU has it."
            )

    def check_before_save(
        self,
        step: int,
        lr: float,
        last: Optional[Path],
        adapters: Iterable[Tuple[str, torch.Tensor]],
        compute_dtype: torch.dtype,
    ) -> None:
        """Call before each save, on every rank (collective).

        Args:
            step (int): the global step being saved.
            lr (float): the current learning rate.
            last (Optional[Path]): the last checkpoint written (for the message).
            adapters (Iterable[Tuple[str, torch.Tensor]]): ``(key, param)`` of every adapter.
            compute_dtype (torch.dtype): the compute dtype.

        Raises:
            NonFiniteError: if every step since the last save (at least :data:`MIN_SKIPPED_RUN`) was skipped (fp16),
                or an adapter is not finite in ``compute_dtype``.
        """
        since, self._since_save = self._since_save, 0
        if self.fp16 and since >= MIN_SKIPPED_RUN and self._consecutive >= since:
            what = f"every one of the {since} steps since the last save was skipped (fp16 overflow)"
            raise NonFiniteError(f"{_message(step, what, lr, last)} {self.advice}; or dtype=bf16 where the GPU has it.")
        bad = nonfinite_adapters(adapters, compute_dtype)
        if bad:
            what = (
                f"{len(bad)} adapter tensor(s) hold NaN, infinite or (in {compute_dtype}) out-of-range values, e.g. "
                f"{bad[:4]}"
            )
            raise NonFiniteError(f"{_message(step, what, lr, last)} {self.advice}.")

    def progress(self) -> str:
        """The progress bar's addition: fp16's skipped steps so far (empty otherwise)."""
        return f"|skipped: {self._scaler.skipped_steps - self._skipped_before}" if self.fp16 else ""

    def summary(self) -> List[str]:
        """The summary's lines: fp16's skipped steps and loss scale (none otherwise)."""
        if not self.fp16:
            return []
        return [
            f"  skipped steps (fp16): {self.skipped} of {self.steps} (gradients overflowed); loss scale now "
            f"{self._scaler.get_scale():g}"
        ]


def _advice(clip_grad_norm: Optional[float]) -> str:
    advice = "Try a lower optimizer.lr (e.g. 10x lower)"
    if clip_grad_norm is not None and clip_grad_norm <= SUGGESTED_CLIP_GRAD_NORM:
        return f"{advice} or a longer lr_scheduler.num_warmup_steps (clip_grad_norm={clip_grad_norm:g} already clips)"
    return f"{advice}, a longer lr_scheduler.num_warmup_steps, or clip_grad_norm={SUGGESTED_CLIP_GRAD_NORM:g}"


def _message(step: int, what: str, lr: float, last: Optional[Path]) -> str:
    kept = (
        f"the last checkpoint, {last}, is finite and stays the latest (resume_from_checkpoint=True continues from "
        "it, e.g. with a lower optimizer.lr)"
        if last is not None
        else "no checkpoint of this run was written"
    )
    return f"Training diverged at step {step} (lr {lr:.3g}): {what}. Stopped without saving; {kept}."


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _gather_names(names: List[str]) -> List[str]:
    """Every rank's ``names`` when any rank has one (collective), else []."""
    if int(all_reduce_sum(torch.tensor([len(names)]))[0]) == 0:
        return []
    if not dist.is_initialized():
        return names
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return sorted({name for rank_names in gathered for name in rank_names})


def nonfinite_adapters(named: Iterable[Tuple[str, torch.Tensor]], compute_dtype: torch.dtype) -> List[str]:
    """The adapters (every rank's) that hold a NaN or an infinity, or values beyond ``compute_dtype``'s range (fp32
    adapters of an fp16 run). Collective.

    Args:
        named (Iterable[Tuple[str, torch.Tensor]]): ``(key, param)`` pairs (DTensors: their local shards are read).
        compute_dtype (torch.dtype): the dtype the adapters compute in.

    Returns:
        List[str]: the keys, sorted; empty if all are finite.
    """
    limit = torch.finfo(compute_dtype).max
    bad = []
    with torch.no_grad():
        for key, param in named:
            local = _local(param)
            if local.numel() and not (all_finite(local) and float(local.abs().max()) <= limit):
                bad.append(key)
    return _gather_names(bad)


@torch.no_grad()
def check_base_finite(model: nn.Module, checkpoint_dir: Path, to_hf: Any = None) -> None:
    """Checks every loaded base weight once: an NF4 weight by its scale mean (whole on every rank; any NaN or
    infinity in the weight, or a value beyond the compute dtype, makes it non-finite), a dense weight by its
    local values. Collective.

    Args:
        model (nn.Module): the loaded model (sharded or not).
        checkpoint_dir (Path): the base checkpoint, for the message.
        to_hf (Any): ``converter.to_hf`` to name the checkpoint's key too (optional).

    Raises:
        NonFiniteError: naming each non-finite tensor.
    """
    bad = []
    for name, param in model.named_parameters():
        key = unwrap_key(model, name)
        if is_adapter_key(key):
            continue
        local = _local(param)
        if isinstance(local, NF4Tensor):
            finite = all_finite(local.scaler_mean) and all_finite(local.quantization_factor)
        else:
            finite = all_finite(local)
        if not finite:
            bad.append(_describe(key, param, to_hf))
    bad = _gather_names(bad)
    if bad:
        raise NonFiniteError(
            f"The base checkpoint in {checkpoint_dir} holds NaN or infinite values (after conversion to the compute "
            f"dtype) in {len(bad)} tensor(s): {bad[:8]}. Download it again, or check how it was made; training on "
            "it would give NaN."
        )


def _describe(key: str, param: torch.Tensor, to_hf: Any) -> str:
    if to_hf is None:
        return key
    try:
        hf_key = to_hf(key, torch.empty(param.shape, device="meta"))[0]
    except Exception:  # torchtune's key mapping raises a bare Exception on an unknown key (e.g. a pruned module)
        return key
    return f"{hf_key} ({key})"

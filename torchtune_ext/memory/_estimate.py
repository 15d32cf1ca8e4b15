"""The result of an estimate, and the device memory torch's allocator does not count."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Tuple

import torch

from torchtune_ext.memory._tracker import CATEGORIES, PERSISTENT_CATEGORIES

GIB = 1 << 30

_LABELS = {
    "nf4_weights": "NF4 weights",
    "frozen_weights": "frozen 16/32-bit weights",
    "buffers": "buffers (RoPE cache)",
    "adapters": "adapters (trainable)",
    "grads": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "logits_loss": "logits / loss",
    "temporaries": "temporaries",
    "gathered_params": "all-gathered params (FSDP2)",
}


@dataclass(frozen=True)
class DeviceAllowance:
    """Device memory beyond ``torch.cuda.max_memory_allocated``: added to the estimate, never measured by it.

    - ``cuda_context_gib``: the CUDA context, the kernels it loads and the cuBLAS/cuDNN handles live outside torch's
      caching allocator: ``nvidia-smi`` shows 0.3-0.5 GiB for a process that has only initialised CUDA and run a
      matmul (CUDA 12 loads kernels lazily; more with ``CUDA_MODULE_LOADING=EAGER``). Default: the upper end,
      0.5 GiB. (cuBLAS's own workspace, up to 32 MiB per stream on Hopper, comes from torch's allocator and is
      covered by the same figure.)
    - ``fragmentation``: reserved minus allocated, as a fraction of the peak's *transient* part (everything but
      weights, buffers, adapters and optimizer state, which are allocated once, before training, and stay). Blocks
      freed by one step are reused by the next when shapes repeat; they are not when every batch has another length
      (alpaca padded per batch), and the caching allocator then holds blocks of many sizes. The default,
      ``fragmentation = 1.0`` for variable-length batches, comes from torchtune's published Llama 2 7B QLoRA run,
      whose reserved - allocated about equals the transient part of its estimated peak (the figures:
      BENCHMARKS.md, "Measurements behind design choices"; ``bench/memory.py --seed``). It is conservative: peak
      reserved includes cached blocks that the allocator frees and retries with before it reports an out-of-memory
      error. For one repeated shape (packed data, batches padded to one length), or with
      ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the recipes' default, ``RECIPE_ALLOWANCE``), 0.1 (an
      assumption: no GPU measured it here).

    Args:
        cuda_context_gib (float): CUDA context allowance in GiB.
        fragmentation (float): fraction of the transient peak added for allocator fragmentation.
    """

    cuda_context_gib: float = 0.5
    fragmentation: float = 1.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak device memory of one training step, where it happens, and what is live then.

    Attributes:
        peak_bytes (int): peak of live storages, as ``torch.cuda.max_memory_allocated`` would report it.
        breakdown (Dict[str, int]): bytes per category at that peak (sums to ``peak_bytes``), see
            :data:`torchtune_ext.memory.CATEGORIES`.
        phase (str): where the peak happens ("forward", "logits/loss", "backward", "backward (recomputation)",
            "optimizer step", ...), and ``where`` the module call or autograd node.
        where (str): module name (forward) or autograd node (backward) at the peak.
        phase_peaks (Dict[str, int]): peak of live storages within each phase.
        cuda_context_bytes (int): allowance for the CUDA context (not in torch's allocator).
        fragmentation_bytes (int): allowance for allocator fragmentation (reserved - allocated).
        batch_size (int): batch size.
        seq_len (int): sequence length every sample is padded to.
        dtype (torch.dtype): compute dtype.
        notes (Tuple[str, ...]): what was counted analytically or emulated, and the assumptions.
        host_bytes (int): what the step moved to host memory (:func:`torchtune_ext.memory.count_as_host`).
        pinned_host_bytes (int): the pinned host memory that takes as torch's caching host allocator reserves it
            (the peak of blocks live at once, each rounded up to a power of two).
        seconds (float): how long the estimate took.
    """

    peak_bytes: int
    breakdown: Dict[str, int]
    phase: str
    where: str
    phase_peaks: Dict[str, int]
    cuda_context_bytes: int
    fragmentation_bytes: int
    batch_size: int
    seq_len: int
    dtype: torch.dtype
    notes: Tuple[str, ...] = field(default=())
    host_bytes: int = 0
    seconds: float = 0.0
    pinned_host_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        """Device memory needed: the peak plus the fragmentation and CUDA context allowances."""
        return self.peak_bytes + self.fragmentation_bytes + self.cuda_context_bytes

    @property
    def persistent_bytes(self) -> int:
        """Weights, buffers, adapters and optimizer state at the peak (allocated once, before training)."""
        return sum(self.breakdown.get(c, 0) for c in PERSISTENT_CATEGORIES)

    def with_allowance(self, allowance: DeviceAllowance) -> MemoryEstimate:
        """The same estimate with other CUDA context and fragmentation allowances.

        Args:
            allowance (DeviceAllowance): the allowances.

        Returns:
            MemoryEstimate: a copy with ``fragmentation_bytes`` and ``cuda_context_bytes`` recomputed.
        """
        fragmentation, context = allowances(self.breakdown, allowance)
        return replace(self, fragmentation_bytes=fragmentation, cuda_context_bytes=context)

    def fits(self, memory_gib: float) -> bool:
        """Whether the step fits on a device of ``memory_gib`` GiB (2**30 bytes, as torch and nvidia-smi count).

        Args:
            memory_gib (float): device memory in GiB.

        Returns:
            bool: ``device_bytes <= memory_gib * 2**30``.
        """
        return self.device_bytes <= memory_gib * GIB

    def format(self) -> str:
        """A table of the peak, its breakdown and the allowances, in GiB, with the notes.

        Returns:
            str: the table.
        """
        lines = [
            f"Peak device memory of one training step: batch {self.batch_size} x {self.seq_len} tokens, "
            f"{str(self.dtype).replace('torch.', '')}",
            f"  peak allocated (torch.cuda.max_memory_allocated)  {self.peak_bytes / GIB:8.3f} GiB"
            f"   at: {self.phase}{f' ({self.where})' if self.where else ''}",
        ]
        for category in CATEGORIES:
            lines.append(f"    {_LABELS[category]:<44} {self.breakdown.get(category, 0) / GIB:8.3f} GiB")
        lines += [
            f"  + allocator fragmentation allowance              {self.fragmentation_bytes / GIB:8.3f} GiB",
            f"  + CUDA context allowance                         {self.cuda_context_bytes / GIB:8.3f} GiB",
            f"  = device memory needed                           {self.device_bytes / GIB:8.3f} GiB",
        ]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def allowances(breakdown: Dict[str, int], allowance: DeviceAllowance) -> Tuple[int, int]:
    """The fragmentation and CUDA context allowances for a peak with this breakdown.

    Args:
        breakdown (Dict[str, int]): bytes per category at the peak.
        allowance (DeviceAllowance): the allowance settings.

    Returns:
        Tuple[int, int]: fragmentation bytes, CUDA context bytes.
    """
    transient = sum(v for k, v in breakdown.items() if k not in PERSISTENT_CATEGORIES)
    return int(allowance.fragmentation * transient), int(allowance.cuda_context_gib * GIB)

"""What the recipes do on CUDA, checked on the CPU where the logic allows: the allocator's expandable segments (set
before the recipe first touches the device, through torch's runtime settings, a user's own kept), the fp16 skip
decision with a fused optimizer (taken on the host, not by the optimizer from a tensor copied without waiting),
and memory peaks per logging window beside the run's overall peak (a fake memory source)."""

from typing import Dict, List

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from torchtune_ext.training import EXPANDABLE_SEGMENTS, LossScaler, MemoryPeaks, use_expandable_segments

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


# ------------------------------------------------------------------------------------------------ allocator


@pytest.fixture
def allocator_calls(monkeypatch) -> List[str]:
    """The runtime allocator settings torch is given (recorded; CUDA is not on this machine)."""
    calls: List[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_expandable_segments_through_the_runtime_settings(allocator_calls, monkeypatch):
    import os

    assert use_expandable_segments(CUDA) == EXPANDABLE_SEGMENTS
    assert allocator_calls == ["expandable_segments:True"]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # for the processes it starts
    assert use_expandable_segments(CPU) is None and len(allocator_calls) == 1


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_users_own_allocator_settings_are_kept(allocator_calls, monkeypatch, name):
    import os

    monkeypatch.setenv(name, "max_split_size_mb:128")
    assert use_expandable_segments(CUDA) is None
    assert allocator_calls == [] and os.environ[name] == "max_split_size_mb:128"


def test_the_recipe_sets_the_allocator_before_it_touches_the_device(allocator_calls, monkeypatch):
    """``RecipeSettings.from_config`` is the recipe's first use of the device (``utils.get_device``, the bf16
    check); the allocator settings come before it, whatever ``import torchtune`` initialised."""
    import torchtune_ext.training._setup as setup

    order: List[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: order.append(f"allocator {s}"))
    monkeypatch.setattr(setup, "check_config", lambda cfg, **checks: None)

    class Stop(Exception):
        pass

    def from_config(cfg):
        order.append("device")
        raise Stop

    monkeypatch.setattr(setup.RecipeSettings, "from_config", staticmethod(from_config))
    with pytest.raises(Stop):
        setup.RecipeSetup(OmegaConf.create({"device": "cuda"}))
    assert order == ["allocator expandable_segments:True", "device"]
    order.clear()
    with pytest.raises(Stop):  # a dry run estimates; it sets nothing
        setup.RecipeSetup(OmegaConf.create({"device": "cuda", "dry_run": True}))
    assert order == ["device"]


# ------------------------------------------------------------------------------------------- fp16 + fused


def _adamw_pair(**fast):
    torch.manual_seed(0)
    values = [torch.randn(4, 3), torch.randn(5)]
    ours = [nn.Parameter(v.clone()) for v in values]
    reference = [nn.Parameter(v.clone()) for v in values]
    return (
        ours,
        torch.optim.AdamW(ours, lr=1e-2, **fast),
        reference,
        torch.optim.AdamW(reference, lr=1e-2, foreach=False),
    )


@pytest.mark.parametrize("fast", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_fp16_skip_decision_is_the_hosts_with_fused_and_foreach(fast):
    ours, optimizer, reference, reference_optimizer = _adamw_pair(**fast)
    scaler = LossScaler(enabled=True, device=CPU, init_scale=8.0)
    scaler.scale(torch.ones(()))  # the recipe scales each loss; the first call makes the scale tensor
    flags_seen = []  # the overflow flag the optimizer holds when it steps (GradScaler.step hands fused ones one)
    step = optimizer.step
    optimizer.step = lambda: flags_seen.append(getattr(optimizer, "found_inf", None)) or step()
    grads = [torch.randn(4, 3), torch.randn(5)]

    # An overflowed step: skipped (params and optimizer state untouched), scale halved.
    for p, g in zip(ours, grads):
        p.grad = g * 8.0
    ours[1].grad[2] = float("inf")
    before = [p.detach().clone() for p in ours]
    scaler.unscale_(optimizer)
    assert scaler.step(optimizer) is False
    assert all(torch.equal(p, b) for p, b in zip(ours, before)) and not optimizer.state
    assert scaler.get_scale() == 4.0 and scaler.skipped_steps == 1
    # Skipped on the host: the optimizer was not called to decide it from a flag tensor, which a fused one copies
    # to its params' device without waiting (with CPU offload, a copy from the GPU: a race).
    assert flags_seen == []

    # A finite step (unscaled here by step itself): the unscaled optimizer's step.
    for p, r, g in zip(ours, reference, grads):
        p.grad, r.grad = g * 4.0, g.clone()
    assert scaler.step(optimizer) is True
    reference_optimizer.step()
    for p, r in zip(ours, reference):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-7)
    assert scaler.skipped_steps == 1 and flags_seen == [None]


# -------------------------------------------------------------------------------------------- memory peaks


class FakeMemory:
    """A memory source with a resettable peak counter, as CUDA's: ``use(n)`` allocates n then frees to ``now``."""

    def __init__(self):
        self.now, self.peak, self.resets = 1.0, 1.0, 0

    def use(self, high: float, now: float) -> None:
        self.peak, self.now = max(self.peak, high), now

    def read(self) -> Dict[str, float]:
        return {"peak_memory_alloc": self.peak, "rss": self.now, "peak_rss": 9.0}

    def reset(self) -> None:
        self.peak, self.resets = self.now, self.resets + 1


def test_logged_peaks_are_per_window_and_the_summary_keeps_the_runs():
    memory = FakeMemory()
    peaks = MemoryPeaks(CPU, read=memory.read, reset=memory.reset)
    memory.use(high=12.0, now=3.0)  # loading
    assert peaks.window()["peak_memory_alloc"] == 12.0  # after setup: the load's peak
    memory.use(high=5.0, now=3.0)
    memory.use(high=6.0, now=3.0)
    assert peaks.window() == {"peak_memory_alloc": 6.0, "rss": 3.0, "peak_rss": 9.0}  # training's, not the load's
    memory.use(high=4.0, now=2.0)
    assert peaks.window()["peak_memory_alloc"] == 4.0
    memory.use(high=7.0, now=2.0)  # not logged yet: the summary still counts it
    assert peaks.overall() == {"peak_memory_alloc": 12.0, "rss": 2.0, "peak_rss": 9.0}
    assert memory.resets == 3  # overall() reads without resetting
    assert peaks.window()["peak_memory_alloc"] == 7.0


def test_memory_peaks_on_the_cpu_read_without_cuda():
    stats = MemoryPeaks(CPU).window()
    assert set(stats) == {"peak_rss", "rss"} and min(stats.values()) > 0  # the host figures only

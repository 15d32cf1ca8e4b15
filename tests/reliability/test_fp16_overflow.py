"""fp16 overflow: gradients blown up (x1e12, loss value unchanged) in steps 2 and 3 of an fp16 run of the
single-device recipe. The loss scaler must skip exactly those optimizer steps (weights untouched), halve the loss
scale at each, log them (``skipped_steps``, ``loss_scale``), and training must go on with finite losses and
weights; the saved checkpoint (adapter, merged model, recipe state) is finite.

The recipe runs in-process so that the adapters can be read after every step (fp16 compute on the CPU works:
torch.amp.GradScaler supports the CPU).
"""

import importlib.util
import math
from pathlib import Path
from typing import Any, Dict, List

import torch
from omegaconf import OmegaConf
from reliability_utils import REPO, SINGLE_CONFIG, SINGLE_RECIPE, adapter, merged, small_run

from torchtune_ext.data import write_tiny_checkpoint

STEPS = 6
OVERFLOW_STEPS = [2, 3]
INIT_SCALE = 1024.0  # the recipe's default for fp16


class _Snapshots:
    """Metric logger (instantiated by the recipe from the config) that keeps each step's metrics and a copy of the
    adapters right after that step."""

    recipe: Any = None
    steps: Dict[int, Dict[str, Any]] = {}

    def __init__(self, **kwargs):
        type(self).steps = {}

    def log_config(self, config):
        pass

    def log_dict(self, payload, step):
        adapters = {k: v.detach().clone() for k, v in type(self).recipe._adapter_params.items()}
        type(self).steps[step] = {"metrics": dict(payload), "adapters": adapters}

    def log(self, name, data, step):
        pass

    def close(self):
        pass


def _equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _finite(tensors: Dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def test_fp16_overflow_skips_steps_lowers_scale_and_keeps_weights_finite(tmp_path):
    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="fp32", seed=0)
    out = tmp_path / "out"
    overrides = small_run(out, base, STEPS, out / "logs") + [
        "dtype=fp16",
        "batch_size=4",
        "model.lora_dropout=0.0",
        "lr_scheduler.num_warmup_steps=0",
        "loss.fault=scale_grad",
        f"loss.steps={OVERFLOW_STEPS}",
        "loss.grad_factor=1e12",
        f"metric_logger._component_={__name__}._Snapshots",
    ]
    cfg = OmegaConf.merge(OmegaConf.load(SINGLE_CONFIG), OmegaConf.from_dotlist(overrides))
    spec = importlib.util.spec_from_file_location("reliability_single_device_recipe", REPO / SINGLE_RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    recipe = module.QLoRAFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    _Snapshots.recipe = recipe
    initial = {k: v.detach().clone() for k, v in recipe._adapter_params.items()}
    recipe.train()
    recipe.cleanup()

    steps = _Snapshots.steps
    assert sorted(steps) == list(range(1, STEPS + 1))
    skipped: List[float] = [steps[s]["metrics"]["skipped_steps"] for s in range(1, STEPS + 1)]
    scales: List[float] = [steps[s]["metrics"]["loss_scale"] for s in range(1, STEPS + 1)]
    assert skipped == [0, 1, 2, 2, 2, 2]
    # Halved at each overflow, unchanged otherwise (growth_interval 2000 steps).
    assert scales == [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 4, INIT_SCALE / 4, INIT_SCALE / 4, INIT_SCALE / 4]

    previous = initial
    for step in range(1, STEPS + 1):
        adapters = steps[step]["adapters"]
        assert _finite(adapters), f"non-finite adapter after step {step}"
        assert _equal(adapters, previous) == (step in OVERFLOW_STEPS), f"step {step}: skipped iff it overflowed"
        previous = adapters
    losses = [steps[s]["metrics"]["loss"] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(x) and 0 < x < 20 for x in losses), losses
    assert all(math.isfinite(steps[s]["metrics"]["grad_norm"]) for s in range(1, STEPS + 1) if s not in OVERFLOW_STEPS)

    # What was saved is finite too, and the recipe state remembers the scale and the skipped steps.
    final = out / f"step_{STEPS}"
    assert _finite(adapter(final)) and _finite(merged(final))
    state = torch.load(out / "recipe_state" / "recipe_state.pt", weights_only=False)
    assert state["loss_scaler"]["skipped_steps"] == len(OVERFLOW_STEPS)
    assert state["loss_scaler"]["scaler"]["scale"] == INIT_SCALE / 4
    assert all(
        bool(torch.isfinite(v).all())
        for entry in state["optimizer"]["state"].values()
        for v in entry.values()
        if isinstance(v, torch.Tensor)
    )
    _Snapshots.recipe = None


def test_overflow_fault_really_overflows_fp16():
    """The injected factor makes fp16 gradients non-finite (else the test above would prove nothing)."""
    from reliability_faults import _ScaleGrad

    logits = torch.randn(4, 8, dtype=torch.float16, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits.float(), torch.arange(4), reduction="sum") * INIT_SCALE
    _ScaleGrad.apply(loss, 1e12).backward()
    assert not torch.isfinite(logits.grad).all()
    assert _ScaleGrad.apply(torch.tensor(2.0), 1e12).item() == 2.0
    assert Path(REPO / SINGLE_RECIPE).is_file()

"""A diverged run stops at the step it diverges and writes nothing non-finite (issue 24).

Real runs of the single-device recipe, its entry point called in this process as ``tune run`` calls it (its exit
code, what it prints and logs): ``optimizer.lr=1e30`` in fp32 (NaN loss from step 3) stops there with a non-zero
exit code, naming the step, the lr and what to try; the step-2 checkpoint stays the latest and equals that of a run
stopped at step 2. In fp16, overflowed steps are skipped and counted (progress bar, summary); a run of them (every
step since the last save, or the loss scale below its floor) stops the same way. A NaN in a base weight is found at
load, naming the tensor. On 2 ranks (a real ``tune run --nproc_per_node 2``), the launcher exits 1 with the message
once.
"""

import importlib.util
import math
import re
from pathlib import Path
from typing import List, Tuple

import psutil
import pytest
import torch
from conftest import run_recipe_in_process
from omegaconf import OmegaConf
from reliability_utils import (
    DIST_CONFIG,
    DIST_RECIPE,
    REPO,
    SINGLE_CONFIG,
    SINGLE_RECIPE,
    adapter,
    assert_no_leftovers,
    call_recipe,
    logged,
    max_abs_diff,
    small_run,
    tune,
)
from safetensors.torch import load_file, save_file

from torchtune_ext.data import write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test]

STEPS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base") / "base", family="llama", dtype="fp32", seed=0)


def _args(out: Path, base: Path, overrides: List[str]) -> List[str]:
    return small_run(out, base, STEPS, out / "logs") + ["batch_size=4", *overrides]


@pytest.fixture
def run(tmp_path, base, monkeypatch, capfd, caplog):
    """``run(name, overrides)``: the single-device recipe into ``tmp_path / name``, in this process; returns the
    output folder, the exit code and everything it printed and logged. It starts no process."""

    def start(name: str, overrides: List[str]) -> Tuple[Path, int, str]:
        out = tmp_path / name
        children = psutil.Process().children(recursive=True)
        rc, output = call_recipe(_args(out, base, overrides), monkeypatch, capfd, caplog)
        assert psutil.Process().children(recursive=True) == children, "a process of the run is left"
        return out, rc, output

    return start


def _nonfinite_files(out: Path) -> List[str]:
    """Every tensor under ``out`` (safetensors files and recipe states, nested) that is not finite."""
    bad = []
    for path in sorted(out.rglob("*.safetensors")):
        bad += [f"{path}:{k}" for k, v in load_file(path).items() if not torch.isfinite(v).all()]
    for path in sorted(out.rglob("*.pt")):
        stack = [torch.load(path, map_location="cpu", weights_only=False)]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                stack += list(item.values())
            elif isinstance(item, (list, tuple)):
                stack += list(item)
            elif isinstance(item, torch.Tensor) and item.is_floating_point() and not torch.isfinite(item).all():
                bad.append(str(path))
            elif isinstance(item, float) and not math.isfinite(item):
                bad.append(str(path))
    return bad


def test_fp32_divergence_stops_at_that_step_and_keeps_the_last_good_checkpoint(run, tmp_path, base):
    out, rc, text = run("diverged", ["optimizer.lr=1e30", "save_every_n_steps=2"])
    assert rc == 1, text[-3000:]
    losses = logged(out / "logs")
    assert math.isfinite(losses[1]) and math.isfinite(losses[2]) and math.isnan(losses[3]), losses
    assert max(losses) == 3, f"the run went on after the NaN step: {losses}"
    lr = logged(out / "logs", "lr")[3]  # the step's logged lr
    assert f"Training diverged at step 3 (lr {lr:.3g}): the loss is nan and the gradient norm nan." in text, text[
        -3000:
    ]
    assert f"the last checkpoint, {out / 'step_2'}, is finite and stays the latest" in text
    # clip_grad_norm=1.0 (the tiny config's) already clips: no advice to set it
    assert (
        "Try a lower optimizer.lr (e.g. 10x lower) or a longer lr_scheduler.num_warmup_steps (clip_grad_norm=1 "
        "already clips).\n" in text
    )
    assert "Traceback" not in text, text[-3000:]  # the message is the report
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2"]
    assert torch.load(out / "recipe_state" / "recipe_state.pt", weights_only=False)["global_step"] == 2
    assert _nonfinite_files(out) == []

    # The last good checkpoint is what a run stopped at step 2 saves.
    ref_out = tmp_path / "reference"
    args = ["--config", str(SINGLE_CONFIG), *_args(ref_out, base, ["optimizer.lr=1e30", "stop_after_step=2"])]
    run_recipe_in_process(REPO / SINGLE_RECIPE, args, cwd=REPO)
    assert max_abs_diff(adapter(out / "step_2"), adapter(ref_out / "step_2")) == 0.0


def test_fp16_skipped_steps_are_counted_in_the_progress_bar_and_the_summary(run):
    out, rc, text = run("fp16", ["dtype=fp16", "loss.fault=scale_grad", "loss.steps=[2,3]", "loss.grad_factor=1e12"])
    assert rc == 0, text[-6000:]
    text = text.replace("\r", "\n")
    assert "  skipped steps (fp16): 2 of 6 (gradients overflowed); loss scale now 256" in text, text[-3000:]
    bars = re.findall(r"1\|(\d)\|Loss: [0-9.]+\|skipped: (\d)", text)
    assert {int(step): int(skipped) for step, skipped in bars} == {1: 0, 2: 1, 3: 2, 4: 2, 5: 2, 6: 2}, bars
    assert _nonfinite_files(out) == []


def test_fp16_every_step_since_the_last_save_skipped_stops_before_saving(run):
    out, rc, text = run(
        "fp16_skipped_run",
        ["dtype=fp16", "save_every_n_steps=2", "loss.fault=scale_grad", "loss.steps=[3,4]", "loss.grad_factor=1e12"],
    )
    assert rc != 0, text[-3000:]
    assert "Training diverged at step 4" in text
    assert "every one of the 2 steps since the last save was skipped (fp16 overflow)" in text
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2"]
    assert torch.load(out / "recipe_state" / "recipe_state.pt", weights_only=False)["global_step"] == 2
    assert _nonfinite_files(out) == []


def test_fp16_loss_scale_at_its_floor_stops(run):
    """lr=1e30 in fp16: the fp32 adapters overflow fp16 after step 2, every later step is skipped and the scale
    halves (4 -> 0.25) until it is below the floor (0.5)."""
    out, rc, text = run(
        "fp16_floor", ["dtype=fp16", "optimizer.lr=1e30", "loss_scaler.init_scale=4", "loss_scaler.min_scale=0.5"]
    )
    assert rc != 0, text[-3000:]
    lr = logged(out / "logs", "lr")[6]
    assert (
        f"Training diverged at step 6 (lr {lr:.3g}): fp16 gradients overflowed in the last 4 steps (all skipped) "
        "and the loss scale fell to 0.25, below its floor loss_scaler.min_scale=0.5. Stopped without saving; no "
        "checkpoint of this run was written." in text
    ), text[-3000:]
    assert logged(out / "logs", "loss_scale") == {1: 4.0, 2: 4.0, 3: 2.0, 4: 1.0, 5: 0.5, 6: 0.25}
    assert not list(out.glob("step_*")) and not (out / "recipe_state").exists()


def test_fp16_adapters_beyond_fp16_are_not_saved(run):
    """lr=1e30 in fp16 with a save at step 4: the fp32 adapters hold values fp16 cannot compute with; the save
    refuses them (step 2's checkpoint, saved before the huge update showed, is finite)."""
    out, rc, text = run("fp16_save", ["dtype=fp16", "optimizer.lr=1e30", "save_every_n_steps=3"])
    assert rc != 0, text[-3000:]
    assert "Training diverged at step 3" in text, text[-3000:]
    assert "out-of-range values" in text
    assert not list(out.glob("step_*"))
    assert _nonfinite_files(out) == []


@pytest.fixture(scope="module")
def recipe_module():
    spec = importlib.util.spec_from_file_location("reliability_diverged_recipe", REPO / SINGLE_RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nan_in_a_base_weight_is_named_at_load(recipe_module, base, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((base / "config.json").read_text())
    tensors = load_file(base / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")  # NF4-quantized
    tensors["model.norm.weight"][7] = float("inf")  # dense
    save_file(tensors, broken / "model.safetensors")
    out = tmp_path / "out"
    cfg = OmegaConf.merge(
        OmegaConf.load(SINGLE_CONFIG), OmegaConf.from_dotlist(small_run(out, broken, STEPS, out / "logs"))
    )
    cfg.pop("generate_base_checkpoint")
    recipe = recipe_module.QLoRAFinetuneRecipeSingleDevice(cfg)
    with pytest.raises(RuntimeError) as raised:
        recipe.setup(cfg)
    text = str(raised.value)
    assert type(raised.value).__name__ == "NonFiniteError"
    assert f"The base checkpoint in {broken} holds NaN or infinite values" in text, text
    assert "in 2 tensor(s): ['model.layers.1.mlp.down_proj.weight (layers.1.mlp.w2.weight)', 'model.norm.weight" in text
    assert not list(out.glob("step_*"))


@pytest.mark.distributed
def test_distributed_divergence_exits_1_with_the_message_once(tmp_path, base):
    """2 gloo ranks (``tune run --nproc_per_node 2``): every rank stops at the NaN step; the launcher exits 1 with the
    message once, without a worker's traceback or torchrun's failure block."""
    out = tmp_path / "distributed"
    overrides = small_run(out, base, STEPS, out / "logs") + ["batch_size=2", "optimizer.lr=1e30"]
    run = tune(DIST_RECIPE, DIST_CONFIG, overrides, tmp_path / "distributed.log", nproc=2)
    rc = run.wait()
    assert_no_leftovers([run])
    assert rc == 1, run.output[-3000:]
    assert run.output.count("Training diverged at step 3") == 1, run.output[-3000:]
    for noise in ("Traceback", "ChildFailedError", "exitcode  :"):
        assert noise not in run.output, run.output[-3000:]
    assert not list(out.glob("step_*")) and _nonfinite_files(out) == []

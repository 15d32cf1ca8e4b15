"""The torchtune habit works: copy the recipe, edit the loss in its loop, ``tune run`` the copy on one device and on
two ranks; and no recipe imports another.

The edit is the one ``docs/hacking.md`` shows, in the copied file's ``forward_backward`` (the loop's micro-batch
step): gradient ascent, the loss negated. Checked after two steps (two accumulated micro-batches each; the first
at the warm-up's learning rate 0) against the unmodified recipe on one device (same seed, same global batch of 4):

- the logged losses are exactly the negated ones (the same batches, the same weights: the first step moved none);
- the LoRA B matrices are exactly the negated ones: they start at zero, AdamW's update is an odd function of the
  gradients, and clipping sees the same norms; the LoRA A matrices have not moved (their gradient is zero while B
  is zero), so they are the same.

On two ranks (``tune run --nproc_per_node 2``, two samples per rank) the same copy gives the same numbers, within the
rounding of summing over ranks.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors.torch import load_file

from torchtune_ext import cli
from torchtune_ext._shipped import DISTRIBUTED_RECIPE, SINGLE_DEVICE_RECIPE

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
CONFIG = REPO / "configs" / "tiny" / "qlora_single_device.yaml"
TUNE = Path(sys.executable).parent / "tune"
INSTALLED_RECIPES = "torchtune_ext.recipes"
GLOBAL_BATCH = 4
STEPS = 2

#: the loss line of the recipe's micro-batch step as shipped, and what the user writes instead.
SHIPPED = "        loss = self.loss_step(batch) * batch_tokens\n"
HACKED = "        loss = -self.loss_step(batch) * batch_tokens  # gradient ascent\n"


def _run(recipe: Path, nproc: int) -> Path:
    """Trains ``STEPS`` steps with ``recipe`` on ``nproc`` ranks in its folder; returns the run's output folder."""
    out = recipe.parent / "outputs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    overrides = [
        f"output_dir={out}",
        f"max_steps_per_epoch={STEPS}",
        f"batch_size={GLOBAL_BATCH // nproc}",
        "gradient_accumulation_steps=2",
        "run_val_every_n_steps=null",
        "save_adapter_weights_only=True",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
    ]
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    result = subprocess.run(
        [str(TUNE), "run", *launcher, recipe.name, "--config", str(CONFIG), *overrides],
        cwd=recipe.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return out


def _losses(out: Path) -> List[float]:
    (log,) = (out / "logs").glob("log_*.txt")
    return [float(m) for m in re.findall(r"\bloss:(\S+)", log.read_text())]


def _lora(out: Path, kind: str) -> Dict[str, torch.Tensor]:
    adapter = load_file(out / f"step_{STEPS}" / "adapter" / "adapter_model.safetensors")
    return {k: t.double() for k, t in adapter.items() if kind in k}


def _copy(name: str, folder: Path) -> Path:
    folder.mkdir()
    cli.main(["cp", name, str(folder / "my_recipe.py")])
    return folder / "my_recipe.py"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """The unmodified copy, trained on one device."""
    return _run(_copy(SINGLE_DEVICE_RECIPE, tmp_path_factory.mktemp("plain") / "run"), nproc=1)


@pytest.mark.integration_test
@pytest.mark.parametrize(
    "nproc, name",
    [(1, SINGLE_DEVICE_RECIPE), pytest.param(2, DISTRIBUTED_RECIPE, marks=pytest.mark.distributed)],
)
def test_a_copy_with_the_loss_edited_in_its_loop_trains_so_on_one_and_two_ranks(tmp_path, plain, nproc, name):
    recipe = _copy(name, tmp_path / "hacked")
    source = recipe.read_text()
    assert source.count(SHIPPED) == 1, "the copied recipe's micro-batch step no longer computes the loss so"
    recipe.write_text(source.replace(SHIPPED, HACKED))

    hacked = _run(recipe, nproc)

    tolerance = 1e-6 if nproc == 1 else 1e-5  # two ranks: sums over ranks, rounded in another order
    base, ascent = _losses(plain), _losses(hacked)
    assert len(base) == STEPS and min(base) > 1.0
    assert ascent == pytest.approx([-loss for loss in base], abs=tolerance)
    base_b, ascent_b = _lora(plain, "lora_B"), _lora(hacked, "lora_B")
    assert base_b.keys() == ascent_b.keys() and len(base_b) > 0
    assert min(float(t.abs().max()) for t in base_b.values()) > 1e-4  # every B moved in the step
    for key, moved in base_b.items():
        torch.testing.assert_close(ascent_b[key], -moved, atol=tolerance, rtol=0, msg=key)
    base_a, ascent_a = _lora(plain, "lora_A"), _lora(hacked, "lora_A")
    for key, initial in base_a.items():
        torch.testing.assert_close(ascent_a[key], initial, atol=tolerance, rtol=0, msg=key)


def _top_level_imports(source: str) -> List[str]:
    tree = ast.parse(source)
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    return imported + ["." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]


@pytest.mark.parametrize("name", [SINGLE_DEVICE_RECIPE, DISTRIBUTED_RECIPE])
def test_cp_of_either_name_gives_the_whole_recipe(tmp_path, capsys, name):
    """The copy is self-contained: it runs no other recipe file, and holds the setup, the step and the loop."""
    cli.main(["cp", name, str(tmp_path / "my_recipe.py")])
    printed = capsys.readouterr().out
    assert "train()" in printed and "--nproc_per_node" in printed
    copied = (tmp_path / "my_recipe.py").read_text()
    assert copied == cli.recipe_files()[SINGLE_DEVICE_RECIPE].read_text()
    assert "runpy" not in _top_level_imports(copied)
    (recipe,) = [n for n in ast.parse(copied).body if isinstance(n, ast.ClassDef) and n.name == "QLoRAFinetuneRecipe"]
    methods = {n.name: ast.unparse(n) for n in recipe.body if isinstance(n, ast.FunctionDef)}
    assert {"setup", "loss_step", "forward_backward", "optimizer_step", "validate", "train"} <= methods.keys()
    assert ".backward()" in methods["forward_backward"]
    for call in ("unscale_", "clip_grad_norm_", "step(self._optimizer)"):
        assert call in methods["optimizer_step"]
    for call in ("self.forward_backward(batch)", "self.optimizer_step(", "self.validate()", "self.save_checkpoint("):
        assert call in methods["train"]


def test_the_distributed_name_runs_the_recipe_file_by_path():
    """The thin entry point loads the single-device file by its path, not as a module: one file, never two names."""
    import recipes.qlora_finetune_distributed as entry

    assert entry.QLoRAFinetuneRecipeDistributed.__module__ == "<run_path>"
    assert entry._RECIPE["__file__"] == str(RECIPES / "qlora_finetune_single_device.py")


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.py")))
def test_no_recipe_imports_another(recipe):
    """A recipe importing another would load one file twice, as ``recipes.<name>`` in a clone and as
    ``torchtune_ext.recipes.<name>`` installed: recipes share code through ``torchtune_ext`` only (a thin entry point
    runs the file it stands for by path)."""
    imported = _top_level_imports((RECIPES / recipe).read_text())
    offending = [m for m in imported if m == "." or m.split(".")[0] == "recipes" or m.startswith(INSTALLED_RECIPES)]
    assert offending == [], f"{recipe} imports {offending}"

"""The torchtune habit works: copy a recipe, change its step, ``tune run`` the copy; and no recipe imports another.

The hack is the one ``docs/hacking.md`` and the recipe's own ``loss_step`` docstring show: an L2 penalty on the
adapters, added in ``loss_step`` during training. Checked against the unmodified copy (same seed, data, steps):

- step 1's logged loss grows by exactly the penalty the hacked recipe printed (within 1e-4; the logged loss is the
  token-weighted mean of ``loss_step``, and the penalty is the same for every micro-batch of the step);
- the LoRA A matrices end smaller: at step 1 their loss gradient is exactly zero (B starts at zero), so without the
  penalty AdamW does not move them then, with it each element moves lr toward zero.
"""

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from safetensors.torch import load_file

from torchtune_ext import cli

pytestmark = pytest.mark.integration_test

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
RECIPE = RECIPES / "qlora_finetune_single_device.py"
CONFIG = REPO / "configs" / "tiny" / "qlora_single_device.yaml"
TUNE = Path(sys.executable).parent / "tune"
INSTALLED_RECIPES = "torchtune_ext.recipes"
STEPS = 3
WEIGHT = 0.01

#: the body of the recipe's ``loss_step`` as shipped, and what the user writes instead.
SHIPPED = "        return super().loss_step(batch)\n"
HACKED = f"""\
        loss = super().loss_step(batch)
        if self._model.training:
            penalty = {WEIGHT} * sum(p.pow(2).sum() for p in self._trainable_params)
            if self.global_step == 0:
                print(f"penalty={{float(penalty)!r}}", flush=True)
            loss = loss + penalty
        return loss
"""


def _run(recipe: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    overrides = [
        f"max_steps_per_epoch={STEPS}",
        "batch_size=4",
        "gradient_accumulation_steps=2",
        "run_val_every_n_steps=null",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
    ]
    result = subprocess.run(
        [str(TUNE), "run", recipe.name, "--config", str(CONFIG), *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _losses(run_dir: Path) -> List[float]:
    (log,) = (run_dir / "outputs" / "tiny_qlora" / "logs").glob("log_*.txt")
    return [float(m) for m in re.findall(r"\bloss:(\S+)", log.read_text())]


def _lora_a_norm(run_dir: Path) -> float:
    adapter = load_file(run_dir / "outputs" / "tiny_qlora" / f"step_{STEPS}" / "adapter" / "adapter_model.safetensors")
    return math.sqrt(sum(float(t.double().pow(2).sum()) for k, t in adapter.items() if "lora_A" in k))


def test_copied_recipe_with_a_regulariser_trains_differently(tmp_path):
    plain, hacked = tmp_path / "plain", tmp_path / "hacked"
    plain.mkdir()
    hacked.mkdir()
    source = RECIPE.read_text()
    assert source.count(SHIPPED) == 1, "the recipe's loss_step no longer just calls the library's"
    (plain / "my_recipe.py").write_text(source)
    (hacked / "my_recipe.py").write_text(source.replace(SHIPPED, HACKED))

    _run(plain / "my_recipe.py", plain)
    result = _run(hacked / "my_recipe.py", hacked)

    penalty = float(re.search(r"penalty=(\S+)", result.stdout).group(1))
    assert penalty > 0.01  # the initial LoRA A matrices are far from zero
    base, regularised = _losses(plain), _losses(hacked)
    assert len(base) == len(regularised) == STEPS
    assert regularised[0] - base[0] == pytest.approx(penalty, abs=1e-4)
    assert _lora_a_norm(hacked) < _lora_a_norm(plain) - 1e-3


def test_cp_of_a_recipe_says_what_to_override(tmp_path, capsys):
    cli.main(["cp", "qlora_finetune_single_device", str(tmp_path / "my_recipe.py")])
    printed = capsys.readouterr().out
    for method in ("loss_step", "forward_backward", "optimizer_step", "tune run"):
        assert method in printed
    shipped = cli.recipe_files()["qlora_finetune_single_device"]
    assert (tmp_path / "my_recipe.py").read_text() == shipped.read_text()


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.py")))
def test_no_recipe_imports_another(recipe):
    """A recipe importing another would load one file twice, as ``recipes.<name>`` in a clone and as
    ``torchtune_ext.recipes.<name>`` installed: recipes share code through ``torchtune_ext`` only."""
    tree = ast.parse((RECIPES / recipe).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += ["." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
    offending = [m for m in imported if m == "." or m.split(".")[0] == "recipes" or m.startswith(INSTALLED_RECIPES)]
    assert offending == [], f"{recipe} imports {offending}"

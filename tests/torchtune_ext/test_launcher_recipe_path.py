"""A copied recipe runs by its absolute path from any working folder, with ``tune run`` and ``tune-ext run``, and is
loaded once (as ``__main__``).

torchtune's ``tune run`` turns a recipe path into a module name imported from the working folder
(``x/my_recipe.py`` -> ``x.my_recipe``), which an absolute path cannot be (``.tmp.x.my_recipe``: "Relative module
names not supported"); ``torchtune_ext._compat`` registers such a file with torchtune, which then runs it by path.
Real processes with the inherited environment.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtune_ext._shipped import SINGLE_DEVICE_RECIPE, recipe_files

BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.stack, pytest.mark.integration_test]

#: the shipped recipe's ``loss_step`` return, and a copy's that first reports every module name its file is under.
SHIPPED = "        return token_mean_loss(self._loss_fn, output, labels)\n"
REPORTS_ITS_NAMES = """\
        if self.global_step == 0:
            here = os.path.realpath(__file__)
            files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
            names = [n for n, f in files.items() if f and os.path.realpath(f) == here]
            print(f"loaded as {sorted(names)}", flush=True)
        return token_mean_loss(self._loss_fn, output, labels)
"""


@pytest.mark.parametrize("program", ["tune", "tune-ext"])
def test_copied_recipe_runs_by_absolute_path_from_another_folder(tmp_path, program):
    recipe = tmp_path / "mine" / "my_recipe.py"
    recipe.parent.mkdir()
    source = recipe_files()[SINGLE_DEVICE_RECIPE].read_text()
    assert source.count(SHIPPED) == 1, "the recipe's loss_step no longer ends so"
    recipe.write_text(source.replace("import sys\n", "import os\nimport sys\n", 1).replace(SHIPPED, REPORTS_ITS_NAMES))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    overrides = ["max_steps_per_epoch=1", "batch_size=4", "run_val_every_n_steps=null"]
    overrides.append("metric_logger._component_=torchtune.training.metric_logging.DiskLogger")
    result = subprocess.run(
        [str(BIN / program), "run", str(recipe), "--config", "tiny/qlora_single_device", *overrides],
        cwd=elsewhere,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )

    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    assert re.findall(r"loaded as (.*)", result.stdout) == ["['__main__']"]
    assert (elsewhere / "outputs" / "tiny_qlora" / "step_1" / "adapter" / "adapter_model.safetensors").is_file()

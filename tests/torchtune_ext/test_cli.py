"""``tune-ext ls/cp/run``: the recipes and configs that ship in the package, run by name from any folder.

In the CI matrix's torch 2.14.1 environment the package is installed from its wheel (not editable), so there these
tests check what a plain ``pip install`` gives. The CLI's entry point runs in this process as its console script
runs it (``conftest.run_main``); a recipe run by name runs as a real process (the slow lane).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_main

from torchtune_ext import cli
from torchtune_ext.cli import config_files, recipe_files, recipe_of

ROOT = Path(__file__).resolve().parents[2]
TUNE_EXT = Path(sys.executable).parent / "tune-ext"

pytestmark = pytest.mark.stack


def _tune_ext(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(TUNE_EXT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def tune_ext(monkeypatch, capfd):
    """``tune_ext(*args, cwd=...)``: ``tune-ext <args>`` run in this process."""

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        return run_main(cli.main, ["tune-ext", *args], monkeypatch, capfd, cwd=cwd)

    return run


def test_registry_matches_the_repository():
    """Every config and recipe of the repository ships, each config with the recipe it is written for."""
    assert set(recipe_files()) == {p.stem for p in (ROOT / "recipes").glob("*.py")} - {"__init__"}
    repo_configs = {
        p.relative_to(ROOT / "configs").with_suffix("").as_posix() for p in (ROOT / "configs").rglob("*.yaml")
    }
    assert set(config_files()) == repo_configs
    for name, path in config_files().items():
        header = path.read_text().split("\n\n")[0]
        assert recipe_of(name) in header or recipe_of(name) in path.read_text(), name
        assert yaml.safe_load(path.read_text())["model"]["_component_"].startswith("torchtune_ext.models.")


def test_ls_lists_every_recipe_and_config(tune_ext, tmp_path):
    result = tune_ext("ls", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in [*recipe_files(), *config_files()]:
        assert name in result.stdout


@pytest.mark.integration_test
def test_cp_then_run_by_name_outside_a_clone(tune_ext, tmp_path):
    """A user without a clone copies the tiny config, edits nothing, and runs the recipe by name on it (the run: a
    real process of the console script, without this clone on its path)."""
    copied = tune_ext("cp", "tiny/qlora_single_device", "my_config.yaml", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr[-3000:]
    assert (tmp_path / "my_config.yaml").read_text() == config_files()["tiny/qlora_single_device"].read_text()
    again = tune_ext("cp", "tiny/qlora_single_device", "my_config.yaml", cwd=tmp_path)
    assert again.returncode != 0 and "exists" in again.stderr
    run = _tune_ext(
        "run",
        "qlora_finetune_single_device",
        "--config",
        "my_config.yaml",
        "max_steps_per_epoch=2",
        "batch_size=4",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "outputs" / "tiny_qlora" / "step_2" / "adapter" / "adapter_model.safetensors").is_file()


def test_run_names_unknown_recipes_and_configs(tune_ext, tmp_path):
    result = tune_ext("run", "no_such_recipe", "--config", "tiny/qlora_single_device", cwd=tmp_path)
    assert result.returncode != 0 and "no_such_recipe" in result.stderr and "tune-ext ls" in result.stderr


def test_every_training_config_names_its_models_generation_config():
    """The summary's "answer prompts" command names the generation config that ships for the model trained."""
    from torchtune_ext._shipped import generation_config_for

    assert generation_config_for("configs/llama3_1/8B_qlora_single_device.yaml") == "llama3_1/8B_generation"
    assert generation_config_for("llama3_1/8B_qlora_2xT4") == "llama3_1/8B_generation"
    assert generation_config_for("configs/tiny/qlora_single_device.yaml") == "tiny/generation"
    assert generation_config_for("my_config.yaml") is None
    assert generation_config_for("llama3_2/1B_eleuther_eval") is None
    training = [name for name in config_files() if recipe_of(name).startswith("qlora_finetune")]
    assert {name: generation_config_for(name) for name in training if generation_config_for(name) is None} == {}

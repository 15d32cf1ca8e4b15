"""``recipes/qlora_finetune_distributed.py`` started without a launcher: one line that says how to launch it, exit 2,
before anything is built or written; its dry run needs no launcher."""

from pathlib import Path

from conftest import load_recipe, run_main

from torchtune_ext.config import CONFIG_ERROR_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "qlora_finetune_distributed.py"
CONFIG = REPO / "configs" / "tiny" / "qlora_distributed.yaml"


def test_without_a_launcher_one_line_names_the_launch_command(tmp_path, monkeypatch, capfd):
    argv = [str(RECIPE), "--config", str(CONFIG), f"output_dir={tmp_path / 'out'}"]
    run = run_main(load_recipe(RECIPE).recipe_main, argv, monkeypatch, capfd, cwd=REPO)
    assert run.returncode == CONFIG_ERROR_EXIT_CODE, run.stderr
    lines = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith("qlora_finetune_distributed: error: the distributed recipe must be started")
    assert "tune run --nproc_per_node <N> recipes/qlora_finetune_distributed.py" in lines[0]
    assert not (tmp_path / "out").exists()


def test_its_dry_run_needs_no_launcher(tmp_path, monkeypatch, capfd):
    argv = [str(RECIPE), "--config", str(CONFIG), "dry_run=True", f"output_dir={tmp_path / 'out'}"]
    run = run_main(load_recipe(RECIPE).recipe_main, argv, monkeypatch, capfd, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "longest sequence every rank fits" in run.stdout + run.stderr
    assert not (tmp_path / "out").exists()

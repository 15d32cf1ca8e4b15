"""``tune-ext validate`` / ``tune-ext cat`` and how config errors print: one line per problem, exit code 2, no
traceback (unless ``TORCHTUNE_EXT_TRACEBACK=1``), nothing written. The printed lines are the point: the CLI's entry
point runs in this process as its console script runs it (``conftest.run_main``), and once as a real process
(``test_the_console_script_prints_the_lines_and_exits_2``, in the slow lane).

The code is whatever ``torchtune_ext`` this process imports (a source tree as such; CI's wheel install as installed).
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from conftest import run_main

from torchtune_ext import cli
from torchtune_ext.cli import config_files

TUNE_EXT = Path(sys.executable).parent / "tune-ext"

pytestmark = pytest.mark.stack
VALIDATE_TINY = ("validate", "--config", "tiny/qlora_single_device")
PROBLEMS = ("dtpye=fp32", "model.lora_rank=0", "lora_rank=-1")
PROBLEM_LINES = [
    "tune-ext: error: unknown key 'dtpye': did you mean 'dtype'?",
    "tune-ext: error: unknown key 'lora_rank': did you mean 'model.lora_rank'?",
    "tune-ext: error: model.lora_rank=0 must be an integer >= 1 (e.g. 8, 16, 64)",
]


@pytest.fixture
def tune_ext(monkeypatch, capfd):
    """``tune_ext(*args, cwd=..., env=...)``: ``tune-ext <args>`` run in this process."""

    def run(*args: str, cwd: Path, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        return run_main(cli.main, ["tune-ext", *args], monkeypatch, capfd, cwd=cwd, **(env or {}))

    return run


def test_validate_a_good_config_writes_nothing(tune_ext, tmp_path):
    result = tune_ext(*VALIDATE_TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].endswith("qlora_single_device.yaml: OK")
    assert "checked: recipe settings (dtype torch.float32, batch_size 16)" in result.stdout
    assert list(tmp_path.iterdir()) == []  # neither the base checkpoint nor the output folder


def test_validate_checks_the_model_against_the_checkpoint_headers(tune_ext, tmp_path):
    from torchtune_ext.data import write_tiny_checkpoint

    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="fp32", seed=0)
    good = tune_ext(*VALIDATE_TINY, f"checkpointer.checkpoint_dir={base}", cwd=tmp_path)
    assert good.returncode == 0, good.stderr[-3000:]
    assert f"matches the checkpoint headers in {base}" in good.stdout
    bad = tune_ext(
        *VALIDATE_TINY,
        f"checkpointer.checkpoint_dir={base}",
        "model.vocab_size=1024",
        cwd=tmp_path,
    )
    assert bad.returncode != 0 and "but the configured model expects (1024, 256)" in bad.stderr


def test_validate_prints_one_line_per_problem_and_exits_2(tune_ext, tmp_path):
    result = tune_ext(*VALIDATE_TINY, *PROBLEMS, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == PROBLEM_LINES
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration_test
def test_the_console_script_prints_the_lines_and_exits_2(tmp_path):
    """The same from the ``tune-ext`` console script in a process of its own: the exit code and the lines a user
    gets."""
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHTUNE_EXT_TRACEBACK"}, "OMP_NUM_THREADS": "1"}
    args = [str(TUNE_EXT), *VALIDATE_TINY, *PROBLEMS]
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2
    assert result.stderr.splitlines() == PROBLEM_LINES
    assert list(tmp_path.iterdir()) == []


def test_validate_names_the_tokenizer_file_with_its_subfolder(tune_ext, tmp_path):
    result = tune_ext("validate", "--config", "llama3_2/1B_qlora_single_device", "device=cpu", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("tune-ext: error: tokenizer.path='/tmp/Llama-3.2-1B-Instruct/original/tokenizer.model'")
    assert line.endswith("(e.g. tokenizer.path=<checkpoint_dir>/original/tokenizer.model).")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A folder where the tiny run saved a resumable checkpoint (step 1) in its default output_dir."""
    folder = tmp_path_factory.mktemp("saved_run")
    overrides = ("stop_after_step=1", "max_steps_per_epoch=2", "run_val_every_n_steps=null")
    args = ["run", "qlora_finetune_single_device", "--config", "tiny/qlora_single_device", *overrides]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setattr(sys, "argv", ["tune-ext", *args])  # `tune run` sets it for the recipe
        with pytest.raises(SystemExit) as stop:  # the recipe's exit, as its process exits
            cli.main(args)
    assert stop.value.code in (0, None)
    assert (folder / "outputs/tiny_qlora/recipe_state/recipe_state.pt").is_file()
    return folder


def _files(folder: Path) -> Dict[str, Tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _errors(result: subprocess.CompletedProcess) -> List[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("tune-ext: error:")]


def test_validate_refuses_an_output_dir_holding_another_runs_checkpoints(tune_ext, saved_run):
    before = _files(saved_run)
    result = tune_ext(*VALIDATE_TINY, cwd=saved_run)
    assert result.returncode == 2, result.stdout
    assert _errors(result) == [
        "tune-ext: error: output_dir='outputs/tiny_qlora' holds another run's checkpoints "
        "(recipe_state/recipe_state.pt, step_1). Continue that run with resume_from_checkpoint=True, replace it "
        "with overwrite_output_dir=True (deletes them), or set another output_dir."
    ]
    assert _files(saved_run) == before


def test_validate_refuses_a_resume_with_nothing_to_resume(tune_ext, saved_run, tmp_path):
    before = _files(saved_run)
    fresh = tmp_path / "fresh"
    result = tune_ext(*VALIDATE_TINY, f"output_dir={fresh}", "resume_from_checkpoint=True", cwd=saved_run)
    assert result.returncode == 2, result.stdout
    assert _errors(result) == [
        f"tune-ext: error: resume_from_checkpoint=True but {fresh}/recipe_state/recipe_state.pt does not exist: resume "
        "with the same output_dir as the interrupted run, or set checkpointer.recipe_checkpoint to its recipe_state.pt."
    ]
    assert not fresh.exists() and _files(saved_run) == before


def test_validate_checks_a_resume_against_the_saved_run(tune_ext, saved_run):
    before = _files(saved_run)
    changed = tune_ext(*VALIDATE_TINY, "resume_from_checkpoint=True", "model.lora_rank=8", cwd=saved_run)
    assert changed.returncode == 2, changed.stdout
    assert _errors(changed) == [
        "tune-ext: error: resume_from_checkpoint=True, but this run is not the one saved in "
        "outputs/tiny_qlora/recipe_state/recipe_state.pt (step 1); it differs in what defines the run:",
        "tune-ext: error:   model.lora_rank: 16 -> 8",
        "tune-ext: error: Resume with the saved values, or start a new run in another output_dir.",
    ]
    same = tune_ext(*VALIDATE_TINY, "resume_from_checkpoint=True", cwd=saved_run)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "checked: resume: outputs/tiny_qlora/recipe_state/recipe_state.pt (step 1) is this run's" in same.stdout
    assert _files(saved_run) == before


def test_validate_refuses_bf16_on_a_t4_profile(tune_ext, tmp_path):
    """The profile names the card the config is for: the run refuses bf16 there as its dry run does."""
    for dry_run in ("dry_run=False", "dry_run=True"):
        result = tune_ext(*VALIDATE_TINY, "dtype=bf16", "device_profile=t4", dry_run, cwd=tmp_path)
        assert result.returncode == 2, result.stdout
        assert _errors(result) == [
            "tune-ext: error: dtype=bf16 with device_profile=t4 (sm75): the card has no bf16 and the recipe refuses it "
            "there. Use dtype=fp32 (same results, ~20% more memory) or dtype=fp16, or drop device_profile if the run "
            "is not for that card."
        ]
    assert list(tmp_path.iterdir()) == []


def test_validate_checks_generation_and_eval_configs_against_their_recipes(tune_ext, saved_run, tmp_path):
    """Their recipes' settings, then what loading checks before it reads a weight: the base and the adapter."""
    no_base = tune_ext("validate", "--config", "tiny/generation", cwd=tmp_path)
    assert no_base.returncode == 2, no_base.stdout
    assert "checking" in no_base.stdout and "as a config of generate" in no_base.stdout
    assert _errors(no_base) == [
        "tune-ext: error: checkpointer.checkpoint_dir='outputs/tiny_base' does not exist. Download the model first "
        "(e.g. `tune download <hf-repo> --output-dir <dir>`) and point checkpointer.checkpoint_dir at it."
    ]
    typo = tune_ext("validate", "--config", "tiny/generation", "max_new_token=3", cwd=tmp_path)
    assert typo.returncode == 2
    assert _errors(typo) == ["tune-ext: error: unknown key 'max_new_token': did you mean 'max_new_tokens'?"]
    tasks = tune_ext("validate", "--config", "tiny/eleuther_eval", cwd=tmp_path)
    assert tasks.returncode == 2
    assert _errors(tasks) == [
        "tune-ext: error: tasks must be set: the config leaves it to the command line (tasks=...)"
    ]
    as_training = tune_ext(
        "validate", "--recipe", "qlora_finetune_single_device", "--config", "tiny/generation", cwd=tmp_path
    )
    assert as_training.returncode == 2 and "loss is missing" in as_training.stderr
    assert list(tmp_path.iterdir()) == []

    before = _files(saved_run)
    adapter = "adapter_dir=outputs/tiny_qlora/step_1/adapter"
    good = tune_ext("validate", "--config", "tiny/generation", adapter, cwd=saved_run)
    assert good.returncode == 0, good.stderr[-3000:]
    assert (
        "checked: model (meta) matches the checkpoint headers in outputs/tiny_base and the adapter in "
        "outputs/tiny_qlora/step_1/adapter"
    ) in good.stdout
    other_rank = tune_ext("validate", "--config", "tiny/generation", adapter, "model.lora_rank=8", cwd=saved_run)
    assert other_rank.returncode != 0
    assert "rank r=16 but the model has lora_rank=8" in other_rank.stderr
    assert _files(saved_run) == before


def test_the_traceback_on_request(tune_ext, tmp_path):
    result = tune_ext(*VALIDATE_TINY, "dtpye=fp32", cwd=tmp_path, env={"TORCHTUNE_EXT_TRACEBACK": "1"})
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError: unknown key 'dtpye': did you mean 'dtype'?" in result.stderr


def test_cat_prints_a_shipped_config(tune_ext, tmp_path):
    result = tune_ext("cat", "llama3_2/1B_qlora_single_device", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout == config_files()["llama3_2/1B_qlora_single_device"].read_text()
    unknown = tune_ext("cat", "llama3_2/1B_qlora", cwd=tmp_path)
    assert unknown.returncode != 0 and "is not a config of `tune-ext ls`" in unknown.stderr

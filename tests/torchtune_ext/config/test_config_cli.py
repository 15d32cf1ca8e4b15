"""``tune-ext validate`` / ``tune-ext cat`` and how config errors print: one line per problem, exit code 2, no
traceback (unless ``TORCHTUNE_EXT_TRACEBACK=1``), nothing written. Real processes: the printed lines are the point.

The environment is inherited (a source tree on ``PYTHONPATH`` is tested as such; CI's wheel install as installed).
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from torchtune_ext.cli import config_files

TUNE_EXT = Path(sys.executable).parent / "tune-ext"

pytestmark = pytest.mark.stack
VALIDATE_TINY = ("validate", "--config", "tiny/qlora_single_device")


def _tune_ext(*args: str, cwd: Path, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if k != "TORCHTUNE_EXT_TRACEBACK"}
    full_env = {**inherited, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([str(TUNE_EXT), *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600)


def test_validate_a_good_config_writes_nothing(tmp_path):
    result = _tune_ext(*VALIDATE_TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].endswith("qlora_single_device.yaml: OK")
    assert "checked: recipe settings (dtype torch.float32, batch_size 16)" in result.stdout
    assert list(tmp_path.iterdir()) == []  # neither the base checkpoint nor the output folder


def test_validate_checks_the_model_against_the_checkpoint_headers(tmp_path):
    from torchtune_ext.data import write_tiny_checkpoint

    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="fp32", seed=0)
    good = _tune_ext(*VALIDATE_TINY, f"checkpointer.checkpoint_dir={base}", cwd=tmp_path)
    assert good.returncode == 0, good.stderr[-3000:]
    assert f"matches the checkpoint headers in {base}" in good.stdout
    bad = _tune_ext(
        *VALIDATE_TINY,
        f"checkpointer.checkpoint_dir={base}",
        "model.vocab_size=1024",
        cwd=tmp_path,
    )
    assert bad.returncode != 0 and "but the configured model expects (1024, 256)" in bad.stderr


def test_validate_prints_one_line_per_problem_and_exits_2(tmp_path):
    result = _tune_ext(*VALIDATE_TINY, "dtpye=fp32", "model.lora_rank=0", "lora_rank=-1", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "tune-ext: error: unknown key 'dtpye': did you mean 'dtype'?",
        "tune-ext: error: unknown key 'lora_rank': did you mean 'model.lora_rank'?",
        "tune-ext: error: model.lora_rank=0 must be an integer >= 1 (e.g. 8, 16, 64)",
    ]
    assert list(tmp_path.iterdir()) == []


def test_validate_names_the_tokenizer_file_with_its_subfolder(tmp_path):
    result = _tune_ext("validate", "--config", "llama3_2/1B_qlora_single_device", "device=cpu", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("tune-ext: error: tokenizer.path='/tmp/Llama-3.2-1B-Instruct/original/tokenizer.model'")
    assert line.endswith("(e.g. tokenizer.path=<checkpoint_dir>/original/tokenizer.model).")


def test_the_traceback_on_request(tmp_path):
    result = _tune_ext(*VALIDATE_TINY, "dtpye=fp32", cwd=tmp_path, env={"TORCHTUNE_EXT_TRACEBACK": "1"})
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError: unknown key 'dtpye': did you mean 'dtype'?" in result.stderr


def test_cat_prints_a_shipped_config(tmp_path):
    result = _tune_ext("cat", "llama3_2/1B_qlora_single_device", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout == config_files()["llama3_2/1B_qlora_single_device"].read_text()
    unknown = _tune_ext("cat", "llama3_2/1B_qlora", cwd=tmp_path)
    assert unknown.returncode != 0 and "is not a config of `tune-ext ls`" in unknown.stderr

"""Writes that fail keep what fitted and say what failed (issue 24), with real processes and real limits:

- a file-size limit (``ulimit -f``) that the adapter (0.5 MB) and the recipe state (1.6 MB) fit under but the merged
  model (5.3 MB) does not: the end-of-run merged export fails, the adapter and the recipe state are kept, and the
  error names the file, the cause and the standalone merge command;
- a full 4 MiB tmpfs: the free-space check skips the merged export with a message and the run succeeds;
- a 1 MiB tmpfs: the recipe state does not fit; the error names ``recipe_state.pt`` and "no space left";
- a read-only output folder, or a read-only ``recipe_state/`` in it: found at start-up, before anything is written.

The tmpfs and read-only cases mount in a private mount namespace (``unshare -m``); where that is not allowed they
are skipped.
"""

import shlex
import subprocess
from pathlib import Path
from typing import List

import pytest
import torch
from reliability_utils import (
    SINGLE_CONFIG,
    SINGLE_RECIPE,
    TUNE,
    Run,
    adapter,
    assert_no_leftovers,
    env,
    recipe_state_step,
    small_run,
    snapshot,
)

from torchtune_ext.data import write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test]

STEPS = 6


def _can_mount() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs a private mount namespace (unshare -m)")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base") / "base", family="llama", dtype="fp32", seed=0)


def _tune_command(out: Path, base: Path, extra: List[str] = ()) -> str:
    args = [str(TUNE), "run", SINGLE_RECIPE, "--config", str(SINGLE_CONFIG)]
    args += small_run(out, base, STEPS, out / "logs") + ["batch_size=4", *extra]
    return shlex.join(args)


def _shell(script: str, log: Path) -> Run:
    return Run(["bash", "-c", script], env(), log)


def _in_namespace(script: str, log: Path) -> Run:
    return Run(["unshare", "-m", "bash", "-c", script], env(), log)


def _merge_command(base: Path, step_dir: Path) -> str:
    return f"tune-ext merge --base {base} --adapter {step_dir / 'adapter'} --output {step_dir / 'merged'}"


def test_file_size_limit_in_the_merged_export_keeps_the_adapter_and_the_recipe_state(tmp_path, base):
    out = tmp_path / "out"
    run = _shell(f"ulimit -f 2048 && exec {_tune_command(out, base)}", tmp_path / "run.log")
    rc = run.wait()
    assert_no_leftovers([run])
    assert rc == 1, run.output[-3000:]
    step = out / f"step_{STEPS}"
    text = run.output
    assert "Traceback" not in text, text[-3000:]  # the message is the report
    assert (
        f"Could not write {step / 'merged' / 'model-00001-of-00001.safetensors'}: file too large (a file-size limit "
        "such as `ulimit -f`, or the file system's largest file). Folder: " in text
    ), text[-3000:]
    assert (
        f"The merged export failed; the adapter ({step / 'adapter'}) and the recipe state ({out / 'recipe_state'}) "
        f"are saved. Free some space (or lift the limit) and run `{_merge_command(base, step)}` to merge them" in text
    )
    assert all(torch.isfinite(t).all() for t in adapter(step).values()) and len(adapter(step)) == 28
    assert recipe_state_step(out) == STEPS
    assert sorted(p.name for p in step.iterdir()) == ["adapter"], "a partial merged model (or its temporary) is left"


@needs_mount
def test_full_tmpfs_skips_the_merged_export_with_a_message(tmp_path, base):
    out, copy = tmp_path / "out", tmp_path / "copy"
    out.mkdir()
    script = (
        f"mount -t tmpfs -o size=4m tmpfs {out} && {{ {_tune_command(out, base)}; rc=$?; cp -a {out} {copy}; "
        "exit $rc; }"
    )
    run = _in_namespace(script, tmp_path / "run.log")
    rc = run.wait()
    assert_no_leftovers([run])
    assert rc == 0, run.output[-3000:]
    step = out / f"step_{STEPS}"
    text = run.output
    assert "Skipped the merged export: merged model needs 6.3 MB, " in text, text[-3000:]
    assert (
        f"MB free in {step}; the adapter is saved ({step / 'adapter'}); run `{_merge_command(base, step)}` to " in text
    )
    assert "  merged model:        skipped: merged model needs 6.3 MB" in text
    copied = copy / step.name
    assert sorted(p.name for p in copied.iterdir()) == ["adapter"]
    assert len(adapter(copied)) == 28
    assert recipe_state_step(copy) == STEPS


@needs_mount
def test_no_space_for_the_recipe_state_names_the_file_and_the_cause(tmp_path, base):
    out = tmp_path / "out"
    out.mkdir()
    script = f"mount -t tmpfs -o size=1m tmpfs {out} && {_tune_command(out, base)}"
    run = _in_namespace(script, tmp_path / "run.log")
    rc = run.wait()
    assert_no_leftovers([run])
    assert rc == 1 and "Traceback" not in run.output, run.output[-3000:]
    assert (
        f"Could not write {out / 'recipe_state' / 'recipe_state.pt'}: no space left on the device. Folder: "
        f"{out / 'recipe_state'}, " in run.output
    ), run.output[-3000:]
    assert "inline_container" not in run.output


@needs_mount
@pytest.mark.parametrize("read_only", ["", "recipe_state"], ids=["output_dir", "recipe_state"])
def test_read_only_folder_is_found_at_start_up(tmp_path, base, read_only):
    out = tmp_path / "out"
    (out / "recipe_state").mkdir(parents=True)
    (out / "recipe_state" / "note.txt").write_text("from an earlier run")
    folder = out / read_only if read_only else out
    before = snapshot(out)
    script = (
        f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder} && "
        f"exec {_tune_command(out, base, ['resume_from_checkpoint=False'])}"
    )
    run = _in_namespace(script, tmp_path / "run.log")
    rc = run.wait()
    assert_no_leftovers([run])
    assert rc != 0
    key = "output_dir" + (f"/{read_only}" if read_only else "")
    assert f"{key}={str(folder)!r} is not writable ({folder}: read-only file system)" in run.output, run.output[-3000:]
    assert "Writing logs" not in run.output and "Loaded" not in run.output
    assert snapshot(out) == before

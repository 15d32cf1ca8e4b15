"""One run per output folder: the lock held by another live process refuses a second start naming its pid, the lock
of a killed process blocks nothing, and a folder holding another run's checkpoints is refused (nothing written)
unless resumed or overwritten."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchtune_ext.checkpoint._lock import (
    LOCK_FILENAME,
    OutputDirInUseError,
    OutputDirLock,
    check_output_dir,
    claim_output_dir,
)

REPO = Path(__file__).resolve().parents[3]


def _holder(output_dir: Path) -> subprocess.Popen:
    """Another process that takes the lock of ``output_dir`` and keeps it until killed."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from torchtune_ext.checkpoint._lock import OutputDirLock
        lock = OutputDirLock({str(output_dir)!r}).acquire()
        print("locked", flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_second_start_refused_naming_the_running_pid(tmp_path):
    out = tmp_path / "out"
    holder = _holder(out)
    try:
        before = _snapshot(out)
        for start in (check_output_dir, claim_output_dir):
            with pytest.raises(OutputDirInUseError, match=rf"in use by another run \(pid {holder.pid} on .*started "):
                start(out, False, False)
        with pytest.raises(OutputDirInUseError, match=f"pid {holder.pid}"):
            claim_output_dir(out, True, False)  # a resume of a running run is refused too
        assert _snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


def test_killed_runs_lock_does_not_block(tmp_path):
    out = tmp_path / "out"
    holder = _holder(out)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (out / LOCK_FILENAME).is_file()
    check_output_dir(out, False, False)
    lock = claim_output_dir(out, False, False)
    assert lock.held and f'"pid": {os.getpid()}' in (out / LOCK_FILENAME).read_text()
    lock.release()


def test_lock_excludes_a_second_holder_in_the_same_process(tmp_path):
    with OutputDirLock(tmp_path):
        assert OutputDirLock.is_held(tmp_path)
        with pytest.raises(OutputDirInUseError, match=f"pid {os.getpid()}"):
            OutputDirLock(tmp_path).acquire()
    assert not OutputDirLock.is_held(tmp_path)
    with OutputDirLock(tmp_path) as lock:
        assert lock.held


@pytest.fixture
def used(tmp_path) -> Path:
    """An output folder holding another run's checkpoints (and its logs)."""
    out = tmp_path / "used"
    (out / "recipe_state").mkdir(parents=True)
    (out / "recipe_state" / "recipe_state.pt").write_bytes(b"state")
    for step in (20, 40, 5):
        (out / f"step_{step}" / "adapter").mkdir(parents=True)
    (out / "logs").mkdir()
    return out


def test_used_output_dir_refused_before_writing(used):
    before = _snapshot(used)
    for start in (check_output_dir, claim_output_dir):
        with pytest.raises(ValueError) as err:
            start(used, False, False)
        message = str(err.value)
        assert "recipe_state/recipe_state.pt, step_5, step_20, step_40" in message
        assert "resume_from_checkpoint=True" in message and "overwrite_output_dir=True" in message
    assert _snapshot(used) == before
    assert not (used / LOCK_FILENAME).exists()


def test_used_output_dir_resumed_or_overwritten(used, tmp_path):
    check_output_dir(used, True, False)
    lock = claim_output_dir(used, True, False)
    assert (used / "step_40").is_dir()
    lock.release()
    with pytest.raises(ValueError, match="contradict"):
        check_output_dir(used, True, True)
    lock = claim_output_dir(used, False, True)
    assert sorted(p.name for p in used.iterdir()) == [LOCK_FILENAME, "logs"]
    lock.release()
    logs_only = tmp_path / "logs_only"
    (logs_only / "logs").mkdir(parents=True)
    claim_output_dir(logs_only, False, False).release()  # a run that failed before saving: nothing to lose


def test_lock_file_names_the_holder_start_time(tmp_path):
    start = time.time()
    with OutputDirLock(tmp_path):
        with pytest.raises(OutputDirInUseError) as err:
            check_output_dir(tmp_path, False, False)
    assert time.strftime("%Y-%m-%d", time.localtime(start)) in str(err.value)

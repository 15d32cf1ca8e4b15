"""One run per output folder (single device): run A is a real process (it holds the folder while paused, then is
SIGKILLed); runs B, C and D call the recipe's entry point in this process, as ``tune run`` calls it (their exit code,
what they print and log, what they write); runs started together are real processes:

1. run A starts (a checkpoint every step) and stalls in step 3;
2. run B starts into the same folder: refused at start, naming A's pid and start time, writing nothing;
3. A is SIGKILLed (its lock goes with it); run C starts into the folder again without resuming: refused, naming
   the checkpoints found there and both ways on (``resume_from_checkpoint=True``, ``overwrite_output_dir=True``),
   writing nothing;
4. run D resumes: the killed run's lock does not block it, and it trains to the end.
"""

import re
import time
from pathlib import Path
from typing import List, Tuple

import pytest
from reliability_utils import (
    SINGLE_CONFIG,
    SINGLE_RECIPE,
    assert_no_leftovers,
    call_recipe,
    kill,
    logged,
    small_run,
    snapshot,
    tune,
)

from torchtune_ext.config import CONFIG_ERROR_EXIT_CODE
from torchtune_ext.data import write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test]

STEPS = 4


def _overrides(out: Path, base: Path, name: str, extra=()) -> List[str]:
    return small_run(out, base, STEPS, out / "logs" / name) + ["batch_size=4", *extra]


def _start(out: Path, base: Path, name: str, extra=()):
    return tune(SINGLE_RECIPE, SINGLE_CONFIG, _overrides(out, base, name, extra), out.parent / f"{name}.log")


def test_one_run_per_output_dir(tmp_path, monkeypatch, capfd, caplog):
    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="fp32", seed=0)
    out = tmp_path / "out"
    marker = tmp_path / "paused"

    def call(name: str, extra=()) -> Tuple[int, str]:
        return call_recipe(_overrides(out, base, name, extra), monkeypatch, capfd, caplog)

    def refused(name: str) -> str:
        rc, output = call(name)
        assert rc != 0, f"a second run into a used output_dir started:\n{output[-3000:]}"
        return output

    stall = ["save_every_n_steps=1", "loss.fault=pause", "loss.steps=[3]", f"loss.marker={marker}"]
    started = time.time()
    first = _start(out, base, "A", stall)
    pid = first.wait_for_marker(marker)
    paused = time.time()
    assert pid == first.proc.pid

    before = snapshot(out)
    output = refused("B")
    assert re.search(
        rf"output_dir='{re.escape(str(out))}' is in use by another run \(pid {pid} on .*, started ", output
    )
    stamp = re.search(r"started (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", output).group(1)
    locked = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))  # A took the lock between its start and pause
    assert started - 1 <= locked <= paused, (started, stamp, paused)
    assert snapshot(out) == before, "the refused run wrote into the folder"

    assert kill(first, pid) != 0
    assert_no_leftovers([first])
    before = snapshot(out)
    output = refused("C")
    assert "holds another run's checkpoints (recipe_state/recipe_state.pt, step_1, step_2)" in output
    assert "resume_from_checkpoint=True" in output and "overwrite_output_dir=True" in output
    assert snapshot(out) == before, "the refused run wrote into the folder"

    rc, output = call("D", ["resume_from_checkpoint=True"])
    assert rc == 0, output[-6000:]
    assert sorted(logged(out / "logs" / "D")) == [3, 4]
    assert (out / f"step_{STEPS}" / "adapter").is_dir()


@pytest.mark.parametrize("trial", range(2))
def test_two_runs_started_together(tmp_path, trial):
    """Two runs started at the same moment into one fresh folder (the issue saw their step folders mixed, and a
    crash on a rename): one trains to the end, the other is refused with one line (exit 2) and writes nothing."""
    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="fp32", seed=0)
    out = tmp_path / "out"
    runs = {name: _start(out, base, name, ["save_every_n_steps=1"]) for name in ("A", "B")}
    codes = {name: run.wait() for name, run in runs.items()}
    assert sorted(codes.values()) == [0, CONFIG_ERROR_EXIT_CODE], {n: r.output[-3000:] for n, r in runs.items()}
    winner, loser = sorted(runs, key=lambda name: codes[name])
    refusal = runs[loser].output
    assert "Traceback" not in refusal, refusal[-3000:]
    # the loser looked while the winner held the lock, or (on a busy machine) after it had saved
    assert f"is in use by another run (pid {runs[winner].proc.pid} on " in refusal or (
        "holds another run's checkpoints" in refusal
    ), refusal[-3000:]
    assert not (out / "logs" / loser).exists()
    assert sorted(logged(out / "logs" / winner)) == list(range(1, STEPS + 1))
    assert sorted(p.name for p in out.glob("step_*")) == [f"step_{STEPS - 1}", f"step_{STEPS}"]  # keep_last_n 2
    assert_no_leftovers(list(runs.values()))

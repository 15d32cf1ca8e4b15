"""Crash safety: SIGKILL a recipe mid-training and mid-checkpoint-write, then resume; the result equals an
uninterrupted run step for step.

Each test runs one output folder through a chain of kills, each followed by ``resume_from_checkpoint=True``:

- single device (8 steps, a checkpoint every 2): killed (1) in the forward of step 3, (2) half-way through writing
  the recipe state of step 4, (3) half-way through writing step 6's adapter file, (4) after writing the final step
  8's folder (its adapter; the merged model is written after the recipe state) but before renaming it into place;
  then resumed to the end.
- 2 gloo ranks (6 steps, a checkpoint every 2): rank 1 killed in the forward of step 3, then rank 0 killed half-way
  through writing step 4's adapter file; then resumed to the end.

After every kill: the launcher exits non-zero and no process of the run is left (no orphan, no zombie); the recipe
state that a resume loads reads completely and belongs to a complete checkpoint (its ``step_N`` folder exists: a
checkpoint is the folder plus the recipe state, so a partial one must never be resumed from), at most one
checkpoint interval of steps is lost; every visible ``step_N`` folder is complete and equals the uninterrupted
run's; a partially written file exists only under a hidden temporary name. The losses the killed run logged, those
of every resumed run, and the final adapter and merged model equal the uninterrupted run's (fp32, 1e-5).
Checkpoint writes are paused by ``inject/sitecustomize.py``; mid-training pauses come from the fault-injecting loss
(``reliability_faults.py``). The uninterrupted single-device run calls the recipe in this process (as ``tune run``
calls it); every killed and resumed run is a launched process. The test prints the figures (kills survived,
completed steps redone per kill).
"""

from pathlib import Path
from typing import Dict, List, Optional

import pytest
from conftest import run_recipe_in_process
from reliability_utils import (
    DIST_CONFIG,
    DIST_RECIPE,
    REPO,
    SINGLE_CONFIG,
    SINGLE_RECIPE,
    adapter,
    assert_no_leftovers,
    check_ok,
    hidden_entries,
    kill,
    logged,
    max_abs_diff,
    merged,
    recipe_state_step,
    small_run,
    tune,
    visible_entries,
)

from torchtune_ext.data import write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test]

TOLERANCE = 1e-5
SAVE_EVERY = 2


class Kill:
    """One interruption of the chain.

    Args:
        name (str): what is interrupted.
        loss_pause_step (Optional[int]): pause in the loss's forward of this step (mid-training).
        write_pause (Optional[str]): pause a checkpoint write (``<point>@<step>``, see inject/sitecustomize.py).
        rank (int): the rank that pauses and is killed.
        partial (Optional[str]): glob of the hidden temporary entry that the interrupted write leaves.
    """

    def __init__(
        self,
        name: str,
        loss_pause_step: Optional[int] = None,
        write_pause: Optional[str] = None,
        rank: int = 0,
        partial: Optional[str] = None,
    ):
        self.name, self.loss_pause_step, self.write_pause, self.rank, self.partial = (
            name,
            loss_pause_step,
            write_pause,
            rank,
            partial,
        )


SINGLE_KILLS = [
    Kill("forward of step 3", loss_pause_step=3),
    Kill("recipe state write of step 4", write_pause="recipe_state@4", partial="recipe_state/.recipe_state.pt.tmp-*"),
    Kill("adapter write of step 6", write_pause="adapter@6", partial=".step_6.tmp-*"),
    Kill(
        "rename of the final step 8's folder (its adapter; the merged model comes after the recipe state)",
        write_pause="commit@8",
        partial=".step_8.tmp-*",
    ),
]
DIST_KILLS = [
    Kill("rank 1 in the forward of step 3", loss_pause_step=3, rank=1),
    Kill("rank 0 in the adapter write of step 4", write_pause="adapter@4", rank=0, partial=".step_4.tmp-*"),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base"), family="llama", dtype="fp32", seed=0)


def _overrides(out: Path, base: Path, steps: int, run_name: str, nproc: int) -> List[str]:
    batch = ["batch_size=4"] if nproc == 0 else ["batch_size=2", "process_group_timeout_s=60"]
    return small_run(out, base, steps, out / "logs" / run_name) + batch + [f"save_every_n_steps={SAVE_EVERY}"]


def _start(recipe: str, out: Path, base: Path, steps: int, run_name: str, extra: List[str], nproc: int, **pause):
    config = SINGLE_CONFIG if recipe == SINGLE_RECIPE else DIST_CONFIG
    overrides = _overrides(out, base, steps, run_name, nproc) + extra
    return tune(recipe, config, overrides, out.parent / f"{out.name}_{run_name}.log", nproc=nproc, **pause)


def _uninterrupted(recipe: str, out: Path, base: Path, steps: int, nproc: int) -> Dict[int, float]:
    """The uninterrupted reference run, its losses by step (on one device: in this process)."""
    # Every step folder kept, to compare with whichever the killed runs keep (their default: the newest 2).
    keep_all = ["keep_last_n_checkpoints=null"]
    if nproc:
        check_ok(_start(recipe, out, base, steps, "run0", keep_all, nproc))
    else:
        args = ["--config", str(SINGLE_CONFIG), *_overrides(out, base, steps, "run0", nproc), *keep_all]
        run_recipe_in_process(REPO / recipe, args, cwd=REPO)
    losses = logged(out / "logs" / "run0")
    assert sorted(losses) == list(range(1, steps + 1))
    return losses


def _check_after_kill(
    kill_: Kill,
    out: Path,
    reference: Path,
    losses: Dict[int, float],
    reference_losses: Dict[int, float],
    resumed_from: int,
) -> int:
    """Checks what a kill left behind; returns the step a resume starts from."""
    assert losses, f"{kill_.name}: the killed run logged no step"
    for step, loss in losses.items():
        assert abs(loss - reference_losses[step]) <= TOLERANCE, (
            f"{kill_.name}: loss {loss} of step {step} differs from the uninterrupted run's {reference_losses[step]}"
        )
    resumable = recipe_state_step(out)
    steps = sorted(int(p.name.split("_")[1]) for p in out.glob("step_*"))
    # A checkpoint is its step folder plus the recipe state: the state a resume loads must not be ahead of the
    # complete folders (a partial checkpoint taken for complete), nor behind the previous resume point.
    assert resumable in steps, (
        f"{kill_.name}: the recipe state is at step {resumable} but step_{resumable} is "
        f"missing (complete step folders: {steps})"
    )
    assert resumed_from <= resumable <= max(losses), (kill_.name, resumed_from, resumable, max(losses))
    # At most the steps since the last checkpoint are lost.
    assert max(losses) - resumable <= SAVE_EVERY, (kill_.name, resumable, max(losses))
    for step in steps:
        assert max_abs_diff(adapter(out / f"step_{step}"), adapter(reference / f"step_{step}")) <= TOLERANCE, step
    assert not any("tmp" in name or "old" in name for name in visible_entries(out)), visible_entries(out)
    if kill_.partial is not None:
        assert list(out.glob(kill_.partial)), (kill_.name, hidden_entries(out))
    return resumable


def _kill_chain(recipe: str, kills: List[Kill], tmp: Path, base: Path, steps: int, nproc: int) -> None:
    reference = tmp / "uninterrupted"
    reference_losses = _uninterrupted(recipe, reference, base, steps, nproc)
    out = tmp / "killed"
    redone, resumed_from = [], 0
    for i, kill_ in enumerate(kills, start=1):
        marker = tmp / f"paused_{i}"
        extra = ["resume_from_checkpoint=True"] if i > 1 else []
        if kill_.loss_pause_step is not None:
            assert i == 1, "the loss counts steps from the start of a fresh run"
            extra += [
                "loss.fault=pause",
                f"loss.steps=[{kill_.loss_pause_step}]",
                f"loss.rank={kill_.rank}",
                f"loss.marker={marker}",
            ]
        pause = dict(pause=kill_.write_pause, marker=marker, rank=kill_.rank) if kill_.write_pause else {}
        run = _start(recipe, out, base, steps, f"run{i}", extra, nproc, **pause)
        pid = run.wait_for_marker(marker)
        rc = kill(run, pid)
        assert rc != 0, f"{kill_.name}: the launcher exited 0 after a rank was killed"
        assert_no_leftovers([run])
        losses = logged(out / "logs" / f"run{i}")
        assert not losses or min(losses) == resumed_from + 1, (kill_.name, "did not resume where expected", losses)
        resumed_from = _check_after_kill(kill_, out, reference, losses, reference_losses, resumed_from)
        redone.append(max(losses) - resumed_from)

    final = f"run{len(kills) + 1}"
    check_ok(_start(recipe, out, base, steps, final, ["resume_from_checkpoint=True"], nproc))
    last = logged(out / "logs" / final)
    assert sorted(last) == list(range(resumed_from + 1, steps + 1)), last
    # The resumed run deleted the temporaries that the killed writes left.
    assert not [e for e in hidden_entries(out) if ".tmp-" in e or ".old-" in e], hidden_entries(out)
    stitched: Dict[int, float] = {}
    for i in range(1, len(kills) + 2):
        stitched.update(logged(out / "logs" / f"run{i}"))
    assert sorted(stitched) == list(range(1, steps + 1))
    worst = max(abs(stitched[s] - reference_losses[s]) for s in stitched)
    assert worst <= TOLERANCE, (stitched, reference_losses)
    final_step = reference / f"step_{steps}"
    assert max_abs_diff(adapter(out / f"step_{steps}"), adapter(final_step)) <= TOLERANCE
    assert max_abs_diff(merged(out / f"step_{steps}"), merged(final_step)) <= TOLERANCE
    print(
        f"\n{recipe}: {len(kills)} kills survived, completed steps redone per kill: {redone}, "
        f"max loss difference vs uninterrupted: {worst:.2e}"
    )


def test_single_device_survives_sigkill_mid_training_and_mid_checkpoint(tmp_path, base):
    _kill_chain(SINGLE_RECIPE, SINGLE_KILLS, tmp_path, base, steps=8, nproc=0)


@pytest.mark.distributed
def test_distributed_survives_sigkill_of_one_rank(tmp_path, base):
    _kill_chain(DIST_RECIPE, DIST_KILLS, tmp_path, base, steps=6, nproc=2)

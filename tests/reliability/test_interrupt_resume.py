"""Interrupts save: a real SIGINT or SIGTERM sent to a running recipe at a random step, then the resume command the
run printed, run as printed.

- one device: the signal to the recipe process (``tune run``), SIGINT and SIGTERM.
- 2 gloo ranks: SIGINT to the whole process group (a terminal's Ctrl-C: the launcher and both workers get it, and
  the launcher forwards it to the workers once more), and SIGTERM to one worker only (rank 0 or 1, drawn).

The uninterrupted single-device run the others are compared with, and the runs aborted by a second signal the recipe
sends itself, call the recipe's entry point in this process (as ``tune run`` calls it); every signal from outside
goes to a launched process, and every resume is the printed command, run as printed.

Each interrupted run: exits with 128 + signal (the recipe process; under torchrun the launcher too, without a
traceback of its own), saved a resumable checkpoint of the step it stopped at (adapter and recipe state, no merged
model mid-epoch), and printed that step and the resume command. The resumed run's losses continue the interrupted
run's, the losses of both together equal an uninterrupted run's step for step, so does the final adapter (fp32,
1e-5), and all of it is in one TensorBoard run folder.
"""

import os
import random
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Sequence

import psutil
import pytest
from conftest import run_recipe_in_process
from omegaconf import OmegaConf
from reliability_utils import (
    DIST_CONFIG,
    DIST_RECIPE,
    FAULTY_LOSS,
    REPO,
    RUN_TIMEOUT_S,
    SINGLE_CONFIG,
    SINGLE_RECIPE,
    TUNE,
    Run,
    adapter,
    assert_no_leftovers,
    call_recipe,
    check_ok,
    env,
    max_abs_diff,
    recipe_state_step,
    tune,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from torchtune_ext.data import write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test]

TOLERANCE = 1e-5
EPOCHS, STEPS_PER_EPOCH = 2, 12
STEPS = EPOCHS * STEPS_PER_EPOCH
#: the signal goes out once the progress bar shows a step drawn from this range (the run then still has steps
#: left, however busy the machine: the signal lands within a step or two).
SIGNAL_AFTER = (2, 15)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base"), family="llama", dtype="fp32", seed=0)


def _overrides(out: Path, base: Path, nproc: int) -> List[str]:
    """Two short epochs; dropout and shuffling on, so that the resume must restore the RNG and the data position."""
    return [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        f"epochs={EPOCHS}",
        f"max_steps_per_epoch={STEPS_PER_EPOCH}",
        "dataset.num_samples=64",
        "run_val_every_n_steps=null",
        "tokenizer.max_seq_len=32",
        "model.lora_dropout=0.1",
        "lr_scheduler.num_warmup_steps=2",
        "metric_logger._component_=torchtune.training.metric_logging.TensorBoardLogger",
        f"metric_logger.log_dir={out}/logs",
        f"loss._component_={FAULTY_LOSS}",  # no fault unless a test sets one
    ] + (["batch_size=2", "process_group_timeout_s=60"] if nproc else ["batch_size=4"])


def _start(out: Path, base: Path, nproc: int, extra: Sequence[str] = ()) -> Run:
    recipe, config = (DIST_RECIPE, DIST_CONFIG) if nproc else (SINGLE_RECIPE, SINGLE_CONFIG)
    overrides = _overrides(out, base, nproc) + list(extra)
    return tune(recipe, config, overrides, out.parent / f"{out.name}.log", nproc=nproc)


def _tensorboard_runs(out: Path) -> List[Path]:
    return sorted(p for p in (out / "logs").iterdir() if p.is_dir())


def _losses(out: Path) -> Dict[int, float]:
    """The losses of the run's one TensorBoard folder, by step; a step logged twice fails."""
    (run,) = _tensorboard_runs(out)
    events = EventAccumulator(str(run), size_guidance={"tensors": 0})
    events.Reload()
    losses: Dict[int, float] = {}
    for event in events.Tensors("loss"):
        assert event.step not in losses, f"step {event.step} logged twice"
        losses[event.step] = float(tensor_util.make_ndarray(event.tensor_proto))
    return losses


def _uninterrupted(root: Path, base: Path, nproc: int) -> Path:
    """An uninterrupted run that saves and keeps every step's adapter (saving changes nothing in the training); on
    one device in this process."""
    out = root / "uninterrupted"
    keep_every_step = ["save_every_n_steps=1", "keep_last_n_checkpoints=null"]
    if nproc:
        check_ok(_start(out, base, nproc, keep_every_step))
    else:
        args = ["--config", str(SINGLE_CONFIG), *_overrides(out, base, 0), *keep_every_step]
        run_recipe_in_process(REPO / SINGLE_RECIPE, args, cwd=REPO)
    assert sorted(_losses(out)) == list(range(1, STEPS + 1))
    return out


@pytest.fixture(scope="module")
def reference_single(tmp_path_factory, base) -> Path:
    return _uninterrupted(tmp_path_factory.mktemp("single"), base, nproc=0)


@pytest.fixture(scope="module")
def reference_distributed(tmp_path_factory, base) -> Path:
    return _uninterrupted(tmp_path_factory.mktemp("distributed"), base, nproc=2)


def _wait_for_step(run: Run, step: int) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not re.search(rf"\|{step}\|Loss", run.output):
        assert run.proc.poll() is None, f"the run ended before step {step}:\n{run.output[-4000:]}"
        if time.monotonic() > deadline:
            run.kill_all()
            raise AssertionError(f"step {step} not reached in {RUN_TIMEOUT_S} s")
        time.sleep(0.02)


def _worker(run: Run, rank: int) -> psutil.Process:
    """The worker process of ``rank`` under the launcher."""
    for child in psutil.Process(run.proc.pid).children(recursive=True):
        if child.environ().get("RANK") == str(rank):
            return child
    raise AssertionError(f"no worker of rank {rank}")


def _interrupt_and_resume(tmp_path: Path, base: Path, reference: Path, sig: int, nproc: int, target: str) -> None:
    out = tmp_path / "interrupted"
    run = _start(out, base, nproc)
    after = random.randint(*SIGNAL_AFTER)
    _wait_for_step(run, after)
    if target == "group":
        os.killpg(run.proc.pid, sig)
    elif target == "launcher":
        run.proc.send_signal(sig)
    else:
        _worker(run, int(target)).send_signal(sig)
    rc = run.wait()
    output = run.output
    name = signal.Signals(sig).name
    assert rc == 128 + sig, f"rc {rc}:\n{output[-4000:]}"
    if nproc:  # the launcher exits like its workers, without torchrun's traceback or failure block
        for torchrun_noise in ("Traceback", "SignalException", "ChildFailedError", "exitcode  :"):
            assert torchrun_noise not in output, output[-4000:]
    assert_no_leftovers([run])

    match = re.search(rf"Interrupted by {name} after step (\d+) \(epoch (\d+), batch (\d+)\).*\n  (.+)\n", output)
    assert match, output[-4000:]
    step, epoch = int(match.group(1)), int(match.group(2))
    assert after <= step < STEPS, (after, step)
    assert epoch == (step - 1) // STEPS_PER_EPOCH + 1
    assert output.count("Interrupted by") == 1, "printed by one rank only"
    assert recipe_state_step(out) == step
    assert max_abs_diff(adapter(out / f"step_{step}"), adapter(reference / f"step_{step}")) <= TOLERANCE
    if step % STEPS_PER_EPOCH:
        assert not (out / f"step_{step}" / "merged").exists(), "an interrupt saves no merged model"
    assert sorted(_losses(out)) == list(range(1, step + 1))

    command = shlex.split(match.group(4))
    assert command[-1] == "resume_from_checkpoint=True"
    resumed = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    resumed_line = f"Resumed from step {step} (epoch {epoch}, batch {match.group(3)}): "  # the step it stopped at
    assert resumed_line in resumed.stdout + resumed.stderr, resumed.stdout[-3000:] + resumed.stderr[-6000:]

    assert len(_tensorboard_runs(out)) == 1, _tensorboard_runs(out)
    losses, reference_losses = _losses(out), _losses(reference)
    assert sorted(losses) == list(range(1, STEPS + 1))
    worst = max(abs(losses[s] - reference_losses[s]) for s in losses)
    assert worst <= TOLERANCE, (worst, losses, reference_losses)
    final = max_abs_diff(adapter(out / f"step_{STEPS}"), adapter(reference / f"step_{STEPS}"))
    assert final <= TOLERANCE
    who = {"group": "the process group", "launcher": "the recipe process"}.get(target, f"rank {target}")
    print(
        f"\n{name} to {who} after step {after}: saved step {step}, resumed; max loss diff {worst:.1e}, "
        f"final adapter diff {final:.1e}"
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_single_device_interrupt_saves_and_resumes(tmp_path, base, reference_single, sig):
    _interrupt_and_resume(tmp_path, base, reference_single, sig, nproc=0, target="launcher")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "sig, target",
    [(signal.SIGINT, "group"), (signal.SIGTERM, str(random.randint(0, 1)))],
    ids=["SIGINT-process-group", "SIGTERM-one-rank"],
)
def test_distributed_interrupt_saves_the_same_step_on_every_rank(tmp_path, base, reference_distributed, sig, target):
    _interrupt_and_resume(tmp_path, base, reference_distributed, sig, nproc=2, target=target)


def test_interrupt_in_the_last_step_of_an_epoch(tmp_path, base, reference_single):
    """A SIGTERM the recipe sends itself (the fault-injecting loss) in the last step of epoch 1: the end-of-epoch
    checkpoint is the one kept (without a merged model: that comes once, at the end of the run, unless
    merge_every_epoch), and the run exits 143. The printed resume command repeats the fault, which fires again in
    the resumed run's 12th step, the last of the last epoch: a signal there lets the run finish (rc 0) with its
    merged model. Both runs together equal the uninterrupted one."""
    out = tmp_path / "interrupted"
    fault = ["loss.fault=signal", f"loss.steps=[{STEPS_PER_EPOCH}]", f"loss.signum={int(signal.SIGTERM)}"]
    run = _start(out, base, 0, fault)
    assert run.wait() == 143, run.output[-4000:]
    match = re.search(
        rf"Interrupted by SIGTERM after step {STEPS_PER_EPOCH} \(epoch 1, batch {STEPS_PER_EPOCH}\)"
        r".*\n  (.+)\n",
        run.output,
    )
    assert match, run.output[-4000:]
    assert recipe_state_step(out) == STEPS_PER_EPOCH
    assert not (out / f"step_{STEPS_PER_EPOCH}" / "merged").exists()
    command = shlex.split(match.group(1))
    resumed = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert "SIGTERM received" in resumed.stderr + resumed.stdout
    losses, reference_losses = _losses(out), _losses(reference_single)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert max(abs(losses[s] - reference_losses[s]) for s in losses) <= TOLERANCE
    assert max_abs_diff(adapter(out / f"step_{STEPS}"), adapter(reference_single / f"step_{STEPS}")) <= TOLERANCE
    assert (out / f"step_{STEPS}" / "merged").is_dir()  # the end of the run's


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_aborts_with_one_line(tmp_path, base, monkeypatch, capfd, caplog, sig):
    """The signal twice within one step (the fault-injecting loss sends it in both micro-batches of step 2): the run
    aborts with 128 + signal and one line, no traceback, and leaves no checkpoint and no temporary file."""
    out = tmp_path / "aborted"
    fault = ["gradient_accumulation_steps=2", "loss.fault=signal", "loss.steps=[3,4]", f"loss.signum={int(sig)}"]
    children = psutil.Process().children(recursive=True)
    rc, output = call_recipe([*_overrides(out, base, 0), *fault], monkeypatch, capfd, caplog)
    assert rc == 128 + sig, f"rc {rc}:\n{output[-4000:]}"
    assert f"{signal.Signals(sig).name} received again: aborting now, without saving." in output
    for noise in ("Traceback", "KeyboardInterrupt", "Interrupted by"):
        assert noise not in output, output[-4000:]
    written = [p.name for p in out.iterdir() if p.name.startswith(("step_", "recipe_state", ".step_"))]
    assert not written, "nothing saved, nothing half-written"
    assert psutil.Process().children(recursive=True) == children, "a process of the run is left"


def test_ctrl_c_while_setting_up_a_background_job_stops_it(tmp_path, base):
    """A background job of a non-interactive shell starts with SIGINT ignored; a Ctrl-C sent to it while it sets up
    (paused here where it would write the tiny base checkpoint) still stops it: exit 130, one line, nothing saved."""
    cfg = OmegaConf.load(SINGLE_CONFIG)
    marker = tmp_path / "setup.pid"
    cfg.generate_base_checkpoint = {"_component_": "reliability_faults.pause_here", "marker": str(marker)}
    config = tmp_path / "pausing.yaml"
    OmegaConf.save(cfg, config)
    out = tmp_path / "stopped"
    command = shlex.join([str(TUNE), "run", SINGLE_RECIPE, "--config", str(config), *_overrides(out, base, 0)])
    run = Run(["bash", "-c", f"trap '' INT; exec {command}"], env(), tmp_path / "stopped.log")
    os.kill(run.wait_for_marker(marker), signal.SIGINT)
    rc = run.wait()
    output = run.output
    assert rc == 130, f"rc {rc}:\n{output[-4000:]}"
    assert "SIGINT received before training started: stopping now; nothing was trained or saved." in output
    assert "Traceback" not in output and "Loaded " not in output, output[-4000:]
    assert not out.exists() or not [p for p in out.iterdir() if p.name.startswith(("step_", "recipe_state"))]
    assert_no_leftovers([run])

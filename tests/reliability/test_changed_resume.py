"""A resume is the same run, or it is refused (issue 24 items 2 and 3, issue 23 item 7), with real recipe runs and
real files.

The runs call the single-device recipe's entry point in this process, as ``tune run`` calls it (``conftest.run_main``:
its exit code and what it prints; its log lines through ``caplog``): what is checked is the refusal, its lines and
code, and what the resumed run computes, not the process (a resume in a fresh process: ``test_interrupt_resume.py``,
``test_kill_resume.py``).

One single-device run is stopped after step 2 (a resumable state after steps 1 and 2: ``recipe_state.pt`` and
``recipe_state.prev.pt``); each test resumes a copy of its output folder:

- changed ``model.lora_alpha``, other base weights of the same shapes, another model family, another data set size,
  another batch size: refused before any weight loads, listing each difference; nothing under the output folder
  changes;
- a changed lr: allowed, listed in the log, and the schedule continues with the new peak lr;
- a recipe state carrying a pickled callable: refused with a clear error, and the callable never runs;
- a truncated newest recipe state: the previous one is used, saying so, and the losses equal an uninterrupted run;
- a finished run: says so, with the step and the outputs' paths;
- a ``stop_after_step`` the saved run has reached: refused before the base loads (it would train one step);
- the tokenizer file: the same file in another folder resumes (losses equal an uninterrupted run); another
  tokenizer at the same path is refused before the base loads, naming the file and the fix.
"""

import functools
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from conftest import run_recipe_in_process
from reliability_utils import REPO, SINGLE_CONFIG, SINGLE_RECIPE, call_recipe, logged, small_run, snapshot
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

from torchtune_ext.config import CONFIG_ERROR_EXIT_CODE
from torchtune_ext.data import TINY_TOKENIZER_PATH, write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test]

STEPS, STOP = 4, 2
LR, NEW_LR = 3e-3, 1e-3
TOLERANCE = 1e-5


def _args(out: Path, base: Path, *extra: str) -> List[str]:
    return small_run(out, base, STEPS, out / "logs") + ["batch_size=16", f"optimizer.lr={LR}", *extra]


def _check(args: List[str]) -> None:
    """Runs the single-device recipe to its end (a non-zero exit fails the caller)."""
    run_recipe_in_process(REPO / SINGLE_RECIPE, ["--config", str(SINGLE_CONFIG), *args], cwd=REPO)


@pytest.fixture
def start(monkeypatch, capfd, caplog) -> Callable[[List[str]], Tuple[int, str]]:
    """``start(args)``: the single-device recipe's entry point with ``args``, in this process; its exit code and
    everything it printed and logged."""
    return functools.partial(call_recipe, monkeypatch=monkeypatch, capfd=capfd, caplog=caplog)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Path]:
    """The base checkpoints, the stopped run (step 2) and an uninterrupted one (step 4)."""
    tmp = tmp_path_factory.mktemp("changed_resume")
    bases = {
        "base": write_tiny_checkpoint(tmp / "base", family="llama", dtype="fp32", seed=0),
        "other_base": write_tiny_checkpoint(tmp / "other_base", family="llama", dtype="fp32", seed=1),
        "qwen_base": write_tiny_checkpoint(tmp / "qwen_base", family="qwen", dtype="fp32", seed=0),
    }
    stopped, straight = tmp / "stopped", tmp / "straight"
    _check(_args(stopped, bases["base"], f"stop_after_step={STOP}", "save_every_n_steps=1"))
    _check(_args(straight, bases["base"]))
    return {**bases, "stopped": stopped, "straight": straight}


def _resume(runs: Dict[str, Path], tmp_path: Path, *extra: str, source: str = "stopped"):
    """A copy of a run's output folder and the arguments that resume it."""
    out = tmp_path / "out"
    shutil.copytree(runs[source], out)
    args = _args(out, runs["base"], "resume_from_checkpoint=True", *extra)
    return out, args


CHANGES = [
    pytest.param(["model.lora_alpha=4"], ["model.lora_alpha: 32 -> 4"], id="lora_alpha"),
    pytest.param(
        ["checkpointer.checkpoint_dir={other_base}"],
        ["base_checkpoint.model.safetensors: "],
        id="other_base_weights",
    ),
    pytest.param(
        [
            "checkpointer.checkpoint_dir={qwen_base}",
            "model._component_=torchtune_ext.models.qlora_tiny_qwen",
            "checkpointer.model_type=QWEN2",
        ],
        [
            "model._component_: torchtune_ext.models.qlora_tiny_llama -> torchtune_ext.models.qlora_tiny_qwen",
            "checkpointer.model_type: LLAMA3_2 -> QWEN2",
        ],
        id="other_model_family",
    ),
    pytest.param(["dataset.num_samples=80"], ["dataset_size: 64 -> 80"], id="dataset"),
    pytest.param(["batch_size=8"], ["global_batch_size: 16 -> 8"], id="batch_size"),
]


@pytest.mark.parametrize("overrides, expected", CHANGES)
def test_a_changed_run_is_refused_before_any_weight_loads(start, runs, tmp_path, overrides, expected):
    out, args = _resume(runs, tmp_path, *[o.format(**{k: str(v) for k, v in runs.items()}) for o in overrides])
    before = snapshot(out)
    rc, output = start(args)
    assert rc != 0
    assert "it differs in what defines the run" in output, output[-4000:]
    for line in expected:
        assert line in output, output[-4000:]
    assert "into NF4" not in output  # no weight was loaded
    assert snapshot(out) == before  # nothing written


def test_a_changed_lr_is_allowed_listed_and_used(start, runs, tmp_path):
    out, args = _resume(runs, tmp_path, f"optimizer.lr={NEW_LR}")
    rc, output = start(args)
    assert rc == 0, output[-4000:]
    for said in ("into NF4", "Loaded ", "Writing logs to", "Disk: "):  # what the refusals' checks look for
        assert said in output, said
    assert "Resuming with changed settings (allowed):" in output
    assert f"\n  optimizer.lr: {LR} -> {NEW_LR}\n" in output
    # The schedule continues at its step with the new peak lr (reference: torchtune's schedule on its own).
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=NEW_LR)
    schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=STEPS)
    expected = {}
    for step in range(1, STEPS + 1):
        optimizer.step()
        schedule.step()
        expected[step] = optimizer.param_groups[0]["lr"]
    lrs = logged(out / "logs", "lr")
    for step in (3, 4):
        assert math.isclose(lrs[step], expected[step], rel_tol=1e-9), (lrs, expected)
    # The loss of step 3 is computed before its update: still the uninterrupted run's.
    assert abs(logged(out / "logs")[3] - logged(runs["straight"] / "logs")[3]) < TOLERANCE


def test_a_recipe_state_carrying_code_is_refused_and_the_code_never_runs(start, runs, tmp_path):
    out, args = _resume(runs, tmp_path)
    marker = tmp_path / "the_payload_ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state = torch.load(out / "recipe_state" / "recipe_state.pt", weights_only=True)
    torch.save({**state, "payload": Payload()}, out / "recipe_state" / "recipe_state.pt")
    rc, output = start(args)
    assert rc == CONFIG_ERROR_EXIT_CODE and "Traceback" not in output, output[-4000:]  # one line, as config errors
    assert "holds Python objects, not only tensors and plain data (it references posix.system)" in output
    assert "nothing in it ran" in output
    assert not marker.exists()


def test_a_truncated_newest_state_falls_back_to_the_previous_one(start, runs, tmp_path):
    out, args = _resume(runs, tmp_path)
    newest = out / "recipe_state" / "recipe_state.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    rc, output = start(args)
    assert rc == 0, output[-4000:]
    assert "is not a readable recipe state" in output
    assert f"Resuming from the previous recipe state instead: {out / 'recipe_state' / 'recipe_state.prev.pt'}" in output
    assert "Resumed from step 1 (epoch 1, batch 1): sample 16 of 64, on 1 rank; saved on 1." in output
    resumed, straight = logged(out / "logs"), logged(runs["straight"] / "logs")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - straight[s]) for s in straight) < TOLERANCE, (resumed, straight)


def test_resuming_a_finished_run_says_so(start, runs, tmp_path):
    out, args = _resume(runs, tmp_path, source="straight")
    before = snapshot(out)
    rc, output = start(args)
    assert rc == 0, output[-4000:]
    assert snapshot(out) == before, "a finished run's resume writes nothing"
    assert f"This run had already finished: step {STEPS}, epoch 1 of 1; nothing is left to train." in output
    assert str(out / f"step_{STEPS}" / "adapter") in output and str(out / f"step_{STEPS}" / "merged") in output
    for skipped in ("Loaded ", "Writing logs to", "Disk: "):  # said before the base weights load, which they do not
        assert skipped not in output, output[-4000:]


@pytest.fixture(scope="module")
def tokenizer_run(runs, tmp_path_factory) -> Dict[str, Path]:
    """The stopped run again, with the tiny tokenizer's file given as ``tokenizer.path`` (a copy of the shipped one)."""
    tmp = tmp_path_factory.mktemp("tokenizer_run")
    tokenizer = tmp / "tokenizer" / "tokenizer.model"
    tokenizer.parent.mkdir()
    shutil.copy(TINY_TOKENIZER_PATH, tokenizer)
    stopped = tmp / "stopped"
    args = _args(stopped, runs["base"], f"stop_after_step={STOP}", f"tokenizer.path={tokenizer}")
    _check(args)
    return {"stopped": stopped, "tokenizer": tokenizer}


def test_the_same_tokenizer_in_another_folder_resumes(start, runs, tokenizer_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tokenizer_run["stopped"], out)
    moved = tmp_path / "moved" / "tokenizer.model"
    moved.parent.mkdir()
    shutil.copy(tokenizer_run["tokenizer"], moved)
    args = _args(out, runs["base"], "resume_from_checkpoint=True", f"tokenizer.path={moved}")
    rc, output = start(args)
    assert rc == 0, output[-4000:]
    assert f"tokenizer.path: {tokenizer_run['tokenizer']} -> {moved}" in output  # listed as an allowed change
    resumed, straight = logged(out / "logs"), logged(runs["straight"] / "logs")  # straight: the shipped file
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(resumed[s] - straight[s]) for s in straight) < TOLERANCE, (resumed, straight)


def test_a_stop_after_step_the_run_has_reached_is_refused_before_the_base_loads(start, runs, tmp_path):
    """The stopped run's own command resumed as is would train one step and stop again: refused, naming the fix."""
    out, args = _resume(runs, tmp_path, f"stop_after_step={STOP}")
    before = snapshot(out)
    rc, output = start(args)
    assert rc == CONFIG_ERROR_EXIT_CODE and "Traceback" not in output, output[-4000:]
    assert f"stop_after_step={STOP}, but the run saved in " in output, output[-4000:]
    assert f"has reached step {STOP}: resume without stop_after_step to train to the end" in output
    assert "into NF4" not in output  # no weight was loaded
    assert snapshot(out) == before  # nothing written


def test_another_tokenizer_at_the_same_path_is_refused_before_the_base_loads(start, runs, tokenizer_run, tmp_path):
    from sentencepiece import sentencepiece_model_pb2

    out = tmp_path / "out"
    shutil.copytree(tokenizer_run["stopped"], out)
    tokenizer = tokenizer_run["tokenizer"]
    original = tokenizer.read_bytes()
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(original)
    model.pieces[3].score += 1.0  # a valid tokenizer that merges "er" otherwise
    before = snapshot(out)
    try:
        tokenizer.write_bytes(model.SerializeToString())  # rewritten in place
        rc, output = start(_args(out, runs["base"], "resume_from_checkpoint=True", f"tokenizer.path={tokenizer}"))
    finally:
        tokenizer.write_bytes(original)
    assert rc == CONFIG_ERROR_EXIT_CODE and "Traceback" not in output, output[-4000:]
    assert "it differs in what defines the run" in output, output[-4000:]
    assert f"  tokenizer.path: {tokenizer} ({len(original)} bytes, sha256 " in output, output[-4000:]
    assert f"another tokenizer gives other token ids; put back the {tokenizer} the run trained with" in output
    assert "into NF4" not in output  # no weight was loaded
    assert snapshot(out) == before  # nothing written

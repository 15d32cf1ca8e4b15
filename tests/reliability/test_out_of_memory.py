"""A step that does not fit in device memory (the fault-injecting loss raises the CUDA allocator's error in step 3):
the run stops with one message instead of torch's traceback, naming the settings that lower the peak, and the
command it prints resumes the run with the first of them to the end, equal to a run that never stopped."""

import shlex
import sys
from pathlib import Path

import pytest
from reliability_faults import CUDA_OOM_MESSAGE
from reliability_utils import SINGLE_CONFIG, SINGLE_RECIPE, TUNE, adapter, call_recipe, logged, max_abs_diff, small_run

from torchtune_ext.data import write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test]

STEPS = 4
PROG = "qlora_finetune_single_device: error: "


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base") / "base", family="llama", dtype="fp32", seed=0)


def test_out_of_memory_prints_the_settings_and_the_command_that_resumes_the_run(
    tmp_path, base, monkeypatch, capfd, caplog
):
    args = [*small_run(tmp_path / "run", base, STEPS, tmp_path / "run" / "logs"), "batch_size=4"]
    fault = ["loss.fault=oom", "loss.steps=[3]", "save_every_n_steps=2"]
    monkeypatch.setattr(
        sys, "orig_argv", [str(TUNE), "run", SINGLE_RECIPE, "--config", str(SINGLE_CONFIG), *args, *fault]
    )
    rc, output = call_recipe([*args, *fault], monkeypatch, capfd, caplog)

    assert rc == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    lines = [line[len(PROG) :] for line in output.splitlines() if line.startswith(PROG)]
    assert lines[0] == f"cpu ran out of memory in training step 3: {CUDA_OOM_MESSAGE}", lines
    assert lines[1] == "Settings that lower the peak and keep the run resumable: enable_activation_checkpointing=True."
    assert lines[2].startswith("Or start a new run with a smaller batch_size (now 4; ")
    assert "tokenizer.max_seq_len (now 32)" in lines[2] and "dry_run=True" in lines[2]
    resume = f"Resume from {tmp_path / 'run' / 'step_2'} with, e.g.: "
    assert lines[3].startswith(resume), lines
    command = shlex.split(lines[3][len(resume) :])
    assert command[-2:] == ["resume_from_checkpoint=True", "enable_activation_checkpointing=True"]

    rc, output = call_recipe(command[command.index("--config") + 2 :], monkeypatch, capfd, caplog)
    assert rc == 0, output[-4000:]
    reference = tmp_path / "reference"
    rc, output = call_recipe(
        [*small_run(reference, base, STEPS, reference / "logs"), "batch_size=4"], monkeypatch, capfd, caplog
    )
    assert rc == 0, output[-4000:]
    losses, expected = logged(tmp_path / "run" / "logs"), logged(reference / "logs")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert max(abs(losses[s] - expected[s]) for s in losses) <= 1e-5, (losses, expected)
    assert max_abs_diff(adapter(tmp_path / "run" / f"step_{STEPS}"), adapter(reference / f"step_{STEPS}")) <= 1e-5

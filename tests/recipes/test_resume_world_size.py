"""Resume on another number of ranks (issue 23 item 4): the recipe state keeps the global data position, so a run
stopped after step 2 on N ranks and resumed on M (the same global batch) trains exactly the samples an uninterrupted
run trains: its losses equal the uninterrupted run's, and it says where it resumed.

Runs are real processes (``tune run``, gloo on CPU) of the tiny model, 4 steps of 16 samples (global batch 8 x
gradient accumulation 2, so that a step spans several micro-batches on every world size). One process runs the
single-device recipe; the uninterrupted reference and the refused resume's first run call it in this process.
2 -> 4 ranks: the tiny model's k/v projections hold 2 NF4 scale groups, sharded unevenly over 4 ranks (one group
each on two ranks, padding on the others: ``torchtune_ext.nf4.UnevenNF4Tensor``).
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import load_recipe, run_main, run_recipe_in_process

pytestmark = [pytest.mark.integration_test, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny" / "qlora_distributed.yaml"
TUNE = Path(sys.executable).parent / "tune"
SINGLE_RECIPE = "recipes/qlora_finetune_single_device.py"
STEPS, STOP, GLOBAL_BATCH, ACCUMULATION = 4, 2, 8, 2
TOLERANCE = 1e-5  # fp32 sums over ranks in another order
RUN_TIMEOUT_S = 300


def _args(out: Path, base: Path, nproc: int, *extra: str) -> List[str]:
    """The recipe's arguments on ``nproc`` ranks, the global batch kept unless ``extra`` says."""
    return [
        "--config",
        str(CONFIG),
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        f"max_steps_per_epoch={STEPS}",
        "dataset.num_samples=64",
        "run_val_every_n_steps=null",
        "tokenizer.max_seq_len=32",
        "lr_scheduler.num_warmup_steps=1",
        "optimizer.lr=1e-2",
        "shuffle=True",
        f"batch_size={GLOBAL_BATCH // nproc}",
        f"gradient_accumulation_steps={ACCUMULATION}",
        "process_group_timeout_s=60",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs",
        *extra,
    ]


def _launch(out: Path, base: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    """``tune run`` on ``nproc`` ranks (1: the single-device recipe)."""
    recipe = SINGLE_RECIPE if nproc == 1 else "recipes/qlora_finetune_distributed.py"
    launcher = [] if nproc == 1 else ["--standalone", "--nproc_per_node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [str(TUNE), "run", *launcher, str(recipe), *_args(out, base, nproc, *extra)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _run_in_process(out: Path, base: Path, *extra: str) -> None:
    """The single-device recipe in this process (a run whose outputs alone are read)."""
    run_recipe_in_process(ROOT / SINGLE_RECIPE, _args(out, base, 1, *extra), cwd=ROOT)


def _run(out: Path, base: Path, nproc: int, *extra: str) -> str:
    """:func:`_launch`, which must succeed; returns its output."""
    result = _launch(out, base, nproc, *extra)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"run failed (rc {result.returncode}):\n{output[-6000:]}"
    return output


def _losses(out: Path) -> Dict[int, float]:
    by_step = {}
    for path in sorted((out / "logs").glob("log_*.txt")):
        for line in path.read_text().splitlines():
            match = re.match(r"Step (\d+) \| .*\bloss:(\S+)", line)
            if match:
                by_step[int(match.group(1))] = float(match.group(2))
    return by_step


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from torchtune_ext.data import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("base"), family="llama", dtype="fp32", seed=0)


@pytest.fixture(scope="module")
def uninterrupted(base, tmp_path_factory) -> Dict[int, float]:
    """The reference: 4 steps on one process (the same samples per step as on any world size)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _run_in_process(out, base)
    return _losses(out)


@pytest.mark.parametrize(
    "saved_on, resumed_on",
    [
        (2, 1),
        (1, 2),
        (2, 4),
    ],
)
def test_resume_on_another_world_size_matches_an_uninterrupted_run(base, uninterrupted, tmp_path, saved_on, resumed_on):
    out = tmp_path / "run"
    _run(out, base, saved_on, f"stop_after_step={STOP}")
    output = _run(out, base, resumed_on, "resume_from_checkpoint=True")
    ranks = "rank" if resumed_on == 1 else "ranks"
    samples = STOP * GLOBAL_BATCH * ACCUMULATION
    expected = (
        f"Resumed from step {STOP} (epoch 1, batch {STOP * ACCUMULATION}): sample {samples} of 64, on {resumed_on} "
        f"{ranks}; saved on {saved_on}."
    )
    assert expected in output, output[-4000:]
    losses = _losses(out)
    assert sorted(losses) == sorted(uninterrupted) == list(range(1, STEPS + 1))
    assert len({round(v, 3) for v in uninterrupted.values()}) == STEPS  # the steps see different samples
    worst = max(abs(losses[s] - uninterrupted[s]) for s in uninterrupted)
    assert worst < TOLERANCE, (losses, uninterrupted)


def test_another_global_batch_is_refused_naming_it(base, tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    _run_in_process(out, base, f"stop_after_step={STOP}")
    argv = [SINGLE_RECIPE, *_args(out, base, 1, "batch_size=4", "resume_from_checkpoint=True")]  # half the batch
    result = run_main(load_recipe(ROOT / SINGLE_RECIPE).recipe_main, argv, monkeypatch, capfd, cwd=ROOT)
    assert result.returncode != 0
    assert f"global_batch_size: {GLOBAL_BATCH} -> 4" in result.stdout + result.stderr

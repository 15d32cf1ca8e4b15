"""No hangs on 2 gloo ranks: a rank that raises, a rank that stalls, and a rank killed without a launcher to clean up.

Every run is bounded by a hang guard (``RUN_TIMEOUT_S``: the runs take seconds; a run still alive then is killed
and the test fails) and must leave no process behind (its whole session is searched, zombies included).
"""

import sys
from pathlib import Path

import pytest
from conftest import free_port
from reliability_utils import (
    DIST_CONFIG,
    DIST_RECIPE,
    Run,
    assert_no_leftovers,
    env,
    kill,
    logged,
    small_run,
    tune,
)

from torchtune_ext.data import write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test, pytest.mark.distributed]

STEPS = 6
FAULT_STEP = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base"), family="llama", dtype="fp32", seed=0)


def _overrides(out: Path, base: Path, timeout_s: int) -> list:
    return small_run(out, base, STEPS, out / "logs") + ["batch_size=2", f"process_group_timeout_s={timeout_s}"]


def _failures(output: str) -> dict:
    """torchrun's failure summary: rank -> exit code, and the root-cause rank."""
    ranks = {}
    for block in output.split("host      :")[1:]:
        rank = int(block.split("rank      :")[1].split()[0])
        ranks[rank] = int(block.split("exitcode  :")[1].split()[0])
    root = output.split("Root Cause (first observed failure):")[1].split("rank      :")[1].split()[0]
    return {"exit_codes": ranks, "root_cause": int(root)}


def test_rank_raising_in_step_k_stops_every_rank_and_names_it(tmp_path, base):
    out = tmp_path / "out"
    run = tune(
        DIST_RECIPE,
        DIST_CONFIG,
        _overrides(out, base, timeout_s=60) + ["loss.fault=raise", f"loss.steps=[{FAULT_STEP}]", "loss.rank=1"],
        tmp_path / "run.log",
        nproc=2,
    )
    rc = run.wait()
    assert rc != 0
    assert_no_leftovers([run])
    output = run.output
    assert f"RuntimeError: injected fault: rank 1 fails in step {FAULT_STEP}" in output
    summary = _failures(output)
    # The failing rank is named as the root cause; the other rank was stopped too (non-zero exit).
    assert summary["root_cause"] == 1, output[-3000:]
    assert set(summary["exit_codes"]) == {0, 1} and all(code != 0 for code in summary["exit_codes"].values())
    # It stopped in step 3: steps 1-2 were logged, nothing after.
    assert sorted(logged(out / "logs")) == list(range(1, FAULT_STEP))


def test_stalled_rank_fails_the_others_after_process_group_timeout(tmp_path, base):
    """Rank 1 stops answering (it sleeps in step 3): rank 0 times out in its next collective after
    ``process_group_timeout_s`` and fails, and the launcher then stops rank 1."""
    out = tmp_path / "out"
    timeout_s = 5
    run = tune(
        DIST_RECIPE,
        DIST_CONFIG,
        _overrides(out, base, timeout_s=timeout_s)
        + ["loss.fault=pause", f"loss.steps=[{FAULT_STEP}]", "loss.rank=1", f"loss.marker={tmp_path / 'paused'}"],
        tmp_path / "run.log",
        nproc=2,
    )
    run.wait_for_marker(tmp_path / "paused")
    rc = run.wait()
    assert rc != 0
    assert_no_leftovers([run])
    output = run.output
    assert f"Timed out waiting {timeout_s * 1000}ms" in output, output[-3000:]
    summary = _failures(output)
    assert summary["root_cause"] == 0 and all(code != 0 for code in summary["exit_codes"].values())


def test_rank_killed_without_launcher_makes_the_other_exit(tmp_path, base):
    """Each rank started on its own (as on separate nodes, no common launcher to stop the others): SIGKILL of
    rank 1 in step 3 makes rank 0 fail on its next collective instead of waiting."""
    out = tmp_path / "out"
    port = free_port()
    overrides = _overrides(out, base, timeout_s=60) + [
        "loss.fault=pause",
        f"loss.steps=[{FAULT_STEP}]",
        "loss.rank=1",
        f"loss.marker={tmp_path / 'paused'}",
    ]
    runs = []
    for rank in range(2):
        rank_env = {
            **env(),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        runs.append(
            Run(
                [sys.executable, DIST_RECIPE, "--config", str(DIST_CONFIG), *overrides],
                rank_env,
                tmp_path / f"rank{rank}.log",
            )
        )
    try:
        pid = runs[1].wait_for_marker(tmp_path / "paused")
        assert pid == runs[1].proc.pid
        assert kill(runs[1], pid) == -9
        rc = runs[0].wait()
    except BaseException:
        for run in runs:
            run.kill_all()
        raise
    assert rc != 0
    assert_no_leftovers(runs)
    # gloo reports the dead peer as a closed or a reset connection, depending on when the kill lands.
    peer_gone = ("Connection closed by peer", "Connection reset by peer")
    assert any(text in runs[0].output for text in peer_gone), runs[0].output[-3000:]

"""How ``tune run --nproc_per_node N`` ends when its workers stopped on a config error or an interrupt
(``torchtune_ext._compat._exit_like_interrupted_workers``), on torchrun's own failure records.

The race it covers: every rank finds a config error, but torchrun stops the others with SIGTERM as soon as the first
has exited; where that first one was not rank 0 (which prints the line), rank 0 may be stopped before it printed.
The workers run in this process here (their exit code and what they print are the real ones).
"""

import signal
import types
from typing import Dict

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torchtune_ext import _compat
from torchtune_ext._finite import NonFiniteError
from torchtune_ext.config import ConfigError, exit_on_config_error

LINE = "recipe: error: unknown key 'dtpye': did you mean 'dtype'?"
SIGTERMED = -int(signal.SIGTERM)  # torchrun's code for a worker it stopped
CONFIG_ERROR = ConfigError("unknown key 'dtpye': did you mean 'dtype'?", "dtpye")
DIVERGED = NonFiniteError("Training diverged at step 3 (lr 0.001): the loss is nan.")


def _worker_exit(monkeypatch, rank: int, error: Exception = CONFIG_ERROR) -> int:
    """A worker of ``rank`` stopped by ``error``, as torchrun starts it; returns its exit code."""
    monkeypatch.setenv("RANK", str(rank))
    before = signal.getsignal(signal.SIGTERM)

    @exit_on_config_error("recipe")
    def main() -> None:
        raise error

    try:
        with pytest.raises(SystemExit) as stop:
            main()
    finally:
        signal.signal(signal.SIGTERM, before)
    return stop.value.code


def _launcher(monkeypatch, workers: Dict[int, str], tmp_path) -> types.SimpleNamespace:
    """torchtune's ``torchtune._cli.run`` reduced to a launch whose workers ``workers`` (rank -> ``"config error"``,
    ``"diverged"``, ``"stopped"`` (by torchrun, before it got anywhere), or an exit code) end as given."""
    errors = {"config error": CONFIG_ERROR, "diverged": DIVERGED}

    def launch(self, args):
        codes = {
            rank: _worker_exit(monkeypatch, rank, errors[how])
            if how in errors
            else SIGTERMED
            if how == "stopped"
            else how
            for rank, how in workers.items()
        }
        failures = {rank: ProcessFailure(rank, 10 + rank, code, str(tmp_path / "none")) for rank, code in codes.items()}
        raise ChildFailedError("recipes.qlora", failures)

    module = types.SimpleNamespace(Run=type("Run", (), {"_run_distributed": launch}))
    _compat._exit_like_interrupted_workers(module)
    return module


def _exit_code(module) -> int:
    with pytest.raises(SystemExit) as stop:
        module.Run()._run_distributed(None)
    return stop.value.code


def test_rank_0_stopped_before_it_printed_the_launcher_prints_the_line_once(tmp_path, monkeypatch, capsys):
    module = _launcher(monkeypatch, {0: "stopped", 1: "config error"}, tmp_path)
    assert _exit_code(module) == 2
    assert capsys.readouterr().err.splitlines() == [LINE]


def test_rank_0_printed_the_launcher_adds_nothing(tmp_path, monkeypatch, capsys):
    module = _launcher(monkeypatch, {1: "config error", 0: "config error"}, tmp_path)
    assert _exit_code(module) == 2
    assert capsys.readouterr().err.splitlines() == [LINE]  # rank 0's


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_workers_exit_like_them(tmp_path, monkeypatch, capsys, sig):
    module = _launcher(monkeypatch, {0: 128 + sig, 1: 128 + sig}, tmp_path)
    assert _exit_code(module) == 128 + sig
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("rank_0", ["stopped", "diverged"])
def test_a_user_facing_error_exits_1_with_its_line_once(tmp_path, monkeypatch, capsys, rank_0):
    module = _launcher(monkeypatch, {0: rank_0, 1: "diverged"}, tmp_path)
    assert _exit_code(module) == 1
    assert capsys.readouterr().err.splitlines() == [f"recipe: error: {DIVERGED}"]


@pytest.mark.parametrize("workers", [{0: 1, 1: "config error"}, {0: 1, 1: "diverged"}], ids=["config", "diverged"])
def test_other_failures_are_torchruns(tmp_path, monkeypatch, workers):
    """A worker that exited 1 without a user-facing error (a crash, its traceback printed) keeps torchrun's report."""
    module = _launcher(monkeypatch, workers, tmp_path)
    with pytest.raises(ChildFailedError):
        module.Run()._run_distributed(None)


def test_workers_outside_tune_run_write_nothing(monkeypatch, tmp_path):
    """Plain ``torchrun`` (no launcher folder): the worker only prints (rank 0) and exits 2."""
    monkeypatch.delenv("TORCHTUNE_EXT_CONFIG_ERROR_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert _worker_exit(monkeypatch, 1) == 2
    assert list(tmp_path.iterdir()) == []

"""How ``tune run --nproc_per_node N`` ends when its workers stopped on a config error or an interrupt
(``torchtune_ext._compat._exit_like_interrupted_workers``), on torchrun's own failure records.

The race it covers: every rank finds a config error, but torchrun stops the others with SIGTERM as soon as the first
has exited; where that first one was not rank 0 (which prints the line), rank 0 may be stopped before it printed.
"""

import signal
import types
from pathlib import Path
from typing import Dict

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torchtune_ext import _compat
from torchtune_ext.config import ConfigError, exit_on_config_error

LINE = "recipe: error: unknown key 'dtpye': did you mean 'dtype'?"


def _worker_exit(tmp_path: Path, monkeypatch, rank: int) -> str:
    """A worker of ``rank`` stopped by a config error, as torchrun starts it; returns its failure record's path."""
    error_file = tmp_path / f"error_{rank}.json"
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    before = signal.getsignal(signal.SIGTERM)

    @exit_on_config_error("recipe")
    def main() -> None:
        raise ConfigError("unknown key 'dtpye': did you mean 'dtype'?", "dtpye")

    try:
        with pytest.raises(SystemExit) as stop:
            main()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stop.value.code == 2
    return str(error_file)


def _launch(failures: Dict[int, ProcessFailure]) -> types.ModuleType:
    """torchtune's ``torchtune._cli.run`` module, reduced to a launch whose workers failed with ``failures``."""

    class Run:
        def _run_distributed(self, args):
            raise ChildFailedError("recipes.qlora", failures)

    module = types.SimpleNamespace(Run=Run)
    _compat._exit_like_interrupted_workers(module)
    return module


def _run(module) -> int:
    with pytest.raises(SystemExit) as stop:
        module.Run()._run_distributed(None)
    return stop.value.code


def test_rank_0_stopped_before_it_printed_the_launcher_prints_the_line_once(tmp_path, monkeypatch, capsys):
    error_file = _worker_exit(tmp_path, monkeypatch, rank=1)
    assert capsys.readouterr().err == ""  # only rank 0 prints
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-int(signal.SIGTERM), error_file=str(tmp_path / "none")),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=2, error_file=error_file),
    }
    assert _run(_launch(failures)) == 2
    assert capsys.readouterr().err.splitlines() == [LINE]


def test_rank_0_printed_the_launcher_adds_nothing(tmp_path, monkeypatch, capsys):
    records = [_worker_exit(tmp_path, monkeypatch, rank) for rank in (1, 0)]
    assert capsys.readouterr().err.splitlines() == [LINE]  # rank 0's
    failures = {rank: ProcessFailure(rank, 10 + rank, 2, record) for rank, record in zip((1, 0), records)}
    assert _run(_launch(failures)) == 2
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_workers_exit_like_them(tmp_path, capsys, sig):
    failures = {rank: ProcessFailure(rank, 10 + rank, 128 + sig, str(tmp_path / "none")) for rank in (0, 1)}
    assert _run(_launch(failures)) == 128 + sig
    assert capsys.readouterr().err == ""


def test_other_failures_are_torchruns(tmp_path, monkeypatch):
    error_file = _worker_exit(tmp_path, monkeypatch, rank=1)
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(tmp_path / "none")),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=2, error_file=error_file),
    }
    with pytest.raises(ChildFailedError):
        _launch(failures).Run()._run_distributed(None)

"""``InterruptGuard`` with real signals sent to this process (and to 2 gloo ranks), the resume command, and the
TensorBoard folder a resume continues."""

import os
import signal
import sys

import pytest
import torch
from conftest import run_distributed
from omegaconf import OmegaConf

from torchtune_ext.checkpoint import atomic_save
from torchtune_ext.training._interrupt import InterruptGuard, continued_metric_logger, launch_command, resume_command


def _send(sig: int) -> None:
    """Sends ``sig`` to this process; the Python handler runs before the next bytecode."""
    os.kill(os.getpid(), sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_requests_a_stop(sig):
    before = signal.getsignal(sig)
    with InterruptGuard() as interrupt:
        assert not interrupt.requested()
        _send(sig)
        assert interrupt.requested()
        assert interrupt.signum == sig
        assert interrupt.exit_code == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig]
        with pytest.raises(SystemExit) as stop:
            interrupt.exit()
        assert stop.value.code == 128 + sig
    assert signal.getsignal(sig) is before


def test_a_rank_leaving_under_a_launcher_ignores_further_signals(monkeypatch):
    """torchrun stops the other ranks with SIGTERM once one has exited: a rank that saved keeps its exit code."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as stop:
            with InterruptGuard() as interrupt:
                _send(signal.SIGINT)
                assert interrupt.requested()
                interrupt.exit()
        assert stop.value.code == 130
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        _send(signal.SIGTERM)  # the launcher's closing signal: ignored
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_handlers_installed_even_where_sigint_was_ignored():
    """A non-interactive shell starts background jobs with SIGINT ignored; the guard still saves on SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with InterruptGuard() as interrupt:
            _send(signal.SIGINT)
            assert interrupt.requested()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_second_signal_aborts_at_once(sig, code):
    with pytest.raises(SystemExit) as abort:  # the shell's code, no KeyboardInterrupt traceback
        with InterruptGuard(repeat_grace_s=0.0):
            _send(sig)
            _send(sig)
            raise AssertionError("not aborted")
    assert abort.value.code == code


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_before_training_the_first_signal_stops_at_once_even_where_it_was_ignored(sig):
    """The setup's guard: a background job (SIGINT ignored) is still stopped by Ctrl-C while loading."""
    previous = signal.signal(sig, signal.SIG_IGN)
    try:
        with pytest.raises(SystemExit) as abort:
            with InterruptGuard(save=False):
                _send(sig)
                raise AssertionError("not stopped")
        assert abort.value.code == 128 + sig
        assert signal.getsignal(sig) is signal.SIG_IGN  # the previous handler is back
    finally:
        signal.signal(sig, previous)


def test_repeat_within_grace_is_the_same_interrupt():
    """A launcher forwarding the terminal's Ctrl-C to its workers: the repeat does not abort."""
    with InterruptGuard(repeat_grace_s=60.0) as interrupt:
        _send(signal.SIGINT)
        _send(signal.SIGINT)
        assert interrupt.requested() and interrupt.signum == signal.SIGINT


class _SignalsWhilePickled:
    """Sends SIGINT while ``torch.save`` writes it: the second signal arrives half-way through a checkpoint write."""

    def __reduce__(self):
        _send(signal.SIGINT)
        return (dict, ())


def test_abort_during_a_write_leaves_no_partial_file(tmp_path):
    path = tmp_path / "recipe_state.pt"
    atomic_save({"step": 1}, path)
    with pytest.raises(SystemExit):
        with InterruptGuard(repeat_grace_s=0.0):
            _send(signal.SIGINT)
            atomic_save({"step": 2, "big": torch.zeros(1 << 16), "late": _SignalsWhilePickled()}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe_state.pt"]
    assert torch.load(path)["step"] == 1


def _one_rank_signalled(rank: int, world_size: int) -> None:
    with InterruptGuard() as interrupt:
        assert not interrupt.requested()
        if rank == 1:
            _send(signal.SIGTERM)
        assert interrupt.requested(), rank
        assert interrupt.signum == signal.SIGTERM


@pytest.mark.distributed
def test_a_signal_on_one_rank_stops_every_rank():
    run_distributed(_one_rank_signalled, 2)


def test_resume_command_sets_resume_and_drops_overwrite():
    argv = ["tune", "run", "recipes/x.py", "--config", "a b.yaml", "resume_from_checkpoint=False"]
    assert resume_command(argv + ["overwrite_output_dir=True", "epochs=2"]) == (
        "tune run recipes/x.py --config 'a b.yaml' epochs=2 resume_from_checkpoint=True"
    )
    assert resume_command(["python", "r.py"]) == "python r.py resume_from_checkpoint=True"
    stopped = ["tune", "run", "r.py", "stop_after_step=120", "max_steps_per_epoch=500"]
    assert resume_command(stopped, drop=("stop_after_step",)) == (
        "tune run r.py max_steps_per_epoch=500 resume_from_checkpoint=True"
    )


def test_launch_command_shows_the_console_script(monkeypatch, tmp_path):
    script = tmp_path / "tune"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python3.11", str(script), "run", "x.py"])
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert launch_command() == [str(script), "run", "x.py"]  # not on PATH: the full path runs it
    monkeypatch.setenv("PATH", str(tmp_path))
    assert launch_command() == ["tune", "run", "x.py"]


def test_tensorboard_run_folder_continued(tmp_path):
    logs = tmp_path / "logs"
    saved = logs / "run_0_123.4"
    saved.mkdir(parents=True)
    cfg = OmegaConf.create({"_component_": "torchtune.training.metric_logging.TensorBoardLogger", "log_dir": str(logs)})
    assert continued_metric_logger(cfg, str(saved)) == {**cfg, "log_dir": str(saved), "organize_logs": False}
    assert continued_metric_logger(cfg, None) == cfg  # a fresh run
    assert continued_metric_logger(cfg, str(logs / "gone")) == cfg
    moved = OmegaConf.merge(cfg, {"log_dir": str(tmp_path / "elsewhere")})
    assert continued_metric_logger(moved, str(saved)) == moved  # the user chose another log_dir
    disk = OmegaConf.create({"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(logs)})
    assert continued_metric_logger(disk, str(saved)) == disk


def test_each_ranks_line_names_its_rank(monkeypatch, capfd):
    from torchtune_ext.training._interrupt import _say

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _say("SIGINT received: finishing the current step")
    assert capfd.readouterr().err == "\nSIGINT received: finishing the current step\n"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    _say("SIGINT received: finishing the current step")
    assert capfd.readouterr().err == "\n[rank 1] SIGINT received: finishing the current step\n"

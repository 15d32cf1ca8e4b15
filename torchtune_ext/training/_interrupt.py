"""Interrupts that save: SIGINT (Ctrl-C, a notebook's "stop") and SIGTERM (a runtime's time limit, ``kill``) let the
current optimizer step finish, the recipe then writes a resumable checkpoint and exits with ``128 + signal``
(130, 143), printing the step and the command that resumes the run.

A second signal aborts at once, and so does the first before training starts (``InterruptGuard(save=False)``, the
setup: nothing to save yet): ``SystemExit(128 + signal)`` (130, 143; one line, no traceback) is raised where the
recipe is, and the checkpoint writes (:mod:`torchtune_ext.checkpoint._atomic`) delete their temporaries on the way
out, so no half-written file is left under a final name. Under a distributed launcher a repeat within
:data:`REPEAT_GRACE_S` is the same interrupt: a terminal's Ctrl-C reaches every process of the group and torchrun
then forwards it to its workers once more.

On several ranks the request is agreed each step (an all-reduce of the signal number, MAX), so a signal on any rank
makes all ranks save the same step.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import psutil
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from torchtune_ext.distributed import group_device

#: the signals that save and stop a run.
SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: under a distributed launcher, a repeat of the signal within this many seconds is the launcher forwarding the
#: same interrupt, not a second one.
REPEAT_GRACE_S = 2.0
#: launchers whose console script runs under the interpreter (``python .../bin/tune run ...`` in ``/proc``).
_LAUNCHERS = ("tune", "tune-ext", "torchrun")

_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, None]


def _under_launcher() -> bool:
    """True in a worker started by torchrun (``tune run --nproc_per_node``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _say(message: str) -> None:
    """Writes to stderr without Python's buffered streams (safe inside a signal handler); on several ranks, each
    rank's line says which rank it is (a Ctrl-C reaches every rank)."""
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank {os.environ.get('RANK', '?')}] " if ranks > 1 else ""
    os.write(2, ("\n" + prefix + message + "\n").encode())  # on a line of its own: a progress bar may hold the cursor


class InterruptGuard:
    """Context manager that turns SIGINT and SIGTERM into a request to stop after the current step.

    Handlers are installed explicitly on entry (a non-interactive shell starts background jobs with SIGINT
    ignored; such a job still saves on Ctrl-C sent to it) and the previous ones restored on exit. Outside the main
    thread (where Python cannot install handlers) the guard does nothing.

    Args:
        repeat_grace_s (Optional[float]): repeats within this many seconds of the first signal are ignored;
            None: :data:`REPEAT_GRACE_S` under a distributed launcher, else 0.
        save (bool): False: the first signal aborts at once (``SystemExit(128 + signal)``), as before training
            starts, where there is nothing to save.

    Example:
        >>> saved = []
        >>> with InterruptGuard() as interrupt:
        ...     for step in range(3):
        ...         if interrupt.requested():
        ...             saved.append(step)
        ...             break
        >>> saved
        []
    """

    def __init__(self, repeat_grace_s: Optional[float] = None, save: bool = True) -> None:
        self._save = save
        if repeat_grace_s is None:
            repeat_grace_s = REPEAT_GRACE_S if _under_launcher() else 0.0
        self._repeat_grace_s = float(repeat_grace_s)
        self._received: Optional[int] = None  # the first signal this process received
        self._received_at = 0.0
        self._previous: Dict[int, _Handler] = {}
        #: the agreed signal (any rank's) once :meth:`requested` returned True.
        self.signum: Optional[int] = None

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if not self._save:
            self._abort(signum, f"{name} received before training started: stopping now; nothing was trained or saved.")
        if self._received is None:
            self._received, self._received_at = signum, now
            _say(
                f"{name} received: finishing the current step, then saving a resumable checkpoint "
                "(send it again to abort at once without saving)."
            )
            return
        if now - self._received_at < self._repeat_grace_s:
            return
        self._abort(signum, f"{name} received again: aborting now, without saving.")

    def _abort(self, signum: int, message: str) -> None:
        """Exits with 128 + signal and one line; under a launcher, the signal it forwards once more is ignored."""
        if _under_launcher():
            self._ignore_signals_from_now_on()
        else:
            self._restore()
        _say(message)
        raise SystemExit(128 + signum)

    def requested(self) -> bool:
        """Whether a signal asked the run to stop; on several ranks, whether any rank received one (collective:
        every rank calls it at the same point).

        Returns:
            bool: stop now (:attr:`signum` is then the signal).
        """
        signum = self._received or 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor([signum], dtype=torch.int64, device=group_device())
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            signum = int(agreed.item())
        if signum:
            self.signum = signum
        return bool(signum)

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process stopped by the signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
        if self.signum is None:
            raise RuntimeError("no interrupt was requested")
        return 128 + self.signum

    def exit(self, message: Optional[str] = None) -> None:
        """Leaves the run with :attr:`exit_code`, printing ``message`` (pass it on one rank only).

        Raises:
            SystemExit: always.
        """
        if message:
            print(message, flush=True)
        if _under_launcher():
            self._ignore_signals_from_now_on()
        raise SystemExit(self.exit_code)

    def _ignore_signals_from_now_on(self) -> None:
        """A rank that saved and is leaving ignores SIGINT/SIGTERM: once one rank has exited, torchrun stops the
        others with SIGTERM, which would kill a rank still tearing down (exit code -15, not 128 + signal, and a
        failure block from the launcher). torchrun's SIGKILL after its shutdown timeout still ends a rank that
        hangs."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
        self._previous = {}


def launch_command() -> List[str]:
    """The command line the user typed for this run: the launcher's (``tune run --nproc_per_node ...``) in a
    distributed worker, else this process's, with the interpreter and the console script's path folded into the
    script's name where that name finds the same script on ``PATH``."""
    argv: List[str] = list(getattr(sys, "orig_argv", sys.argv))
    if _under_launcher():
        try:
            argv = psutil.Process().parent().cmdline()
        except (psutil.Error, AttributeError):
            pass
    if len(argv) >= 2 and Path(argv[0]).name.startswith("python") and Path(argv[1]).name in _LAUNCHERS:
        script = Path(argv[1])
        found = shutil.which(script.name)
        shown = script.name if found and Path(found).resolve() == script.resolve() else str(script)
        argv = [shown] + argv[2:]
    return argv


def resume_command(argv: Optional[Sequence[str]] = None, drop: Sequence[str] = ()) -> str:
    """The command that resumes this run: ``argv`` (default :func:`launch_command`) with
    ``resume_from_checkpoint=True`` set (replacing a given value, or appended) and ``overwrite_output_dir``
    dropped (it would delete what the resume needs).

    Args:
        argv (Optional[Sequence[str]]): the original command line.
        drop (Sequence[str]): more config keys whose overrides are left out (e.g. ``stop_after_step``, which the
            saved run has reached).

    Returns:
        str: the command, quoted for a POSIX shell.
    """
    argv = list(launch_command() if argv is None else argv)
    dropped = ("resume_from_checkpoint=", "overwrite_output_dir", *(f"{key}=" for key in drop))
    keep = [arg for arg in argv if not arg.lstrip("+~").startswith(dropped)]
    return shlex.join(keep + ["resume_from_checkpoint=True"])


def interrupted_message(signum: int, step: int, epoch: int, batch: int, checkpoint: Path, command: str) -> str:
    """What an interrupted run prints last.

    Args:
        signum (int): the signal.
        step (int): the last completed (and saved) global step.
        epoch (int): the epoch it belongs to, from 1.
        batch (int): batches of that epoch done.
        checkpoint (Path): the saved step folder.
        command (str): :func:`resume_command`.

    Returns:
        str: the lines.
    """
    return (
        f"\nInterrupted by {signal.Signals(signum).name} after step {step} (epoch {epoch}, batch {batch}): saved "
        f"a resumable checkpoint ({checkpoint} and the recipe state). Resume with (in {os.getcwd()}):\n  {command}"
    )


def continued_metric_logger(cfg: DictConfig, saved_log_dir: Optional[str]) -> DictConfig:
    """The metric logger's config for a resumed run: torchtune's ``TensorBoardLogger`` opens a new
    ``run_<rank>_<time>`` folder per start; a resume writes into the interrupted run's folder instead (one run in
    TensorBoard). Other loggers, a folder that is gone and a changed ``log_dir`` are left as configured.

    Args:
        cfg (DictConfig): ``metric_logger``.
        saved_log_dir (Optional[str]): the logger's ``log_dir`` recorded in the recipe state.

    Returns:
        DictConfig: the config to instantiate.
    """
    tensorboard = str(cfg.get("_component_", "")).endswith("TensorBoardLogger")
    if not tensorboard or not cfg.get("organize_logs", True) or not saved_log_dir:
        return cfg
    saved = Path(saved_log_dir)
    if not saved.is_dir() or saved.parent.resolve() != Path(str(cfg.log_dir)).resolve():
        return cfg
    return OmegaConf.merge(cfg, {"log_dir": str(saved_log_dir), "organize_logs": False})

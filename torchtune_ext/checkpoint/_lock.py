"""One run per output folder.

:class:`OutputDirLock` holds ``filelock``'s native lock (``flock`` on POSIX, ``LockFileEx`` on Windows) on
``<output_dir>/.run.lock``, which records the holder's pid, start time, host and command, for the life of the run;
the operating system releases it when the process ends, however it ends, so the lock of a killed run never blocks a
resume. A second run into the same folder fails at start with :class:`OutputDirInUseError`, naming the running one.

:func:`check_output_dir` refuses, before anything is written, an ``output_dir`` that holds another run's
checkpoints (its recipe state or ``step_N`` folders) unless the run resumes it (``resume_from_checkpoint=True``) or
replaces it (``overwrite_output_dir=True``). :func:`claim_output_dir` takes the lock and checks again once the run
starts writing. Both run on rank 0 and agree with the other ranks, which then fail with the same error.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, TypeVar, Union

import filelock
import torch.distributed as dist
from torchtune import utils

from torchtune_ext.checkpoint._checkpointer import RECIPE_STATE_DIRNAME, RECIPE_STATE_FILENAME
from torchtune_ext.config import ConfigError

log = utils.get_logger("INFO")
#: what a file system without locks answers (some network mounts): the run goes on unlocked, with a warning.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

LOCK_FILENAME = ".run.lock"
T = TypeVar("T")
PathLike = Union[str, Path]


class OutputDirInUseError(ConfigError, RuntimeError):
    """Another live run holds the output folder's lock (a config error: one line, exit 2)."""


def _holder_text(path: Path) -> str:
    """What the lock file says about the run holding it."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if "pid" not in info:
        return "a run that is starting"
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(info.get("started", 0)))
    return f"pid {info['pid']} on {info.get('host', '?')}, started {started}"


def _in_use_error(output_dir: Path) -> OutputDirInUseError:
    return OutputDirInUseError(
        f"output_dir={str(output_dir)!r} is in use by another run ({_holder_text(output_dir / LOCK_FILENAME)}): "
        "two runs in one folder would overwrite each other's checkpoints. Wait for it to end or stop it, or set "
        "another output_dir."
    )


class OutputDirLock:
    """An exclusive lock on an output folder, held until :meth:`release` or the end of the process.

    Args:
        output_dir (PathLike): the run's output folder (created by :meth:`acquire`).
    """

    def __init__(self, output_dir: PathLike) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILENAME
        # preserve_lock_file: the file stays (deleting it would race with a run opening it), and a file system
        # without flock raises (below) instead of falling back to a marker file that a killed run would leave.
        self._lock = filelock.FileLock(
            self.path, timeout=0, preserve_lock_file=True, on_acquired=_record_holder, thread_local=False
        )

    def acquire(self) -> OutputDirLock:
        """Takes the lock and records this process in the lock file. On a file system without locks (some network
        mounts) it warns and goes on unlocked.

        Returns:
            OutputDirLock: self.

        Raises:
            OutputDirInUseError: if a live process holds it.
        """
        self.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise _in_use_error(self.output_dir) from None
        except OSError as err:
            if err.errno not in _NO_LOCKS:
                raise
            log.warning(f"{self.output_dir} does not support file locks ({err}): nothing stops a second run there.")
        return self

    def release(self) -> None:
        """Releases the lock (the file stays)."""
        self._lock.release()

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def __enter__(self) -> OutputDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def is_held(output_dir: PathLike) -> bool:
        """Whether a live process holds the lock of ``output_dir`` (writes nothing).

        Args:
            output_dir (PathLike): the folder.

        Returns:
            bool: True while another run holds it.
        """
        path = Path(output_dir) / LOCK_FILENAME
        if not path.is_file():
            return False
        fd = os.open(path, os.O_RDONLY)
        try:
            if filelock.lock_descriptor(fd, blocking=False):
                filelock.unlock_descriptor(fd)
                return False
            return True
        except OSError:
            return False
        finally:
            os.close(fd)


def _record_holder(fd: int) -> None:
    """Writes this process into the lock file just locked (``fd``): what a refused second run names."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": sys.argv}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder).encode())


def previous_run_state(output_dir: PathLike) -> List[str]:
    """What of another run's checkpoints ``output_dir`` holds: its recipe state and ``step_N`` folders.

    Args:
        output_dir (PathLike): the folder.

    Returns:
        List[str]: their names (empty for a new or a logs-only folder).
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = sorted(p.name for p in folder.glob("step_*") if p.is_dir())
    found.sort(key=lambda name: int(name[5:]) if name[5:].isdigit() else -1)
    if (folder / RECIPE_STATE_DIRNAME / RECIPE_STATE_FILENAME).exists():
        found.insert(0, f"{RECIPE_STATE_DIRNAME}/{RECIPE_STATE_FILENAME}")
    return found


def _check_unlocked(output_dir: Path, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise ConfigError(
            "resume_from_checkpoint=True and overwrite_output_dir=True contradict each other: the overwrite deletes "
            "the checkpoints the resume needs. Drop one.",
            "overwrite_output_dir",
        )
    found = previous_run_state(output_dir)
    if found and not resume and not overwrite:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ConfigError(
            f"output_dir={str(output_dir)!r} holds another run's checkpoints ({shown}). Continue that run with "
            "resume_from_checkpoint=True, replace it with overwrite_output_dir=True (deletes them), or set another "
            "output_dir.",
            "output_dir",
        )


def on_rank_zero(fn: Callable[[], T]) -> Optional[T]:
    """Runs ``fn`` on rank 0 and raises its config error (any ``ValueError``) on every rank, so that every rank stops
    with the same message instead of waiting for rank 0. Collective on several ranks.

    Args:
        fn (Callable[[], T]): what rank 0 does.

    Returns:
        Optional[T]: ``fn``'s result on rank 0, None elsewhere.
    """
    distributed = dist.is_available() and dist.is_initialized()
    result, error = None, None
    if not distributed or dist.get_rank() == 0:
        try:
            result = fn()
        except (OutputDirInUseError, ValueError) as err:
            error = err
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error
    return result


def check_output_dir(output_dir: PathLike, resume: bool, overwrite: bool) -> None:
    """Refuses, writing nothing, an ``output_dir`` in use by a live run, or holding another run's checkpoints
    unless resumed or overwritten. Collective on several ranks (rank 0 looks).

    Args:
        output_dir (PathLike): the run's output folder.
        resume (bool): ``resume_from_checkpoint``.
        overwrite (bool): ``overwrite_output_dir``.

    Raises:
        OutputDirInUseError: if a live run holds the folder.
        ConfigError: if it holds another run's checkpoints, or both flags are set.
    """

    def check() -> None:
        if OutputDirLock.is_held(output_dir):
            raise _in_use_error(Path(output_dir))
        _check_unlocked(Path(output_dir), resume, overwrite)

    on_rank_zero(check)


def claim_output_dir(output_dir: PathLike, resume: bool, overwrite: bool) -> Optional[OutputDirLock]:
    """Locks ``output_dir`` for this run (rank 0), checks it again as :func:`check_output_dir` (another run may
    have finished there since), and with ``overwrite`` deletes the previous run's checkpoints. Collective on
    several ranks.

    Args:
        output_dir (PathLike): the run's output folder.
        resume (bool): ``resume_from_checkpoint``.
        overwrite (bool): ``overwrite_output_dir``.

    Returns:
        Optional[OutputDirLock]: the held lock on rank 0 (keep it for the run), None on other ranks.

    Raises:
        OutputDirInUseError: if a live run holds the folder.
        ConfigError: as :func:`check_output_dir`.
    """

    def claim() -> OutputDirLock:
        folder = Path(output_dir)
        _check_unlocked(folder, resume, overwrite)  # before the lock file is written
        lock = OutputDirLock(folder).acquire()
        try:
            _check_unlocked(folder, resume, overwrite)  # a run may have saved there meanwhile
        except ValueError:
            lock.release()
            raise
        if overwrite:
            _delete_previous_run(folder)
        return lock

    return on_rank_zero(claim)


def _delete_previous_run(folder: Path) -> None:
    found = previous_run_state(folder)
    for name in found:
        path = folder / name.split("/")[0]
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if found:
        log.info(f"overwrite_output_dir=True: deleted the previous run's {', '.join(found)} in {folder}.")

"""Write errors that say what failed, and the checks that find them before a write: writable folders at start-up,
free space before a big export.

A failed write raises :class:`WriteError` naming the file, the cause (no space left, file too large, permission
denied, read-only file system) and the folder with its free space, instead of the bare ``OSError`` of ``write`` or
the ``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos`` of ``torch.save``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, List, Optional, Union

import torch

from torchtune_ext.config import UserFacingError

PathLike = Union[str, Path]

_CAUSES: Dict[int, str] = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "file too large (a file-size limit such as `ulimit -f`, or the file system's largest file)",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
}


def format_bytes(nbytes: float) -> str:
    """``16.1 GB``, ``5.3 MB`` (decimal units, as disks are sold and ``df -H`` shows)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def existing_folder(path: PathLike) -> Path:
    """``path`` if it is a folder, else its nearest existing ancestor (where a new folder would be created)."""
    folder = Path(path).absolute()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    return folder


def free_bytes(path: PathLike) -> int:
    """Free bytes (for this user) on the file system ``path`` is, or would be, on."""
    return shutil.disk_usage(existing_folder(path)).free


class WriteError(UserFacingError, OSError):
    """A file could not be written: names the file, the cause and the folder (with its free space); the entry points
    print it without a traceback (exit code 1).

    Args:
        path (PathLike): the file (or folder) being written.
        error (OSError): what the operating system said.
        note (str): what was kept and what to do, appended to the message.
    """

    def __init__(self, path: PathLike, error: OSError, note: str = ""):
        super().__init__(error.errno, error.strerror or str(error))
        self.path = Path(path)
        self.error = error
        self.note = note

    @property
    def cause(self) -> str:
        """str: the cause in words (``no space left on the device``, ``file too large ...``, ...)."""
        return _CAUSES.get(self.error.errno, self.error.strerror or str(self.error))

    def with_path(self, path: PathLike) -> WriteError:
        """The same error naming another path (the final name of a file written under a temporary one)."""
        return WriteError(path, self.error, self.note)

    def with_note(self, note: str) -> WriteError:
        """The same error with ``note`` (what was kept, what to do) added."""
        return WriteError(self.path, self.error, " ".join(n for n in (self.note, note) if n))

    def __str__(self) -> str:
        folder = existing_folder(self.path.parent)
        try:
            free = f", {format_bytes(free_bytes(folder))} free"
        except OSError:
            free = ""
        message = f"Could not write {self.path}: {self.cause}. Folder: {folder}{free}."
        return f"{message} {self.note}" if self.note else message

    def __reduce__(self):
        return type(self), (self.path, self.error, self.note)


@contextlib.contextmanager
def writing(path: PathLike) -> Iterator[None]:
    """Turns an ``OSError`` raised while writing ``path`` into a :class:`WriteError` naming it.

    Args:
        path (PathLike): the file or folder written in the block.
    """
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        raise WriteError(path, err) from err


class _RecordingFile:
    """A binary file that remembers the ``OSError`` of a failed write: ``torch.save`` reports it as a bare
    ``RuntimeError`` of its zip writer."""

    def __init__(self, file: BinaryIO):
        self._file = file
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._file.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def torch_save(obj: Any, file: BinaryIO, path: PathLike) -> None:
    """``torch.save(obj, file)``; a failed write raises :class:`WriteError` naming ``path`` and the real cause.

    Args:
        obj (Any): what to save.
        file (BinaryIO): an open binary file.
        path (PathLike): its name, for the error.
    """
    recording = _RecordingFile(file)
    try:
        torch.save(obj, recording)
    except (OSError, RuntimeError) as err:
        cause = recording.error if recording.error is not None else err
        if isinstance(cause, OSError):  # chained to the OS error alone: torch's zip-writer message says nothing
            raise WriteError(path, cause) from cause
        raise


def unwritable_folders(folders: Dict[str, PathLike]) -> List[str]:
    """The folders a run will write that it cannot: each one that exists and is not writable, or whose nearest
    existing ancestor is not (a read-only file system included). Nothing is written.

    Args:
        folders (Dict[str, PathLike]): what each folder is (for the message) -> the folder.

    Returns:
        List[str]: one line per folder that cannot be written.
    """
    problems = []
    for what, folder in folders.items():
        path = Path(folder).absolute()
        target = path if path.exists() else existing_folder(path.parent)
        if not target.is_dir():
            problems.append(f"{what}={str(folder)!r} is not writable ({target} is not a folder)")
        elif not os.access(target, os.W_OK | os.X_OK):
            cause = "read-only file system" if _read_only(target) else "permission denied"
            problems.append(f"{what}={str(folder)!r} is not writable ({target}: {cause})")
    return problems


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_writable_folders(folders: Dict[str, PathLike]) -> None:
    """Fails before anything is written if any folder the run will write cannot be written.

    Args:
        folders (Dict[str, PathLike]): what each folder is (e.g. ``"output_dir"``) -> the folder.

    Raises:
        PermissionError: listing every folder that cannot be written.
    """
    problems = unwritable_folders(folders)
    if problems:
        raise PermissionError(
            "; ".join(problems) + ": this run could not save its results. Make the folder(s) writable, or set "
            "output_dir (and metric_logger.log_dir) to a writable folder."
        )

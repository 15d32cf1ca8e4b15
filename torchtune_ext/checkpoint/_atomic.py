"""Atomic, durable writes: a crash, a kill or a full disk never leaves a half-written checkpoint under its final name.

Every folder is written into a temporary sibling and renamed into place; files are replaced with ``os.replace``;
files and folders are fsync'ed before the rename and the parent after it. What killed writes leave behind
(``.NAME.tmp-XXXXXXXX``, ``.NAME.old-XXXXXXXX``) is deleted by :func:`remove_stale_temporaries` before the next run
writes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, List, Union

from torchtune_ext.checkpoint._writes import WriteError, torch_save, writing
from torchtune_ext.config import ConfigError

PathLike = Union[str, Path]


@contextlib.contextmanager
def atomic_directory(final: PathLike) -> Iterator[Path]:
    """Yields a temporary sibling of ``final`` to write into; on success it is renamed to ``final``.

    An existing ``final`` is replaced (moved aside, then deleted after the rename). On an exception the temporary
    folder is deleted and ``final`` is left as it was; a :class:`WriteError` names the file under ``final``.

    Args:
        final (PathLike): the folder to produce.

    Yields:
        Path: the temporary folder.
    """
    final = Path(final)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    with writing(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    try:
        yield tmp
        with writing(final):
            _fsync_tree(tmp)
    except WriteError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _final_name(err, tmp, final) from err.__cause__
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    with writing(final):
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _final_name(err: WriteError, tmp: Path, final: Path) -> WriteError:
    """``err`` naming the file's final path instead of its temporary one."""
    try:
        return err.with_path(final / err.path.relative_to(tmp))
    except ValueError:
        return err


def atomic_save(obj: Any, path: PathLike) -> None:
    """``torch.save`` into a temporary file next to ``path``, then ``os.replace`` it into place.

    Args:
        obj (Any): what to save.
        path (PathLike): destination file.

    Raises:
        WriteError: naming ``path``, the cause and the folder, if it cannot be written (``path`` is left as it was).
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch_save(obj, f, path)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """Flushes a file, or a folder's entries (POSIX only: other systems cannot open a folder), to disk."""
    if path.is_dir() and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flushes every file and folder under ``folder``, and ``folder`` itself, so a renamed checkpoint survives a
    machine crash with its data."""
    for path in sorted(folder.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(folder)


_STALE_TEMPORARY = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]{8}$")


def remove_stale_temporaries(folder: PathLike) -> List[Path]:
    """Deletes the temporary files and folders that killed writes of :func:`atomic_directory` and
    :func:`atomic_save` left directly in ``folder`` (``.NAME.tmp-XXXXXXXX``, ``.NAME.old-XXXXXXXX``).

    Call it only while nothing writes into ``folder``.

    Args:
        folder (PathLike): an output folder; a missing one is fine.

    Returns:
        List[Path]: what was deleted.
    """
    folder = Path(folder)
    stale = sorted(p for p in folder.iterdir() if _STALE_TEMPORARY.match(p.name)) if folder.is_dir() else []
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def check_writable(folder: PathLike, what: str) -> None:
    """Checks that ``folder`` exists as a writable folder or can be created, without creating anything.

    Args:
        folder (PathLike): the folder.
        what (str): its config key, for the error.

    Raises:
        ValueError: if the nearest existing ancestor is not a folder, or not writable.
    """
    ancestor = Path(folder).absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{what}={str(folder)!r} is not writable ({ancestor} is not a folder this user can write to); set "
            f"{what} to a writable folder."
        )

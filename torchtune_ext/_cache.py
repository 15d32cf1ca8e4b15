"""The folder where torchtune_ext keeps what it builds once per machine (converted checkpoints, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

#: the environment variable that sets the folder.
CACHE_ENV = "TORCHTUNE_EXT_CACHE"


def cache_dir() -> Path:
    """
    Returns:
        Path: ``$TORCHTUNE_EXT_CACHE``, else ``$XDG_CACHE_HOME/torchtune_ext`` (``~/.cache/torchtune_ext``); not
        created here.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchtune_ext"

"""The start-up hook: what ``torchtune_ext_compat.pth`` runs as the interpreter starts, and no more.

``setup.py`` installs this file into site-packages as the top-level module ``_torchtune_ext_startup``. It imports
nothing of torchtune_ext: at start-up the working folder is not on ``sys.path`` yet, so importing the package then
would fix the installed checkout for the whole process, even in a second checkout that tests its own code. It puts
a finder first on ``sys.meta_path`` (no import, microseconds) that, on the first import of torchtune, torchao or
``recipes``, imports ``torchtune_ext._compat`` from wherever ``sys.path`` finds it by then (the working folder
first), installs its import hook and hands that import over to it; from then on it finds nothing.

Why at start-up at all: users start us in ways where torchtune is imported before any code of ours runs (``tune
run``, the workers ``torchrun`` starts, ``python recipes/<recipe>.py``, pytest, a notebook that imports torchtune
first); only interpreter start-up runs before all of them. Rejected: ``sitecustomize`` (one per environment, owned
by the environment), a wrapper of the ``tune`` script (users type ``tune``), entry points (torchtune 0.6.1 loads
none).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

#: the imports the compat hook must see first: everything it acts on is one of these or a module below them.
_FIRST_IMPORTS = frozenset({"torchtune", "torchao", "recipes"})


class _StartupFinder:
    """Hands the first import of :data:`_FIRST_IMPORTS` over to ``torchtune_ext._compat``'s import hook."""

    def __init__(self) -> None:
        self.handed_over = False

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if self.handed_over or fullname not in _FIRST_IMPORTS:
            return None
        # Stays on sys.meta_path, finding nothing: removed while the import system walks the list, it would make
        # the walk skip the next finder.
        self.handed_over = True
        import importlib

        try:
            compat = importlib.import_module("torchtune_ext._compat")
        except ModuleNotFoundError as error:
            if error.name in ("torchtune_ext", "torchtune_ext._compat"):
                return None  # the package is gone and this file was left behind
            raise
        return compat.install_import_hook().find_spec(fullname, path, target)


def install() -> None:
    """Puts the start-up finder first on ``sys.meta_path`` (once)."""
    if not any(type(finder).__name__ == "_StartupFinder" for finder in sys.meta_path):
        sys.meta_path.insert(0, _StartupFinder())

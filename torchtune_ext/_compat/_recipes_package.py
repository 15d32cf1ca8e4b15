"""The recipes of the checkout in use: ``import recipes`` gives the working folder's package under ``tune run
recipes/<recipe>.py``, and a source checkout's ``torchtune_ext.recipes`` / ``.configs`` are its own folders.

``tune`` turns the path into the module ``recipes.<recipe>`` and appends the working folder to ``sys.path``, after
site-packages, where torchtune installs a placeholder ``recipes`` package whose ``__init__`` only raises ("The
torchtune recipes directory isn't a package"). When that placeholder is what ``import recipes`` would find and the
working folder has a ``recipes/__init__.py``, the import hook returns the working folder's package instead
(:func:`local_recipes_spec`); without one, an error that names the fix. Nothing importable changes: the placeholder
can never be imported.

``setup.py`` installs the checkout's root ``recipes/`` and ``configs/`` as ``torchtune_ext.recipes`` and
``torchtune_ext.configs``; an editable install maps them to the installed checkout's folders. Where ``torchtune_ext``
was imported from another source checkout (a second clone testing its own code, a tree on ``PYTHONPATH``), they are
that checkout's folders (:func:`checkout_package_spec`), so ``tune-ext ls/run`` list and run its own recipes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Optional


def _torchtune_recipes_placeholder() -> Optional[Path]:
    """The ``recipes/__init__.py`` that torchtune installs next to itself, or None (torchtune not installed)."""
    spec = importlib.machinery.PathFinder.find_spec("torchtune")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent / "recipes" / "__init__.py"


class _NoRecipesHere(importlib.abc.Loader):
    """Loads nothing: raises the error that tells a user who ran ``tune run recipes/...`` elsewhere what to do."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        raise ModuleNotFoundError(
            f"`tune run recipes/<recipe>.py` imports the package `recipes` from the working folder, and {os.getcwd()} "
            "has no recipes/ folder (only torchtune's unimportable placeholder was found). Run it from the root of a "
            "torchtune_ext clone, or run the installed recipes by name from anywhere: "
            "tune-ext run qlora_finetune_single_device --config <model>/<config> (tune-ext ls lists them)."
        )


def local_recipes_spec() -> Optional[importlib.machinery.ModuleSpec]:
    """The working folder's ``recipes`` package where torchtune's placeholder would be imported, else None."""
    found = importlib.machinery.PathFinder.find_spec("recipes")
    placeholder = _torchtune_recipes_placeholder()
    if found is None or found.origin is None or placeholder is None or Path(found.origin) != placeholder:
        return None
    local = Path(os.getcwd()) / "recipes" / "__init__.py"
    if not local.is_file():
        return importlib.machinery.ModuleSpec("recipes", _NoRecipesHere())
    return importlib.util.spec_from_file_location("recipes", local, submodule_search_locations=[str(local.parent)])


#: the subpackages ``setup.py`` makes of a checkout's root folders.
CHECKOUT_PACKAGES = {"torchtune_ext.recipes": "recipes", "torchtune_ext.configs": "configs"}


def checkout_package_spec(fullname: str) -> Optional[importlib.machinery.ModuleSpec]:
    """The root folder of the source checkout ``torchtune_ext`` was imported from, as the package ``fullname`` (one
    of :data:`CHECKOUT_PACKAGES`); None for an installed package (which holds it) or outside a checkout."""
    origin = getattr(sys.modules.get("torchtune_ext"), "__file__", None)
    if origin is None:
        return None
    package = Path(origin).parent
    folder = package.parent / CHECKOUT_PACKAGES[fullname]
    init = folder / "__init__.py"
    if (package / folder.name).exists() or not (package.parent / "setup.py").is_file() or not init.is_file():
        return None
    return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])

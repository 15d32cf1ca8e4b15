"""The import hook that applies every compatibility alias and registration of the project in time.

The aliases must exist after torchao has fully imported and before the first ``import torchtune``, and torchtune's
recipe registry and launcher get their registrations as they are imported. :class:`_CompatFinder`, first on
``sys.meta_path``, acts on those imports: before ``import torchtune`` it imports torchao and calls :func:`apply`
(the warning filters before ``import torchao``); it gives ``torchtune._recipe_registry`` and ``torchtune._cli.run``
their registrations as they load; ``recipes`` resolves to the working folder's package, and a source checkout's
``torchtune_ext.recipes`` / ``.configs`` to its own folders (``torchtune_ext._compat._recipes_package``); and it
gives torchao's NF4 module under its old name (``torchao.dtypes.nf4tensor``, which torchtune 0.6.1 and its tests
import) on a torchao that moved it, imported first or after torchtune alike. It finds nothing itself otherwise.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Callable, Dict, Optional, Sequence

from torchtune_ext._compat._launcher import _exit_like_interrupted_workers
from torchtune_ext._compat._nf4_ops import register_nf4_ops
from torchtune_ext._compat._recipes_package import CHECKOUT_PACKAGES, checkout_package_spec, local_recipes_spec
from torchtune_ext._compat._registry import register_recipes
from torchtune_ext._compat._torchao import NF4_MODULES, alias_module, apply_torchao_aliases
from torchtune_ext._compat._warnings import quiet_known_warnings

_applied = False

#: the torchtune modules given a registration as they are imported (or at once, where already imported).
_ON_IMPORT: Dict[str, Callable[[types.ModuleType], None]] = {
    "torchtune._recipe_registry": register_recipes,
    "torchtune._cli.run": _exit_like_interrupted_workers,
}


def apply() -> None:
    """Applies every alias and registration once (imports torchao, and torch). Idempotent."""
    global _applied
    if _applied:
        return
    _applied = True
    quiet_known_warnings()
    apply_torchao_aliases()
    register_nf4_ops()


class _ThenRegister(importlib.abc.Loader):
    """A torchtune module of :data:`_ON_IMPORT`, loaded by its own loader, then given its registration."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _ON_IMPORT[module.__name__](module)


def _registering_spec(fullname: str, path: Optional[Sequence[str]]) -> Optional[importlib.machinery.ModuleSpec]:
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return None
    spec.loader = _ThenRegister(spec.loader)
    return spec


class _MovedModule(importlib.abc.Loader):
    """Loads a module that torchao moved: the import gives the module at its new name (the same module object,
    so the same classes and ops table), after :func:`apply`."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system returns what sys.modules holds under the name once this returns; set before apply(),
        # which imports the name again.
        alias_module(module.__name__, importlib.import_module(self.new_name))
        apply()


class _CompatFinder(importlib.abc.MetaPathFinder):
    """Applies :func:`apply` before the first ``import torchtune`` (and the warning filters before ``import
    torchao``); registers as :data:`_ON_IMPORT` says; resolves ``recipes`` to the working folder's package where
    torchtune's placeholder would shadow it, and a source checkout's recipes and configs to its own; gives
    torchao's NF4 module under its old name where the installed torchao moved it. Finds nothing itself otherwise."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == "torchtune":
            apply()
        elif fullname == "torchao":
            quiet_known_warnings()
        elif fullname in _ON_IMPORT:
            return _registering_spec(fullname, path)
        elif fullname == "recipes":
            return local_recipes_spec()
        elif fullname in CHECKOUT_PACKAGES:
            return checkout_package_spec(fullname)
        elif fullname == NF4_MODULES[0] and importlib.machinery.PathFinder.find_spec(fullname, path) is None:
            return importlib.machinery.ModuleSpec(fullname, _MovedModule(NF4_MODULES[1]))
        return None


def install_import_hook() -> importlib.abc.MetaPathFinder:
    """Puts the finder first on ``sys.meta_path`` (once). If torchtune is already imported, applies now.

    Called by ``import torchtune_ext``, and by the start-up hook (``torchtune_ext._compat._startup``) on the first
    import of torchtune, torchao or ``recipes``, which hands that import over to the finder.

    Returns:
        importlib.abc.MetaPathFinder: the finder on ``sys.meta_path``.
    """
    finder = next((f for f in sys.meta_path if isinstance(f, _CompatFinder)), None)
    if finder is None:
        finder = _CompatFinder()
        sys.meta_path.insert(0, finder)
    if "torchtune" in sys.modules:
        apply()
    for name, register in _ON_IMPORT.items():
        if name in sys.modules:
            register(sys.modules[name])
    return finder

"""This package's recipes and configs in torchtune's recipe registry, so that torchtune's own ``tune ls``, ``tune cp``
and ``tune run <recipe> --config <config>`` know them by name from any folder, and ``tune run /path/to/my_recipe.py``
runs a copied recipe from any folder (:func:`register_recipes`, applied as ``torchtune._recipe_registry`` is
imported)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import List


def register_recipes(registry: types.ModuleType) -> None:
    """Lists this package's recipes and configs in torchtune's registry (once), by absolute path (torchtune joins its
    ``recipes`` folder with the path, which an absolute path replaces). Our entries come first: where a config name
    is also torchtune's (``llama3_2/1B_qlora_single_device``), ``tune run <recipe> --config`` looks in the named
    recipe's configs first, and ``tune cp`` keeps finding torchtune's own (``tune-ext cp`` copies ours)."""
    from torchtune_ext._shipped import DISTRIBUTED_RECIPE, config_files, recipe_files, recipe_of

    recipes = registry.get_all_recipes()
    known = {recipe.name for recipe in recipes}
    configs = config_files()
    ours = [
        registry.Recipe(
            name=name,
            file_path=str(path),
            configs=[registry.Config(name=c, file_path=str(p)) for c, p in configs.items() if recipe_of(c) == name],
            supports_distributed=name == DISTRIBUTED_RECIPE,
        )
        for name, path in recipe_files().items()
        if name not in known
    ]
    ours += [
        registry.Recipe(name=arg, file_path=str(Path(arg).resolve()), configs=[], supports_distributed=True)
        for arg in _recipe_files_tune_run_cannot_import()
        if arg not in known
    ]
    recipes[:0] = ours


def _recipe_files_tune_run_cannot_import() -> List[str]:
    """Under ``tune run``, the recipe files on its command line (before ``--config``) that torchtune would turn into
    a relative module name: torchtune runs a file path as the module ``x.my_recipe`` (``x/my_recipe.py``) from the
    working folder, and an absolute path or one through ``.``/``..`` gives ``.tmp.x.my_recipe``, which runpy
    refuses ("Relative module names not supported"). Registered under the path as typed, torchtune runs such a file
    by its absolute path, as it runs its own recipes (``runpy.run_path``, or torchrun on the file): one module,
    ``__main__``, from any working folder."""
    if Path(sys.argv[0]).stem != "tune" or sys.argv[1:2] != ["run"]:
        return []
    args = sys.argv[2:]
    before_config = args[: args.index("--config")] if "--config" in args else args
    return [
        arg
        for arg in before_config
        if arg.endswith(".py") and "" in os.path.splitext(arg)[0].replace("/", ".").split(".") and Path(arg).is_file()
    ]

"""The recipes and configs that ship inside the package (``torchtune_ext.recipes``, ``torchtune_ext.configs``), by
name. Imports nothing heavy: ``torchtune_ext._compat`` lists them in torchtune's recipe registry while torchtune is
being imported."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Dict, Optional

#: configs whose name contains this belong to the single-device recipe; the others to the distributed one.
_SINGLE_DEVICE_MARK = "single_device"
SINGLE_DEVICE_RECIPE = "qlora_finetune_single_device"
DISTRIBUTED_RECIPE = "qlora_finetune_distributed"
GENERATION_RECIPE = "generate"  # configs named *generation
EVAL_RECIPE = "eleuther_eval"  # configs named *eleuther_eval
#: recipe names whose file is a thin entry point -> the recipe whose file holds the code (``tune-ext cp`` copies it)
_ENTRY_POINTS = {DISTRIBUTED_RECIPE: SINGLE_DEVICE_RECIPE}


def recipe_files() -> Dict[str, Path]:
    """
    Returns:
        Dict[str, Path]: recipe name -> the installed recipe file.
    """
    folder = Path(str(resources.files("torchtune_ext.recipes")))
    return {path.stem: path for path in sorted(folder.glob("*.py")) if path.stem != "__init__"}


def recipe_file_to_copy(name: str) -> Path:
    """The file a copy of recipe ``name`` starts from: the recipe's own, or where its file is a thin entry point (the
    distributed name), the file that holds the recipe for any world size.

    Args:
        name (str): a recipe name from :func:`recipe_files`.

    Returns:
        Path: the installed file.
    """
    return recipe_files()[_ENTRY_POINTS.get(name, name)]


def config_files() -> Dict[str, Path]:
    """
    Returns:
        Dict[str, Path]: config name (``<model>/<config>``, no suffix) -> the installed YAML file.
    """
    folder = Path(str(resources.files("torchtune_ext.configs")))
    return {path.relative_to(folder).with_suffix("").as_posix(): path for path in sorted(folder.rglob("*.yaml"))}


def recipe_of(config_name: str) -> str:
    """
    Args:
        config_name (str): a config name from :func:`config_files`.

    Returns:
        str: the recipe the config is written for.
    """
    if config_name.endswith("eleuther_eval"):
        return EVAL_RECIPE
    if "generation" in config_name:
        return GENERATION_RECIPE
    return SINGLE_DEVICE_RECIPE if _SINGLE_DEVICE_MARK in config_name else DISTRIBUTED_RECIPE


def generation_config_for(training_config: str) -> Optional[str]:
    """The shipped generation config for a training config's model, e.g. ``llama3_1/8B_generation`` for
    ``configs/llama3_1/8B_qlora_single_device.yaml`` or ``llama3_1/8B_qlora``, ``tiny/generation`` for the tiny default.

    Args:
        training_config (str): the training config, as ``--config`` names it (a shipped name or a path).

    Returns:
        Optional[str]: the generation config's name, or None where none ships (e.g. a config of the user's own).
    """
    path = Path(training_config)
    stem = path.name.removesuffix(".yaml")  # not Path.stem: "0.5B_qlora" has no suffix to drop
    name = f"{path.parent.name}/{stem.split('qlora')[0]}generation"
    return name if "qlora" in stem and name in config_files() else None

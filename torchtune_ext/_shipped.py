"""The recipes and configs that ship inside the package (``torchtune_ext.recipes``, ``torchtune_ext.configs``), by
name. Imports nothing heavy: ``torchtune_ext._compat`` lists them in torchtune's recipe registry while torchtune is
being imported."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Dict

#: configs whose name contains this belong to the single-device recipe; the others to the distributed one.
_SINGLE_DEVICE_MARK = "single_device"
SINGLE_DEVICE_RECIPE = "qlora_finetune_single_device"
DISTRIBUTED_RECIPE = "qlora_finetune_distributed"
GENERATION_RECIPE = "generate"  # [issue 18] configs named *generation
EVAL_RECIPE = "eleuther_eval"  # [issue 18] configs named *eleuther_eval


def recipe_files() -> Dict[str, Path]:
    """
    Returns:
        Dict[str, Path]: recipe name -> the installed recipe file.
    """
    folder = Path(str(resources.files("torchtune_ext.recipes")))
    return {path.stem: path for path in sorted(folder.glob("*.py")) if path.stem != "__init__"}


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
    if config_name.endswith("eleuther_eval"):  # [issue 18]
        return EVAL_RECIPE
    if "generation" in config_name:  # [issue 18]
        return GENERATION_RECIPE
    return SINGLE_DEVICE_RECIPE if _SINGLE_DEVICE_MARK in config_name else DISTRIBUTED_RECIPE

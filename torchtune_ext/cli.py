"""``tune-ext``: torchtune's ``tune ls`` / ``tune cp`` / ``tune run`` for the recipes and configs that ship in this
package, so that a plain ``pip install`` (no clone) runs them by name::

    tune-ext ls
    tune-ext run qlora_finetune_single_device --config tiny/qlora_single_device
    tune-ext run qlora_finetune_single_device --config llama3_2/1B_qlora_single_device dtype=fp32
    tune-ext run --nproc_per_node 2 qlora_finetune_distributed --config tiny/qlora_distributed
    tune-ext cp llama3_2/1B_qlora_single_device my_config.yaml   # then: tune-ext run <recipe> --config my_config.yaml
    tune-ext cp qlora_finetune_single_device my_recipe.py        # then: tune-ext run my_recipe.py --config ...

``run`` takes torchrun's flags before the recipe, as ``tune run`` does (``--nproc_per_node``, ``--nnodes``,
``--rdzv_endpoint``, ...); recipes and configs are names from ``tune-ext ls`` or paths to files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional

from torchtune._cli.run import Run

from torchtune_ext.export._gguf_cli import add_export_subcommand  # [issue 18]

#: configs whose name contains this belong to the single-device recipe; the others to the distributed one.
_SINGLE_DEVICE_MARK = "single_device"
SINGLE_DEVICE_RECIPE = "qlora_finetune_single_device"
DISTRIBUTED_RECIPE = "qlora_finetune_distributed"


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
    return SINGLE_DEVICE_RECIPE if _SINGLE_DEVICE_MARK in config_name else DISTRIBUTED_RECIPE


def _resolve(name: str, known: Dict[str, Path], what: str) -> Path:
    key = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if key in known:
        return known[key]
    if Path(name).is_file():
        return Path(name)
    raise SystemExit(f"tune-ext: {what} {name!r} is neither one of `tune-ext ls` nor an existing file.")


def _ls(args: argparse.Namespace) -> None:
    configs = config_files()
    print(f"{'RECIPE':<32} CONFIG")
    for recipe in recipe_files():
        names = [name for name in configs if recipe_of(name) == recipe]
        for i, name in enumerate(names or ["-"]):
            print(f"{recipe if i == 0 else '':<32} {name}")


def _cp(args: argparse.Namespace) -> None:
    recipes, configs = recipe_files(), config_files()
    key = args.file[: -len(".yaml")] if args.file.endswith(".yaml") else args.file
    source = recipes.get(key) or configs.get(key)
    if source is None:
        raise SystemExit(f"tune-ext: {args.file!r} is not a recipe or config of `tune-ext ls`.")
    destination = Path(args.destination)
    if destination.is_dir():
        destination = destination / source.name
    elif not destination.suffix:
        destination = destination.with_suffix(source.suffix)
    if destination.exists():
        raise SystemExit(f"tune-ext: {destination} exists; pick another destination or delete it first.")
    if not destination.parent.is_dir():
        if not args.make_parents:
            raise SystemExit(f"tune-ext: {destination.parent} does not exist; pass --make-parents to create it.")
        destination.parent.mkdir(parents=True)
    shutil.copyfile(source, destination)
    print(f"Copied {source} to {destination}")


class _RunOurs(Run):
    """torchtune's ``tune run`` (torchrun flags, single-device or torchrun launch) over this package's recipes and
    configs: names resolve to the installed files, which run as files (torchtune's path for its own recipes)."""

    def __init__(self, subparsers: argparse._SubParsersAction):
        super().__init__(subparsers)
        self._parser.prog = "tune-ext run"
        self._parser.usage = "tune-ext run [TORCHRUN-OPTIONS] <recipe> --config <config> [RECIPE-OPTIONS]"
        self._parser.epilog = __doc__

    def _run_cmd(self, args: argparse.Namespace) -> None:
        if "--config" not in args.recipe_args or args.recipe_args[-1] == "--config":
            self._parser.error("the '--config <config>' argument is required.")
        config_index = args.recipe_args.index("--config") + 1
        args.recipe = str(_resolve(args.recipe, recipe_files(), "recipe"))
        args.recipe_args[config_index] = str(_resolve(args.recipe_args[config_index], config_files(), "config"))
        if self._is_distributed_args(args):
            self._run_distributed(args, is_builtin=True)
        else:
            self._run_single_device(args, is_builtin=True)


def build_parser() -> argparse.ArgumentParser:
    """
    Returns:
        argparse.ArgumentParser: the ``tune-ext`` parser (subcommands ``ls``, ``cp``, ``run``).
    """
    parser = argparse.ArgumentParser(
        prog="tune-ext", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.set_defaults(func=lambda args: parser.print_help())
    subparsers = parser.add_subparsers(title="subcommands")
    ls = subparsers.add_parser("ls", help="List the recipes and their configs.")
    ls.set_defaults(func=_ls)
    cp = subparsers.add_parser("cp", help="Copy a recipe or config to a local path, to edit it.")
    cp.add_argument("file", help="a recipe or config name from `tune-ext ls`")
    cp.add_argument("destination", help="a file or folder")
    cp.add_argument("--make-parents", action="store_true", help="create the destination's missing folders")
    cp.set_defaults(func=_cp)
    _RunOurs(subparsers)
    add_export_subcommand(subparsers)  # [issue 18] tune-ext export gguf
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of the ``tune-ext`` console script.

    Args:
        argv (Optional[List[str]]): the arguments; None: ``sys.argv[1:]``.
    """
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.func(args)


if __name__ == "__main__":
    main()

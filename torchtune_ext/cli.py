"""``tune-ext``: torchtune's ``tune ls`` / ``tune cp`` / ``tune run`` for the recipes and configs that ship in this
package, so that a plain ``pip install`` (no clone) runs them by name::

    tune-ext ls
    tune-ext run qlora_finetune_single_device --config tiny/qlora_single_device
    tune-ext run qlora_finetune_single_device --config llama3_2/1B_qlora_single_device dtype=fp32
    tune-ext run --nproc_per_node 2 qlora_finetune_distributed --config tiny/qlora_distributed
    tune-ext cp llama3_2/1B_qlora_single_device my_config.yaml   # then: tune-ext run <recipe> --config my_config.yaml
    tune-ext cp qlora_finetune_single_device my_recipe.py        # edit its loop; then: tune run my_recipe.py --config
    tune-ext validate --config llama3_2/1B_qlora_single_device dtype=fp32   # the recipe's start-up checks, no weights
    tune-ext cat tiny/qlora_single_device                        # print a shipped config

torchtune's own ``tune ls`` / ``tune cp`` / ``tune run <recipe>`` know the training recipes and configs too; not
``generate`` and ``eleuther_eval``, which are torchtune's own recipes' names there (``tune-ext run`` them).

``run`` takes torchrun's flags before the recipe, as ``tune run`` does (``--nproc_per_node``, ``--nnodes``,
``--rdzv_endpoint``, ...); recipes and configs are names from ``tune-ext ls`` or paths to files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

from torchtune._cli.run import Run

from torchtune_ext import _use_cli
from torchtune_ext._shipped import config_files, recipe_file_to_copy, recipe_files, recipe_of
from torchtune_ext.config import exit_on_config_error
from torchtune_ext.export import add_export_subcommand


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


#: printed after copying a recipe (``docs/hacking.md`` says more).
_HACK_HINT = """\
{recipe} is the whole recipe, for any world size: setup() in order, the step (loss_step: forward and loss;
forward_backward: one micro-batch's backward; optimizer_step: unscale, clip, step) and the loop, train().
Edit it there; the pieces it calls are in torchtune_ext.training. Run it on one device or on N:
  tune run {recipe} --config <config.yaml>
  tune run --nproc_per_node N {recipe} --config <config.yaml>   (see docs/hacking.md)"""


def _cp(args: argparse.Namespace) -> None:
    recipes, configs = recipe_files(), config_files()
    key = args.file[: -len(".yaml")] if args.file.endswith(".yaml") else args.file
    source = recipe_file_to_copy(key) if key in recipes else configs.get(key)
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
    if source.suffix == ".py":  # how to hack a recipe
        print(_HACK_HINT.format(recipe=destination))


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


def _validate(args: argparse.Namespace) -> None:
    from torchtune.config._parse import TuneRecipeArgumentParser
    from torchtune.config._utils import _merge_yaml_and_cli_args

    from torchtune_ext._validate import validate

    path = _resolve(args.config, config_files(), "config")
    recipe = args.recipe or recipe_of(args.config[: -len(".yaml")] if args.config.endswith(".yaml") else args.config)
    if recipe not in recipe_files():
        raise SystemExit(
            f"tune-ext: --recipe {recipe!r} is not a recipe of `tune-ext ls`: use one of {list(recipe_files())}."
        )
    print(f"checking {path} as a config of {recipe}" + ("" if args.recipe else " (--recipe to choose another)"))
    yaml_args, cli_args = TuneRecipeArgumentParser().parse_known_args(["--config", str(path), *args.overrides])
    for line in validate(_merge_yaml_and_cli_args(yaml_args, cli_args), recipe):
        print(f"checked: {line}")
    print(f"{path}: OK")


def _cat(args: argparse.Namespace) -> None:
    key = args.config[: -len(".yaml")] if args.config.endswith(".yaml") else args.config
    if key not in config_files():
        raise SystemExit(f"tune-ext: {args.config!r} is not a config of `tune-ext ls`.")
    print(config_files()[key].read_text(), end="")


def build_parser() -> argparse.ArgumentParser:
    """
    Returns:
        argparse.ArgumentParser: the ``tune-ext`` parser (subcommands ``ls``, ``cp``, ``run``, ``validate``,
        ``cat``, ``generate``, ``chat``, ``merge``).
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
    validate = subparsers.add_parser(
        "validate",
        help="Run the start-up checks of a config's recipe (with overrides): no weights loaded, nothing written.",
    )
    validate.add_argument("--config", required=True, help="a config name from `tune-ext ls` or a YAML file")
    validate.add_argument(
        "--recipe",
        help="the recipe it is for, from `tune-ext ls` (default: from the config's name, as `tune-ext ls` pairs "
        "them: *generation -> generate, *eleuther_eval -> eleuther_eval, *single_device -> "
        "qlora_finetune_single_device, else qlora_finetune_distributed)",
    )
    validate.add_argument("overrides", nargs="*", help="key=value overrides, as for `run`")
    validate.set_defaults(func=_validate)
    cat = subparsers.add_parser("cat", help="Print a shipped config.")
    cat.add_argument("config", help="a config name from `tune-ext ls`")
    cat.set_defaults(func=_cat)
    _use_cli.add_subcommands(subparsers, lambda name: _resolve(name, config_files(), "config"))
    add_export_subcommand(subparsers)  # tune-ext export gguf
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of the ``tune-ext`` console script.

    Args:
        argv (Optional[List[str]]): the arguments; None: ``sys.argv[1:]``.
    """
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    exit_on_config_error("tune-ext")(args.func)(args)  # config errors: one line, exit code 2


if __name__ == "__main__":
    main()

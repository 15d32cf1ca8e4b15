"""Public names where users look, and no reaching into another package's private modules.

A subpackage of ``torchtune_ext`` (``nf4``, ``distributed``, ``training``, ...) offers what others need through its
``__init__``; its ``_modules`` and ``_names`` are its own. The root package's private modules (``_compat``, the one
place for compatibility registrations, and ``_dtype``) serve every subpackage. Recipes and benchmarks use public
names only.
"""

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

import torchtune_ext.distributed
import torchtune_ext.training

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("torchtune_ext", "recipes", "bench")


def _imports(path: Path) -> Iterator[Tuple[int, str]]:
    """Every imported dotted name of ``path`` (``from a.b import c`` gives ``a.b.c``), with its line."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def _violation(path: Path, name: str) -> bool:
    """Whether importing ``name`` from ``path`` reaches into a private part of another package of ours."""
    parts = name.split(".")
    if parts[0] != "torchtune_ext":
        return False
    private = next((i for i, part in enumerate(parts) if part.startswith("_")), None)
    if private is None:
        return False
    owner = parts[:private]  # the package (or a module of it) whose private module or name this is
    if ROOT.joinpath(*owner).with_suffix(".py").is_file():
        owner = owner[:-1]  # a private name of a public module: private to its package
    relative = path.relative_to(ROOT).with_suffix("").parts
    if relative[0] != "torchtune_ext":
        return True  # recipes and benchmarks: public names only
    return tuple(relative[: len(owner)]) != tuple(owner)


def _violations() -> List[str]:
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [
                f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in _imports(path) if _violation(path, name)
            ]
    return found


def test_no_private_cross_package_imports():
    assert _violations() == []


#: CONTRIBUTING.md's layers: a package (or a module of the root package) imports only those of lower layers.
LAYERS = {
    "config": -1,
    "_shipped": -1,
    "_compat": 0,
    "_dtype": 0,
    "_finite": 0,
    "nf4": 1,
    "distributed": 2,
    "modules": 3,
    "models": 4,
    "checkpoint": 4,
    "data": 5,
    "memory": 5,
    "training": 6,
    "generation": 7,
    "export": 8,
    "evaluation": 8,
    "cli": 9,
}
#: the modules of ``tune-ext`` beside ``cli.py`` (its subcommands' code): one unit with it.
CLI_MODULES = ("_use_cli", "_validate")


def _unit(path: Path) -> str:
    """The package or root module ``path`` belongs to (``cli`` for the CLI's modules)."""
    top = path.relative_to(ROOT / "torchtune_ext").with_suffix("").parts[0]
    return "cli" if top in CLI_MODULES else top


def _library_modules() -> List[Path]:
    """Every module of the library but the root ``__init__`` (which only installs ``_compat``'s import hook)."""
    return [p for p in sorted((ROOT / "torchtune_ext").rglob("*.py")) if p != ROOT / "torchtune_ext" / "__init__.py"]


def test_every_module_is_in_a_layer():
    assert sorted({_unit(path) for path in _library_modules()} - set(LAYERS)) == []


def test_imports_only_go_down_the_layers():
    upward = []
    for path in _library_modules():
        unit = _unit(path)
        for line, name in _imports(path):
            top = name.split(".")[1] if name.startswith("torchtune_ext.") else None
            target = "cli" if top in CLI_MODULES else top
            if target in LAYERS and target != unit and LAYERS[target] >= LAYERS[unit]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert upward == []


@pytest.mark.parametrize(
    "path, name, expected",
    [
        ("torchtune_ext/modules/low_precision.py", "torchtune_ext.nf4._codec.decode_nf4_", True),
        ("torchtune_ext/training/_metrics.py", "torchtune_ext.distributed._utils.group_device", True),
        ("torchtune_ext/training/_metrics.py", "torchtune_ext.distributed.group_device", False),
        ("torchtune_ext/nf4/__init__.py", "torchtune_ext.nf4._codec.quantize_nf4", False),
        ("torchtune_ext/nf4/_codec.py", "torchtune_ext._compat.NF4Tensor", False),
        ("torchtune_ext/checkpoint/_random.py", "torchtune_ext.checkpoint._safetensors", False),
        ("torchtune_ext/modules/peft.py", "torchtune_ext.modules.low_precision._quantize_incoming_weight", False),
        ("torchtune_ext/training/_recipe.py", "torchtune_ext.modules.low_precision._quantize_incoming_weight", True),
        ("bench/memory.py", "torchtune_ext.training._recipe.RECIPE_ALLOWANCE", True),
        ("recipes/qlora_finetune_distributed.py", "torchtune_ext.training.QLoRARecipe", False),
    ],
)
def test_the_scan_tells_private_from_public(path, name, expected):
    assert _violation(ROOT / path, name) is expected


def test_get_full_state_dict_where_torchtune_users_look():
    """torchtune re-exports its distributed state-dict helpers from ``torchtune.training``; ours lives in
    ``torchtune_ext.distributed`` and is the same function under ``torchtune_ext.training``."""
    assert torchtune_ext.training.get_full_state_dict is torchtune_ext.distributed.get_full_state_dict
    assert "get_full_state_dict" in torchtune_ext.training.__all__

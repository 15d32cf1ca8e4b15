"""Public names where users look, and no reaching into another package's private modules.

A subpackage of ``torchtune_ext`` (``nf4``, ``distributed``, ``training``, ...) offers what others need through its
``__init__``; its ``_modules`` and ``_names`` are its own. The root package's private modules (``_compat``, the one
place for compatibility registrations, and ``_dtype``) serve every subpackage. Recipes and benchmarks use public
names only.
"""

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

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
    "_cache": 0,
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


def _upward(path: Path, name: str) -> bool:
    """Whether importing ``name`` from ``path`` imports a package of ours of the same layer or above."""
    top = name.split(".")[1] if name.startswith("torchtune_ext.") else None
    target = "cli" if top in CLI_MODULES else top
    unit = _unit(path)
    return target in LAYERS and target != unit and LAYERS[target] >= LAYERS[unit]


def test_imports_only_go_down_the_layers():
    upward = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _library_modules()
        for line, name in _imports(path)
        if _upward(path, name)
    ]
    assert upward == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> Dict[str, Set[str]]:
    """Each module of the library -> the modules of ours it imports (a name imported from a module is that module)."""
    modules = {_module_name(path): path for path in sorted((ROOT / "torchtune_ext").rglob("*.py"))}
    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for _, name in _imports(path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The import circles: each set of modules that reach each other (Tarjan's strongly connected components)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circle():
    assert _circles(_import_graph()) == []


@pytest.mark.parametrize(
    "path, name, expected",
    [
        ("torchtune_ext/config/_files.py", "torchtune_ext.data.TINY_SPLITS", True),
        ("torchtune_ext/config/_check.py", "torchtune_ext._dtype.parse_dtype", True),
        ("torchtune_ext/_dtype.py", "torchtune_ext.config.ConfigError", False),
        ("torchtune_ext/_dtype.py", "torchtune_ext._finite.check_finite", True),
        ("torchtune_ext/checkpoint/_hf.py", "torchtune_ext.models.qlora_builder", True),
        ("torchtune_ext/checkpoint/_hf.py", "torchtune_ext.checkpoint._phi3.FUSED", False),
        ("torchtune_ext/_validate.py", "torchtune_ext.training.QLoRARecipe", False),
        ("torchtune_ext/cli.py", "torchtune_ext._validate.validate", False),
        ("torchtune_ext/training/_setup.py", "torchtune_ext._validate.validate", True),
    ],
)
def test_the_layer_scan_tells_down_from_up(path, name, expected):
    assert _upward(ROOT / path, name) is expected


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

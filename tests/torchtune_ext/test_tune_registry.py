"""torchtune's own CLI knows our recipes and configs (``tune ls``, ``tune cp``, ``tune run <name>`` from any folder),
and every command is quiet: none of the start-up warnings nobody can act on (torchao's failed ``.so`` loads, torch's
``KernelPreference`` deprecation, torchdata's ``'set_vital' is deprecated``) reaches the output.

What ``tune ls`` and ``tune cp`` print and copy is checked with torchtune's CLI entry point in this process, as its
console script runs it (``conftest.run_main``). Quiet is a property of a fresh process: launched, with the inherited
environment (CI's wheel install runs these as installed: ``-m stack``), are ``tune run`` by name (the ``tune``
console script's start-up, the one ``tune ls`` and ``tune cp`` have, then a recipe run) and the same imports with the
hook (after ``tune-ext ls``, its console script's start-up) and without it.
"""

import logging
import os
import subprocess
import sys
from enum import Enum
from pathlib import Path
from typing import List

import pytest
import torch
from conftest import run_main

from torchtune_ext import _compat
from torchtune_ext._shipped import DISTRIBUTED_RECIPE, SINGLE_DEVICE_RECIPE, config_files, recipe_files, recipe_of

BIN = Path(sys.executable).parent
#: what the three warnings print (any part of any of them fails the test).
NOISE = ("Failed to load", "_C_", "KernelPreference", "register_constant", "set_vital", "Skipping import of cpp")

pytestmark = pytest.mark.stack


def _run(args: List[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def tune(monkeypatch, capfd):
    """``tune(*args, cwd=...)``: torchtune's ``tune <args>`` run in this process."""
    from torchtune._cli.tune import main

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        return run_main(main, ["tune", *args], monkeypatch, capfd, cwd=cwd)

    return run


def _assert_quiet(result: subprocess.CompletedProcess) -> None:
    output = result.stdout + result.stderr
    found = [noise for noise in NOISE if noise in output]
    assert not found, f"{found} in:\n{output[-4000:]}"


#: our recipes whose names torchtune's registry already holds (torchtune's keep them).
TORCHTUNE_NAMES = {"generate", "eleuther_eval"}


def test_registry_lists_our_recipes_and_configs():
    from torchtune._recipe_registry import get_all_recipes

    ours = {recipe.name: recipe for recipe in get_all_recipes() if recipe.name in recipe_files()}
    assert set(ours) == set(recipe_files())
    # torchtune's own `generate` keeps its name (docs/use-what-you-trained.md: ours runs by file or via tune-ext)
    assert {name for name, recipe in ours.items() if Path(recipe.file_path) != recipe_files()[name]} == TORCHTUNE_NAMES
    ours = {name: recipe for name, recipe in ours.items() if name not in TORCHTUNE_NAMES}
    for name, recipe in ours.items():
        assert Path(recipe.file_path) == recipe_files()[name]
        assert recipe.supports_distributed == (name == DISTRIBUTED_RECIPE)
        expected = {c: str(p) for c, p in config_files().items() if recipe_of(c) == name}
        assert {c.name: c.file_path for c in recipe.configs} == expected
    assert sum(recipe.name == SINGLE_DEVICE_RECIPE for recipe in get_all_recipes()) == 1  # registered once


def test_tune_run_resolves_a_shared_config_name_to_ours():
    """``llama3_2/1B_qlora_single_device`` is a torchtune config name too: ``tune run <our recipe>`` gets ours."""
    import argparse

    from torchtune._cli.run import Run

    run = Run(argparse.ArgumentParser().add_subparsers())
    recipe = run._get_recipe(SINGLE_DEVICE_RECIPE)
    name = "llama3_2/1B_qlora_single_device"
    assert Path(run._get_config(name, recipe).file_path) == config_files()[name]
    theirs = run._get_config(name, run._get_recipe("lora_finetune_single_device"))
    assert theirs.file_path == f"{name}.yaml"  # torchtune's own recipe keeps its own config


def test_tune_ls_lists_ours(tune, tmp_path):
    result = tune("ls", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()]
    recipe = None
    listed = {}
    for row in rows[1:]:
        if len(row) == 2:
            recipe = row[0]
        listed.setdefault(row[-1], set()).add(recipe)
    for name in config_files():
        if recipe_of(name) not in TORCHTUNE_NAMES:
            assert recipe_of(name) in listed[name], name
    assert "lora_finetune_single_device" in result.stdout  # torchtune's own are still there


def test_tune_cp_copies_our_recipe_and_config(tune, tmp_path):
    recipe = tune("cp", SINGLE_DEVICE_RECIPE, "my_recipe.py", cwd=tmp_path)
    assert recipe.returncode == 0, recipe.stderr[-3000:]
    assert (tmp_path / "my_recipe.py").read_text() == recipe_files()[SINGLE_DEVICE_RECIPE].read_text()
    config = tune("cp", "tiny/qlora_single_device", "my_config.yaml", cwd=tmp_path)
    assert config.returncode == 0, config.stderr[-3000:]
    assert (tmp_path / "my_config.yaml").read_text() == config_files()["tiny/qlora_single_device"].read_text()


@pytest.mark.integration_test
def test_tune_run_by_name_from_anywhere_is_quiet(tmp_path):
    """Quiet from the ``tune`` console script's start-up (``tune ls`` and ``tune cp`` start the same) to the end of a
    recipe run."""
    result = _run(
        [
            str(BIN / "tune"),
            "run",
            SINGLE_DEVICE_RECIPE,
            "--config",
            "tiny/qlora_single_device",
            f"output_dir={tmp_path / 'out'}",
            f"checkpointer.checkpoint_dir={tmp_path / 'base'}",
            "dataset.num_samples=32",
            "max_steps_per_epoch=2",
            "run_val_every_n_steps=null",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Done." in result.stdout
    assert (tmp_path / "out" / "step_2" / "adapter").is_dir()
    _assert_quiet(result)


def test_the_filters_remove_the_warnings_that_appear_without_them(tmp_path):
    """The same imports and data loader with the hook (quiet) and without it: whatever the unhooked process prints
    of the three warnings (all three where torchao's prebuilt kernels do not load, as on this CPU build), the hooked
    one does not. The hooked one starts as the ``tune-ext`` console script does: ``tune-ext ls`` first."""
    script = (
        "import sys\n"
        "if sys.argv[1] == 'off':\n"
        "    sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                        if type(f).__name__ not in ('_StartupFinder', '_CompatFinder')]\n"
        "else:\n"
        "    from torchtune_ext.cli import main\n"
        "    main(['ls'])\n"
        "import torchao, torchao.quantization\n"
        "from torchdata.stateful_dataloader import StatefulDataLoader\n"
        "StatefulDataLoader([1, 2])\n"
    )
    off = _run([sys.executable, "-c", script, "off"], tmp_path)
    on = _run([sys.executable, "-c", script, "on"], tmp_path)
    assert off.returncode == 0 and on.returncode == 0, off.stderr[-3000:] + on.stderr[-3000:]
    if torch.__version__ >= "2.13":  # from 2.13 torch warns on every StatefulDataLoader (2.11 does not)
        assert "set_vital" in off.stderr
    assert "tiny/qlora_single_device" in on.stdout  # tune-ext ls listed
    _assert_quiet(on)


def _record(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


class _OurEnum(Enum):
    A = 1


def test_the_log_filters_are_narrow():
    so = _compat._torchao_so_load_failure
    assert so(_record("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library"))
    assert so(_record("torchao", "Skipping import of cpp extensions due to incompatible torch version."))
    assert not so(_record("torchao", "Failed to load the checkpoint"))
    assert not so(_record("torchao", "some other torchao warning"))
    enum = _compat._torchao_enum_constant
    torchao_enum = Enum("KernelPreference", {"AUTO": 1}, module="torchao.quantization.x")
    message = "%s is an Enum subclass and is now natively supported by torch.compile"
    assert enum(_record("torch.utils._pytree", message, torchao_enum))
    assert not enum(_record("torch.utils._pytree", message, _OurEnum))

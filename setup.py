"""What pyproject.toml cannot say: the start-up hook file, and the recipes/configs that ship inside the package.

- ``torchtune_ext_compat.pth`` and the module it imports, ``_torchtune_ext_startup`` (a copy of
  ``torchtune_ext/_compat/_startup.py``), go into site-packages, in wheels and in editable installs alike; at
  interpreter start-up they put a finder on ``sys.meta_path`` that imports nothing until the first import of
  torchtune, torchao or ``recipes``, then installs the import hook of ``torchtune_ext._compat`` (``_startup.py``'s
  docstring says why a ``.pth``, and why it does not import the package at start-up).
- ``recipes/`` and ``configs/`` (torchtune's layout, at the repo root) are installed as ``torchtune_ext.recipes``
  and ``torchtune_ext.configs``, so ``tune-ext run/ls/cp`` find them after a plain ``pip install``.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH_NAME = "torchtune_ext_compat.pth"
STARTUP_SOURCE = Path("torchtune_ext") / "_compat" / "_startup.py"
STARTUP_MODULE = "_torchtune_ext_startup"
# One line that site executes at start-up; silent if the module is gone (a stale .pth must not break Python).
PTH_LINE = (
    f"import sys; exec('try:\\n import {STARTUP_MODULE} as m\\nexcept ImportError:\\n m = None\\n"
    "if m is not None:\\n m.install()')\n"
)


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the ``.pth`` and the start-up module at the root of what becomes
    site-packages."""

    def run(self) -> None:
        super().run()
        # Editable installs (PEP 660) put the wheel's root in install_lib; regular builds in build_lib.
        root = Path(self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib)
        root.mkdir(parents=True, exist_ok=True)
        (root / PTH_NAME).write_text(PTH_LINE)
        (root / f"{STARTUP_MODULE}.py").write_text(STARTUP_SOURCE.read_text())

    def get_outputs(self, include_bytecode: bool = True) -> list:
        root = Path(self.build_lib)
        return [*super().get_outputs(include_bytecode), str(root / PTH_NAME), str(root / f"{STARTUP_MODULE}.py")]


setup(
    packages=[
        *find_packages(include=["torchtune_ext", "torchtune_ext.*"]),
        "torchtune_ext.assets",  # data only (the tiny tokenizer)
        "torchtune_ext.recipes",
        "torchtune_ext.configs",
    ],
    package_dir={"torchtune_ext.recipes": "recipes", "torchtune_ext.configs": "configs"},
    package_data={
        "torchtune_ext.assets": ["*"],
        "torchtune_ext.nf4": ["*.c"],
        "torchtune_ext.configs": ["**/*.yaml"],
    },
    cmdclass={"build_py": BuildPyWithPth},
)

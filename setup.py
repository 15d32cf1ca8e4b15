"""What pyproject.toml cannot say: the start-up hook file, and the recipes/configs that ship inside the package.

- ``torchtune_ext_compat.pth`` goes into site-packages, in wheels and in editable installs alike; at interpreter
  start-up it installs the import hook of ``torchtune_ext/_compat.py`` (its docstring says why a ``.pth``).
- ``recipes/`` and ``configs/`` (torchtune's layout, at the repo root) are installed as ``torchtune_ext.recipes``
  and ``torchtune_ext.configs``, so ``tune-ext run/ls/cp`` find them after a plain ``pip install``.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH_NAME = "torchtune_ext_compat.pth"
# One line that site executes at start-up; silent if the package is gone (a stale .pth must not break Python).
PTH_LINE = (
    "import sys; exec('try:\\n import torchtune_ext._compat as m\\nexcept ImportError:\\n m = None\\n"
    "if m is not None:\\n m.install_import_hook()')\n"
)


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the ``.pth`` at the root of what becomes site-packages."""

    def run(self) -> None:
        super().run()
        # Editable installs (PEP 660) put the wheel's root in install_lib; regular builds in build_lib.
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH_NAME)]


setup(
    packages=[
        *find_packages(include=["torchtune_ext", "torchtune_ext.*"]),
        "torchtune_ext.assets",  # data only (the tiny tokenizer)
        "torchtune_ext.recipes",
        "torchtune_ext.configs",
    ],
    package_dir={"torchtune_ext.recipes": "recipes", "torchtune_ext.configs": "configs"},
    package_data={"torchtune_ext.assets": ["*"], "torchtune_ext.configs": ["**/*.yaml"]},
    cmdclass={"build_py": BuildPyWithPth},
)

"""A second checkout tests its own code: a python started in it imports its torchtune_ext, not the installed one.

Checkout A is installed editable (as ``make install`` installs /work/main) into a fresh environment that borrows
this one's packages; checkout B is a copy beside it. The start-up hook (``torchtune_ext_compat.pth``) must not
import the package before the working folder is on ``sys.path`` (``torchtune_ext/_compat/_startup.py``).
"""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: what an install of a checkout reads.
CHECKOUT_FILES = ("torchtune_ext", "recipes", "configs", "setup.py", "pyproject.toml", "README.md")

pytestmark = pytest.mark.integration_test


def _copy_checkout(dst: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in CHECKOUT_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        else:
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


def _run(args, cwd: Path) -> str:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory):
    """(python of an environment where checkout A is installed editable, A, B)."""
    tmp = tmp_path_factory.mktemp("checkouts")
    a, b = _copy_checkout(tmp / "a"), _copy_checkout(tmp / "b")
    env = tmp / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], tmp)
    python = env / "bin" / "python"
    site_packages = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp))
    # This environment's packages as a plain path entry: its own .pth files (our installed hook) do not run there.
    (Path(str(site_packages).strip()) / "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = ["install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(a)]
    _run([str(python), "-m", "pip", *install], a)
    return python, a, b


def _imported_from(python: Path, cwd: Path, code: str = "import torchtune_ext") -> Path:
    out = _run([str(python), "-c", f"{code}; import torchtune_ext; print(torchtune_ext.__file__)"], cwd)
    return Path(out.strip().splitlines()[-1])


def test_start_up_imports_nothing(checkouts, tmp_path):
    python, _, _ = checkouts
    code = "import sys; print(type(sys.meta_path[0]).__name__, 'torch' in sys.modules, 'torchtune_ext' in sys.modules)"
    assert _run([str(python), "-c", code], tmp_path).split() == ["_StartupFinder", "False", "False"]


def test_the_installed_checkout_is_imported_elsewhere(checkouts, tmp_path):
    python, a, _ = checkouts
    assert _imported_from(python, tmp_path) == a / "torchtune_ext" / "__init__.py"


def test_a_second_checkout_imports_its_own_package(checkouts):
    python, _, b = checkouts
    assert _imported_from(python, b) == b / "torchtune_ext" / "__init__.py"


def test_a_second_checkout_applies_its_own_compat_hook(checkouts):
    """torchtune imported first (as ``tune run`` does): the hook installed at start-up hands over to B's code."""
    python, _, b = checkouts
    code = "import torchtune, torchtune_ext._compat as c; print(c.__file__)"
    assert Path(_run([str(python), "-c", code], b).strip()) == b / "torchtune_ext" / "_compat" / "__init__.py"


def test_a_second_checkout_ships_its_own_recipes_and_configs(checkouts):
    """``torchtune_ext.recipes`` / ``.configs`` (what ``tune-ext ls/run`` read) are B's folders, not A's."""
    python, _, b = checkouts
    code = (
        "from torchtune_ext._shipped import config_files, recipe_files\n"
        "print(recipe_files()['qlora_finetune_single_device']); print(config_files()['tiny/qlora_single_device'])"
    )
    recipe, config = _run([str(python), "-c", code], b).split()
    assert (Path(recipe), Path(config)) == (
        b / "recipes" / "qlora_finetune_single_device.py",
        b / "configs" / "tiny" / "qlora_single_device.yaml",
    )


def test_pytest_in_a_second_checkout_tests_its_own_code(checkouts):
    python, _, b = checkouts
    test = b / "tests" / "test_which_checkout.py"
    test.parent.mkdir()
    test.write_text(
        "from pathlib import Path\n\nimport torchtune_ext\n\n\n"
        "def test_imports_this_checkout():\n"
        f"    assert Path(torchtune_ext.__file__) == Path({str(b)!r}) / 'torchtune_ext' / '__init__.py'\n"
    )
    out = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], b)
    assert "1 passed" in out, out


def test_the_pytest_command_in_the_installed_checkout_collects_its_tests():
    """The console script ``pytest`` (not ``python -m pytest``: no working folder on ``sys.path``, only ``tests/``,
    which holds a ``torchtune_ext`` folder of its own) imports the installed package (tests/conftest.py)."""
    pytest_script = Path(sys.executable).parent / "pytest"
    test_file = "tests/torchtune_ext/checkpoint/test_lock.py"
    out = _run([str(pytest_script), "--collect-only", "-q", "-p", "no:cacheprovider", test_file], ROOT)  # rc 0
    assert "tests collected" in out, out

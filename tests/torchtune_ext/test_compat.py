"""The compat hook (``torchtune_ext/_compat/``) in fresh interpreters, started the ways users start us.

The cases run in new ``python`` processes of this environment, so the start-up ``.pth`` hook runs as it does for
``tune``, torchrun workers or a notebook, and nothing this test process imported can help. One interpreter serves
the cases that need torchtune, torchao or ours imported first: it checks the start-up state, imports what they all
import from torch and Hugging Face (as a notebook may first; the hook acts on none of it), checks that none of
torchtune, torchao and ours came with it, then forks a child per case, in which that case's import is the first of
those (the shared imports once instead of once per case: they are most of a launch's seconds).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.stack


def _python(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


#: the first import of each import-order case: torchtune's own imports of the names torchao moved or dropped
#: (modules/common_utils.py, training/*); torchao 0.18 moved torchao.dtypes.nf4tensor, which the compat finder gives
#: under the old name in any import order.
FIRSTS = [
    "import torchtune",
    "import torchtune_ext.modules",
    "import torchtune.training.quantization",
    "import torchao.dtypes.nf4tensor",  # torchtune's tests' path, before anything of torchtune or ours
    "from torchao.dtypes import nf4tensor",
]
IMPORT_ORDER = (
    "{first}\n"
    "import torchtune, torchtune.training.quantization\n"
    "from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4\n"
    "from torchao.quantization import int4_weight_only, int8_dynamic_activation_int4_weight\n"
    "from torchao.dtypes import TensorCoreTiledLayout\n"
    "from torchtune_ext.nf4 import NF4Tensor as ours\n"
    "assert ours is NF4Tensor\n"
    "print('ok')\n"
)
#: torch >= 2.11 wraps functional-collective outputs (FSDP2's all-gather of NF4 shards) with this op.
WRAP_TENSOR_AUTOGRAD = (
    "import torch, torchtune_ext\n"
    "from torchtune_ext import _compat\n"
    "nf4 = _compat._nf4_module()\n"
    "_compat.apply()\n"
    "op = getattr(torch.ops._c10d_functional, '_wrap_tensor_autograd', None)\n"
    "print(op is None or nf4.NF4_OPS_TABLE[op.default].__module__ == 'torchtune_ext._compat._nf4_ops')\n"
)
REMOVED_NAMES = (
    "import torchtune\n"
    "from torchao.quantization import int8_dynamic_activation_int4_weight as f\n"
    "try:\n"
    "    f(32)\n"
    "    print('no error')\n"
    "except NotImplementedError as err:\n"
    "    print('removed' if 'removed' in str(err) else err)\n"
    "except Exception as err:\n"
    "    print('native', type(err).__name__)\n"
)
#: ``tune run recipes/x.py`` imports ``recipes.x``; torchtune's placeholder ``recipes`` package would win.
RECIPES = "import recipes.qlora_finetune_single_device as r; print(r.__file__)"
CASES = {
    **{first: IMPORT_ORDER.format(first=first) for first in FIRSTS},
    "wrap_tensor_autograd": WRAP_TENSOR_AUTOGRAD,
    "removed_names": REMOVED_NAMES,
    "recipes": RECIPES,
}

#: the interpreter of the cases (``sys.argv[1]``: ``CASES`` as JSON): one JSON line of the start-up state, one after
#: the shared imports, then per case, in a child forked from it: ``[case, exit code, what it printed]``.
FORK_PER_CASE = """
import contextlib, io, json, os, sys, traceback
FIRST = ("torch", "torchtune", "torchao", "torchtune_ext", "recipes")
def loaded():
    return sorted(name for name in FIRST if name in sys.modules)
print(json.dumps(["start", type(sys.meta_path[0]).__name__, loaded()]))
import torch, torch._dynamo, datasets
print(json.dumps(["shared", loaded()]), flush=True)
for case, code in json.loads(sys.argv[1]).items():
    printed = io.StringIO()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, case, "exec"), {"__name__": "__main__"})
        except BaseException:
            printed.write(traceback.format_exc())
            status = 1
        print(json.dumps([case, status, printed.getvalue()]), flush=True)
        os._exit(status)
    os.waitpid(pid, 0)
"""


@pytest.fixture(scope="module")
def forked() -> Dict[str, list]:
    """What the interpreter of the cases printed: ``start`` and ``shared`` (the modules of ``FIRST`` loaded then), and
    per case its exit code and output."""
    result = _python(FORK_PER_CASE, json.dumps(CASES))
    lines = [json.loads(line) for line in _ok(result).splitlines()]
    return {line[0]: line[1:] for line in lines}


def _case(forked: Dict[str, list], case: str) -> str:
    assert case in forked, f"{case}: the child printed nothing"
    code, printed = forked[case]
    assert code == 0, printed[-4000:]
    return printed


def test_start_up_installs_a_finder_and_imports_nothing(forked):
    """The start-up hook imports neither torch nor torchtune_ext (a second checkout imports its own later); the shared
    imports bring none of torchtune, torchao and ours, so each case's first import of those is the process's first."""
    assert forked["start"] == ["_StartupFinder", []]
    assert forked["shared"] == [["torch"]]


@pytest.mark.parametrize("first", FIRSTS)
def test_torchtune_imports_whichever_comes_first(forked, first):
    assert _case(forked, first).strip() == "ok"


def test_nf4_handles_wrap_tensor_autograd(forked):
    assert _case(forked, "wrap_tensor_autograd").strip() == "True"


def test_removed_names_fail_only_when_used(forked):
    out = _case(forked, "removed_names").strip()
    # torchao 0.15 still has the real function (it returns a config); later releases get our stand-in.
    assert out in ("no error", "removed"), out


def test_recipes_resolve_to_the_working_folder(forked):
    assert Path(_case(forked, "recipes").strip()) == ROOT / "recipes" / "qlora_finetune_single_device.py"


def test_recipes_outside_a_clone_name_the_fix(tmp_path):
    result = _python("import recipes", cwd=tmp_path)
    assert result.returncode != 0
    assert "tune-ext run" in result.stderr and "has no recipes" in result.stderr, result.stderr[-2000:]

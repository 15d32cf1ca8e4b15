"""The compat hook (``torchtune_ext/_compat/``) in fresh interpreters, started the ways users start us.

Each case runs a new ``python`` of this environment, so the start-up ``.pth`` hook runs as it does for ``tune``,
torchrun workers or a notebook, and nothing this test process imported can help.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.stack


def _python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_start_up_installs_a_finder_and_imports_nothing():
    """The start-up hook imports neither torch nor torchtune_ext (a second checkout imports its own later)."""
    code = "import sys; print(type(sys.meta_path[0]).__name__, 'torch' in sys.modules, 'torchtune_ext' in sys.modules)"
    assert _ok(_python(code)).split() == ["_StartupFinder", "False", "False"]


@pytest.mark.parametrize(
    "first",
    [
        "import torchtune",
        "import torchtune_ext.modules",
        "import torchtune.training.quantization",
        "import torchao.dtypes.nf4tensor",  # torchtune's tests' path, before anything of torchtune or ours
        "from torchao.dtypes import nf4tensor",
    ],
)
def test_torchtune_imports_whichever_comes_first(first):
    # torchtune's own imports of the names torchao moved or dropped (modules/common_utils.py, training/*); torchao
    # 0.18 moved torchao.dtypes.nf4tensor, which the compat finder gives under the old name in any import order.
    code = (
        f"{first}\n"
        "import torchtune, torchtune.training.quantization\n"
        "from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4\n"
        "from torchao.quantization import int4_weight_only, int8_dynamic_activation_int4_weight\n"
        "from torchao.dtypes import TensorCoreTiledLayout\n"
        "from torchtune_ext.nf4 import NF4Tensor as ours\n"
        "assert ours is NF4Tensor\n"
        "print('ok')\n"
    )
    assert _ok(_python(code)).strip() == "ok"


def test_nf4_handles_wrap_tensor_autograd():
    """torch >= 2.11 wraps functional-collective outputs (FSDP2's all-gather of NF4 shards) with this op."""
    code = (
        "import torch, torchtune_ext\n"
        "from torchtune_ext import _compat\n"
        "nf4 = _compat._nf4_module()\n"
        "_compat.apply()\n"
        "op = getattr(torch.ops._c10d_functional, '_wrap_tensor_autograd', None)\n"
        "print(op is None or nf4.NF4_OPS_TABLE[op.default].__module__ == 'torchtune_ext._compat._nf4_ops')\n"
    )
    assert _ok(_python(code)).strip() == "True"


def test_removed_names_fail_only_when_used():
    code = (
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
    out = _ok(_python(code)).strip()
    # torchao 0.15 still has the real function (it returns a config); later releases get our stand-in.
    assert out in ("no error", "removed"), out


def test_recipes_resolve_to_the_working_folder():
    """``tune run recipes/x.py`` imports ``recipes.x``; torchtune's placeholder ``recipes`` package would win."""
    out = _ok(_python("import recipes.qlora_finetune_single_device as r; print(r.__file__)"))
    assert Path(out.strip()) == ROOT / "recipes" / "qlora_finetune_single_device.py"


def test_recipes_outside_a_clone_name_the_fix(tmp_path):
    result = _python("import recipes", cwd=tmp_path)
    assert result.returncode != 0
    assert "tune-ext run" in result.stderr and "has no recipes" in result.stderr, result.stderr[-2000:]

"""The interop virtual environment (torch + transformers + peft + safetensors, no torchao) and a runner for
``_hf_side.py`` inside it.

peft 0.21 refuses the torchao 0.15 that torchtune 0.6.1 needs, so the HF side cannot live in the project's venv:
it runs in ``.venv-interop`` at the repo root, created on first use (about 2 minutes) and reused while it imports
what the HF side needs and has no torchao; one that does not (e.g. an interrupted creation) is rebuilt.
``TORCHTUNE_EXT_INTEROP_PYTHON=/path/to/python`` uses an existing interpreter instead (it must pass the same check).

This is a plain module, not a ``conftest.py``: a second ``conftest`` module would shadow ``tests/conftest.py``
for ``from conftest import ...`` in other test folders.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-interop"
HF_SIDE = Path(__file__).resolve().parent / "_hf_side.py"
ENV_OVERRIDE = "TORCHTUNE_EXT_INTEROP_PYTHON"
# torch first, pinned: it is the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH_REQUIREMENT = "torch==2.13.0"
HF_REQUIREMENTS = ("transformers", "peft", "safetensors")
PIP_TIMEOUT_S = 1800
HF_SIDE_TIMEOUT_S = 300

_PROBE = (
    "import importlib.util, json, sys\n"
    "if importlib.util.find_spec('torchao') is not None:\n"
    "    sys.exit('torchao is installed here; peft refuses the torchao version torchtune needs')\n"
    "import peft, safetensors, torch, transformers\n"
    "from peft import PeftModel, get_peft_model_state_dict\n"
    "from transformers import AutoModelForCausalLM\n"
    "print(json.dumps({m.__name__: m.__version__ for m in (torch, transformers, peft, safetensors)}))\n"
)


def _probe(python: Path) -> Tuple[bool, str]:
    """Whether ``python`` imports torch/transformers/peft/safetensors without torchao; its versions or the error."""
    if not python.is_file():
        return False, f"{python} does not exist"
    result = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=300)
    return result.returncode == 0, (result.stdout.strip() or result.stderr.strip()[-2000:])


def _run(cmd: List[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(
            f"Creating {VENV} failed at `{' '.join(cmd)}` (rc {result.returncode}):\n{result.stdout[-2000:]}\n"
            f"{result.stderr[-4000:]}\nFix the cause (network access to PyPI?), or point {ENV_OVERRIDE} at a python "
            f"with {TORCH_REQUIREMENT} and {', '.join(HF_REQUIREMENTS)} but without torchao."
        )


def _create_venv() -> None:
    if VENV.exists():
        shutil.rmtree(VENV)  # unusable: an interrupted creation, or torchao / a package missing
    _run([sys.executable, "-m", "venv", str(VENV)])
    python = VENV / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", TORCH_REQUIREMENT])
    _run([str(python), "-m", "pip", "install", "--quiet", TORCH_REQUIREMENT, *HF_REQUIREMENTS])


def ensure_interop_python() -> Path:
    """The interop venv's python: ``TORCHTUNE_EXT_INTEROP_PYTHON``, else ``.venv-interop`` (created if needed).

    Returns:
        Path: a python that imports torch, transformers, peft and safetensors, and has no torchao.

    Raises:
        RuntimeError: if the override is unusable or creating the venv fails, with pip's output.
    """
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        ok, detail = _probe(Path(override))
        if not ok:
            raise RuntimeError(f"{ENV_OVERRIDE}={override} is not usable for the interop tests: {detail}")
        return Path(override)
    python = VENV / "bin" / "python"
    if _probe(python)[0]:
        return python
    _create_venv()
    ok, detail = _probe(python)
    if not ok:
        raise RuntimeError(f"{VENV} was created but is not usable: {detail}")
    return python


def hf_logits(
    python: Path, input_ids: torch.Tensor, runs: List[Dict[str, Any]], workdir: Path
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Runs ``_hf_side.py`` in the interop venv: transformers (and peft) load the given folders, give logits.

    Args:
        python (Path): the interop venv's python.
        input_ids (torch.Tensor): token ids, shape ``(batch, seq)``.
        runs (List[Dict[str, Any]]): ``{"name", "model", "adapter"}`` per model; see ``_hf_side.py``.
        workdir (Path): where the spec, logits and report files go.

    Returns:
        Tuple[Dict[str, torch.Tensor], Dict[str, Any]]: fp32 logits and the loading report, by run name.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec, out, report = workdir / "hf_spec.json", workdir / "hf_logits.safetensors", workdir / "hf_report.json"
    spec.write_text(json.dumps({"input_ids": input_ids.tolist(), "runs": runs}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("PYTHONPATH", None)  # nothing of this project (or torchtune) may leak into the HF side
    result = subprocess.run(
        [str(python), str(HF_SIDE), str(spec), str(out), str(report)],
        capture_output=True,
        text=True,
        timeout=HF_SIDE_TIMEOUT_S,
        env=env,
        cwd=workdir,
    )
    assert result.returncode == 0, f"the HF side failed (rc {result.returncode}):\n{result.stderr[-6000:]}"
    return load_file(str(out)), json.loads(report.read_text())

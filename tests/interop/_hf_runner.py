"""Runs ``_hf_side.py`` (transformers + peft loading our folders) in a fresh process of this same environment.

Our outputs must load in the environment users train in (torchtune_ext, torchao, peft and transformers side by
side), so the HF side runs with this venv's python; a separate process keeps what transformers and peft import
apart from what the test imported (torchtune, our modules), so nothing of ours can make their loading pass.

This is a plain module, not a ``conftest.py``: a second ``conftest`` module would shadow ``tests/conftest.py``
for ``from conftest import ...`` in other test folders.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
HF_SIDE = Path(__file__).resolve().parent / "_hf_side.py"
HF_SIDE_TIMEOUT_S = 300


def hf_logits(
    input_ids: torch.Tensor, runs: List[Dict[str, Any]], workdir: Path
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Runs ``_hf_side.py``: transformers (and peft) load the given folders and give logits.

    Args:
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
    env.pop("PYTHONPATH", None)  # the HF side sees the installed environment only
    result = subprocess.run(
        [sys.executable, str(HF_SIDE), str(spec), str(out), str(report)],
        capture_output=True,
        text=True,
        timeout=HF_SIDE_TIMEOUT_S,
        env=env,
        cwd=workdir,
    )
    assert result.returncode == 0, f"the HF side failed (rc {result.returncode}):\n{result.stderr[-6000:]}"
    return load_file(str(out)), json.loads(report.read_text())

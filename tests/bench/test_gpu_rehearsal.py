"""``bench/gpu.sh``, the one prepared run on a lent GPU machine, rehearsed on the CPU: its budget, its summary of
failed steps, the rehearsal's target (only the lent machine's packages), and the whole run at tiny sizes."""

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_SH = REPO / "bench" / "gpu.sh"


def _rehearsal():
    spec = importlib.util.spec_from_file_location("gpu_rehearsal", REPO / "bench" / "gpu_rehearsal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step_limits() -> dict:
    """Each step of gpu.sh with its time limit (``step NAME LIMIT ...`` and ``tune_run NAME LIMIT ...``)."""
    text = GPU_SH.read_text()
    limits = {}
    for name, limit in re.findall(r'^\s*(?:step|tune_run) "?([\w$]+)"? (\d+) ', text, flags=re.M):
        names = [name.replace("$dtype", d) for d in ("fp16", "fp32")] if "$dtype" in name else [name]
        limits.update({n: int(limit) for n in names})
    return limits


def test_step_limits_fit_the_budget():
    budget = int(re.search(r"BUDGET=\$\{BUDGET:-(\d+)\}", GPU_SH.read_text()).group(1))
    limits = _step_limits()
    assert len(limits) == 13, limits
    assert sum(limits.values()) <= budget <= 8 * 60 - 20, (sum(limits.values()), budget)


def test_lent_site_links_the_lent_packages_and_their_needs_but_not_the_wheelhouse(tmp_path):
    rehearsal = _rehearsal()
    listed, besides = rehearsal.lent_site(tmp_path / "site", ["torch", "torchtune", "omegaconf", "pyyaml"])
    assert listed == ["pyyaml", "torch"]
    assert {"filelock", "sympy", "jinja2"} <= set(besides)
    assert not {"torchtune", "omegaconf", "torchao", "torchtune-ext"} & set(besides)
    names = {p.name for p in (tmp_path / "site").iterdir()}
    assert {"torch", "yaml", "sympy"} <= names
    assert not {"torchtune", "omegaconf", "torchao", "torchtune_ext"} & names


@pytest.mark.integration_test
def test_a_failed_step_and_its_last_lines_reach_the_summary(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'first line'\necho 'ImportError: the reason' >&2\nexit 3\n")
    python.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": str(python), "LOGS": str(tmp_path / "logs")}
    env.update(WHEELS=str(tmp_path / "no_wheels"), CACHE=str(tmp_path / "cache"))
    subprocess.run(["bash", str(GPU_SH)], env=env, check=False, capture_output=True, timeout=60)
    summary = (tmp_path / "out" / "gpu_bench.txt").read_text()
    tail = summary[summary.index("SUMMARY") :]
    assert "FAILED   imports (rc=3" in tail
    assert "--- last lines of imports:" in tail and "ImportError: the reason" in tail
    assert "0 ok or skipped, 1 failed" in tail


@pytest.mark.integration_test
@pytest.mark.slow
def test_gpu_sh_runs_end_to_end_in_a_lent_machine_like_target(tmp_path):
    """The wheelhouse (bench/gpu_wheels.sh) installed without a registry into a Python that has only the lent
    machine's packages, then every step of bench/gpu.sh at tiny sizes on the CPU."""
    not_ok = _rehearsal().rehearse(tmp_path / "rehearsal", limit_scale=6, budget=2700)
    summary = (tmp_path / "rehearsal" / "out" / "gpu_bench.txt").read_text()
    tail = summary[summary.index("SUMMARY") :]
    ok = re.findall(r"^ok +(\w+) ", tail, flags=re.M)
    assert not_ok == 0, tail
    assert sorted(ok) == sorted(_step_limits()), tail
    assert f"torchtune_ext from {tmp_path / 'rehearsal' / 'site'}" in summary

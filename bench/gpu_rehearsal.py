"""Rehearses ``bench/gpu.sh`` on this CPU exactly as it runs on the lent GPU machine, at tiny sizes.

What it copies from that machine:

- the Python: a fresh ``python -m venv`` (no system site-packages) whose only packages are those the lent machine's
  image has (:data:`LENT_MACHINE_PACKAGES`, the device tool's list), linked from the environment of the Python that
  runs this script. From ``.venv`` that is torch 2.13 (CPU): run it with a Python whose environment holds torch
  2.11 (PyPI's CUDA build imports on a CPU-only machine with its nvidia-* packages) to rehearse the lent machine's
  torch too, as version-only breakages (a private torch name that 2.11 lacks) pass with 2.13;
- the tree: only what the device call carries (``git ls-files --cached --others --exclude-standard``: tracked files
  and untracked files git does not ignore; no ``outputs/``, no ``.venv``), plus the wheelhouse;
- the wheelhouse: ``bench/gpu_wheels.sh`` for this Python, installed by ``bench/gpu.sh`` itself with
  ``pip install --no-index --find-links gpu_wheels --no-deps --target`` (no registry);
- the run: ``bench/gpu.sh`` with ``SIZE=tiny DEVICE=cpu`` (every step, the same order and scripts, tiny shapes) and
  the step limits times ``--limit-scale``.

It prints the summary file (``gpu_bench.txt``) and exits non-zero if any step failed or was skipped, or the summary
is missing. Run::

    python bench/gpu_rehearsal.py [--work /tmp/gpu_rehearsal] [--limit-scale 4]
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]

#: The Python packages of the lent machine's image ("cuda", as the device tool's KINDS.md lists them, 2026-11-17);
#: the CUDA-only ones (nvidia-*, cupy, jax's plugins) cannot run here and nothing of ours imports them.
LENT_MACHINE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split()


#: What bench/gpu_wheels.sh carries (and this project): the rehearsal's target must get them from the wheelhouse.
WHEELHOUSE = {
    "torchtune",
    "torchao",
    "omegaconf",
    "antlr4-python3-runtime",
    "torchdata",
    "datasets",
    "dill",
    "multiprocess",
    "kagglehub",
    "kagglesdk",
    "blobfile",
    "pycryptodomex",
    "gguf",
    "torchtune-ext",
}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: metadata.Distribution) -> List[str]:
    """The names of what ``dist`` needs installed (its requirements without extras, for this platform)."""
    from packaging.requirements import Requirement

    names = []
    for line in dist.requires or ():
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            names.append(_canonical(requirement.name))
    return names


def lent_site(dest: Path, packages: Iterable[str] = LENT_MACHINE_PACKAGES) -> Tuple[List[str], List[str]]:
    """Links into ``dest`` the top-level modules and metadata of every distribution of the running environment that
    the lent machine also has, and of what those need here (this environment's versions can need packages the lent
    machine's do not), but never anything of ``bench/gpu_wheels.sh``'s wheelhouse or this project.

    Args:
        dest (Path): an empty folder (added to the rehearsal's ``sys.path`` by a ``.pth`` file).
        packages (Iterable[str]): the lent machine's distributions.

    Returns:
        Tuple[List[str], List[str]]: the lent machine's distributions linked, and the requirements linked besides.
    """
    installed = {_canonical(d.metadata["Name"] or ""): d for d in metadata.distributions()}
    listed = {_canonical(name) for name in packages}
    todo, linked = sorted(listed & installed.keys()), set()
    while todo:
        name = todo.pop()
        if name in linked or name in WHEELHOUSE or name not in installed:
            continue
        linked.add(name)
        todo.extend(_requirements(installed[name]))
    dest.mkdir(parents=True)
    for name in sorted(linked):
        dist = installed[name]
        for top in {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (dest / top).exists() and not top.endswith(".pth"):
                (dest / top).symlink_to(source)
    return sorted(linked & listed), sorted(linked - listed)


def _copy_tree(dest: Path, commit: Optional[str]) -> None:
    """Copies what a device call carries: tracked files and untracked ones git does not ignore; or, with ``commit``,
    that commit's files (a consistent tree while others edit the working one)."""
    dest.mkdir(parents=True)
    archive = dest.parent / "tree.tar"
    if commit:
        subprocess.run(["git", "archive", "-o", str(archive), commit], cwd=ROOT, check=True)
    else:
        files = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.split(b"\0")
        with tarfile.open(archive, "w") as tar:
            for name in filter(None, files):
                if (ROOT / name.decode()).is_file():
                    tar.add(ROOT / name.decode(), arcname=name.decode())
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="tar")
    archive.unlink()


def _lent_python(work: Path) -> Path:
    """A venv without system site-packages whose ``site-packages`` sees only the lent machine's packages."""
    venv = work / "lent_venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    linked, besides = lent_site(work / "lent_site")
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "lent_machine.pth").write_text(f"{work / 'lent_site'}\n")
    print(f"lent-machine Python: {venv} with {len(linked)} of its packages: {' '.join(linked)}", flush=True)
    print(f"and what this environment's versions of them need besides: {' '.join(besides)}", flush=True)
    return venv


def rehearse(work: Path, limit_scale: int, budget: int, commit: Optional[str] = None) -> int:
    """Builds the target and runs ``bench/gpu.sh`` in it; returns the number of steps not ``ok``.

    Args:
        work (Path): a new folder for everything the rehearsal writes.
        limit_scale (int): the steps' time limits times this (a loaded 2-core CPU is slower than the GPU machine).
        budget (int): the run's budget in seconds (``bench/gpu.sh``'s ``BUDGET``).
        commit (Optional[str]): rehearse this commit's files instead of the working tree's.

    Returns:
        int: failed or skipped steps (0: the run would go through).
    """
    if work.exists():
        shutil.rmtree(work)
    tree = work / "tree"
    _copy_tree(tree, commit)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels_env = {**os.environ, "DEST": str(tree / "gpu_wheels"), "PYTHON_VERSION": version, "PY": sys.executable}
    subprocess.run(["bash", str(tree / "bench" / "gpu_wheels.sh")], env=wheels_env, check=True)
    venv = _lent_python(work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        OUT=str(work / "out"),
        SIZE="tiny",
        DEVICE="cpu",
        BUDGET=str(budget),
        LIMIT_SCALE=str(limit_scale),
        SITE=str(work / "site"),
        CACHE=str(work / "cache"),
        LOGS=str(work / "logs"),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    subprocess.run(["bash", "bench/gpu.sh"], cwd=tree, env=env, check=False, stdout=subprocess.DEVNULL)
    summary = (work / "out" / "gpu_bench.txt").read_text()
    tail = summary[summary.index("=================== SUMMARY") :] if "SUMMARY" in summary else summary[-4000:]
    print(tail)
    if "SUMMARY" not in summary:
        return 1
    return sum(1 for line in tail.splitlines() if line.startswith(("FAILED", "SKIPPED")))


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/gpu_rehearsal", help="a folder for everything it writes (replaced)")
    parser.add_argument("--limit-scale", type=int, default=4)
    parser.add_argument("--budget", type=int, default=1800)
    parser.add_argument("--commit", default=None, help="rehearse this commit's files (default: the working tree)")
    args = parser.parse_args()
    sys.exit(1 if rehearse(Path(args.work), args.limit_scale, args.budget, args.commit) else 0)


if __name__ == "__main__":
    main()

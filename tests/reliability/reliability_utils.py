"""Shared helpers of the reliability tests: start recipes as real processes, pause and SIGKILL them, find leftover
processes; call a recipe's entry point in this process; read the per-step logs and the checkpoints a run left
behind."""

import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import psutil
import torch
from conftest import load_recipe, run_main
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
INJECT = HERE / "inject"  # sitecustomize.py: pauses checkpoint writes
TUNE = Path(sys.executable).parent / "tune"
SINGLE_RECIPE = "recipes/qlora_finetune_single_device.py"
DIST_RECIPE = "recipes/qlora_finetune_distributed.py"
SINGLE_CONFIG = REPO / "configs" / "tiny" / "qlora_single_device.yaml"
DIST_CONFIG = REPO / "configs" / "tiny" / "qlora_distributed.yaml"
FAULTY_LOSS = "reliability_faults.CEWithChunkedOutputLoss"
#: hang guard: a run that neither finishes nor fails within this long is a hang (the runs take seconds).
RUN_TIMEOUT_S = 180


def small_run(out: Path, base: Path, steps: int, log_dir: Path) -> List[str]:
    """Overrides shared by the runs: tiny data and sequences, dropout and shuffling on (so that resuming must restore
    the RNG and data position), per-step logs in a plain-text DiskLogger file, the fault-injecting loss (no fault)."""
    return [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        f"max_steps_per_epoch={steps}",
        "dataset.num_samples=64",
        "run_val_every_n_steps=null",
        "tokenizer.max_seq_len=32",
        "model.lora_dropout=0.1",
        "lr_scheduler.num_warmup_steps=2",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={log_dir}",
        f"loss._component_={FAULTY_LOSS}",
    ]


def env(pause: Optional[str] = None, marker: Optional[Path] = None, rank: Optional[int] = None) -> Dict[str, str]:
    """The subprocess environment: the fault modules importable; with ``pause``, the checkpoint-write hooks of
    ``inject/sitecustomize.py`` armed (``<point>@<step>``, see there)."""
    paths = [str(REPO), str(HERE)] + ([str(INJECT)] if pause else [])  # the code under test, not an installed copy
    result = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    for key in (
        "RELIABILITY_PAUSE",
        "RELIABILITY_MARKER",
        "RELIABILITY_RANK",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        result.pop(key, None)
    if pause:
        result.update(RELIABILITY_PAUSE=pause, RELIABILITY_MARKER=str(marker))
        if rank is not None:
            result["RELIABILITY_RANK"] = str(rank)
    return result


class Run:
    """A recipe process started in its own session (so that every process it starts can be found afterwards).

    Args:
        args (Sequence[str]): the command.
        env (Dict[str, str]): its environment.
        log (Path): stdout and stderr go here.
    """

    def __init__(self, args: Sequence[str], env: Dict[str, str], log: Path):
        self.log = log
        self._log_file = open(log, "w")
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            list(args), cwd=REPO, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def output(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        """Waits for the process; a run still alive after ``timeout`` is a hang: it is killed and the test fails."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as err:
            self.kill_all()
            raise AssertionError(
                f"hang: {self.proc.args[:4]} still running after {timeout} s\n{self.output[-4000:]}"
            ) from err
        finally:
            self._log_file.close()

    def wait_for_marker(self, marker: Path, timeout: float = RUN_TIMEOUT_S) -> int:
        """Waits until a paused process announces its pid in ``marker``; fails if the run ends first."""
        deadline = time.monotonic() + timeout
        while not marker.is_file():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the run ended (rc {self.proc.returncode}) before pausing:\n{self.output[-6000:]}"
                )
            if time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(f"the run did not reach its pause point in {timeout} s:\n{self.output[-4000:]}")
            time.sleep(0.05)
        return int(marker.read_text())

    def leftovers(self) -> List[psutil.Process]:
        """Processes of this run's session still present (running or zombie)."""
        return session_processes(self.proc.pid)

    def kill_all(self) -> None:
        """SIGKILLs every process of this run's session, one by one (cleanup after a failure)."""
        for process in self.leftovers():
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def session_processes(session_id: int) -> List[psutil.Process]:
    """Every process (zombies included) whose session id is ``session_id``."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session_id:
                found.append(process)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return found


def assert_no_leftovers(runs: Iterable[Run], grace_s: float = 10.0) -> None:
    """Every process the runs started has exited and been reaped (no orphan, no zombie), allowing ``grace_s`` for
    the kernel and the launcher to finish reaping."""
    runs = list(runs)
    deadline = time.monotonic() + grace_s
    while True:
        left = [(p.pid, _describe(p)) for run in runs for p in run.leftovers()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for run in runs:
        run.kill_all()
    assert not left, f"processes left behind: {left}"


def _describe(process: psutil.Process) -> str:
    try:
        return f"{process.status()} {' '.join(process.cmdline())[:120]}"
    except psutil.Error:
        return "gone"


def tune(recipe: str, config: Path, overrides: Sequence[str], log: Path, nproc: int = 0, **env_kwargs) -> Run:
    """Starts ``tune run [--standalone --nproc_per_node N] <recipe> --config <config> <overrides>`` (standalone:
    the launcher picks a free port)."""
    launcher = ["--standalone", "--nproc_per_node", str(nproc)] if nproc else []
    return Run([str(TUNE), "run", *launcher, recipe, "--config", str(config), *overrides], env(**env_kwargs), log)


@functools.cache
def _single_recipe_main() -> Callable[[], Any]:
    return load_recipe(REPO / SINGLE_RECIPE).recipe_main


def call_recipe(args: Sequence[str], monkeypatch: Any, capfd: Any, caplog: Any) -> Tuple[int, str]:
    """The single-device recipe's entry point on the tiny config with ``args``, in this process, as ``tune run``
    calls it (``conftest.run_main``); returns its exit code and everything it printed and logged (``caplog``: a
    logger's handler may hold an earlier stream than ``capfd``'s)."""
    caplog.clear()
    argv = [SINGLE_RECIPE, "--config", str(SINGLE_CONFIG), *args]
    result = run_main(_single_recipe_main(), argv, monkeypatch, capfd, cwd=REPO)
    return result.returncode, result.stdout + result.stderr + caplog.text


def check_ok(run: Run) -> None:
    rc = run.wait()
    assert rc == 0, f"run failed (rc {rc}):\n{run.output[-6000:]}"


def kill(run: Run, pid: int) -> int:
    """SIGKILLs ``pid`` (a process of ``run``) and waits for the whole run to end; returns the run's exit code."""
    os.kill(pid, signal.SIGKILL)
    return run.wait()


def logged(log_dir: Path, key: str = "loss") -> Dict[int, float]:
    """``key`` by step from the DiskLogger files of one run (``Step N | key:value ...`` lines)."""
    by_step = {}
    for path in sorted(log_dir.glob("log_*.txt")):
        for line in path.read_text().splitlines():
            match = re.match(rf"Step (\d+) \| .*\b{re.escape(key)}:(\S+)", line)
            if match:
                by_step[int(match.group(1))] = float(match.group(2))
    return by_step


def recipe_state_step(out: Path) -> int:
    """The global step of the recipe state that a resume would load (it must load completely)."""
    state = torch.load(out / "recipe_state" / "recipe_state.pt", map_location="cpu", weights_only=False)
    return int(state["global_step"])


def adapter(folder: Path) -> Dict[str, torch.Tensor]:
    """A step folder's PEFT adapter, read completely (a truncated file fails here)."""
    return load_file(folder / "adapter" / "adapter_model.safetensors")


def merged(folder: Path) -> Dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted((folder / "merged").glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def max_abs_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def visible_entries(out: Path) -> List[str]:
    """Names under ``out`` (two levels) that do not start with a dot: what a user or a resume would take as
    outputs. Temporary files and folders of interrupted writes are hidden (``.name.tmp-*``)."""
    names = []
    for child in sorted(out.iterdir()):
        if child.name.startswith("."):
            continue
        names.append(child.name)
        if child.is_dir():
            names += [f"{child.name}/{c.name}" for c in sorted(child.iterdir()) if not c.name.startswith(".")]
    return names


def hidden_entries(out: Path) -> List[str]:
    """Temporary entries left by interrupted writes (relative paths)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob(".*"))


def snapshot(folder: Path) -> Dict[str, tuple]:
    """Every file and folder under ``folder`` with its size and mtime (to prove that nothing was written)."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
    }

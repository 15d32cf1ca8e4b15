"""Shared test helpers. ``run_distributed`` runs a function on a real multi-process gloo group;
``tiny_trained_state`` gives a tiny QLoRA model as a trained recipe holds it, with the recipe's checkpointer;
``run_main`` calls a command's entry point in this process, as its console script would run it, and
``run_recipe_in_process`` a recipe as ``tune run`` would on one device;
``family_marks`` keeps one builder per model family in the fast lane of a test over every shipped builder.

The test lanes: plain ``pytest`` runs the fast lane, the in-process tests (``addopts`` in pyproject.toml deselects
the markers of the slow lane: ``integration_test``, ``distributed``, ``slow``, ``real_model``); ``.ci/run`` runs
both (``-m`` on the command line replaces the default one).
"""

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import pytest
import torch.multiprocessing as mp


def _import_the_package_under_test() -> None:
    """Imports ``torchtune_ext`` as Python finds it without this folder on ``sys.path``: the console script
    ``pytest`` (unlike ``python -m pytest``, which puts the working folder first) starts with only ``tests/`` there,
    where ``tests/torchtune_ext`` would be imported as an empty namespace package before an editable install's
    finder is asked. Once imported, every test gets the same module."""
    here = Path(__file__).resolve().parent
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if Path(entry or ".").resolve() != here]
    try:
        import torchtune_ext  # noqa: F401
    finally:
        sys.path[:] = saved


_import_the_package_under_test()

DIST_TIMEOUT_S = 120
#: what a worker of ``tune run --nproc_per_node`` / ``torchrun`` has in its environment (a test runs as none).
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHTUNE_EXT_CONFIG_ERROR_DIR", "TORCHTUNE_EXT_TRACEBACK")


#: one shipped builder per model family (its smallest): the fast lane's cases of a test over every builder; the
#: others' cases are marked ``slow``.
FAMILY_REPRESENTATIVES = frozenset(
    f"{prefix}{name}"
    for prefix in ("qlora_", "lora_")
    for name in (
        "tiny_llama",
        "tiny_qwen",
        "llama2_7b",
        "llama3_2_1b",
        "mistral_7b",
        "gemma2_2b",
        "phi3_mini",
        "qwen2_5_0_5b",
        "qwen3_0_6b",
        "smollm2_135m",
    )
)


def family_marks(builder: Callable) -> Tuple[Any, ...]:
    """The marks of ``builder``'s case in a test over every shipped builder: none for its family's representative
    (:data:`FAMILY_REPRESENTATIVES`), ``slow`` for the others."""
    return () if builder.__name__ in FAMILY_REPRESENTATIVES else (pytest.mark.slow,)


def load_recipe(path: Path) -> ModuleType:
    """The recipe file at ``path`` imported as a module of its own (not ``__main__``: its entry point does not run)."""
    spec = importlib.util.spec_from_file_location(f"test_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _called_as_entry_point(
    monkeypatch: Any, argv: Sequence[str], cwd: Optional[Path], env: Optional[Dict[str, str]] = None
) -> Iterator[None]:
    """This process as a console script's: ``sys.argv`` set to ``argv``, ``env`` added to an environment without a
    launcher's or the traceback switch's variables, in ``cwd``; the SIGTERM handler restored after (a config error's
    exit ignores SIGTERM, for torchrun)."""
    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", list(argv))
    if cwd is not None:
        monkeypatch.chdir(cwd)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, sigterm)


def run_main(
    main: Callable[[], Any],
    argv: Sequence[str],
    monkeypatch: Any,
    capfd: Any,
    cwd: Optional[Path] = None,
    **env: str,
) -> subprocess.CompletedProcess:
    """Runs an entry point (a recipe's ``recipe_main``, the CLI's ``main``) in this process as its console script
    would: ``sys.argv`` set to ``argv``, ``env`` added to an environment without a launcher's or the traceback
    switch's variables, in ``cwd``. Its ``SystemExit`` is the exit code; another exception is what the interpreter
    makes of it (its traceback on stderr, exit code 1). What it printed is read at the file-descriptor level
    (``capfd``).

    Returns:
        subprocess.CompletedProcess: ``argv``, the exit code, and what it wrote to stdout and stderr.
    """
    code: Any = 0
    with _called_as_entry_point(monkeypatch, argv, cwd, env):
        capfd.readouterr()  # what earlier code printed is not this run's
        try:
            main()
        except SystemExit as stop:
            code = stop.code
        except Exception:
            traceback.print_exc()
            code = 1
    printed = capfd.readouterr()
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        printed = printed._replace(err=f"{printed.err}{code}\n")
        code = 1
    return subprocess.CompletedProcess(list(argv), code, printed.out, printed.err)


def run_recipe_in_process(recipe: Path, args: Sequence[str], cwd: Optional[Path] = None) -> None:
    """Runs ``tune run <recipe> <args>`` on one device in this process: the recipe file's ``recipe_main`` with that
    ``sys.argv``, in ``cwd``, without a launcher's variables (a launched ``tune run`` costs ~10 s of start-up; this
    costs none). What it prints goes to the test's output; a non-zero exit fails the caller with its code."""
    with pytest.MonkeyPatch.context() as monkeypatch, _called_as_entry_point(monkeypatch, [str(recipe), *args], cwd):
        try:
            load_recipe(recipe).recipe_main()
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise AssertionError(f"{recipe.name} {' '.join(args)} exited with {stop.code}") from stop


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous or a process group)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    from torchtune_ext.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"), DIST_TIMEOUT_S)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        destroy_distributed()


def run_distributed(fn: Callable, world_size: int = 2, *args: Any) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes on a gloo group.

    ``fn`` must be a module-level function (it is pickled). Assertion errors in any rank fail the caller with
    that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(DIST_TIMEOUT_S + 60)
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or any(p.exitcode != 0 for p in procs):
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures)
        raise AssertionError(f"distributed run failed (exit codes {[p.exitcode for p in procs]}):\n{details}")


#: LoRA on every linear of a tiny model (rank 8; the builders take ``lora_alpha=16`` with it), and the PEFT adapter
#: config the recipe saves for it.
TINY_LORA: Dict[str, Any] = dict(
    lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=8
)
TINY_ADAPTER_CONFIG: Dict[str, Any] = dict(
    target_modules=["q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3"],
    rank=8,
    alpha=16,
    dropout=0.0,
    use_dora=False,
)


def tiny_trained_state(
    base: Path, out: Path, family: str = "llama", **checkpointer_kwargs: Any
) -> Tuple[Any, Any, Dict]:
    """A tiny fp32 QLoRA model (``family``: llama or qwen, :data:`TINY_LORA`) loaded from the HF checkpoint in
    ``base``, its adapters initialised with seed 0 and every ``lora_b`` drawn from N(0, 0.05): trained-looking.

    Returns:
        Tuple[TransformerDecoder, QLoRAHFCheckpointer, Dict]: the model (on the CPU), the recipe's checkpointer
        (writing into ``out``; ``checkpointer_kwargs`` go to it) and the model's full state dict (NF4 kept), for
        ``checkpointer.save(state, step, TINY_ADAPTER_CONFIG, ...)``.
    """
    import torch

    from torchtune_ext.checkpoint import QLoRAHFCheckpointer, load_base_
    from torchtune_ext.distributed import get_full_state_dict
    from torchtune_ext.models import init_adapters_, qlora_tiny_llama, qlora_tiny_qwen

    builder, model_type = {"llama": (qlora_tiny_llama, "LLAMA3_2"), "qwen": (qlora_tiny_qwen, "QWEN2")}[family]
    model = builder(**TINY_LORA, lora_alpha=16, dtype=torch.float32, device="meta")
    checkpointer = QLoRAHFCheckpointer(str(base), str(out), model_type, **checkpointer_kwargs)
    checkpointer.validate(model)
    load_base_(model, checkpointer, torch.device("cpu"))
    torch.manual_seed(0)
    init_adapters_(model, torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:
                param.normal_(0, 0.05)
    return model, checkpointer, get_full_state_dict(model, keep_nf4=True, cpu_offload=False)

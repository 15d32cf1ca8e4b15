"""Every compatibility alias and registration of the project, and the import hook that applies them in time.

torchtune 0.6.1 (its last release) imports torchao names that later torchao releases moved or dropped; torch
>= 2.11 dispatches an op on NF4Tensors that torchao 0.15 does not handle (and 0.16+ handles lazily); torchao's NF4
all-gather leaves several gathers in flight, which corrupts memory on gloo. This module
fills exactly those gaps: each alias only where the installed torchao lacks the name, with the reason next to it
(:func:`_apply_torchao_aliases`), two op handlers (:func:`_register_nf4_ops`, which says why they replace
torchao's), FSDP2's split and padding of NF4 weights that do not split evenly (:func:`register_nf4_sharding_ops`,
which ``torchtune_ext.nf4`` calls with its handlers); and it re-exports torchao's NF4 names from wherever the
installed torchao keeps them (``NF4Tensor``, ``to_nf4``, ... as attributes of this module).

When: the aliases must exist after torchao has fully imported and before the first ``import torchtune``. Users
start us in ways where torchtune is imported before any code of ours runs: ``tune run ...`` (torchtune's own
console script imports torchtune first), the workers that ``tune run --nproc_per_node`` / ``torchrun`` start,
``python recipes/<recipe>.py``, pytest, a notebook that imports torchtune first. Only interpreter start-up runs
before all of them, so the package installs ``torchtune_ext_compat.pth`` into site-packages (see ``setup.py``);
``site`` runs its one import line at start-up, which calls :func:`install_import_hook`. That only puts a finder on
``sys.meta_path`` (no torch import, microseconds); the finder acts on the first ``import torchtune``: it imports
torchao, applies the aliases and registrations, and lets torchtune's import proceed. ``import torchtune_ext`` calls
:func:`install_import_hook` too, so a source tree on ``PYTHONPATH`` without the ``.pth`` works when torchtune_ext is
imported first. Rejected: ``sitecustomize`` (one per environment, owned by the environment), a wrapper of the
``tune`` script (users type ``tune``), entry points (torchtune 0.6.1 loads none).

The same finder gives ``torchao.dtypes.nf4tensor`` (where torchao < 0.18 kept NF4Tensor, and torchtune 0.6.1 and
its tests import it from) on a torchao that moved it, imported first or after torchtune alike.

It also fixes ``tune run recipes/<recipe>.py`` from a clone: ``tune`` turns the path into the module
``recipes.<recipe>`` and appends the working folder to ``sys.path``, after site-packages, where torchtune installs a
placeholder ``recipes`` package whose ``__init__`` only raises ("The torchtune recipes directory isn't a
package"). When that placeholder is what ``import recipes`` would find and the working folder has a
``recipes/__init__.py``, the finder returns the working folder's package instead. Nothing importable changes: the
placeholder can never be imported.

The finder also lists this package's recipes and configs in torchtune's recipe registry as
``torchtune._recipe_registry`` is imported (:func:`_register_recipes`), so torchtune's own ``tune ls``, ``tune cp``
and ``tune run <recipe> --config <config>`` know them by name from any folder, and ``tune run /path/to/my_recipe.py``
runs a copied recipe from any folder (:func:`_recipe_files_tune_run_cannot_import`); and it silences, narrowly, three
start-up warnings nobody can act on, each where it is emitted (:func:`_quiet_known_warnings`, which says why).
As ``torchtune._cli.run`` is imported it makes ``tune run --nproc_per_node N`` exit 130/143 without torchrun's
traceback when interrupted, and exit 2 with the config error's line once on a config error, without torchrun's log
lines about those workers (:func:`_exit_like_interrupted_workers`, which says why).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import signal
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

if TYPE_CHECKING:
    import logging

#: where torchao keeps the NF4 tensor code: torchao < 0.18, then torchao >= 0.18.
_NF4_MODULES = ("torchao.dtypes.nf4tensor", "torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
#: names this module re-exports from torchao's NF4 module.
_NF4_EXPORTS = (
    "NF4Tensor",
    "SubclassTensorArgs",
    "to_nf4",
    "construct_nf4_args",
    "_INNER_TENSOR_NAMES_FOR_SHARDING",
)

_applied = False
_REGISTRY = "torchtune._recipe_registry"
_RUN = "torchtune._cli.run"


def _removed(name: str, release: str) -> Callable[..., Any]:
    """A stand-in for a torchao name that ``release`` removed without a drop-in replacement."""

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"torchao.{name} was removed in torchao {release}; torchtune 0.6.1 code that uses it (its int4/8da4w "
            "post-training quantizers) needs torchao<0.16. torchtune_ext's QLoRA recipes do not use it."
        )

    unavailable.__name__ = name.rpartition(".")[2]
    return unavailable


def _int4_weight_only(group_size: int = 128, layout: Any = None, **kwargs: Any) -> Any:
    """torchao < 0.16's ``int4_weight_only(group_size, layout)``: it built an ``Int4WeightOnlyConfig``, which
    torchao >= 0.16 takes directly (``layout`` became ``int4_packing_format``; only the default is accepted)."""
    from torchao.quantization import Int4WeightOnlyConfig

    if layout is not None:
        raise NotImplementedError(
            "int4_weight_only(layout=...) has no equivalent in torchao>=0.16 (Int4WeightOnlyConfig takes "
            "int4_packing_format); use torchao<0.16 for torchtune 0.6.1's Int4WeightOnlyQuantizer."
        )
    return Int4WeightOnlyConfig(group_size=group_size, **kwargs)


class _TensorCoreTiledLayout:
    """torchao < 0.18's ``torchao.dtypes.TensorCoreTiledLayout``: torchtune 0.6.1 imports it at module level but only
    its int4 quantizer instantiates it, which torchao >= 0.18 cannot run anyway."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _removed("dtypes.TensorCoreTiledLayout", "0.18")()


def _nf4_module() -> types.ModuleType:
    """torchao's NF4 tensor module, wherever the installed release keeps it."""
    for name in _NF4_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        f"torchtune_ext needs torchao's NF4Tensor ({' or '.join(_NF4_MODULES)}); none is importable. Install a "
        "supported torchao: pip install 'torchao>=0.15,<0.19'"
    )


def _alias_module(name: str, module: types.ModuleType) -> None:
    """Makes ``import name`` and ``from parent import child`` give ``module``."""
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(importlib.import_module(parent), child, module)


def _apply_torchao_aliases() -> None:
    """The torchao names torchtune 0.6.1 imports, provided where the installed torchao lacks them."""
    import torchao.dtypes
    import torchao.quantization

    # torchtune/modules/common_utils.py and four more modules: `from torchao.dtypes.nf4tensor import ...`;
    # torchao 0.18 moved the module: the finder (_CompatFinder, _MovedModule) gives the new one under the old name,
    # whatever the import order.
    # torchtune/training/quantization.py imports these three at module level (for its PTQ quantizers).
    # int4_weight_only: removed in 0.16, a constructor of Int4WeightOnlyConfig until then.
    if not hasattr(torchao.quantization, "int4_weight_only"):
        torchao.quantization.int4_weight_only = _int4_weight_only
    # int8_dynamic_activation_int4_weight: removed in 0.16 (its config class too in 0.17).
    if not hasattr(torchao.quantization, "int8_dynamic_activation_int4_weight"):
        torchao.quantization.int8_dynamic_activation_int4_weight = _removed(
            "quantization.int8_dynamic_activation_int4_weight", "0.16"
        )
    # TensorCoreTiledLayout: removed in 0.18.
    if not hasattr(torchao.dtypes, "TensorCoreTiledLayout"):
        torchao.dtypes.TensorCoreTiledLayout = _TensorCoreTiledLayout


def _register_nf4_ops() -> None:
    """Two NF4 handlers for the functional collectives behind ``DTensor.full_tensor()`` and ``redistribute``.

    - ``_c10d_functional.all_gather_into_tensor``: torchao's handler issues one all-gather per inner tensor and
      leaves all three in flight at once. On a gloo group, torch 2.13.0 and 2.14.1 corrupt the heap when several
      functional all-gathers are in flight (SIGSEGV / "malloc(): unaligned tcache chunk detected" in 3 of 4 runs of
      3,000 rounds of three in-flight gathers on 2 ranks; none in 12,000 rounds gathered one at a time;
      tests/torchtune_ext/distributed/test_fsdp_nf4.py). Ours waits on each gather before issuing the next; the
      caller waits right after anyway (below), so nothing is lost on NCCL either.
    - ``_c10d_functional._wrap_tensor_autograd``, which torch >= 2.11 dispatches on the outputs of functional
      collectives: torchao 0.15 has no handler (the op fails on NF4). torchao >= 0.16 has one that leaves the inner
      tensors as ``AsyncCollectiveTensor``s (waited on first use), so a gathered NF4Tensor cannot be saved and
      loaded back with ``torch.load(weights_only=True)`` ("Unsupported global: AsyncCollectiveTensor";
      tests/torchtune_ext/distributed/test_fsdp_nf4.py). Ours waits on each inner tensor, as torchao's own
      ``wait_tensor`` handler does.

    Both replace torchao's handlers for every torchao release.
    """
    import torch

    nf4 = _nf4_module()
    functional = torch.ops._c10d_functional
    wait = functional.wait_tensor.default

    @nf4.implements([functional.all_gather_into_tensor.default])
    def _nf4_all_gather_into_tensor(func, args, kwargs=None):
        value, group_size, group_name = args
        inner: dict = {
            name: wait(func(getattr(value, name), group_size, group_name))
            for name in nf4._INNER_TENSOR_NAMES_FOR_SHARDING
        }
        inner["size"] = torch.Size((value.size(0) * group_size, *value.shape[1:]))
        return nf4.NF4Tensor(*nf4.construct_nf4_args(value, inner))

    wrap_op = getattr(functional, "_wrap_tensor_autograd", None)
    if wrap_op is None:
        return

    @nf4.implements([wrap_op.default])
    def _nf4_wrap_tensor_autograd(func, args, kwargs=None):
        value = args[0]
        inner = {name: wait(getattr(value, name)) for name in nf4._INNER_TENSOR_NAMES_FOR_SHARDING}
        return nf4.NF4Tensor(*nf4.construct_nf4_args(value, inner))


#: torchao's own handlers of the ops :func:`register_nf4_sharding_ops` takes over, kept for the weights it declines.
_TORCHAO_SHARDING_HANDLERS: Dict[Any, Callable[..., Any]] = {}


def register_nf4_sharding_ops(split: Callable[..., Any], new_zeros: Callable[..., Any]) -> None:
    """Lets FSDP2 shard any NF4 weight over any world size: ``aten.split.Tensor`` and ``aten.new_zeros.default`` on
    an ``NF4Tensor`` try ``split`` / ``new_zeros`` first, and torchao's handler where they return None.

    FSDP2's ``fully_shard`` (and so torchtune's ``training.shard_model``) chunks a parameter's rows with
    ``torch.chunk`` and pads every shard to the first one's size with ``new_zeros``. torchao's handlers (identical in
    0.15 to 0.18) split an NF4 weight only into equal shards of whole scale groups: ``"quantization_factor.numel() not
    divisible by 3"`` otherwise. torchtune_ext picks scale groups per shape, so many weights do not divide (a 256 ->
    192 projection on 3 ranks); ``torchtune_ext.nf4`` supplies padded shards of whole scale groups for those
    (``UnevenNF4Tensor``, whose FSDP2 hooks gather them) and leaves the even ones to torchao. It calls this when
    imported (it sits above this module): every NF4 weight torchtune_ext makes comes from it. Idempotent.

    Args:
        split (Callable[..., Any]): ``split(weight, split_size, dim=0)``: the chunks, or None for torchao's.
        new_zeros (Callable[..., Any]): ``new_zeros(weight, size, **kwargs)``: a padded shard, or None for torchao's.
    """
    import torch

    nf4 = _nf4_module()
    for op, ours in ((torch.ops.aten.split.Tensor, split), (torch.ops.aten.new_zeros.default, new_zeros)):
        torchao_handler = _TORCHAO_SHARDING_HANDLERS.setdefault(op, nf4.NF4_OPS_TABLE[op])
        nf4.implements([op])(_first_then(ours, torchao_handler))


def _first_then(ours: Callable[..., Any], torchao_handler: Callable[..., Any]) -> Callable[..., Any]:
    """An NF4 op handler that returns ``ours(*args, **kwargs)`` unless that is None, then torchao's result."""

    def handler(func, args, kwargs=None):
        result = ours(*args, **(kwargs or {}))
        return torchao_handler(func, args, kwargs) if result is None else result

    return handler


class _DropRecords:
    """A ``logging`` filter (any object with ``filter``: no ``import logging`` at start-up) that drops the records
    for which ``match(record)`` holds."""

    def __init__(self, match: Callable[[logging.LogRecord], bool]):
        self._match = match

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._match(record)


def _torchao_so_load_failure(record: logging.LogRecord) -> bool:
    # torchao's __init__ tries to load every prebuilt `_C*.so` and logs each failure (six lines under 2 ranks): they
    # are its CUDA/CUTLASS kernels (mxfp8, cutlass_90a, ...) built for other torch/Python/CUDA builds, and neither
    # NF4 nor anything else we use needs them. The skip for a torch older than torchao's build is the same case.
    message = str(record.msg)
    return (message.startswith("Failed to load ") and ".so" in message) or message.startswith(
        "Skipping import of cpp extensions"
    )


def _torchao_enum_constant(record: logging.LogRecord) -> bool:
    # torch >= 2.12 warns when an Enum is registered as a pytree constant; torchao registers its own enums
    # (KernelPreference, ...) at import (torchao.utils.register_as_pytree_constant). Only torchao can change that.
    args = record.args if isinstance(record.args, tuple) else ()
    return "is an Enum subclass" in str(record.msg) and any(
        getattr(arg, "__module__", "").startswith("torchao.") for arg in args
    )


def _quiet_known_warnings() -> None:
    """Silences three warnings printed by every command (even ``tune-ext ls``) that no user can act on, each at its
    source and matched narrowly: torchao's failed ``.so`` loads, torch's deprecation of torchao's enum pytree
    registrations (``KernelPreference``), and torch's ``'set_vital' is deprecated``, which torchdata's
    ``StatefulDataLoader`` triggers on every data loader it creates. Idempotent; imports nothing heavy."""
    import logging

    torchao_log = logging.getLogger("torchao")
    pytree_log = logging.getLogger("torch.utils._pytree")
    if not any(isinstance(f, _DropRecords) for f in torchao_log.filters):
        torchao_log.addFilter(_DropRecords(_torchao_so_load_failure))
        pytree_log.addFilter(_DropRecords(_torchao_enum_constant))
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", module=r"torchdata\.stateful_dataloader")


def _register_recipes(registry: types.ModuleType) -> None:
    """Lists this package's recipes and configs in torchtune's registry (once), by absolute path (torchtune joins its
    ``recipes`` folder with the path, which an absolute path replaces). Our entries come first: where a config name
    is also torchtune's (``llama3_2/1B_qlora_single_device``), ``tune run <recipe> --config`` looks in the named
    recipe's configs first, and ``tune cp`` keeps finding torchtune's own (``tune-ext cp`` copies ours)."""
    from torchtune_ext._shipped import DISTRIBUTED_RECIPE, config_files, recipe_files, recipe_of

    recipes = registry.get_all_recipes()
    known = {recipe.name for recipe in recipes}
    configs = config_files()
    ours = [
        registry.Recipe(
            name=name,
            file_path=str(path),
            configs=[registry.Config(name=c, file_path=str(p)) for c, p in configs.items() if recipe_of(c) == name],
            supports_distributed=name == DISTRIBUTED_RECIPE,
        )
        for name, path in recipe_files().items()
        if name not in known
    ]
    ours += [
        registry.Recipe(name=arg, file_path=str(Path(arg).resolve()), configs=[], supports_distributed=True)
        for arg in _recipe_files_tune_run_cannot_import()
        if arg not in known
    ]
    recipes[:0] = ours


def _recipe_files_tune_run_cannot_import() -> List[str]:
    """Under ``tune run``, the recipe files on its command line (before ``--config``) that torchtune would turn into
    a relative module name: torchtune runs a file path as the module ``x.my_recipe`` (``x/my_recipe.py``) from the
    working folder, and an absolute path or one through ``.``/``..`` gives ``.tmp.x.my_recipe``, which runpy
    refuses ("Relative module names not supported"). Registered under the path as typed, torchtune runs such a file
    by its absolute path, as it runs its own recipes (``runpy.run_path``, or torchrun on the file): one module,
    ``__main__``, from any working folder."""
    if Path(sys.argv[0]).stem != "tune" or sys.argv[1:2] != ["run"]:
        return []
    args = sys.argv[2:]
    before_config = args[: args.index("--config")] if "--config" in args else args
    return [
        arg
        for arg in before_config
        if arg.endswith(".py") and "" in os.path.splitext(arg)[0].replace("/", ".").split(".") and Path(arg).is_file()
    ]


def _exit_like_interrupted_workers(run_module: types.ModuleType) -> None:
    """Wraps torchtune's distributed launch (``Run._run_distributed``, which calls torchrun) so that an interrupt
    ends ``tune run --nproc_per_node N`` with the conventional exit code and no traceback.

    Why: our workers save on SIGINT/SIGTERM and exit ``128 + signal`` (:mod:`torchtune_ext.training._interrupt`),
    but torchrun turns both ways an interrupt reaches it into a traceback and exit code 1: a signal to the launcher
    itself (a terminal's Ctrl-C reaches the whole process group; a runtime's SIGTERM) raises its ``SignalException``
    after it has forwarded the signal and waited for the workers, and workers that exited 130/143 are a
    ``ChildFailedError`` with its failure block. Here the first exits ``128 + signal`` quietly, the second exits
    with the workers' code when every failed worker exited with the same 130 or 143. A config error
    (:data:`torchtune_ext.config.CONFIG_ERROR_EXIT_CODE`, see ``exit_on_config_error``) exits 2 the same way, so it
    is one line under torchrun too, and so does any other user-facing error (a divergence, a failed write: exit 1):
    every rank finds it, rank 0 prints it, and the ranks torchrun stopped with SIGTERM once the first had exited
    count as stopped by it; where rank 0 was stopped before it printed, the line
    is printed here, as another rank wrote it into a folder this wrap gives the workers (a torchrun error file
    would add torchrun's own log lines). Any other failure is torchrun's, unchanged.
    Idempotent."""
    import functools
    import logging

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torchtune_ext.config import CONFIG_ERROR_DIR_ENV, CONFIG_ERROR_EXIT_CODE

    interrupted_codes = {128 + int(s) for s in (signal.SIGINT, signal.SIGTERM)}
    launch = run_module.Run._run_distributed
    if getattr(launch, "_exits_like_interrupted_workers", False):
        return
    # torchrun's agent logs "failed (exitcode: N) local_rank: ..." for the first worker that ended, and "Sending
    # process P closing signal SIGTERM" for each it then stops: for 2, 130 and 143 (and 1 where a worker wrote a
    # user-facing error's lines) the workers printed why and the launcher exits with the code; any other failure
    # keeps torchrun's report (each worker's exit code and signal).
    quiet = {CONFIG_ERROR_EXIT_CODE, *interrupted_codes}

    def explained(code: int) -> bool:
        folder = os.environ.get(CONFIG_ERROR_DIR_ENV)
        return code in quiet or code == 1 and bool(folder) and any(Path(folder).glob("rank_*.txt"))

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        _DropRecords(
            lambda r: (
                str(r.msg).startswith("Sending process %s closing signal")
                or str(r.msg).startswith("failed (exitcode: ")
                and bool(r.args)
                and explained(r.args[0])
            )
        )
    )

    @functools.wraps(launch)
    def run_distributed(self: Any, *args: Any, **kwargs: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="torchtune_ext_config_errors_") as folder:
            os.environ[CONFIG_ERROR_DIR_ENV] = folder  # the workers inherit it
            try:
                return launch(self, *args, **kwargs)
            except SignalException as error:
                sys.exit(128 + int(error.sigval))
            except ChildFailedError as error:
                codes = {failure.exitcode for failure in error.failures.values()}
                code = _user_facing_exit_code(error.failures, Path(folder))
                if code is not None:
                    _print_config_error_once(error.failures, Path(folder), code)
                    sys.exit(code)
                if len(codes) == 1 and codes <= interrupted_codes:
                    sys.exit(codes.pop())
                raise
            finally:
                os.environ.pop(CONFIG_ERROR_DIR_ENV, None)

    run_distributed._exits_like_interrupted_workers = True  # type: ignore[attr-defined]
    run_module.Run._run_distributed = run_distributed


def _user_facing_exit_code(failures: Dict[int, Any], folder: Path) -> Optional[int]:
    """The exit code of the workers stopped by a user-facing error (``exit_on_config_error``), the others having
    been stopped by torchrun (SIGTERM); None for any other failure. A config error's code (2) is its own; a code 1
    counts only where every worker that exited 1 wrote its error's lines into ``folder`` (a crash exits 1 too)."""
    from torchtune_ext.config import CONFIG_ERROR_EXIT_CODE

    codes = {failure.exitcode for failure in failures.values()} - {-int(signal.SIGTERM)}
    if codes == {CONFIG_ERROR_EXIT_CODE}:
        return CONFIG_ERROR_EXIT_CODE
    written = {path.name for path in folder.glob("rank_*.txt")}
    failed = [rank for rank, failure in failures.items() if failure.exitcode == 1]
    if codes == {1} and all(f"rank_{rank}.txt" in written for rank in failed):
        return 1
    return None


def _print_config_error_once(failures: Dict[int, Any], folder: Path, code: int) -> None:
    """Prints a user-facing error's lines where rank 0 did not (it did where it exited with ``code``, see
    ``exit_on_config_error``), as the lowest rank that found it wrote them into ``folder``."""
    if 0 in failures and failures[0].exitcode == code:
        return
    written = sorted(folder.glob("rank_*.txt"), key=lambda path: int(path.stem[5:]))
    if written:
        print(written[0].read_text(), end="", file=sys.stderr, flush=True)


#: the torchtune modules given a registration as they are imported (or at once, where already imported).
_ON_IMPORT: Dict[str, Callable[[types.ModuleType], None]] = {
    _REGISTRY: _register_recipes,
    _RUN: _exit_like_interrupted_workers,
}


class _ThenRegister(importlib.abc.Loader):
    """A torchtune module of :data:`_ON_IMPORT`, loaded by its own loader, then given its registration."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _ON_IMPORT[module.__name__](module)


def _registering_spec(fullname: str, path: Optional[Sequence[str]]) -> Optional[importlib.machinery.ModuleSpec]:
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return None
    spec.loader = _ThenRegister(spec.loader)
    return spec


def apply() -> None:
    """Applies every alias and registration once (imports torchao, and torch). Idempotent."""
    global _applied
    if _applied:
        return
    _applied = True
    _quiet_known_warnings()
    _apply_torchao_aliases()
    _register_nf4_ops()


def _torchtune_recipes_placeholder() -> Optional[Path]:
    """The ``recipes/__init__.py`` that torchtune installs next to itself, or None (torchtune not installed)."""
    spec = importlib.machinery.PathFinder.find_spec("torchtune")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent / "recipes" / "__init__.py"


class _CompatFinder(importlib.abc.MetaPathFinder):
    """Applies :func:`apply` before the first ``import torchtune`` (and the warning filters before ``import
    torchao``); registers our recipes as torchtune's registry loads; resolves ``recipes`` to the working folder's
    package where torchtune's placeholder would shadow it; gives torchao's NF4 module under its old name
    (``torchao.dtypes.nf4tensor``, which torchtune and its tests import) where the installed torchao moved it.
    Finds nothing itself otherwise."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == "torchtune":
            apply()
        elif fullname == "torchao":
            _quiet_known_warnings()
        elif fullname in _ON_IMPORT:
            return _registering_spec(fullname, path)
        elif fullname == "recipes":
            return _local_recipes_spec()
        elif fullname == _NF4_MODULES[0] and importlib.machinery.PathFinder.find_spec(fullname, path) is None:
            return importlib.machinery.ModuleSpec(fullname, _MovedModule(_NF4_MODULES[1]))
        return None


class _MovedModule(importlib.abc.Loader):
    """Loads a module that torchao moved: the import gives the module at its new name (the same module object,
    so the same classes and ops table), after :func:`apply`."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system returns what sys.modules holds under the name once this returns; set before apply(),
        # which imports the name again.
        _alias_module(module.__name__, importlib.import_module(self.new_name))
        apply()


class _NoRecipesHere(importlib.abc.Loader):
    """Loads nothing: raises the error that tells a user who ran ``tune run recipes/...`` elsewhere what to do."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        raise ModuleNotFoundError(
            f"`tune run recipes/<recipe>.py` imports the package `recipes` from the working folder, and {os.getcwd()} "
            "has no recipes/ folder (only torchtune's unimportable placeholder was found). Run it from the root of a "
            "torchtune_ext clone, or run the installed recipes by name from anywhere: "
            "tune-ext run qlora_finetune_single_device --config <model>/<config> (tune-ext ls lists them)."
        )


def _local_recipes_spec() -> Optional[importlib.machinery.ModuleSpec]:
    found = importlib.machinery.PathFinder.find_spec("recipes")
    placeholder = _torchtune_recipes_placeholder()
    if found is None or found.origin is None or placeholder is None or Path(found.origin) != placeholder:
        return None
    local = Path(os.getcwd()) / "recipes" / "__init__.py"
    if not local.is_file():
        return importlib.machinery.ModuleSpec("recipes", _NoRecipesHere())
    return importlib.util.spec_from_file_location("recipes", local, submodule_search_locations=[str(local.parent)])


def install_import_hook() -> None:
    """Puts the finder first on ``sys.meta_path`` (once). If torchtune is already imported, applies now.

    Called at interpreter start-up by ``torchtune_ext_compat.pth`` and by ``import torchtune_ext``.
    """
    if not any(isinstance(finder, _CompatFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CompatFinder())
    if "torchtune" in sys.modules:
        apply()
    for name, register in _ON_IMPORT.items():
        if name in sys.modules:
            register(sys.modules[name])


def __getattr__(name: str) -> Any:
    """Lazily re-exports torchao's NF4 names (:data:`_NF4_EXPORTS`), applying the registrations first."""
    if name == "nf4_ops_table_implements":
        apply()
        return _nf4_module().implements
    if name in _NF4_EXPORTS:
        apply()
        return getattr(_nf4_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> Sequence[str]:
    return sorted([*globals(), *_NF4_EXPORTS, "nf4_ops_table_implements"])

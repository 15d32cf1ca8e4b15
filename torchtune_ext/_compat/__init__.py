"""Every compatibility alias and registration of the project, one module per reason, and the hook that applies them
in time.

- ``_torchao``: torchao names that torchtune 0.6.1 imports and later torchao releases moved or dropped; torchao's
  NF4 names re-exported from wherever the installed torchao keeps them (``NF4Tensor``, ``to_nf4``, ... as
  attributes of this package).
- ``_nf4_ops``: NF4 op handlers for the functional collectives (torch >= 2.11 dispatches one torchao 0.15 lacks;
  torchao's all-gather leaves several gathers in flight, which corrupts memory on gloo) and FSDP2's uneven split.
- ``_warnings``: three start-up warnings nobody can act on, silenced narrowly.
- ``_registry``: this package's recipes and configs in torchtune's recipe registry.
- ``_launcher``: ``tune run --nproc_per_node N`` exits like its workers (130/143, 2, 1) without torchrun's traceback.
- ``_recipes_package``: ``tune run recipes/<recipe>.py`` imports the working folder's ``recipes``.
- ``_hook``: the import hook (:func:`install_import_hook`) that applies all of them as torchtune and torchao are
  imported; ``_startup``: the start-up hook (``torchtune_ext_compat.pth``) that installs it on the first such import.

Importing this package imports only the standard library; :func:`apply` imports torchao and torch.
"""

from typing import Any, List

from torchtune_ext._compat._hook import apply, install_import_hook
from torchtune_ext._compat._launcher import _exit_like_interrupted_workers
from torchtune_ext._compat._nf4_ops import register_nf4_sharding_ops
from torchtune_ext._compat._torchao import NF4_EXPORTS
from torchtune_ext._compat._torchao import nf4_module as _nf4_module
from torchtune_ext._compat._warnings import _torchao_enum_constant, _torchao_so_load_failure

__all__ = [
    "apply",
    "install_import_hook",
    "register_nf4_sharding_ops",
    *NF4_EXPORTS,
    "_exit_like_interrupted_workers",
    "_nf4_module",
    "_torchao_enum_constant",
    "_torchao_so_load_failure",
]


def __getattr__(name: str) -> Any:
    """Lazily re-exports torchao's NF4 names (``NF4_EXPORTS``), applying the registrations first."""
    if name in NF4_EXPORTS:
        apply()
        return getattr(_nf4_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted([*globals(), *NF4_EXPORTS])

"""Three start-up warnings nobody can act on, silenced narrowly where they are emitted
(:func:`quiet_known_warnings`, which says why), and the ``logging`` filter the torchrun wrapper uses too."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import logging


class DropRecords:
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


def quiet_known_warnings() -> None:
    """Silences three warnings printed by every command (even ``tune-ext ls``) that no user can act on, each at its
    source and matched narrowly: torchao's failed ``.so`` loads, torch's deprecation of torchao's enum pytree
    registrations (``KernelPreference``), and torch's ``'set_vital' is deprecated``, which torchdata's
    ``StatefulDataLoader`` triggers on every data loader it creates. Idempotent; imports nothing heavy."""
    import logging

    torchao_log = logging.getLogger("torchao")
    pytree_log = logging.getLogger("torch.utils._pytree")
    if not any(isinstance(f, DropRecords) for f in torchao_log.filters):
        torchao_log.addFilter(DropRecords(_torchao_so_load_failure))
        pytree_log.addFilter(DropRecords(_torchao_enum_constant))
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", module=r"torchdata\.stateful_dataloader")

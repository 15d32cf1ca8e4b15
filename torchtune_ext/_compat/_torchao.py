"""torchao's names that torchtune 0.6.1 imports, where the installed torchao moved or dropped them.

torchtune 0.6.1 (its last release) imports torchao names that later torchao releases moved or dropped. Each alias
here is applied only where the installed torchao lacks the name, with the reason next to it
(:func:`apply_torchao_aliases`); :func:`nf4_module` finds torchao's NF4 tensor module wherever the installed release
keeps it (the import hook gives it under its old name, ``torchao.dtypes.nf4tensor``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable

#: where torchao keeps the NF4 tensor code: torchao < 0.18, then torchao >= 0.18.
NF4_MODULES = ("torchao.dtypes.nf4tensor", "torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
#: names ``torchtune_ext._compat`` re-exports from torchao's NF4 module.
NF4_EXPORTS = (
    "NF4Tensor",
    "SubclassTensorArgs",
    "to_nf4",
    "construct_nf4_args",
    "_INNER_TENSOR_NAMES_FOR_SHARDING",
)


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


def nf4_module() -> types.ModuleType:
    """torchao's NF4 tensor module, wherever the installed release keeps it."""
    for name in NF4_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        f"torchtune_ext needs torchao's NF4Tensor ({' or '.join(NF4_MODULES)}); none is importable. Install a "
        "supported torchao: pip install 'torchao>=0.15,<0.19'"
    )


def alias_module(name: str, module: types.ModuleType) -> None:
    """Makes ``import name`` and ``from parent import child`` give ``module``."""
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(importlib.import_module(parent), child, module)


def apply_torchao_aliases() -> None:
    """The torchao names torchtune 0.6.1 imports, provided where the installed torchao lacks them."""
    import torchao.dtypes
    import torchao.quantization

    # torchtune/modules/common_utils.py and four more modules: `from torchao.dtypes.nf4tensor import ...`;
    # torchao 0.18 moved the module: the import hook (_CompatFinder, _MovedModule) gives the new one under the old
    # name, whatever the import order.
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

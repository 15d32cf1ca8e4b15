"""Compatibility layer between torchtune 0.6.1, torchao 0.14/0.15 and current PyTorch.

This is the only module in torchtune_ext that touches torchao's internals. It is applied once,
on ``import torchtune_ext``, and does two things:

1. Exposes ``NF4Tensor``, ``to_nf4`` and ``nf4_ops_table_implements`` from wherever the installed
   torchao keeps them, so the rest of the project imports them from here.
2. Registers the NF4 ops that torch >= 2.11 dispatches and torchao 0.15 does not know:

   - ``_c10d_functional._wrap_tensor_autograd``: functional collectives wrap their outputs with it
     (``DTensor.full_tensor()``, ``redistribute``), so an all-gathered NF4 shard fails without it.
     For NF4 the wrap is a wait on each inner tensor, as torchao's own ``wait_tensor`` handler does.

   That is the only one: on torch 2.13 + torchao 0.15 (2-process gloo, tests/torchtune_ext/test_fsdp_nf4.py),
   FSDP2 ``fully_shard`` of models built on CPU or meta (with or without ``set_trainable_params`` first),
   forward/backward, ``state_dict``, ``full_tensor``, ``redistribute``, ``to_local``, torch DCP save/load,
   ``get_model_state_dict``/``set_model_state_dict``, torchtune's ``gather_cpu_state_dict`` and
   ``load_from_full_model_state_dict``, ``torch.save``/``torch.load``, ``deepcopy`` and ``.to(device)`` of NF4
   params and models all work with it alone (``aten.alias`` is never dispatched on these paths).
"""

from __future__ import annotations

import torch

try:
    from torchao.dtypes.nf4tensor import (
        _INNER_TENSOR_NAMES_FOR_SHARDING,
        NF4Tensor,
        SubclassTensorArgs,
        construct_nf4_args,
        to_nf4,
    )
    from torchao.dtypes.nf4tensor import implements as nf4_ops_table_implements
except ImportError as err:  # pragma: no cover - depends on the installed torchao
    raise ImportError(
        "torchtune_ext needs torchao's NF4Tensor (torchao.dtypes.nf4tensor), which torchao >= 0.16 "
        "removed and torchtune 0.6.1 still imports. Install torchao>=0.14,<0.16: "
        "pip install 'torchao>=0.14,<0.16'"
    ) from err

__all__ = ["NF4Tensor", "SubclassTensorArgs", "to_nf4", "nf4_ops_table_implements"]


def _map_inner_tensors(nf4: NF4Tensor, fn) -> NF4Tensor:
    updated = {name: fn(getattr(nf4, name)) for name in _INNER_TENSOR_NAMES_FOR_SHARDING}
    return NF4Tensor(*construct_nf4_args(nf4, updated))


def _register_missing_nf4_ops() -> None:
    wrap_op = getattr(torch.ops._c10d_functional, "_wrap_tensor_autograd", None)
    if wrap_op is not None:

        @nf4_ops_table_implements([wrap_op.default])
        def _nf4_wrap_tensor_autograd(func, args, kwargs=None):
            wait = torch.ops._c10d_functional.wait_tensor.default
            return _map_inner_tensors(args[0], wait)


_register_missing_nf4_ops()

"""Activation offloading as an estimate sees it: torchtune's ``OffloadActivations`` (``use_streams=True``, as
``training.get_act_offloading_ctx_manager`` makes it) replayed on fake tensors, its bookkeeping step for step.

What it reproduces: which saved tensors go to the host (at least ``min_offload_size`` bytes, not parameters or
buffers; every saved tensor takes an id), when each device copy is released and what stays on the device meanwhile:
in forward, an offloaded tensor's device copy stays stashed until an offloaded tensor ``max_fwd_stash_size`` ids
later is saved, and what is still stashed at the end of forward stays through the loss until the first backward
node that unpacks an offloaded tensor has run; in backward, a tensor brought back stays until the next autograd node
that unpacks one has run (or right after its own node when something else took a reference to its storage, torch's
``record_stream`` case), the rest until the end of backward; a tensor unpacked while still stashed is not brought
back. The output projection's forward runs under torchtune's ``NoOpManager`` (:meth:`OffloadedActivations.for_model`).

What it cannot: stream timing. On CUDA a stashed or brought-back tensor may live a little longer than its release
point (the copy stream's events, ``record_stream``); the estimate frees it at the release point, as if the copies
kept up with the compute. And each host copy is made on the (fake) device, then declared host memory: for that
instant it counts on the device too (after the stash's releases at that pack, as torchtune releases them first).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torchtune.modules import TiedLinear
from torchtune.training._activation_offloading import NoOpManager

from torchtune_ext.memory._tracker import count_as_host

#: torchtune's ``OffloadActivations`` leaves tensors smaller than this on the device (``min_offload_size``).
MIN_OFFLOAD_BYTES = 1024
#: torchtune's ``OffloadActivations`` default ``max_fwd_stash_size``, which ``get_act_offloading_ctx_manager`` uses.
MAX_FWD_STASH_SIZE = 5


class OffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload as torchtune's streaming ``OffloadActivations`` does, on fake tensors: an
    offloaded tensor's host copy counts as host memory (:func:`count_as_host`), and its device copy stays live as
    long as torchtune's forward and backward stashes keep it (see the module docstring). For the recipes'
    ``enable_activation_offloading``, whose real context needs CUDA.

    Args:
        max_fwd_stash_size (int): how many ids after an offloaded tensor its device copy is released in forward
            (torchtune's argument of that name). Default: :data:`MAX_FWD_STASH_SIZE`.

    Raises:
        ValueError: if ``max_fwd_stash_size`` is less than 1.
    """

    def __init__(self, max_fwd_stash_size: int = MAX_FWD_STASH_SIZE) -> None:
        if max_fwd_stash_size < 1:
            raise ValueError(f"max_fwd_stash_size should be at least 1 but is {max_fwd_stash_size}")
        self.max_fwd_stash_size = max_fwd_stash_size
        self._tensor_id = 0
        self._saved: Dict[int, Tuple[torch.Tensor, bool]] = {}  # id -> (host copy, True) or (the tensor, False)
        self._fwd_stash: Dict[int, torch.Tensor] = {}  # id -> device copy of an offloaded tensor, in forward
        self._bwd_stash: Dict[int, torch.Tensor] = {}  # id -> device copy brought back, in backward
        self._first_forward_call = True
        self._first_backward_call = True
        self._graph_id: Optional[int] = None
        self._node: Any = None
        super().__init__(self._pack, self._unpack)

    @classmethod
    def for_model(cls, model: nn.Module, max_fwd_stash_size: int = MAX_FWD_STASH_SIZE) -> OffloadedActivations:
        """The hooks that ``training.get_act_offloading_ctx_manager(model, True)`` stands for: ``model.output`` (the
        ``Linear`` of a ``TiedLinear``) is given the same forward hooks, which run it under torchtune's
        ``NoOpManager``, so that its saved tensors stay on the device. (torchtune's function cannot be called here:
        it makes CUDA streams.)

        Args:
            model (nn.Module): the model whose forward runs in the hooks.
            max_fwd_stash_size (int): see :class:`OffloadedActivations`.

        Returns:
            OffloadedActivations: the hooks.
        """
        hooks = cls(max_fwd_stash_size)
        output = getattr(model, "output", None)
        head = output.linear if isinstance(output, TiedLinear) else output
        if isinstance(head, nn.Module):
            noop = NoOpManager()
            head.register_forward_pre_hook(lambda *args: noop.__enter__())
            head.register_forward_hook(lambda *args: noop.__exit__(), always_call=True)
        return hooks

    def _pack(self, tensor: torch.Tensor) -> int:
        if self._first_forward_call:
            self._first_forward_call, self._first_backward_call = False, True
        self._tensor_id += 1
        tensor_id = self._tensor_id
        if tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES or isinstance(tensor, (nn.Parameter, nn.Buffer)):
            self._saved[tensor_id] = (tensor, False)
            return tensor_id
        for stashed in [i for i in self._fwd_stash if i <= tensor_id - self.max_fwd_stash_size]:
            del self._fwd_stash[stashed]
        host = tensor.detach().clone()
        count_as_host(host)
        self._saved[tensor_id] = (host, True)
        self._fwd_stash[tensor_id] = tensor
        return tensor_id

    def _unpack(self, tensor_id: int) -> torch.Tensor:
        if self._first_backward_call:
            self._graph_id = torch._C._current_graph_task_id()
            torch.autograd.variable.Variable._execution_engine.queue_callback(self._bwd_stash.clear)
            self._first_backward_call, self._first_forward_call = False, True
        tensor, offloaded = self._saved.pop(tensor_id)
        if not offloaded:
            return tensor
        node = torch._C._current_autograd_node()
        previous: List[int] = []
        if torch._C._current_graph_task_id() == self._graph_id and self._node != node:
            self._node = node
            previous = list(self._bwd_stash)
        refcount = None
        if tensor_id in self._fwd_stash:
            tensor = self._fwd_stash[tensor_id]
        else:
            tensor = tensor.clone()  # back on the device
            self._bwd_stash[tensor_id] = tensor
            refcount = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
        node.register_hook(partial(self._after_node, tensor_id, refcount, previous))
        return tensor

    def _after_node(
        self, tensor_id: int, refcount: Optional[int], previous: List[int], outputs: Any, inputs: Any
    ) -> Any:
        """After the node that unpacked ``tensor_id`` (``refcount``: its storage's use count when brought back, None
        if it was still stashed): the releases of torchtune's node hook."""
        if refcount is not None:
            brought_back = self._bwd_stash[tensor_id]
            if torch._C._storage_Use_Count(brought_back.untyped_storage()._cdata) > refcount:
                del self._bwd_stash[tensor_id]  # torchtune's record_stream case
        self._fwd_stash.clear()
        for stashed in previous:
            del self._bwd_stash[stashed]
        return outputs

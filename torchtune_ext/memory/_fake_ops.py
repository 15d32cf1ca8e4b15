"""Shortcuts for the most frequent ops of a training step on fake tensors, used by the memory estimate's tracker.

The ops run as FakeTensorMode runs them (their meta kernel, the outputs wrapped on the inputs' device) but without
its per-op bookkeeping (cache keys, device and constant checks), which is most of an estimate's time. They apply
only when every tensor argument is a fake tensor and no device is asked for; anything else goes through
FakeTensorMode. Host reads of fake values return placeholders (:func:`placeholder`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

_aten = torch.ops.aten
# Views alias their first input's storage.
VIEW_OPS = frozenset(
    {
        _aten.view.default,
        _aten.view.dtype,
        _aten._unsafe_view.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.permute.default,
        _aten.slice.Tensor,
        _aten.select.int,
        _aten.unsqueeze.default,
        _aten.squeeze.dim,
        _aten.expand.default,
        _aten.detach.default,
        _aten.alias.default,
    }
)
# Ops that make one fresh output whose shape, strides and dtype follow from those of their inputs: the output of a
# fake call is built from the metadata of the first call with the same input metadata (the meta kernels of these
# ops are Python reference implementations, slower than building the output).
# In-place and out= ops: their output is the tensor they write, whose metadata they do not change (checked on the
# first call with given input metadata, by running the meta kernel).
WRITE_OPS = {_aten.mul_.Tensor: 0, _aten.add_.Tensor: 0, _aten.add_.Scalar: 0, _aten.index_select.out: "out"}
FRESH_OUTPUT_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.bmm.default,
        _aten.mul.Tensor,
        _aten.add.Tensor,
        _aten.sub.Tensor,
        _aten.div.Tensor,
        _aten.neg.default,
        _aten.pow.Tensor_Scalar,
        _aten.rsqrt.default,
        _aten.silu.default,
        _aten.silu_backward.default,
        _aten.mean.dim,
        _aten.sum.dim_IntList,
        _aten._to_copy.default,
        _aten.clone.default,
        _aten.zeros_like.default,
    }
)


def fake_view(func, args, kwargs) -> FakeTensor:
    """A view op on a fake tensor, as FakeTensorMode runs it (the meta kernel, wrapped on the input's device)."""
    base = args[0]
    mode = base.fake_mode
    with in_kernel_invocation_manager(mode):
        out = func(*args, **kwargs)
    return mode.fake_tensor_converter.from_meta_and_device(mode, out, base.fake_device)


def all_fake(args: Any, kwargs: Dict[str, Any]) -> bool:
    """Every tensor argument is a fake tensor of one mode without a known value, and no device is asked for.

    A fake tensor made by ``torch.tensor(0.0)`` (an optimizer's step counter) carries its value (``constant``), and
    FakeTensorMode computes the ops on it for real: a later ``.item()`` must read that value (a non-fused Adam's bias
    correction divides by ``1 - beta1 ** step``), so such ops skip the shortcuts and go through FakeTensorMode."""
    if kwargs.get("device") is not None:
        return False
    mode = None
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            if (
                type(arg) is not FakeTensor
                or arg.constant is not None
                or (mode is not None and arg.fake_mode is not mode)
            ):
                return False
            mode = arg.fake_mode
        elif isinstance(arg, (list, tuple)) and any(isinstance(a, torch.Tensor) for a in arg):
            return False
    return mode is not None


def signature(arg: Any) -> Any:
    """What an op's output metadata may depend on, for one argument."""
    if isinstance(arg, torch.Tensor):
        return (tuple(arg.shape), arg.stride(), arg.dtype)
    if isinstance(arg, (list, tuple)):
        return tuple(signature(a) for a in arg)
    return (type(arg), arg)


def placeholder(tensor: torch.Tensor) -> Any:
    """The value a host read (``.item()``, ``bool()``, ``float()``) of a fake tensor returns during an estimate."""
    if tensor.dtype == torch.bool:
        return True
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return 0.0
    return 1


class FakeOutputCache:
    """The output metadata of the ops of :data:`FRESH_OUTPUT_OPS` and :data:`WRITE_OPS` per input metadata, learnt
    from each op's first call on inputs of that metadata (one cache per estimate)."""

    def __init__(self) -> None:
        self._output_metadata: Dict[Tuple[Any, ...], Any] = {}  # op signature -> output metadata (or: unchanged)

    def fresh_output(self, func, args: Any, kwargs: Dict[str, Any]) -> FakeTensor:
        """The output of an op of :data:`FRESH_OUTPUT_OPS` on fake tensors: its meta kernel the first time, then
        an empty meta tensor of the metadata it gave for inputs of the same metadata."""
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        mode, device = first.fake_mode, first.fake_device
        key = (func, signature(args), signature(tuple(kwargs.items())))
        meta = self._output_metadata.get(key)
        with in_kernel_invocation_manager(mode):
            if meta is None:
                out = func(*args, **kwargs)
                self._output_metadata[key] = (tuple(out.shape), out.stride(), out.dtype)
            else:
                out = torch.empty_strided(meta[0], meta[1], dtype=meta[2], device="meta")
        return FakeTensor(mode, out, device)

    def written_output(
        self, func, args: Any, kwargs: Dict[str, Any], track: Callable[[Any], None]
    ) -> Optional[FakeTensor]:
        """The output of an in-place or out= op of :data:`WRITE_OPS` on fake tensors (the tensor written), or None
        to run it through FakeTensorMode (when its first call with this input metadata resized the output). The first
        call gives the written tensor to ``track`` (it may have been resized)."""
        where = WRITE_OPS[func]
        written = kwargs[where] if isinstance(where, str) else args[where]
        key = (func, signature(args), signature(tuple(kwargs.items())))
        known = self._output_metadata.get(key)
        if known is None:
            before = (tuple(written.shape), written.stride(), written.dtype)
            with in_kernel_invocation_manager(written.fake_mode):
                func(*args, **kwargs)
            self._output_metadata[key] = before == (tuple(written.shape), written.stride(), written.dtype)
            track(written)
            return written
        return written if known else None

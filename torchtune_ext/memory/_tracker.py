"""A dispatch-level count of live device storages, with the category of each one at the peak.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it does count NF4Tensor params (it flattens traceable
tensor subclasses into their inner tensors), and on a real CPU step it finds the same peak as this tracker (see the
tests), but (1) it registers a gradient hook on every parameter of every module it sees, which raises on frozen
params ("cannot register a hook on a tensor that doesn't require gradient"), i.e. on every QLoRA model; (2) its
categories (params, buffers, grads, activations, temporaries, optimizer state) are fixed when a storage is created,
so the peak cannot be split into NF4 weights, frozen 16/32-bit weights and adapters, nor the logits and the loss
out of the activations; (3) it updates every tracked module's peak on every op. This tracker keeps one small record
per storage (size, when it was created and freed, a provisional kind) and classifies the records live at the peak
once the step is over, when each one's fate is known (stolen as a gradient, kept as optimizer state, freed inside
the module call that made it).

Sizes are what the CUDA caching allocator would count for ``torch.cuda.max_memory_allocated``: each storage rounded
up to 512 bytes (``round_bytes``), zero-byte storages not at all. The one allocation that is not a storage and is
counted analytically is the CUDA attention backward kernels' internal workspace (:func:`attention_backward_workspace`,
and for flex attention the fp32 ``delta`` inductor's backward computes before its kernel:
:func:`flex_attention_backward_workspace`). Higher-order operators (flex attention) run on their fake
implementations, their outputs counted as an op's.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch._higher_order_ops.flex_attention import flex_attention_backward
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

# Categories of the breakdown, in display order.
NF4_WEIGHTS = "nf4_weights"
FROZEN_WEIGHTS = "frozen_weights"
BUFFERS = "buffers"
ADAPTERS = "adapters"
GRADS = "grads"
OPTIMIZER_STATE = "optimizer_state"
ACTIVATIONS = "activations"
LOGITS_LOSS = "logits_loss"
TEMPORARIES = "temporaries"
GATHERED = "gathered_params"  # FSDP2's all-gathered (unsharded) params, live between unshard and reshard
CATEGORIES = (
    NF4_WEIGHTS,
    FROZEN_WEIGHTS,
    BUFFERS,
    ADAPTERS,
    GRADS,
    OPTIMIZER_STATE,
    ACTIVATIONS,
    LOGITS_LOSS,
    TEMPORARIES,
    GATHERED,
)
#: categories allocated once before training that stay for the whole run.
PERSISTENT_CATEGORIES = (NF4_WEIGHTS, FROZEN_WEIGHTS, BUFFERS, ADAPTERS, OPTIMIZER_STATE)

# Provisional kinds, resolved into categories after the step.
_FORWARD = "forward"  # made in a forward (or an activation-checkpointing recomputation)
_BACKWARD = "backward"  # made by a backward node of the decoder body
_OPTIMIZER = "optimizer"  # made inside optimizer.step()

_AUTOGRAD_NO_SEQ = 2**64 - 1  # sequence number of AccumulateGrad nodes
_PLAIN_TYPES = (torch.Tensor, nn.Parameter, FakeTensor)
_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
_DEVICE = torch.ops.prim.device.default
_NO_ALLOCATION_OPS = frozenset({_DEVICE, torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int})
_aten = torch.ops.aten
# The most frequent ops of a training step, run on fake tensors as FakeTensorMode runs them (their meta kernel, the
# outputs wrapped on the inputs' device) but without its per-op bookkeeping (cache keys, device and constant
# checks), which is most of an estimate's time. Only when every tensor argument is a fake tensor and no device is
# asked for; anything else goes through FakeTensorMode. Views alias their first input's storage.
_VIEW_OPS = frozenset(
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
_WRITE_OPS = {_aten.mul_.Tensor: 0, _aten.add_.Tensor: 0, _aten.add_.Scalar: 0, _aten.index_select.out: "out"}
_FRESH_OUTPUT_OPS = frozenset(
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


class _Call:
    """One module call: its name and the tick at which it returned."""

    __slots__ = ("name", "exit")

    def __init__(self, name: str):
        self.name = name
        self.exit: Optional[int] = None


class _Record:
    """One storage: its (rounded) size, kind, and the ticks at which it was created and freed."""

    __slots__ = ("nbytes", "raw", "kind", "alloc", "free", "call", "ref")

    def __init__(self, nbytes: int, raw: int, kind: str, alloc: int, call: Optional[_Call]):
        self.nbytes = nbytes
        self.raw = raw
        self.kind = kind
        self.alloc = alloc
        self.free: Optional[int] = None
        self.call = call
        self.ref: Optional[weakref.ref] = None


@dataclass(frozen=True)
class TrackerResult:
    """What a tracked run found.

    Attributes:
        peak_bytes (int): the largest total of live storages.
        breakdown (Dict[str, int]): bytes per category at that peak (sums to ``peak_bytes``).
        phase (str): where the peak happened ("forward", "loss", "backward", "optimizer step", ...).
        where (str): the innermost module call (forward) or autograd node (backward) at the peak.
        phase_peaks (Dict[str, int]): the largest total seen in each phase.
        host_bytes (int): bytes the step declared host memory (:func:`count_as_host`), in all.
        pinned_host_peak_bytes (int): the peak of those live at once, each rounded up to a power of two as torch's
            caching host allocator (pinned memory) rounds every block: what it reserves.
    """

    peak_bytes: int
    breakdown: Dict[str, int]
    phase: str
    where: str
    phase_peaks: Dict[str, int]
    host_bytes: int = 0
    pinned_host_peak_bytes: int = 0


def pinned_block_bytes(nbytes: int) -> int:
    """The block torch's caching host allocator reserves for ``nbytes`` of pinned memory: the next power of two
    (``c10::llvm::PowerOf2Ceil`` in ``CachingHostAllocator``).

    Args:
        nbytes (int): the tensor's bytes.

    Returns:
        int: the block's bytes (0 for 0).
    """
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _round(nbytes: int, round_bytes: int) -> int:
    if nbytes <= 0:
        return 0
    return -(-nbytes // round_bytes) * round_bytes


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``tensor``; a traceable tensor subclass (NF4Tensor) stands for its inner tensors."""
    if is_traceable_wrapper_subclass(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    yield tensor.untyped_storage()


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors among an op's outputs (a tensor, or a flat tuple/list that may hold None)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from _tensors(item)


def _placeholder(tensor: torch.Tensor) -> Any:
    """The value a host read (``.item()``, ``bool()``, ``float()``) of a fake tensor returns during an estimate."""
    if tensor.dtype == torch.bool:
        return True
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return 0.0
    return 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def attention_backward_workspace(query: torch.Tensor, backend: Optional[str] = None) -> int:
    """Bytes the CUDA attention backward kernels allocate inside the op (not as outputs), for ``query`` of shape
    ``[batch, heads, seq, head_dim]``: FlashAttention-2 (``"flash"``: 16-bit inputs on sm80+) keeps an fp32 dQ
    accumulator ``[batch, seq rounded to 128, heads, head_dim rounded to 32]`` and fp32 softmax row sums ``[batch,
    heads, seq rounded to 128]``; the memory-efficient kernel (``"efficient"``) keeps the fp32 row sums ``[batch,
    heads, seq]`` and, for 16-bit inputs (fp16 on a T4), an fp32 dQ accumulator ``[batch, heads, seq, head_dim]``
    (fp32 inputs accumulate in dQ itself). The CPU kernel's own scratch is not the GPU's, so this is counted
    analytically.

    Args:
        query (torch.Tensor): the attention query.
        backend (Optional[str]): ``"flash"`` or ``"efficient"`` (a device profile's ``sdpa_backend``); None: by
            dtype, as on sm80+ (flash for 16-bit, efficient for fp32).

    Returns:
        int: bytes.

    Raises:
        ValueError: for the ``"math"`` backend, whose O(seq^2) intermediates this estimate does not run.
    """
    batch, heads, seq, head_dim = query.shape
    sixteen_bit = query.dtype != torch.float32
    backend = backend or ("flash" if sixteen_bit else "efficient")
    if backend == "math":
        raise ValueError(
            "the math SDPA kernel (O(seq^2) memory) is not estimated: use a dtype the device's fused "
            "attention kernels take (fp32 or fp16 below sm80)"
        )
    if backend == "efficient":
        return 4 * batch * heads * seq * ((head_dim + 1) if sixteen_bit else 1)
    seq_rounded = _round_up(seq, 128)
    return 4 * batch * seq_rounded * heads * _round_up(head_dim, 32) + 4 * batch * heads * seq_rounded


def flex_attention_backward_workspace(query: torch.Tensor) -> int:
    """Bytes inductor's flex attention backward allocates besides its outputs, for ``query`` of shape ``[batch,
    heads, seq, head_dim]``: ``delta = (out * grad_out).sum(-1)`` in fp32, ``[batch, heads, seq]``
    (``torch/_inductor/kernel/flex/flex_attention.py``); the kernel accumulates dQ in registers, not in memory.

    Args:
        query (torch.Tensor): the attention query.

    Returns:
        int: bytes.
    """
    batch, heads, seq, _ = query.shape
    return 4 * batch * heads * seq


# Attention backward ops and the position of their query argument; their kernel-internal workspace is added for the
# duration of the op (see attention_backward_workspace).
_ATTENTION_BACKWARD = {
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 1,
    _aten._scaled_dot_product_flash_attention_backward.default: 1,
    _aten._scaled_dot_product_efficient_attention_backward.default: 1,
}


def _fake_view(func, args, kwargs) -> FakeTensor:
    """A view op on a fake tensor, as FakeTensorMode runs it (the meta kernel, wrapped on the input's device)."""
    base = args[0]
    mode = base.fake_mode
    with in_kernel_invocation_manager(mode):
        out = func(*args, **kwargs)
    return mode.fake_tensor_converter.from_meta_and_device(mode, out, base.fake_device)


def _all_fake(args: Any, kwargs: Dict[str, Any]) -> bool:
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


def _signature(arg: Any) -> Any:
    """What an op's output metadata may depend on, for one argument."""
    if isinstance(arg, torch.Tensor):
        return (tuple(arg.shape), arg.stride(), arg.dtype)
    if isinstance(arg, (list, tuple)):
        return tuple(_signature(a) for a in arg)
    return (type(arg), arg)


_ACTIVE: List[LiveStorageTracker] = []


def count_as_host(tensor: torch.Tensor) -> None:
    """Declares ``tensor`` host memory for the estimate in progress (no-op outside an estimate).

    Under fake CPU tensors every storage looks alike, so a step that moves tensors off the device (activation
    offloading) calls this on what it moved: those storages then count as host memory, not device memory.

    Args:
        tensor (torch.Tensor): a tensor now held in host memory.
    """
    if _ACTIVE:
        _ACTIVE[-1].move_to_host(tensor)


@contextmanager
def uncounted() -> Iterator[None]:
    """Within: the ops' outputs are not counted by the estimate in progress (no-op outside an estimate).

    For values a compiled kernel keeps in registers, never in device memory (inductor's fused pointwise ops, see
    ``torchtune_ext.memory._compiled``): the op still runs, on fake tensors, so that later ops get their inputs.
    """
    tracker = _ACTIVE[-1] if _ACTIVE else None
    if tracker is not None:
        tracker._paused += 1
    try:
        yield
    finally:
        if tracker is not None:
            tracker._paused -= 1


class LiveStorageTracker(TorchDispatchMode):
    """Counts live storages op by op and classifies those live at the peak.

    Every op's outputs are looked at once the op has run: a storage not seen before is new memory (a view shares
    its base's storage and costs nothing); a weak reference on it says when it is freed. Ops on traceable tensor
    subclasses (NF4Tensor) are passed to the subclass first, so the ops it runs on its inner tensors are counted
    like any others. Host reads of fake tensors (``.item()``, ``bool()``) return placeholders (True, 1, 0.0) instead
    of failing: the step follows the branch where the batch has label tokens and the optimizer step is taken; fake
    tensors whose value FakeTensorMode knows (made by ``torch.tensor(...)``, such as an optimizer's step counter)
    return that value. The
    most frequent ops on fake tensors (views, elementwise, matmuls) skip FakeTensorMode's per-op bookkeeping: their
    outputs are built from the meta kernels' metadata (see :data:`_VIEW_OPS`, :data:`_FRESH_OUTPUT_OPS`), faster
    (BENCHMARKS.md, "Measurements behind design choices").

    Provisional kinds: the caller registers params, buffers and inputs (:meth:`register`); tensors made in a
    forward are activations if they outlive the module call that made them, temporaries if not; those made after
    ``head_after`` returned (the output projection, the loss) and by their backward nodes are logits/loss; the rest
    of backward makes temporaries, except what becomes a parameter's ``.grad`` (:meth:`retag`); what ``optimizer.step``
    keeps in ``optimizer.state`` is optimizer state, anything else it makes a temporary.

    Args:
        round_bytes (int): allocation granularity (512: the CUDA caching allocator's).
        attention_backend (Optional[str]): the SDPA kernel whose backward workspace is counted
            (:func:`attention_backward_workspace`); None: by dtype, as on sm80+.
    """

    def __init__(self, round_bytes: int = 512, attention_backend: Optional[str] = None):
        super().__init__()
        self.round_bytes = round_bytes
        self.attention_backend = attention_backend
        self._live: Dict[int, _Record] = {}
        self._records: List[_Record] = []
        self._host: Dict[int, weakref.ref] = {}
        self._host_bytes = 0
        self._pinned = 0
        self._pinned_peak = 0
        self._tick = 0
        self._total = 0
        self._peak = 0
        self._peak_tick = 0
        self._peak_phase = ("", "")
        self._phase_peaks: Dict[str, int] = {}
        self._calls: List[_Call] = []
        self._names: Dict[int, str] = {}
        self._root: Optional[nn.Module] = None
        self._head_after: Optional[nn.Module] = None
        self._head_seq: Optional[int] = None
        self._in_head = False
        self._in_optimizer = 0
        self._stage = "step"
        self._handles: List[Any] = []
        self._output_metadata: Dict[Any, Any] = {}  # op signature -> output metadata (or: unchanged)
        self._resizable: Dict[int, weakref.ref] = {}  # storages written by out= ops (FSDP2's all-gather outputs)
        self._polling = False
        self._paused = 0  # > 0: inside uncounted()

    # ------------------------------------------------------------------------------------------ configuration

    def watch(self, model: nn.Module, head_after: Optional[nn.Module] = None) -> None:
        """Names ``model``'s modules for the report and marks where its output head starts.

        Args:
            model (nn.Module): the model (its forward starts a new step's forward).
            head_after (Optional[nn.Module]): the module after whose forward the output projection and loss begin
                (the last decoder layer); None: no logits/loss category.
        """
        self._root = model
        self._head_after = head_after
        for name, module in model.named_modules():
            self._names[id(module)] = name.replace("_checkpoint_wrapped_module.", "") or "model"

    def set_stage(self, stage: str) -> None:
        """Labels what runs next (e.g. "warm-up"), for the phase of the peak."""
        self._stage = stage

    # --------------------------------------------------------------------------------------------- tracking

    def register(self, tensor: torch.Tensor, kind: str) -> None:
        """Counts ``tensor``'s storages (not seen before) as ``kind`` from now on.

        Args:
            tensor (torch.Tensor): a tensor made outside the tracked ops (param, buffer, input).
            kind (str): its category.
        """
        for storage in _storages(tensor):
            self._add(storage, kind, None)

    def retag(self, tensor: Optional[torch.Tensor], kind: str) -> None:
        """Gives ``tensor``'s counted storages the category ``kind`` (a gradient, optimizer state)."""
        if tensor is None:
            return
        for storage in _storages(tensor):
            record = self._live.get(storage._cdata)
            if record is not None:
                record.kind = kind

    def move_to_host(self, tensor: torch.Tensor) -> None:
        """Stops counting ``tensor``'s storages as device memory (see :func:`count_as_host`)."""
        for storage in _storages(tensor):
            key = storage._cdata
            record = self._live.pop(key, None)
            if record is not None:
                self._release(record)
                self._host_bytes += record.nbytes
                block = pinned_block_bytes(record.raw)
                self._pinned += block
                self._pinned_peak = max(self._pinned_peak, self._pinned)
                self._host[key] = weakref.ref(storage, self._host_freed_callback(key, block))

    def _host_freed_callback(self, key: int, block: int):
        def freed(_: weakref.ref) -> None:
            if self._host.pop(key, None) is not None:
                self._pinned -= block

        return freed

    def _add(self, storage: torch.UntypedStorage, kind: str, call: Optional[_Call]) -> None:
        key = storage._cdata
        record = self._live.get(key)
        raw = storage.nbytes()
        if record is not None:
            if record.raw != raw:  # resized in place (an out= op)
                self._total += _round(raw, self.round_bytes) - record.nbytes
                record.raw, record.nbytes = raw, _round(raw, self.round_bytes)
                self._bump()
            return
        if key in self._host:
            return
        self._tick += 1
        record = _Record(_round(raw, self.round_bytes), raw, kind, self._tick, call)
        record.ref = weakref.ref(storage, self._freed_callback(key, record))
        self._live[key] = record
        self._records.append(record)
        self._total += record.nbytes
        self._bump()

    def _freed_callback(self, key: int, record: _Record):
        def freed(_: weakref.ref) -> None:
            if self._live.get(key) is record:
                del self._live[key]
                self._release(record)

        return freed

    def _release(self, record: _Record) -> None:
        self._tick += 1
        record.free = self._tick
        self._total -= record.nbytes

    def _bump(self) -> None:
        if self._total > self._peak and self._resizable and not self._polling:
            self._poll_resizable()  # a storage FSDP freed since the last poll must not make a peak
        phase = self._phase()
        if self._total > self._phase_peaks.get(phase, -1):
            self._phase_peaks[phase] = self._total
        if self._total > self._peak:
            self._peak = self._total
            self._peak_tick = self._tick
            self._peak_phase = (phase, self._where())

    # ------------------------------------------------------------------------------------------------ state

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _phase(self) -> str:
        if self._in_optimizer:
            return "warm-up optimizer step" if self._stage == "warm-up" else "optimizer step"
        if self._in_backward():
            return "backward (recomputation)" if self._calls else "backward"
        if self._in_head:
            return "logits/loss"
        return "forward" if self._calls else self._stage

    def _where(self) -> str:
        if self._calls:
            return self._calls[-1].name
        if self._in_backward():
            node = torch._C._current_autograd_node()
            return node.name() if node is not None else "autograd engine"
        return "step code, outside modules"

    def _kind(self) -> Tuple[str, Optional[_Call]]:
        """The provisional kind of a storage made now, and the module call making it."""
        if self._in_optimizer:
            return _OPTIMIZER, None
        if self._in_backward():
            if self._calls:  # activation checkpointing recomputes the forward inside backward
                return _FORWARD, self._calls[-1]
            node = torch._C._current_autograd_node()
            if node is not None and self._head_seq is not None:
                seq = node._sequence_nr()
                if self._head_seq < seq < _AUTOGRAD_NO_SEQ:
                    return LOGITS_LOSS, None
            return _BACKWARD, None
        if self._in_head:
            return LOGITS_LOSS, None
        return _FORWARD, self._calls[-1] if self._calls else None

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        if func in _VIEW_OPS and type(args[0]) is FakeTensor and args[0].constant is None:
            return _fake_view(func, args, kwargs)
        if func in _FRESH_OUTPUT_OPS and _all_fake(args, kwargs):
            out = self._fresh_output(func, args, kwargs)
            self._track_outputs(out)
            return out
        if func in _WRITE_OPS and _all_fake(args, kwargs):
            written = self._written_output(func, args, kwargs)
            if written is not None:
                return written
        if func is _DEVICE and type(args[0]) is FakeTensor:
            return args[0].fake_device
        if func in _NO_ALLOCATION_OPS:
            return func(*args, **kwargs)
        if func is _LOCAL_SCALAR_DENSE and isinstance(args[0], FakeTensor) and args[0].constant is None:
            return _placeholder(args[0])  # a known value (``constant``) is read by FakeTensorMode below
        if any(t not in _PLAIN_TYPES for t in types):
            return NotImplemented  # a tensor subclass runs its own ops first; those come back here
        out = func(*args, **kwargs)
        self._track_outputs(out)
        if "out" in kwargs and getattr(func, "namespace", None) == "fsdp":
            self._track_written(kwargs["out"])  # FSDP2's copy into the storages it gathers into
        if func in _ATTENTION_BACKWARD:
            self._spike(attention_backward_workspace(args[_ATTENTION_BACKWARD[func]], self.attention_backend))
        return out

    def _higher_order(self, func: HigherOrderOperator, args: Any, kwargs: Dict[str, Any]) -> Any:
        """A higher-order operator (flex attention): its implementation below this mode (FakeTensorMode's: its
        outputs' shapes), its outputs counted, and its kernel's workspace."""
        out = func(*args, **kwargs)
        self._track_outputs(out)
        if func is flex_attention_backward:
            self._spike(flex_attention_backward_workspace(args[0]))
        return out

    def _spike(self, nbytes: int) -> None:
        """Counts ``nbytes`` of kernel-internal workspace live now, on top of the op's inputs and outputs."""
        self._tick += 1
        record = _Record(_round(nbytes, self.round_bytes), nbytes, _BACKWARD, self._tick, None)
        self._records.append(record)
        self._total += record.nbytes
        self._bump()
        self._release(record)

    def _fresh_output(self, func, args: Any, kwargs: Dict[str, Any]) -> FakeTensor:
        """The output of an op of :data:`_FRESH_OUTPUT_OPS` on fake tensors: its meta kernel the first time, then
        an empty meta tensor of the metadata it gave for inputs of the same metadata."""
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        mode, device = first.fake_mode, first.fake_device
        key = (func, _signature(args), _signature(tuple(kwargs.items())))
        meta = self._output_metadata.get(key)
        with in_kernel_invocation_manager(mode):
            if meta is None:
                out = func(*args, **kwargs)
                self._output_metadata[key] = (tuple(out.shape), out.stride(), out.dtype)
            else:
                out = torch.empty_strided(meta[0], meta[1], dtype=meta[2], device="meta")
        return FakeTensor(mode, out, device)

    def _written_output(self, func, args: Any, kwargs: Dict[str, Any]) -> Optional[FakeTensor]:
        """The output of an in-place or out= op of :data:`_WRITE_OPS` on fake tensors (the tensor written), or None
        to run it through FakeTensorMode (when its first call with this input metadata resized the output)."""
        where = _WRITE_OPS[func]
        written = kwargs[where] if isinstance(where, str) else args[where]
        key = (func, _signature(args), _signature(tuple(kwargs.items())))
        known = self._output_metadata.get(key)
        if known is None:
            before = (tuple(written.shape), written.stride(), written.dtype)
            with in_kernel_invocation_manager(written.fake_mode):
                func(*args, **kwargs)
            self._output_metadata[key] = before == (tuple(written.shape), written.stride(), written.dtype)
            self._track_outputs(written)  # counts a resize
            return written
        return written if known else None

    def _track_outputs(self, out: Any) -> None:
        if self._paused:
            return
        kind = None
        for tensor in _tensors(out):
            if type(tensor) is not FakeTensor and is_traceable_wrapper_subclass(tensor):
                continue  # its inner tensors came out of ops counted here
            storage = tensor.untyped_storage()
            if kind is None and storage._cdata not in self._live:
                kind = self._kind()
            self._add(storage, *(kind or (None, None)))

    def _track_written(self, out: Any) -> None:
        """The storages FSDP2's out= copy wrote: counted (again) if their size changed, watched for later resizes.

        FSDP2 frees an all-gathered param by resizing its storage to 0 bytes and gathers it again into the same
        storage (``free_storage`` / ``alloc_storage``), with no op to see; its copy into them is an out= op
        (``fsdp.split_with_sizes_copy``). Those storages are polled (:meth:`_poll_resizable`) before a new peak is
        recorded and at every module call, so a freed one stops counting."""
        for tensor in _tensors(out):
            for storage in _storages(tensor):
                key = storage._cdata
                if key in self._host:
                    continue
                self._resizable.setdefault(key, weakref.ref(storage))
                record = self._live.get(key)
                if record is None:
                    self._add(storage, GATHERED, None)
                else:
                    record.kind = GATHERED
                    self._add(storage, GATHERED, None)  # counts a resize

    def _poll_resizable(self) -> None:
        """Updates the count of the watched storages whose size changed outside any op (see :meth:`_track_written`)."""
        self._polling = True
        try:
            for key, ref in list(self._resizable.items()):
                storage = ref()
                if storage is None:
                    del self._resizable[key]
                    continue
                record = self._live.get(key)
                raw = storage.nbytes()
                if record is not None and raw == 0:
                    del self._live[key]
                    self._release(record)
                elif raw > 0 and (record is None or record.raw != raw):
                    self._add(storage, GATHERED, None)
        finally:
            self._polling = False

    # ------------------------------------------------------------------------------------------------ hooks

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._resizable:
            self._poll_resizable()
        if module is self._root and not self._in_backward():
            self._in_head = False
        self._calls.append(_Call(self._names.get(id(module), type(module).__name__)))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._calls:
            call = self._calls.pop()
            self._tick += 1
            call.exit = self._tick
        if module is self._head_after and not self._in_backward():
            self._in_head = True
            grad_fn = getattr(output, "grad_fn", None)
            self._head_seq = grad_fn._sequence_nr() if grad_fn is not None else None

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._in_optimizer += 1

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.retag(value, OPTIMIZER_STATE)
        self._in_optimizer -= 1

    def __enter__(self) -> LiveStorageTracker:
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre_forward),
            nn.modules.module.register_module_forward_hook(self._post_forward, always_call=True),
            register_optimizer_step_pre_hook(self._pre_step),
            register_optimizer_step_post_hook(self._post_step),
        ]
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        _ACTIVE.remove(self)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------------------------------------ result

    def _category(self, record: _Record) -> str:
        if record.kind == _FORWARD:
            call = record.call
            died_inside = call is not None and record.free is not None and call.exit is not None
            return TEMPORARIES if died_inside and record.free < call.exit else ACTIVATIONS
        if record.kind in (_BACKWARD, _OPTIMIZER):
            return TEMPORARIES
        return record.kind

    def result(self) -> TrackerResult:
        """The peak and its breakdown by category (call after the tracked step).

        Returns:
            TrackerResult: the peak, its breakdown, and where it happened.
        """
        breakdown = dict.fromkeys(CATEGORIES, 0)
        tick = self._peak_tick
        for record in self._records:
            if record.alloc <= tick and (record.free is None or record.free > tick):
                category = self._category(record)
                breakdown[category] = breakdown.get(category, 0) + record.nbytes
        total = sum(breakdown.values())
        assert total == self._peak, f"breakdown {total} != peak {self._peak}"
        return TrackerResult(
            peak_bytes=self._peak,
            breakdown=breakdown,
            phase=self._peak_phase[0],
            where=self._peak_phase[1],
            phase_peaks=dict(self._phase_peaks),
            host_bytes=self._host_bytes,
            pinned_host_peak_bytes=self._pinned_peak,
        )

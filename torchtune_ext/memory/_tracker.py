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
counted analytically is the attention backward kernels' internal workspace (``torchtune_ext.memory._workspace``).
Higher-order operators (flex attention) run on their fake implementations, their outputs counted as an op's; the
most frequent ops on fake tensors take the shortcuts of ``torchtune_ext.memory._fake_ops``.
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
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from torchtune_ext.memory._fake_ops import (
    FRESH_OUTPUT_OPS,
    VIEW_OPS,
    WRITE_OPS,
    FakeOutputCache,
    all_fake,
    fake_view,
    placeholder,
)
from torchtune_ext.memory._workspace import (
    ATTENTION_BACKWARD,
    attention_backward_workspace,
    flex_attention_backward_workspace,
    pinned_block_bytes,
)

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
    outputs are built from the meta kernels' metadata (``torchtune_ext.memory._fake_ops``), faster
    (BENCHMARKS.md, "Measurements behind design choices").

    Provisional kinds: the caller registers params, buffers and inputs (:meth:`register`); tensors made in a
    forward are activations if they outlive the module call that made them, temporaries if not; those made after
    ``head_after`` returned (the output projection, the loss) and by their backward nodes are logits/loss; the rest
    of backward makes temporaries, except what becomes a parameter's ``.grad`` (:meth:`retag`); what ``optimizer.step``
    keeps in ``optimizer.state`` is optimizer state, anything else it makes a temporary.

    Args:
        round_bytes (int): allocation granularity (512: the CUDA caching allocator's).
        attention_backend (Optional[str]): the SDPA kernel whose backward workspace is counted
            (``attention_backward_workspace``); None: by dtype, as on sm80+.
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
        self._fake_outputs = FakeOutputCache()
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
        if func in VIEW_OPS and type(args[0]) is FakeTensor and args[0].constant is None:
            return fake_view(func, args, kwargs)
        if func in FRESH_OUTPUT_OPS and all_fake(args, kwargs):
            out = self._fake_outputs.fresh_output(func, args, kwargs)
            self._track_outputs(out)
            return out
        if func in WRITE_OPS and all_fake(args, kwargs):
            written = self._fake_outputs.written_output(func, args, kwargs, self._track_outputs)
            if written is not None:
                return written
        if func is _DEVICE and type(args[0]) is FakeTensor:
            return args[0].fake_device
        if func in _NO_ALLOCATION_OPS:
            return func(*args, **kwargs)
        if func is _LOCAL_SCALAR_DENSE and isinstance(args[0], FakeTensor) and args[0].constant is None:
            return placeholder(args[0])  # a known value (``constant``) is read by FakeTensorMode below
        if any(t not in _PLAIN_TYPES for t in types):
            return NotImplemented  # a tensor subclass runs its own ops first; those come back here
        out = func(*args, **kwargs)
        self._track_outputs(out)
        if "out" in kwargs and getattr(func, "namespace", None) == "fsdp":
            self._track_written(kwargs["out"])  # FSDP2's copy into the storages it gathers into
        if func in ATTENTION_BACKWARD:
            self._spike(attention_backward_workspace(args[ATTENTION_BACKWARD[func]], self.attention_backend))
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

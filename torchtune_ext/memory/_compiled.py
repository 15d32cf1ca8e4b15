"""Compiled steps (``compile=True``): what the compiled graphs keep and free, run on fake tensors.

torchtune's recipe compiles each decoder layer (``torchtune.training.compile_model``: ``layer.compile()`` on every
``TransformerSelfAttentionLayer``) and the loss's cross-entropy (``compile_loss``: ``loss.compute_cross_entropy``).
torch.compile hands each to AOTAutograd, which traces forward and backward as one joint graph (with inductor's
decompositions) and splits it with ``min_cut_rematerialization_partition(compiler="inductor")``: the forward graph's
extra outputs are what the layer keeps for its backward; the rest is recomputed there. Inductor then fuses pointwise
ops into kernels, so only some graph values ever occupy device memory.

:func:`compile_for_estimate` gives the estimator's fake model the same: each compiled part becomes the AOTAutograd
partition of its forward and backward, traced at the run's shapes, run node by node (:class:`_GraphRunner`): a
node's output is counted only where inductor materializes a buffer (:func:`materialized_nodes`), each value is
dropped after its last use, and the backward graph frees its saved inputs as it consumes them (the boxed calling
convention inductor's code uses). The estimator's tracker then counts the compiled step as it counts an eager one:
what activation checkpointing discards and recomputes, the gradients, the optimizer state, the peak.

Dynamo itself is not run: it skips frames while a dispatch mode (the tracker) is active. AOTAutograd traces the
layer's forward directly, which is the graph dynamo hands it for a layer without graph breaks. Our NF4 linear decodes
through a cached table (a global tensor), which dynamo lifts into a graph input; the trace takes it as an input too.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import fx, nn
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_ext.memory._fake import _TABLE_CACHES, _nf4_code_modules
from torchtune_ext.memory._steps import Setup, captured_tensors, with_captured_tensors
from torchtune_ext.memory._tracker import LiveStorageTracker, uncounted
from torchtune_ext.modules import FrozenNF4Linear, LoRALinear
from torchtune_ext.nf4 import NF4Tensor

_aten = torch.ops.aten
# Ops that alias their input (no storage of their own), as the tracker counts them.
_ALIASING = frozenset({_aten._unsafe_view.default, _aten.alias.default, _aten.detach.default})
# Reductions: inductor always realizes a reduction's output (``make_reduction`` calls ``realize()``).
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "prod", "var_mean", "argmax", "argmin", "any"})
_PARTITION = functools.partial(min_cut_rematerialization_partition, compiler="inductor")


# Inductor is imported on first use, not with this package (seconds of import time for every recipe start).
@functools.cache
def _decompositions() -> Dict[Any, Callable[..., Any]]:
    """Inductor's decompositions, less those that replace the fused attention kernels by their O(seq^2) math: on
    CUDA, inductor calls the flash / memory-efficient kernels as extern kernels."""
    from torch._inductor.decomposition import select_decomp_table

    return {k: v for k, v in select_decomp_table().items() if "scaled_dot_product" not in str(k)}


def _is_alias(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _ALIASING)


def _is_extern(node: fx.Node) -> bool:
    """An op inductor runs as its own kernel on realized inputs (matmuls, attention, fallbacks, flex attention's
    templates), not in a loop."""
    from torch._inductor import lowering

    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target in lowering.needs_realized_inputs or target in lowering.fallbacks or target not in lowering.lowerings


def _base(node: fx.Node) -> fx.Node:
    """The node owning ``node``'s storage (through views and items of a multi-output op)."""
    while node.op == "call_function" and (_is_alias(node) or node.target is operator.getitem):
        node = node.args[0]
    return node


def materialized_nodes(graph: fx.Graph) -> Set[fx.Node]:
    """The nodes of an AOTAutograd graph whose outputs inductor keeps in a buffer (device memory).

    Inductor's rules (``torch/_inductor/lowering.py``, ``ir.py``): inputs and outputs of the graph are buffers;
    extern kernels (matmuls, attention, fallbacks) write buffers and read realized inputs; reductions are realized;
    a pointwise value is inlined into its consumers unless it has more than one user and reads more than
    ``realize_reads_threshold`` buffers or has more than ``realize_opcount_threshold`` ops, or it has accumulated
    more than ``realize_acc_reads_threshold`` reads (its GPU rules: on a CPU, inductor also realizes reused values
    with an exp, log, sigmoid or tanh). Not modelled, each an upper bound: the scheduler's later fusion of realized
    pointwise buffers into their consumers' kernels (which removes some buffers), and pattern rewrites such as an
    ``mm`` followed by the add of a full matrix becoming one ``addmm`` (one buffer less).

    Args:
        graph (fx.Graph): a forward or backward graph of the partition.

    Returns:
        Set[fx.Node]: the materialized nodes (owners of storages; views are not listed).
    """
    from torch._inductor import config as inductor_config

    realized: Set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            realized.add(node)
        elif node.op == "output":
            realized.update(_base(n) for n in tree_flatten(node.args)[0] if isinstance(n, fx.Node))
        elif _is_extern(node):
            realized.add(node)
            realized.update(_base(n) for n in node.all_input_nodes)
        elif isinstance(node.target, torch._ops.OpOverload) and node.target.__name__.split(".")[0] in _REDUCTIONS:
            realized.add(node)
    reads: Dict[fx.Node, Set[fx.Node]] = {}
    opcount: Dict[fx.Node, int] = {}
    reads_limit = inductor_config.realize_reads_threshold
    ops_limit = inductor_config.realize_opcount_threshold or inductor_config._realize_opcount_threshold_default
    acc_limit = inductor_config.realize_acc_reads_threshold or inductor_config._realize_acc_reads_threshold_default
    for node in graph.nodes:
        if node.op != "call_function" or _base(node) is not node or node in realized:
            continue
        inputs = [_base(n) for n in node.all_input_nodes]
        reads[node] = set().union(*({n} if n in realized else reads.get(n, set()) for n in inputs))
        opcount[node] = 1 + sum(opcount.get(n, 0) for n in inputs if n not in realized)
        many_users = len(node.users) > 1 and (len(reads[node]) > reads_limit or opcount[node] > ops_limit)
        if many_users or len(reads[node]) > acc_limit:
            realized.add(node)
    return realized


class _GraphRunner:
    """Runs one graph of the partition on fake tensors, as inductor's compiled code holds memory: only
    materialized values counted, each dropped after its last use, the inputs released as they are consumed."""

    _boxed_call = True  # AOTAutograd passes a list it gives up, so saved tensors can be freed inside the graph

    def __init__(self, module: fx.GraphModule):
        self.module = module  # its submodules: the score and mask functions of flex attention
        self.nodes = list(module.graph.nodes)
        self.counted = materialized_nodes(module.graph)
        for node in self.nodes:
            node.meta.clear()  # its example values: on fake inputs, the traced call's own tensors, kept alive
        last_use: Dict[fx.Node, fx.Node] = {}
        for node in self.nodes:
            for used in node.all_input_nodes:
                last_use[used] = node
        self.dead_after: Dict[fx.Node, List[fx.Node]] = {}
        for used, user in last_use.items():
            self.dead_after.setdefault(user, []).append(used)

    def __call__(self, args: List[Any]) -> Any:
        inputs = iter(list(args))
        args.clear()
        env: Dict[fx.Node, Any] = {}
        for node in self.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], env.__getitem__)
            elif node.op == "get_attr":
                env[node] = operator.attrgetter(node.target)(self.module)
            else:
                env[node] = self._run(node, env)
            for dead in self.dead_after.get(node, ()):
                env.pop(dead, None)
        raise RuntimeError("graph without an output node")

    def _run(self, node: fx.Node, env: Dict[fx.Node, Any]) -> Any:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if _base(node) in self.counted:  # a view: counted with its base (on real tensors, a view of an
            return node.target(*args, **kwargs)  # uncounted value would count that value's storage)
        with uncounted():
            return node.target(*args, **kwargs)


def _compiler(module: fx.GraphModule, example_inputs: Any) -> _GraphRunner:
    return _GraphRunner(module)


def _signature(values: Any) -> Tuple[Any, ...]:
    leaves = tree_flatten(values)[0]
    return tuple(
        (tuple(v.shape), v.dtype, v.requires_grad, type(v)) if isinstance(v, torch.Tensor) else (type(v), v)
        for v in leaves
    ) + (torch.is_grad_enabled(),)


class _Untracked:
    """Within: the estimate's tracker is off the dispatch stack (AOTAutograd traces; the trace is not the step)."""

    def __enter__(self) -> None:
        self._pop = _pop_mode_temporarily() if isinstance(_get_current_dispatch_mode(), LiveStorageTracker) else None
        if self._pop is not None:
            self._pop.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._pop is not None:
            self._pop.__exit__(*exc)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _example(value: Any) -> Any:
    """A fresh tensor like ``value`` (same metadata; zeros: valid indices on real tensors), for a trace; anything
    else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.zeros_like(value).requires_grad_(value.requires_grad)


class _AotCompiled:
    """``fn(params, *args)`` compiled as torch.compile's AOTAutograd stage does, one trace per input signature
    (shapes, dtypes, grad mode), shared by every module of the same structure (the decoder layers). ``context``: what
    the trace closes over besides the tensors (what their shapes determine, such as a ``BlockMask``'s structure),
    passed to ``fn`` as ``context=`` when there is one."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.compiled: Dict[Tuple[Any, ...], Callable[..., Any]] = {}

    def __call__(self, params: Dict[str, torch.Tensor], *args: Any, context: Any = None) -> Any:
        key = _signature((params, args))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = aot_function(
                self.fn if context is None else functools.partial(self.fn, context=context),
                fw_compiler=_compiler,
                bw_compiler=_compiler,
                partition_fn=_PARTITION,
                decompositions=_decompositions(),
            )
            # The trace runs the graphs once: uncounted, its saved tensors hidden from any activation checkpointing
            # around this call, on copies of the inputs (AOTAutograd keeps its example inputs alive), the backward
            # graph compiled now rather than at the step's first backward (from the step's own saved tensors).
            with (
                _Untracked(),
                torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
                functorch_config.patch(force_non_lazy_backward_lowering=True),
            ):
                compiled(params, *(_example(a) for a in args))
            self.compiled[key] = compiled
        return compiled(params, *args)


def _nf4_tables() -> Dict[Any, torch.Tensor]:
    """Our NF4 codec's decoding tables (its cache, per dtype and device)."""
    return getattr(_nf4_code_modules()[1], _TABLE_CACHES[0])


def _layer_nf4_tables(layer: nn.Module) -> Dict[Any, torch.Tensor]:
    """The decoding tables our NF4 linears in ``layer`` use (torchao's decode without them), made now if they are not
    yet: counted, as an eager step makes them."""
    quad_lut = _nf4_code_modules()[1]._quad_lut
    for module in layer.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (FrozenNF4Linear, LoRALinear)) and isinstance(weight, NF4Tensor) and not weight.is_meta:
            quad_lut(weight.nf4)
    return dict(_nf4_tables())


class _TracedTables:
    """Within: the codec reads the decoding tables the trace takes as inputs (set by the traced forward), as dynamo
    lifts the cached tables (global tensors) into graph inputs; after: the cache as it was. The trace spans the
    backward too, so the tables stay the traced ones until the traced call returns."""

    def __enter__(self) -> None:
        self._saved = dict(_nf4_tables())

    def __exit__(self, *exc: Any) -> None:
        _nf4_tables().clear()
        _nf4_tables().update(self._saved)


def _layer_forward(layer: nn.Module) -> Callable[..., Any]:
    def forward(
        params: Dict[str, torch.Tensor],
        tables: Dict[Any, torch.Tensor],
        x: torch.Tensor,
        mask: Any,
        input_pos: Optional[torch.Tensor],
        context: Optional[Callable[[Tuple[torch.Tensor, ...]], BlockMask]] = None,
    ) -> torch.Tensor:
        if context is not None:
            mask = context(mask)
        _nf4_tables().update(tables)
        with _reparametrize_module(layer, params):
            return type(layer).forward(layer, x, mask=mask, input_pos=input_pos)

    return forward


def _block_mask_tensors(mask: BlockMask) -> Tuple[Tuple[Any, ...], Callable[..., BlockMask]]:
    """A ``BlockMask``'s tensors and its ``mask_mod``'s captured tensors (the inputs a trace takes, as dynamo lifts
    a closure's tensors into graph inputs) and how to make the mask again from such leaves. Torch's pytree
    flattening gives both on torch 2.13; on 2.11 it keeps the captured tensors in its context, where a trace
    would bake them into the graph as constants, so those are added here."""
    leaves, context = mask._flatten()
    captured = captured_tensors(mask.mask_mod)
    if any(tensor is leaf for tensor in captured for leaf in leaves):
        captured = ()
    return (*leaves, *captured), functools.partial(_rebuild_block_mask, len(leaves), context)


def _rebuild_block_mask(num_leaves: int, context: Any, tensors: Tuple[Any, ...]) -> BlockMask:
    """The ``BlockMask`` of :func:`_block_mask_tensors`'s leaves ``tensors``: its ``mask_mod`` capturing the ones past
    torch's own leaves, if any."""
    mask = BlockMask._unflatten(tensors[:num_leaves], context=context)
    if len(tensors) > num_leaves:
        mask.mask_mod = with_captured_tensors(mask.mask_mod, tuple(tensors[num_leaves:]))
    return mask


class _CompiledForward:
    """A decoder layer's forward, compiled; the layer's call (and its hooks, which the tracker uses) stays. A packed
    batch's ``mask`` (a flex attention ``BlockMask``: its tensors) and ``input_pos`` are inputs of the trace, and
    flex attention is one extern kernel of the layer's graph. Not modelled: torchtune calls it through
    ``torch.compiler.disable`` (its own compiled function), so dynamo breaks the layer's graph there, and what the
    attention saves for backward is then its inputs as given (k and v expanded to every head) rather than what the
    partition of the one graph chooses (at most one layer's expanded k and v apart, with checkpointing)."""

    def __init__(self, layer: nn.Module, compiled: _AotCompiled):
        self.layer = layer
        self.compiled = compiled

    def __call__(
        self, x: torch.Tensor, *, mask: Any = None, input_pos: Optional[torch.Tensor] = None, **kwargs: Any
    ) -> torch.Tensor:
        if any(value is not None for value in kwargs.values()):
            raise NotImplementedError(
                f"compiled layer estimate: {sorted(k for k, v in kwargs.items() if v is not None)} not modelled "
                "(KV caches, encoder inputs); estimate without them"
            )
        rebuild = None
        if isinstance(mask, BlockMask):
            mask, rebuild = _block_mask_tensors(mask)
        params = {**dict(self.layer.named_parameters()), **dict(self.layer.named_buffers())}
        tables = _layer_nf4_tables(self.layer)
        with _TracedTables():
            return self.compiled(params, tables, x, mask, input_pos, context=rebuild)


def compile_for_estimate(model: nn.Module, loss_fn: Optional[Any]) -> None:
    """Compiles, for an estimate, what torchtune's recipe compiles under ``compile=True``: every
    ``TransformerSelfAttentionLayer`` of ``model`` (``training.compile_model``), and the cross-entropy of a
    ``CEWithChunkedOutputLoss`` (``training.compile_loss``; other losses it compiles whole, not modelled here).

    Args:
        model (nn.Module): the estimator's fake model (set up: adapters trainable, checkpointing wrapped).
        loss_fn (Optional[Any]): its loss, if the recipe compiles it (None: not compiled).

    Raises:
        NotImplementedError: a loss other than ``CEWithChunkedOutputLoss`` (whose compiled form is not modelled).
    """
    layers = [m for m in model.modules() if isinstance(m, TransformerSelfAttentionLayer)]
    shared: Dict[Any, _AotCompiled] = {}
    for layer in layers:
        structure = tuple((n, p.shape, p.dtype, p.requires_grad) for n, p in layer.named_parameters())
        compiled = shared.setdefault(structure, _AotCompiled(_layer_forward(layer)))
        layer.forward = _CompiledForward(layer, compiled)
    if loss_fn is None:
        return
    if not isinstance(loss_fn, CEWithChunkedOutputLoss):
        raise NotImplementedError(
            f"compiled loss estimate: {type(loss_fn).__name__} not modelled; use CEWithChunkedOutputLoss"
        )
    eager = loss_fn.compute_cross_entropy
    cross_entropy = _AotCompiled(lambda _, logits, labels: eager(logits, labels))
    loss_fn.compute_cross_entropy = functools.partial(cross_entropy, {})


def compiled_setup(setup: Setup) -> Setup:
    """``setup`` followed by :func:`compile_for_estimate`: a recipe's set-up with ``compile=True``.

    Args:
        setup (Setup): the recipe's set-up (e.g. ``torchtune_setup``).

    Returns:
        Setup: the set-up that also compiles the model's layers and the loss.
    """

    def setup_compiled(model: nn.Module, loss_fn: Any, activation_checkpointing: bool) -> None:
        setup(model, loss_fn, activation_checkpointing)
        compile_for_estimate(model, loss_fn)

    return setup_compiled

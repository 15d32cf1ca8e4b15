"""NF4 op handlers that torchao lacks or gets wrong for us: the collectives behind ``DTensor.full_tensor()`` and
``redistribute`` (:func:`register_nf4_ops`), and FSDP2's split and padding of NF4 weights that do not split evenly
(:func:`register_nf4_sharding_ops`, which ``torchtune_ext.nf4`` calls with its handlers)."""

from __future__ import annotations

from typing import Any, Callable, Dict

from torchtune_ext._compat._torchao import nf4_module


def register_nf4_ops() -> None:
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

    nf4 = nf4_module()
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
    imported (it sits above this package): every NF4 weight torchtune_ext makes comes from it. Idempotent.

    Args:
        split (Callable[..., Any]): ``split(weight, split_size, dim=0)``: the chunks, or None for torchao's.
        new_zeros (Callable[..., Any]): ``new_zeros(weight, size, **kwargs)``: a padded shard, or None for torchao's.
    """
    import torch

    nf4 = nf4_module()
    for op, ours in ((torch.ops.aten.split.Tensor, split), (torch.ops.aten.new_zeros.default, new_zeros)):
        torchao_handler = _TORCHAO_SHARDING_HANDLERS.setdefault(op, nf4.NF4_OPS_TABLE[op])
        nf4.implements([op])(_first_then(ours, torchao_handler))


def _first_then(ours: Callable[..., Any], torchao_handler: Callable[..., Any]) -> Callable[..., Any]:
    """An NF4 op handler that returns ``ours(*args, **kwargs)`` unless that is None, then torchao's result."""

    def handler(func, args, kwargs=None):
        result = ours(*args, **(kwargs or {}))
        return torchao_handler(func, args, kwargs) if result is None else result

    return handler

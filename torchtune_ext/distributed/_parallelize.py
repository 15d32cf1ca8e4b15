"""FSDP2 sharding of a QLoRA model: per decoder layer in the compute dtype, with a vocab-pruning module sharded on its
own in fp32 or replicated (torchtitan's ``parallelize`` layout)."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from torchtune_ext.distributed._nf4_sharding import nf4_params_kept_whole

#: how a vocab-pruning module is distributed (config ``vocab_pruning.sharding``).
VOCAB_PRUNING_SHARDING = ("sharded", "replicated")


def fsdp_units(model: nn.Module) -> List[FSDPModule]:
    """
    Args:
        model (nn.Module): a model after ``fully_shard``.

    Returns:
        List[FSDPModule]: every module ``fully_shard`` was applied to.
    """
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def shard_model(
    model: nn.Module,
    *,
    dtype: torch.dtype,
    vocab_pruning: Optional[nn.Module] = None,
    vocab_pruning_sharding: str = "sharded",
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    mesh: Optional[DeviceMesh] = None,
) -> None:
    """Applies FSDP2 per decoder layer in the compute dtype, then to the root.

    Params are all-gathered in ``dtype`` (``MixedPrecisionPolicy.param_dtype``; NF4 bases are already stored in
    it, fp32 master adapters under fp16 are cast for compute) and gradients are reduce-scattered in fp32. The
    reduction is a plain sum (no division by the world size): the recipe normalises the loss by the global
    token count, so each rank's gradient is already its share of the global mean.

    A vocab-pruning module is either ``"sharded"`` on its own (``fully_shard`` with fp32 params and reduce dtype,
    before the root) or ``"replicated"``: left out of FSDP (every rank holds all of it) and its gradients must
    be summed with :func:`all_reduce_grads` before the optimizer step.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` (meta or materialised), activation checkpointing
            already applied.
        dtype (torch.dtype): compute dtype.
        vocab_pruning (Optional[nn.Module]): the model's vocab-pruning module, if any.
        vocab_pruning_sharding (str): ``"sharded"`` or ``"replicated"``.
        reshard_after_forward (bool): free gathered params after forward (FULL_SHARD) or keep them (SHARD_GRAD_OP).
        cpu_offload (bool): FSDP CPU offload of params, grads and optimizer state (accelerators only).
        mesh (Optional[DeviceMesh]): the 1-D mesh to shard over; None: torch's default (the process group on the
            host's accelerator, else the CPU).

    NF4 weights whose rows or scale groups do not divide the world size are sharded unevenly by whole scale groups
    (padded, :class:`torchtune_ext.nf4.UnevenNF4Tensor`: FSDP2's own split of them, as under plain ``fully_shard``);
    one with a single scale group is kept whole on every rank (:func:`torchtune_ext.distributed.check_nf4_sharding`
    says which, and logs their bytes per rank).

    On a single rank nothing is sharded (FSDP would only add copies, and torchao's NF4 does not support FSDP2's
    single-rank all-gather path): every param stays a plain tensor, as replicated params do.

    Raises:
        ValueError: on an unknown ``vocab_pruning_sharding`` or a model without ``layers``.
    """
    if vocab_pruning_sharding not in VOCAB_PRUNING_SHARDING:
        raise ValueError(
            f"vocab_pruning.sharding={vocab_pruning_sharding!r} is not supported; use one of {VOCAB_PRUNING_SHARDING}."
        )
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(f"shard_model expects a TransformerDecoder with decoder layers, got {type(model).__name__}.")
    if dist.is_initialized() and dist.get_world_size() == 1:
        return
    common = {"reshard_after_forward": reshard_after_forward, "mesh": mesh}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    compute = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    whole = nf4_params_kept_whole(model, world_size)
    ignored = set(whole)
    if vocab_pruning is not None:
        if vocab_pruning_sharding == "sharded":
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            pruning_whole = (whole & set(vocab_pruning.parameters())) or None
            fully_shard(vocab_pruning, mp_policy=fp32, ignored_params=pruning_whole, **common)
        else:
            ignored |= set(vocab_pruning.parameters())
    for layer in layers:
        fully_shard(layer, mp_policy=compute, ignored_params=(whole & set(layer.parameters())) or None, **common)
    # The root (embedding, final norm, output) keeps its params gathered after forward (FSDP2's own default for the
    # root): backward needs them first anyway, and LinearCrossEntropyLoss calls the output after the forward. In
    # fp32 its frozen weights may be stored in 16 bits (``frozen_dtype``): they are gathered as stored.
    root = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    fully_shard(model, mp_policy=root, ignored_params=ignored or None, **{**common, "reshard_after_forward": False})
    for unit in fsdp_units(model):
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)


def replicated_params(model: nn.Module) -> List[nn.Parameter]:
    """
    Args:
        model (nn.Module): a sharded model.

    Returns:
        List[nn.Parameter]: trainable params that FSDP does not manage (plain tensors, e.g. a replicated
        vocab-pruning module).
    """
    return [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]

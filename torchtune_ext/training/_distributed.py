"""Small helpers for the FSDP2 QLoRA recipe that work on CUDA/NCCL and on CPU/gloo alike.

torchtune's distributed recipes assume NCCL and CUDA memory APIs; these pick the backend from the device, read
memory per rank on any device, shard a QLoRA model per decoder layer in its compute dtype (with a vocab-pruning
module sharded on its own in fp32, or replicated), clip gradients over a mix of sharded and replicated params,
and scale fp16 losses with an overflow check that agrees across ranks.
"""

from __future__ import annotations

import datetime
import math
import os
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from torchtune_ext.training._metrics import memory_stats
from torchtune_ext.training._precision import LossScaler
from torchtune_ext.training._state_dict_utils import unwrap_key

#: device type -> process-group backend.
BACKENDS: Dict[str, str] = {"cuda": "nccl", "cpu": "gloo", "xpu": "xccl", "hpu": "hccl"}

#: how a vocab-pruning module is distributed (config ``vocab_pruning.sharding``).
VOCAB_PRUNING_SHARDING = ("sharded", "replicated")


def backend_for(device: torch.device) -> str:
    """The process-group backend for a training device: NCCL on CUDA, gloo on CPU.

    Args:
        device (torch.device): the training device.

    Returns:
        str: the backend name.
    """
    return BACKENDS.get(device.type, "gloo")


def launched_world_size() -> int:
    """The world size the launcher (torchrun / ``tune run --nproc_per_node``) set, before any process group exists.

    Returns:
        int: ``WORLD_SIZE``.

    Raises:
        RuntimeError: if the process was not started by a distributed launcher.
    """
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"the distributed recipe must be started by a distributed launcher ({', '.join(missing)} not set): "
            "tune run --nproc_per_node <N> recipes/qlora_finetune_distributed.py --config <config> "
            "(or torchrun --nproc_per_node <N> ...); for one device use recipes/qlora_finetune_single_device.py."
        )
    return int(os.environ["WORLD_SIZE"])


def init_distributed(device: torch.device, timeout_s: float) -> Tuple[int, int]:
    """Creates the default process group for ``device`` (NCCL on CUDA, gloo on CPU).

    Args:
        device (torch.device): the training device (``cuda:<LOCAL_RANK>`` on GPUs).
        timeout_s (float): collective timeout in seconds: a rank that fails makes the others fail after this
            long instead of hanging.

    Returns:
        Tuple[int, int]: world size and rank.

    Raises:
        ValueError: on a non-positive timeout.
    """
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"process_group_timeout_s={timeout_s} must be a positive number of seconds.")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend=backend_for(device), timeout=datetime.timedelta(seconds=float(timeout_s)), **kwargs
        )
    return dist.get_world_size(), dist.get_rank()


def destroy_distributed() -> None:
    """Destroys the default process group if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_fsdp_cpu_offload(fsdp_cpu_offload: bool, device: torch.device, world_size: int = 2) -> None:
    """FSDP CPU offload moves sharded params to the host and streams them to an accelerator, so it needs one, and
    a sharded model (one rank is not sharded, see :func:`shard_model`).

    Args:
        fsdp_cpu_offload (bool): the config's ``fsdp_cpu_offload``.
        device (torch.device): the training device.
        world_size (int): number of ranks.

    Raises:
        ValueError: if offload is requested while training on the CPU or on one rank.
    """
    if fsdp_cpu_offload and device.type == "cpu":
        raise ValueError(
            "fsdp_cpu_offload=True needs an accelerator (it offloads params from the GPU to the host), but "
            "device=cpu: set fsdp_cpu_offload=False (the params already live on the CPU) or train on device=cuda."
        )
    if fsdp_cpu_offload and world_size == 1:
        raise ValueError(
            "fsdp_cpu_offload=True needs at least 2 ranks (one rank is not sharded): use --nproc_per_node 2 or more, "
            "or set fsdp_cpu_offload=False."
        )


def per_rank_batch_size(batch_size: int, global_batch_size: Optional[int], world_size: int) -> int:
    """The per-rank micro-batch size from the config.

    ``batch_size`` is per rank (torchtune's convention); ``global_batch_size``, when set, is the number of samples
    per micro-batch over all ranks and must split evenly across them.

    Args:
        batch_size (int): per-rank batch size.
        global_batch_size (Optional[int]): samples per micro-batch over all ranks, or None.
        world_size (int): number of ranks.

    Returns:
        int: the per-rank batch size.

    Raises:
        ValueError: if ``global_batch_size`` is not a multiple of ``world_size``, or disagrees with ``batch_size``.
    """
    if global_batch_size is None:
        if batch_size is None or batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be a positive integer (samples per rank).")
        return int(batch_size)
    if global_batch_size < world_size or global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} cannot be split evenly over {world_size} ranks "
            f"(--nproc_per_node x nnodes); use a multiple of {world_size} or change --nproc_per_node."
        )
    return global_batch_size // world_size


def check_dataset_size(num_samples: int, batch_size: int, world_size: int) -> None:
    """Every rank needs at least one full micro-batch, or ranks would wait on each other forever.

    Args:
        num_samples (int): samples in the training set.
        batch_size (int): per-rank batch size.
        world_size (int): number of ranks.

    Raises:
        ValueError: if the data set has fewer than ``batch_size * world_size`` samples.
    """
    if num_samples < batch_size * world_size:
        raise ValueError(
            f"the training set has {num_samples} samples, fewer than one batch per rank ({world_size} ranks x "
            f"batch_size {batch_size} = {batch_size * world_size}): use fewer processes (--nproc_per_node), a "
            "smaller batch_size or more data."
        )


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
    common = {"reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    compute = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    ignored = None
    if vocab_pruning is not None:
        if vocab_pruning_sharding == "sharded":
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            fully_shard(vocab_pruning, mp_policy=fp32, **common)
        else:
            ignored = set(vocab_pruning.parameters())
    for layer in layers:
        fully_shard(layer, mp_policy=compute, **common)
    fully_shard(model, mp_policy=compute, ignored_params=ignored, **common)
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


def all_reduce_grads(params: Sequence[nn.Parameter]) -> None:
    """Sums the gradients of replicated params over all ranks, in fp32, so every rank steps identically.

    Args:
        params (Sequence[nn.Parameter]): replicated params (see :func:`replicated_params`).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not dist.is_initialized():
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads]).to(_comm_device())
    dist.all_reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad).to(grad.device))
        offset += grad.numel()


@torch.no_grad()
def grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """The global 2-norm of the gradients of sharded (DTensor) and replicated params together.

    DTensor shards contribute their local sum of squares, summed over ranks; replicated gradients (identical on
    every rank) are counted once.

    Args:
        params (Iterable[nn.Parameter]): params whose ``grad`` to include.

    Returns:
        torch.Tensor: a 0-dim fp32 tensor on the CPU, equal on every rank (inf/nan if a gradient is).
    """
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            sharded += grad.to_local().double().pow(2).sum().cpu()
        else:
            replicated += grad.double().pow(2).sum().cpu()
    if dist.is_initialized():
        sharded = all_reduce_sum(sharded, _comm_device())
    return (sharded + replicated).sqrt().float()


def _comm_device() -> torch.device:
    """Where tensors for the default group's collectives must live (the GPU for NCCL, the host for gloo)."""
    if dist.get_backend() == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@torch.no_grad()
def clip_grad_norm_(params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips gradients of sharded and replicated params by their global norm (``clip_grad_norm_`` cannot mix them).

    Args:
        params (Sequence[nn.Parameter]): params to clip.
        max_norm (float): maximum total norm (``inf`` only measures it).

    Returns:
        torch.Tensor: the total norm before clipping (0-dim, CPU).
    """
    params = list(params)
    total = grad_norm(params)
    coef = float(max_norm) / (float(total) + 1e-6)
    if math.isfinite(float(total)) and coef < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coef)
    return total


class _DistributedGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` for FSDP2: unscales DTensor gradients through their local shards.

    torch's per-device foreach unscale cannot take DTensor and plain gradients in one list (a replicated
    vocab-pruning module next to sharded adapters); unscaling local tensors works for both, and
    ``ShardedGradScaler.unscale_`` then all-reduces the inf/nan flag so every rank skips the same steps.
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        grouped = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grouped[grad.device][grad.dtype].append(grad)
        per_device_found_inf: Dict[torch.device, torch.Tensor] = {}
        for device, per_dtype in grouped.items():
            flag = per_device_found_inf.setdefault(device, found_inf.to(device))
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
        if not per_device_found_inf:
            per_device_found_inf[found_inf.device] = found_inf
        return per_device_found_inf


class DistributedLossScaler(LossScaler):
    """:class:`~torchtune_ext.training._precision.LossScaler` whose overflow check agrees across ranks.

    Same arguments and behaviour as ``LossScaler`` (fp16: dynamic scaling, overflowed steps skipped and counted);
    the inf/nan flag is all-reduced over the default process group before the step decision.
    """

    def __init__(self, enabled: bool, device: torch.device, init_scale: float = 2.0**16, growth_interval: int = 2000):
        super().__init__(enabled, device, init_scale=init_scale, growth_interval=growth_interval)
        self._scaler = _DistributedGradScaler(
            device.type, init_scale=init_scale, growth_interval=growth_interval, enabled=enabled
        )


def gather_memory_stats(device: torch.device, reset_peaks: bool = False) -> Dict[str, float]:
    """Every rank's memory figures (:func:`~torchtune_ext.training._metrics.memory_stats`), on every rank.

    Collective: call it on all ranks.

    Args:
        device (torch.device): the training device.
        reset_peaks (bool): reset CUDA peak counters after reading them.

    Returns:
        Dict[str, float]: ``"<name>/rank<r>"`` -> GiB for every rank ``r``.
    """
    stats = memory_stats(device, reset_peaks=reset_peaks)
    names = sorted(stats)
    local = torch.tensor([stats[name] for name in names], dtype=torch.float64)
    if not dist.is_initialized():
        return {f"{name}/rank0": stats[name] for name in names}
    gathered = [torch.empty_like(local, device=_comm_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local.to(_comm_device()))
    return {
        f"{name}/rank{rank}": float(values[i]) for rank, values in enumerate(gathered) for i, name in enumerate(names)
    }


def all_reduce_sum(value: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """Sums a small tensor over all ranks, returned on the CPU.

    Args:
        value (torch.Tensor): the local value.
        device (Optional[torch.device]): unused (kept for call sites that pass the training device); the
            collective runs where the backend needs it.

    Returns:
        torch.Tensor: the global sum.
    """
    if not dist.is_initialized():
        return value.detach().cpu()
    reduced = value.detach().to(_comm_device()).clone()
    dist.all_reduce(reduced)
    return reduced.cpu()


class GatheredModelView:
    """A live (sharded) model seen through its gathered full state dict, for savers that read ``model.state_dict()``.

    ``QLoRAHFCheckpointer.save`` takes a model and reads its ``state_dict()``, ``named_parameters()`` (to tell
    tied embeddings) and ``named_modules()`` / ``get_submodule()`` (LoRA alpha). On a sharded model those hold
    DTensors under wrapped names; this view answers them from the gathered plain-tensor dict, under unwrapped
    names, and forwards everything else (``layers``, ...) to the model.

    Args:
        model (nn.Module): the (sharded, wrapped) model.
        state_dict (Dict[str, torch.Tensor]): its gathered full state dict with unwrapped keys (e.g. from
            ``get_full_state_dict``, exported to the full vocabulary after vocab pruning).
    """

    def __init__(self, model: nn.Module, state_dict: Dict[str, torch.Tensor]):
        self._model = model
        self._state_dict = state_dict

    def state_dict(self, *args, **kwargs) -> Dict[str, torch.Tensor]:
        """
        Returns:
            Dict[str, torch.Tensor]: the gathered state dict.
        """
        return self._state_dict

    def named_parameters(self, *args, **kwargs):
        """Yields the gathered tensors as ``(name, tensor)``."""
        yield from self._state_dict.items()

    def named_modules(self, *args, **kwargs):
        """Yields ``(unwrapped name, module)``; a pruned output projection also appears as ``output``."""
        for name, module in self._model.named_modules():
            yield unwrap_key(self._model, name) if name else name, module
        pruned_output = getattr(getattr(self._model, "tok_embeddings", None), "output", None)
        if isinstance(pruned_output, nn.Module):
            yield "output", pruned_output

    def get_submodule(self, target: str) -> nn.Module:
        """
        Args:
            target (str): an unwrapped module name.

        Returns:
            nn.Module: the module.

        Raises:
            AttributeError: if there is no such module.
        """
        modules = dict(self.named_modules())
        if target not in modules:
            raise AttributeError(f"the model has no submodule {target!r}")
        return modules[target]

    def __getattr__(self, name: str):
        return getattr(self._model, name)

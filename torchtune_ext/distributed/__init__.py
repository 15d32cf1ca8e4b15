"""Distributed training pieces that work on CUDA/NCCL and CPU/gloo alike: FSDP2 sharding of QLoRA models, full and
sharded state dicts of sharded / NF4 / mixed-precision models (and loading them back), optimizer state, collectives
and the launch checks. Every function also works without a process group (one rank)."""

from torchtune_ext.distributed._collectives import all_reduce_grads, all_reduce_sum, clip_grad_norm_, grad_norm
from torchtune_ext.distributed._launch import (
    backend_for,
    check_dataset_size,
    check_fsdp_cpu_offload,
    destroy_distributed,
    init_distributed,
    launched_world_size,
    per_rank_batch_size,
)
from torchtune_ext.distributed._nf4_sharding import NF4ShardingPlan, check_nf4_sharding, nf4_nbytes, nf4_weights
from torchtune_ext.distributed._optimizer import (
    get_full_optimizer_state,
    load_full_optimizer_state,
    optimizer_param_groups,
)
from torchtune_ext.distributed._parallelize import (
    VOCAB_PRUNING_SHARDING,
    fsdp_units,
    replicated_params,
    shard_model,
)
from torchtune_ext.distributed._state_dict import get_full_state_dict, get_model_state_dict
from torchtune_ext.distributed._state_dict_load import FullStateDictLoader, load_full_state_dict
from torchtune_ext.distributed._utils import group_device, unwrap_key, world_info

__all__ = [
    "FullStateDictLoader",
    "NF4ShardingPlan",
    "VOCAB_PRUNING_SHARDING",
    "all_reduce_grads",
    "all_reduce_sum",
    "backend_for",
    "check_nf4_sharding",
    "nf4_nbytes",
    "nf4_weights",
    "check_dataset_size",
    "check_fsdp_cpu_offload",
    "clip_grad_norm_",
    "destroy_distributed",
    "fsdp_units",
    "get_full_optimizer_state",
    "get_full_state_dict",
    "get_model_state_dict",
    "grad_norm",
    "group_device",
    "init_distributed",
    "launched_world_size",
    "load_full_optimizer_state",
    "load_full_state_dict",
    "optimizer_param_groups",
    "per_rank_batch_size",
    "replicated_params",
    "shard_model",
    "unwrap_key",
    "world_info",
]

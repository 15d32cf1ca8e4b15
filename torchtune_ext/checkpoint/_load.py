"""Loading a base HF checkpoint into a QLoRA model built on the meta device: one rank or many (FSDP2), vocab-pruned
or not, with the same code."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ext.checkpoint._checkpointer import QLoRAHFCheckpointer
from torchtune_ext.distributed import load_full_state_dict, unwrap_key, world_info
from torchtune_ext.modules.vocab_pruning import VocabPruning, is_vocab_key, prune_state_dict

#: on several ranks, rank 0 reads the checkpoint in chunks of about this many bytes (one rank: a tensor at a time).
LOAD_CHUNK_BYTES = 1 << 30


@torch.no_grad()
def load_base_(
    model: nn.Module,
    checkpointer: QLoRAHFCheckpointer,
    device: torch.device,
    *,
    pruning: Optional[VocabPruning] = None,
    sharded_device: Optional[torch.device] = None,
) -> None:
    """Loads the base weights of ``checkpointer`` into ``model``; each rank quantizes only its own shard.

    Rank 0 streams the checkpoint (one tensor at a time on one rank; chunks of about :data:`LOAD_CHUNK_BYTES` on
    several, each tensor broadcast), so host memory stays near one chunk on rank 0 and one tensor elsewhere. NF4
    weights are quantized in the model's compute dtype as they arrive, bit for bit as ``to_nf4`` of the whole
    tensor. Collective: call it on every rank. Adapters, DoRA magnitudes and RoPE caches come after
    (:func:`torchtune_ext.models.init_adapters_`).

    Args:
        model (nn.Module): the QLoRA model built on the meta device, possibly ``fully_shard``-ed and vocab-pruned
            (``checkpointer.validate`` ran on it before pruning).
        checkpointer (QLoRAHFCheckpointer): the base checkpoint.
        device (torch.device): the training device.
        pruning (Optional[VocabPruning]): the model's vocab pruning: the embedding/output are loaded as their kept
            rows, in the pruning module's dtype.
        sharded_device (Optional[torch.device]): where sharded (DTensor) params go; the CPU under FSDP CPU offload
            (FSDP streams them to ``device``). None: ``device``.
    """
    rank, world_size = world_info()
    plan = checkpointer.chunk_plan(LOAD_CHUNK_BYTES if world_size > 1 else 0)
    chunks = checkpointer.read_base(plan) if rank == 0 else (None for _ in plan)
    load = _loader(model, device, sharded_device)
    vocab: Dict[str, torch.Tensor] = {}
    for state in chunks:
        if state is not None and pruning is not None:
            vocab.update({k: state.pop(k) for k in list(state) if is_vocab_key(k)})
        load(state)
        del state
    if pruning is not None:
        pruned = prune_state_dict(vocab, pruning.kept_ids, dtype=pruning.weight.dtype) if rank == 0 else None
        del vocab
        load(pruned)


def _loader(model: nn.Module, device: torch.device, sharded_device: Optional[torch.device]):
    """``load(state)``: ``load_full_state_dict`` from rank 0, sharded params onto ``sharded_device``."""
    if sharded_device is None or sharded_device == device:
        return lambda state: load_full_state_dict(model, state, device=device, strict=False, broadcast_from_rank0=True)
    sharded = {unwrap_key(model, k) for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, DTensor)}

    def load(state: Optional[Dict[str, torch.Tensor]]) -> None:
        for keep_sharded, target in ((True, sharded_device), (False, device)):
            part = None if state is None else {k: v for k, v in state.items() if (k in sharded) == keep_sharded}
            load_full_state_dict(model, part, device=target, strict=False, broadcast_from_rank0=True)

    return load

"""Loading a base HF checkpoint into a QLoRA model built on the meta device: one rank or many (FSDP2), vocab-pruned
or not, with the same code."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ext.checkpoint._checkpointer import QLoRAHFCheckpointer
from torchtune_ext.distributed import FullStateDictLoader, world_info
from torchtune_ext.modules.vocab_pruning import VocabPruning, is_vocab_key, prune_state_dict

#: rank 0 reads the checkpoint in chunks of about this many bytes (one rank or several alike).
LOAD_CHUNK_BYTES = 1 << 30


@torch.no_grad()
def load_base_(
    model: nn.Module,
    checkpointer: QLoRAHFCheckpointer,
    device: torch.device,
    *,
    pruning: Optional[VocabPruning] = None,
    sharded_device: Optional[torch.device] = None,
    chunk_bytes: int = LOAD_CHUNK_BYTES,
) -> None:
    """Loads the base weights of ``checkpointer`` into ``model``; each rank quantizes only its own shard.

    Rank 0 streams the checkpoint in chunks of about ``chunk_bytes`` (each tensor broadcast on several ranks), so
    host memory stays near one chunk on rank 0 and one tensor elsewhere; the model is walked once (a key ->
    parameter map), so the time is linear in the model, the same code for one rank or many. NF4
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
        chunk_bytes (int): bytes per chunk (0: one tensor per chunk). Default: :data:`LOAD_CHUNK_BYTES`.
    """
    rank = world_info()[0]
    plan = checkpointer.chunk_plan(chunk_bytes)
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
    """``load(state)``: a state dict from rank 0 into the model (walked once), sharded params on ``sharded_device``."""
    loader = FullStateDictLoader(model, device=device, strict=False, broadcast_from_rank0=True)
    if sharded_device is None or sharded_device == device:
        return loader.load
    sharded_loader = FullStateDictLoader(model, device=sharded_device, strict=False, broadcast_from_rank0=True)
    sharded = {key for key, entry in loader.entries.items() if isinstance(entry.value, DTensor)}

    def load(state: Optional[Dict[str, torch.Tensor]]) -> None:
        for keep_sharded, target in ((True, sharded_loader), (False, loader)):
            part = None if state is None else {k: v for k, v in state.items() if (k in sharded) == keep_sharded}
            target.load(part)

    return load

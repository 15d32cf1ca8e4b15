"""Batches: the data checks before a run writes anything, the training and validation data loaders (one loop for
any world size), and what a batch gets before the loss (padding to a multiple, labels shifted)."""

import logging
from functools import partial
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import ListConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed

from torchtune_ext.config import ConfigError
from torchtune_ext.distributed import check_dataset_size

log = utils.get_logger("INFO")


def check_data(
    dataset: Any,
    val_dataset: Optional[Any],
    max_seq_len: Optional[int],
    ignore_index: int,
    batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
) -> None:
    """Fails on data that would train on nothing or cannot fill a step on every rank.

    Args:
        dataset (Any): the training data set.
        val_dataset (Optional[Any]): the validation data set, if validation runs.
        max_seq_len (Optional[int]): ``tokenizer.max_seq_len``.
        ignore_index (int): the loss's ignore index.
        batch_size (int): samples per micro-batch, per rank.
        gradient_accumulation_steps (int): micro-batches per step.
        world_size (int): the number of ranks.

    Raises:
        ConfigError: if none of the first samples keeps a label token within ``max_seq_len``, an epoch has fewer
            batches per rank than ``gradient_accumulation_steps``, or the validation set fewer samples than ranks.
    """
    _check_samples_have_labels(dataset, max_seq_len, ignore_index)
    if world_size > 1:
        check_dataset_size(len(dataset), batch_size, world_size)
    if val_dataset is not None and len(val_dataset) < world_size:
        raise ConfigError(
            f"dataset_val has {len(val_dataset)} samples, fewer than one per rank ({world_size} ranks): the "
            "validation loss would have none (each rank takes an equal share, the remainder is left out); use more "
            "validation samples, fewer processes (--nproc_per_node) or run_val_every_n_steps=null.",
            "dataset_val",
        )
    batches = len(dataset) // (batch_size * world_size)
    if batches < gradient_accumulation_steps:
        raise ConfigError(  # an input error: one line, exit code 2
            f"The data set gives {batches} batches of batch_size={batch_size}"
            + (" per rank" if world_size > 1 else "")
            + f", fewer than gradient_accumulation_steps={gradient_accumulation_steps}: lower either.",
            "gradient_accumulation_steps",
        )


def _check_samples_have_labels(dataset: Any, max_seq_len: Optional[int], ignore_index: int, limit: int = 64) -> None:
    """Fails if none of the first ``limit`` samples keeps a label token after truncation (prompts longer than
    ``max_seq_len``), which would train on nothing; warns (rank 0) if some do not."""
    count = min(len(dataset), limit)
    empty = [i for i in range(count) if all(int(label) == ignore_index for label in dataset[i]["labels"])]
    if count and len(empty) == count:
        raise ConfigError(  # an input error: one line, exit code 2
            f"None of the first {count} samples of the data set keeps a label token after truncation to "
            f"tokenizer.max_seq_len={max_seq_len}: their prompts are longer. Raise tokenizer.max_seq_len.",
            "tokenizer.max_seq_len",
        )
    if empty:
        utils.log_rank_zero(
            log,
            f"{len(empty)} of the first {count} samples have no label token within tokenizer.max_seq_len="
            f"{max_seq_len} (e.g. sample {empty[0]}); they do not train.",
            level=logging.WARNING,
        )


def build_data_loader(
    dataset: Any,
    cfg_dataset: Any,
    *,
    shuffle: bool,
    collate_fn: str,
    drop_last: bool,
    batch_size: int,
    seed: int,
    pad_id: int,
    ignore_index: int,
    world_size: int = 1,
    rank: int = 0,
) -> Tuple[StatefulDistributedSampler, StatefulDataLoader]:
    """A resumable data loader over this rank's share of ``dataset``.

    Args:
        dataset (Any): the data set.
        cfg_dataset (Any): its config section (``packed``), or a list of sections.
        shuffle (bool): shuffle (per epoch, from ``seed``).
        collate_fn (str): the collate function's dotted path.
        drop_last (bool): drop the last partial batch (training: static shapes, comparable batches).
        batch_size (int): samples per batch on this rank.
        seed (int): the sampler's seed.
        pad_id (int): the tokenizer's padding id.
        ignore_index (int): the loss's ignore index (padded labels).
        world_size (int): the number of ranks.
        rank (int): this rank.

    Returns:
        Tuple[StatefulDistributedSampler, StatefulDataLoader]: the sampler and the loader.

    Raises:
        RuntimeError: for an inference-only collate function.
    """
    packed = (
        getattr(dataset, "packed", False) if isinstance(cfg_dataset, ListConfig) else cfg_dataset.get("packed", False)
    )
    if "left_pad_sequence" in collate_fn:
        raise RuntimeError("left_pad_sequence collator is only for inference.")
    collate = _get_component_from_path(collate_fn)
    # Every rank must run the same number of batches (FSDP's collectives). Training pads the index list to a
    # multiple of the world size (torchtune's behaviour); validation (no dropped batches) drops the remainder
    # instead, so that no sample counts twice in the validation loss. One rank: no padding either way.
    sampler = StatefulDistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=not drop_last
    )
    dataloader = StatefulDataLoader(
        dataset=dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=padded_collate_packed if packed else partial(collate, padding_idx=pad_id, ignore_idx=ignore_index),
        drop_last=drop_last,
    )
    return sampler, dataloader


def pad_batch_(batch: Dict[str, torch.Tensor], multiple: int, pad_id: int, ignore_index: int) -> None:
    """Right-pads tokens (``pad_id``) and labels (ignored) to a multiple of ``multiple``; causal attention makes the
    extra positions invisible to the others, so the loss is unchanged. Packed batches are left."""
    if "mask" in batch:
        return
    extra = -batch["tokens"].shape[1] % multiple
    if extra:
        batch["tokens"] = nn.functional.pad(batch["tokens"], (0, extra), value=pad_id)
        batch["labels"] = nn.functional.pad(batch["labels"], (0, extra), value=ignore_index)


def shifted_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Labels shifted left by one, the last position ignored: equivalent to ``labels[..., 1:]`` against
    ``logits[..., :-1, :]`` without slicing the logits (or the hidden states).

    Args:
        labels (torch.Tensor): ``(batch, seq)`` labels.
        ignore_index (int): the loss's ignore index.

    Returns:
        torch.Tensor: the shifted labels.
    """
    last = torch.full((labels.shape[0], 1), ignore_index, dtype=labels.dtype, device=labels.device)
    return torch.hstack((labels[..., 1:], last))

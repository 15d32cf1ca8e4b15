"""The ``vocab_pruning:`` section of a recipe config, and the kept ids it resolves to."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.config import ConfigError, ConfigFileNotFoundError
from torchtune_ext.distributed import VOCAB_PRUNING_SHARDING
from torchtune_ext.modules.vocab_pruning._kept_ids import (
    estimate_scan_seconds,
    load_kept_ids,
    load_scanned_kept_ids,
    scan_kept_ids,
)
from torchtune_ext.modules.vocab_pruning._module import validate_kept_ids

#: keys of ``vocab_pruning:`` in a recipe config.
VOCAB_PRUNING_KEYS = ("enabled", "kept_ids", "dtype", "sharding", "unknown_token_id", "trainable")
#: the tokenizer attributes always kept (padding is added by the collator, not by the data set).
SPECIAL_ID_ATTRIBUTES = ("bos_id", "eos_id", "pad_id")


def parse_vocab_pruning(section: Optional[DictConfig]) -> Optional[Dict[str, Any]]:
    """Reads a ``vocab_pruning:`` config section.

    Args:
        section (Optional[DictConfig]): the section: ``enabled`` (default True when the section exists),
            ``kept_ids`` (a file, see ``load_kept_ids``; null: the ids the data uses), ``dtype`` (of the pruned
            rows, default fp32), ``sharding`` (distributed only: ``sharded`` or ``replicated``),
            ``unknown_token_id``, ``trainable`` (default True).

    Returns:
        Optional[Dict[str, Any]]: the settings, None when pruning is off.

    Raises:
        ConfigError: on an unknown key, dtype or sharding.
    """
    if section is None or not section.get("enabled", True):
        return None
    unknown = sorted(set(section) - set(VOCAB_PRUNING_KEYS))
    if unknown:
        raise ConfigError(
            f"vocab_pruning has unknown key(s) {unknown}; known keys: {sorted(VOCAB_PRUNING_KEYS)}.", "vocab_pruning"
        )
    sharding = section.get("sharding", "sharded")
    if sharding not in VOCAB_PRUNING_SHARDING:
        raise ConfigError(
            f"vocab_pruning.sharding={sharding!r} is not supported; use one of {list(VOCAB_PRUNING_SHARDING)}.",
            "vocab_pruning.sharding",
        )
    return {
        "kept_ids": section.get("kept_ids", None),
        "dtype": parse_dtype(section.get("dtype", "fp32"), what="vocab_pruning.dtype"),
        "sharding": sharding,
        "unknown_token_id": section.get("unknown_token_id", None),
        "trainable": bool(section.get("trainable", True)),
    }


def resolve_kept_ids(
    source: Optional[str],
    vocab_size: int,
    tokenizer: Any,
    datasets: Sequence[Optional[Any]],
    scanned: Optional[Path] = None,
) -> List[int]:
    """The kept token ids of vocab pruning.

    Args:
        source (Optional[str]): a kept-ids file (``vocab_pruning.kept_ids``); None: every id ``datasets`` use plus
            the tokenizer's special ids (``bos_id``, ``eos_id``, ``pad_id``), from :func:`scan_kept_ids`
            (collective on several ranks).
        vocab_size (int): the model's vocabulary size.
        tokenizer (Any): the tokenizer.
        datasets (Sequence[Optional[Dataset]]): the training (and validation) data; None entries are skipped.
        scanned (Optional[Path]): a resume's earlier scan (``save_scanned_kept_ids``), used instead of scanning
            again when it is there and matches the vocabulary and the data sets' sizes.

    Returns:
        List[int]: the kept ids, validated.

    Raises:
        ConfigError: on a ``source`` file that is missing (also a ``FileNotFoundError``), unreadable or holds invalid
            ids (out of range, duplicates), naming ``vocab_pruning.kept_ids``.
        ValueError: on invalid scanned ids.
    """
    if source is not None:
        ids = _load_configured_kept_ids(source, vocab_size)
    else:
        ids = load_scanned_kept_ids(scanned, vocab_size, datasets) if scanned is not None else None
        if ids is None:
            special = [getattr(tokenizer, name, None) for name in SPECIAL_ID_ATTRIBUTES]
            ids = scan_kept_ids(datasets, vocab_size, always_keep=special)
    validate_kept_ids(ids, vocab_size)
    return list(ids)


def _load_configured_kept_ids(source: str, vocab_size: int) -> List[int]:
    """The ids of the ``vocab_pruning.kept_ids`` file; its errors are config errors naming the key."""
    key = "vocab_pruning.kept_ids"
    try:
        return load_kept_ids(source, vocab_size=vocab_size)
    except FileNotFoundError as err:
        raise ConfigFileNotFoundError(f"{key}={source!r}: {err}", key) from err
    except ValueError as err:
        raise ConfigError(f"{key}={source!r}: {err}", key) from err


def scan_estimate_line(
    section: Optional[Dict[str, Any]], datasets: Sequence[Optional[Any]], vocab_size: int, world_size: int
) -> Optional[str]:
    """The dry run's line on the kept-id pass: its time from a measured sample of rows (None without a pass).

    Args:
        section (Optional[Dict[str, Any]]): :func:`parse_vocab_pruning`'s settings.
        datasets (Sequence[Optional[Any]]): the data sets the pass reads.
        vocab_size (int): the model's vocabulary size.
        world_size (int): ranks sharing the pass.

    Returns:
        Optional[str]: the line.
    """
    if section is None or section["kept_ids"] is not None:
        return None
    estimate = estimate_scan_seconds(datasets, vocab_size, world_size)
    return (
        f"  vocab pruning: the kept-id pass reads {estimate.rows:,} rows"
        + (f" over {world_size} ranks" if world_size > 1 else "")
        + f": about {estimate.seconds:,.1f} s (measured on {estimate.sampled} rows)."
    )

"""The start-up checks of a recipe config (:func:`check_config`), run first in the QLoRA recipe's ``__init__``: every
problem a config can have that shows without loading weights or data fails here, one line each, before anything is
written. Each job has its module: the keys and sections (``_keys``), the value ranges of the schema (``_ranges``),
the device (``_device``), the tokenizer's and data sets' files (``_files``).

:func:`check_generation_config` runs the key and device checks for the recipes that use a trained model.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, List, Mapping

from omegaconf import DictConfig

from torchtune_ext.config._device import check_device
from torchtune_ext.config._errors import ConfigError, ConfigFileNotFoundError
from torchtune_ext.config._files import check_data_sets, check_tokenizer_files
from torchtune_ext.config._keys import check_keys
from torchtune_ext.config._ranges import check_ranges
from torchtune_ext.config._schema import GENERATION_KEYS


def check_config(
    cfg: DictConfig,
    *,
    dry_run: bool = False,
    splits: Mapping[str, Collection[str]] = {},
    plain_sections: Mapping[str, Callable[..., Any]] = {},
) -> None:
    """Every start-up check of a QLoRA recipe config; nothing is loaded or written.

    Args:
        cfg (DictConfig): the recipe config.
        dry_run (bool): the memory estimate only: the device, tokenizer and data files are not needed.
        splits (Mapping[str, Collection[str]]): the splits of the data set builders that know theirs without loading,
            by ``_component_`` path (the recipe passes the tiny data set's).
        plain_sections (Mapping[str, Callable[..., Any]]): the sections without a ``_component_`` that are the keyword
            arguments of a class the recipe builds, by key (the recipe passes ``loss_scaler``'s).

    Raises:
        ConfigError: one line per problem found (``ConfigFileNotFoundError`` when the first is a missing file).
    """
    problems = [*check_keys(cfg, plain_sections=plain_sections), *check_ranges(cfg)]
    if not problems and not dry_run:
        problems += [
            *check_device(cfg.get("device", None)),
            *check_tokenizer_files(cfg),
            *check_data_sets(cfg, splits),
        ]
    _raise(problems)


def check_generation_config(cfg: DictConfig, known: frozenset = GENERATION_KEYS) -> None:
    """The start-up checks of a config of a recipe that uses a trained model (:mod:`torchtune_ext.generation`,
    :mod:`torchtune_ext.evaluation`): its keys (top level and each section's), then, but for a dry run, the device
    and the tokenizer's files. Nothing is loaded or written.

    Args:
        cfg (DictConfig): the config.
        known (frozenset): the recipe's top-level keys (:data:`GENERATION_KEYS`, :data:`EVAL_KEYS`).

    Raises:
        ConfigError: one line per problem found (``ConfigFileNotFoundError`` when the first is a missing file).
    """
    sections = ("tokenizer",) if cfg.get("merged_dir", None) else ("model", "tokenizer", "checkpointer")
    problems = check_keys(cfg, known, sections)
    if not problems and not cfg.get("dry_run", False):
        problems += [*check_device(cfg.get("device", None)), *check_tokenizer_files(cfg)]
    _raise(problems)


def _raise(problems: List[ConfigError]) -> None:
    if problems:
        kind = ConfigFileNotFoundError if isinstance(problems[0], ConfigFileNotFoundError) else ConfigError
        raise kind("\n".join(str(p) for p in problems), problems[0].key)

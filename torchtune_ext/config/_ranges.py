"""The range checks of a config: each key of the schema (``RECIPE_SCHEMA``) with a rule that the config sets (counts,
LoRA rank/alpha/dropout, learning rate, ...), and the LoRA attention modules' names."""

from __future__ import annotations

import difflib
from typing import List

from omegaconf import DictConfig, ListConfig

from torchtune_ext.config._errors import ConfigError, bad_value
from torchtune_ext.config._schema import LORA_ATTN_MODULES, RECIPE_SCHEMA, lookup


def check_ranges(cfg: DictConfig) -> List[ConfigError]:
    """
    Args:
        cfg (DictConfig): the recipe config.

    Returns:
        List[ConfigError]: one per value its key does not allow.
    """
    problems = []
    for key in RECIPE_SCHEMA:
        present, value = lookup(cfg, key.name)
        error = key.rule.error(key.name, value) if present and key.rule is not None else None
        if error is not None:
            problems.append(error)
    return problems + _check_lora_modules(cfg)


def _check_lora_modules(cfg: DictConfig) -> List[ConfigError]:
    """``model.lora_attn_modules``: a list of torchtune's attention projections (else it fails at the first save)."""
    key = "model.lora_attn_modules"
    present, value = lookup(cfg, key)
    if not present or value is None:
        return []
    names = list(LORA_ATTN_MODULES)
    if not isinstance(value, ListConfig):
        return [bad_value(key, value, "must be a list", f"e.g. {key}=[q_proj,v_proj] (any of {names})")]
    problems = []
    for module in value:
        if module not in names:
            close = difflib.get_close_matches(str(module), names, n=1, cutoff=0.6)
            fix = f"did you mean {close[0]!r}? ({key} takes any of {names})" if close else f"use any of {names}"
            problems.append(bad_value(key, list(value), f"has {module!r}, which is not an attention projection", fix))
    return problems

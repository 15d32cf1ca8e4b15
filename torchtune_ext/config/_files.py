"""The file checks of a config: the tokenizer's files (the hint keeps their place in the model's folder); a local data
set's ``data_files`` exist, parse (JSON/JSONL: file, line and column of the first error) and have the columns the
data set's format needs (else ``column_map``, with the columns found); a ``split`` the data set has, where that is
known without loading (the tiny data set; a local file's loader)."""

from __future__ import annotations

import difflib
import glob
import json
import re
from pathlib import Path
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple

from omegaconf import DictConfig

from torchtune_ext.config._errors import ConfigError, ConfigFileNotFoundError, bad_value
from torchtune_ext.config._keys import sections

#: tokenizer arguments that name files.
TOKENIZER_FILE_KEYS = (
    "path",
    "merges_file",
    "vocab_file",
    "special_tokens_path",
    "tokenizer_json_path",
    "tokenizer_config_path",
)
#: the columns torchtune's data set builders read from each sample: (required, optional), by builder.
_ALPACA_COLUMNS = (("instruction", "output"), ("input",))
_DATASET_COLUMNS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "torchtune.datasets.alpaca_dataset": _ALPACA_COLUMNS,
    "torchtune.datasets.alpaca_cleaned_dataset": _ALPACA_COLUMNS,
    "torchtune.datasets.instruct_dataset": (("input", "output"), ()),
}
#: the Hugging Face loaders of local files: without a dict of ``data_files`` per split, their one split is "train".
_LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")
_GLOB_CHARS = ("*", "?", "[")


def tokenizer_file_hint(key: str, path: str, checkpoint_dir: Optional[str]) -> str:
    """Where to point a tokenizer file: its place inside the model's folder (``original/tokenizer.model`` for Llama)
    when the config's path is under ``checkpointer.checkpoint_dir``."""
    relative = Path(path).name
    if checkpoint_dir:
        try:
            relative = Path(path).relative_to(Path(checkpoint_dir)).as_posix()
        except ValueError:
            pass
    return f"tokenizer.{key}=<checkpoint_dir>/{relative}"


def missing_tokenizer_file(key: str, path: str, checkpoint_dir: Optional[str]) -> ConfigFileNotFoundError:
    """The error of a tokenizer file that does not exist.

    Args:
        key (str): the tokenizer argument (``path``, ``merges_file``, ...).
        path (str): its value.
        checkpoint_dir (Optional[str]): ``checkpointer.checkpoint_dir``, if known.

    Returns:
        ConfigFileNotFoundError: naming the key, the file and the fix.
    """
    return ConfigFileNotFoundError(
        f"tokenizer.{key}={path!r} does not exist. The tokenizer files ship with the model: download it (the config's "
        f"header has the `tune download` line) and set tokenizer.{key} to the file in the model's folder (e.g. "
        f"{tokenizer_file_hint(key, path, checkpoint_dir)}).",
        f"tokenizer.{key}",
    )


def check_tokenizer_files(cfg: DictConfig) -> List[ConfigError]:
    """Each tokenizer file the config names exists (else where to point it)."""
    tokenizer = cfg.get("tokenizer", None)
    checkpointer = cfg.get("checkpointer", None)
    checkpoint_dir = checkpointer.get("checkpoint_dir", None) if isinstance(checkpointer, DictConfig) else None
    return [
        missing_tokenizer_file(key, value, checkpoint_dir)
        for key in TOKENIZER_FILE_KEYS
        if isinstance(value := tokenizer.get(key, None), str) and not Path(value).is_file()
    ]


def _data_files(section: DictConfig) -> List[str]:
    files = section.get("data_files", None)
    if isinstance(files, DictConfig):
        files = [f for split in files.values() for f in ([split] if isinstance(split, str) else split)]
    elif isinstance(files, str):
        files = [files]
    return [str(f) for f in files or []]


def check_data_sets(cfg: DictConfig, splits: Mapping[str, Collection[str]] = {}) -> List[ConfigError]:
    """The data sets' local files exist, parse and have the columns their builder reads; their ``split`` is one they
    have, where that is known without loading.

    Args:
        cfg (DictConfig): the recipe config.
        splits (Mapping[str, Collection[str]]): the splits of the data set builders that know theirs without loading
            (a name each, no slices), by ``_component_`` path.

    Returns:
        List[ConfigError]: one per problem.
    """
    problems: List[ConfigError] = []
    for name, section in sections(cfg):
        if name.split("[")[0] not in ("dataset", "dataset_val"):
            continue
        problems += _check_split(name, section, splits)
        for path in _data_files(section):
            if "://" in path:
                continue  # remote: the data set builder downloads it
            if any(c in path for c in _GLOB_CHARS) and glob.glob(path):
                continue
            if not Path(path).is_file():
                problems.append(
                    ConfigFileNotFoundError(
                        f"{name}.data_files={path!r} does not exist (relative paths start at {Path.cwd()}); set "
                        f"{name}.data_files to your data file",
                        f"{name}.data_files",
                    )
                )
                continue
            problems += _check_data_file(name, section, Path(path))
    return problems


def _check_split(name: str, section: DictConfig, splits: Mapping[str, Collection[str]]) -> List[ConfigError]:
    """``split`` names one of the data set's splits (``train[:90%]``, ``train+validation`` too), where they are known
    without loading: a builder's of ``splits`` (the tiny data set's), and a local loader's ("train", or the keys of a
    ``data_files`` dict)."""
    split, files = section.get("split", None), section.get("data_files", None)
    if split is None:
        return []
    if section._component_ in splits:  # a name, no slices
        known, names = sorted(splits[section._component_]), {str(split)}
    elif section.get("source", None) in _LOCAL_LOADERS and files is not None:
        known = sorted(files) if isinstance(files, DictConfig) else ["train"]
        names = {re.sub(r"\[.*\]$", "", s.strip()) for s in str(split).split("+")}
    else:
        return []
    unknown = sorted(names - set(known))
    if not unknown:
        return []
    nearest = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.3) or known
    fix = f"use {name}.split={nearest[0]}" + (f" (or another of {known})" if len(known) > 1 else "")
    return [bad_value(f"{name}.split", split, f"is not a split of this data set, which has {known}", fix)]


def _check_data_file(name: str, section: DictConfig, path: Path) -> List[ConfigError]:
    """A local JSON/JSONL data file: it parses, and its first record has the columns the data set reads."""
    if not (section.get("source", "") == "json" or path.suffix in (".json", ".jsonl")):
        return []
    try:
        records = read_json_records(path, section.get("field", None))
    except ConfigError as error:
        return [ConfigError(f"{name}.data_files: {error}", f"{name}.data_files")]
    if not records or not isinstance(records[0], dict):
        return []
    return _check_columns(name, section, sorted(records[0]))


def read_json_records(path: Path, field: Optional[str] = None) -> List[Any]:
    """Reads a data file as the Hugging Face ``json`` loader does: one JSON document (a list of records, or an object
    whose ``field`` is that list) or JSON Lines.

    Args:
        path (Path): the file.
        field (Optional[str]): the key of the records in a single JSON object.

    Returns:
        List[Any]: the records.

    Raises:
        ConfigError: naming the file, the line and the column of the first syntax error.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        document = json.loads(text)
        return list(document[field] if field is not None else document if isinstance(document, list) else [document])
    except json.JSONDecodeError as whole:
        if text.lstrip().startswith("["):
            raise ConfigError(
                f"{path}: line {whole.lineno}, column {whole.colno}: invalid JSON ({whole.msg})"
            ) from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{path}: line {number}, column {error.colno}: invalid JSON ({error.msg}); JSON Lines need one "
                "complete record per line"
            ) from None
    return records


def _check_columns(name: str, section: DictConfig, found: List[str]) -> List[ConfigError]:
    component = section._component_
    if component == "torchtune.datasets.chat_dataset":
        required, optional = (section.get("conversation_column", "conversations"),), ()
        column_map: Dict[str, str] = {}
    elif component in _DATASET_COLUMNS:
        required, optional = _DATASET_COLUMNS[component]
        column_map = dict(section.get("column_map", None) or {})
    else:
        return []
    unknown = sorted(set(column_map) - set(required) - set(optional))
    if unknown:
        return [
            ConfigError(
                f"{name}.column_map has {unknown}, which {component} does not read; its keys are "
                f"{list(required + optional)} (each mapped to one of the data's columns {found})",
                f"{name}.column_map",
            )
        ]
    missing = [column for column in required if column_map.get(column, column) not in found]
    if not missing:
        return []
    example = ", ".join(f"{column}: <column>" for column in required + optional)
    key = "conversation_column" if component == "torchtune.datasets.chat_dataset" else "column_map"
    fix = f"{name}.{key}=<column>" if key == "conversation_column" else f"{name}.column_map='{{{example}}}'"
    return [
        ConfigError(
            f"{name}: the data's columns are {found}, but {component} reads {[column_map.get(c, c) for c in missing]}; "
            f"map them with {fix}",
            f"{name}.{key}",
        )
    ]

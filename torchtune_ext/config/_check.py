"""The start-up checks of a QLoRA recipe config (:func:`check_config`), run first in the recipe's ``__init__``: every
problem a config can have that shows without loading weights or data fails here, one line each, before anything is
written.

- keys: unknown top-level keys, and keys of each ``_component_`` section that the component does not take (its
  signature), with the nearest known key ("unknown key 'dtpye': did you mean 'dtype'?");
- sections: a component section given as a string (``generate_base_checkpoint=None`` is the string ``'None'``), a
  ``_component_`` that does not import (the missing name and the nearest one);
- ranges: LoRA rank/alpha/dropout, learning rate, batch sizes, sequence length, step counts, epochs; the LoRA
  attention modules' names;
- ``device``: one this machine has (else the ones it has);
- files: the tokenizer's files (the hint keeps their place in the model's folder); a local data set's
  ``data_files`` exist, parse (JSON/JSONL: file, line and column of the first error) and have the columns the data
  set's format needs (else ``column_map``, with the columns found); a ``split`` the data set has, where that is
  known without loading (the tiny data set; a local file's loader).

:func:`check_generation_config` runs the key and device checks for the generation recipe.
"""

from __future__ import annotations

import difflib
import glob
import importlib
import inspect
import json
import pkgutil
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_ext.config._errors import ConfigError, ConfigFileNotFoundError, bad_value

#: every top-level key the QLoRA recipes read (both recipes take the same keys; the distributed-only ones are
#: harmless on one device). A key a recipe starts to read must be added here.
RECIPE_KEYS = frozenset(
    {
        # components
        "model", "tokenizer", "checkpointer", "dataset", "dataset_val", "optimizer", "lr_scheduler", "loss",
        "metric_logger", "generate_base_checkpoint", "collate_fn",
        # run
        "output_dir", "overwrite_output_dir", "device", "dtype", "merged_dtype", "adapter_dtype", "frozen_dtype",
        "seed", "shuffle", "cudnn_deterministic_mode",
        "batch_size", "global_batch_size", "gradient_accumulation_steps", "clip_grad_norm", "epochs",
        "max_steps_per_epoch", "stop_after_step", "log_every_n_steps", "save_every_n_steps", "run_val_every_n_steps",
        "max_validation_steps", "resume_from_checkpoint", "save_adapter_weights_only", "merge_base", "compile",
        "enable_activation_checkpointing", "enable_activation_offloading", "tiled_mlp_tokens", "loss_scaler",
        "vocab_pruning", "dry_run", "device_memory_gb", "keep_last_n_checkpoints", "merge_every_epoch",
        "device_profile", "compute_capability", "host_memory_gb", "memory_headroom", "world_size",
        # distributed
        "fsdp_cpu_offload", "fsdp_reshard_after_forward", "process_group_timeout_s",
        # torchtune's, for configs shared with its recipes: ours always log memory
        "log_peak_memory_stats",
    }
)  # fmt: skip
#: every top-level key the generation recipe reads (:class:`torchtune_ext.generation.GenerationRecipe`).
GENERATION_KEYS = frozenset(
    {
        "model", "tokenizer", "checkpointer", "output_dir", "adapter_dir", "dtype", "device", "dry_run", "mode",
        "prompt", "prompts", "prompts_file", "chat", "answers_file",
        "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "use_cache", "max_seq_len",
    }
)  # fmt: skip
#: every top-level key the ``eleuther_eval`` recipe reads (:class:`torchtune_ext.evaluation.EleutherEvalRecipe`).
EVAL_KEYS = frozenset(
    {
        "model", "tokenizer", "checkpointer", "output_dir", "adapter_dir", "merged_dir", "dtype", "device", "seed",
        "tasks", "include_path", "limit", "num_fewshot", "batch_size", "max_seq_len", "output_file", "bootstrap_iters",
    }
)  # fmt: skip
#: sections that must be a ``_component_`` section, and those that may be null too.
REQUIRED_COMPONENTS = (
    "model", "tokenizer", "checkpointer", "dataset", "optimizer", "lr_scheduler", "loss", "metric_logger",
)  # fmt: skip
OPTIONAL_COMPONENTS = ("dataset_val", "generate_base_checkpoint")
#: how to do without an optional section (a section cannot be removed on torchtune's command line).
_WITHOUT = {
    "generate_base_checkpoint": "it only writes the tiny base model when checkpointer.checkpoint_dir has none, so it "
    "can stay; or delete the section in your own copy of the config (tune-ext cp)",
    "dataset_val": "to skip validation set run_val_every_n_steps=null, or delete the section in your own copy of the "
    "config (tune-ext cp)",
}
#: arguments the recipe passes to a section's component itself (a config that sets them is wrong).
_RECIPE_ARGS = {
    "model": ("dtype", "adapter_dtype", "frozen_dtype", "device"),
    "optimizer": ("params",),
    "lr_scheduler": ("optimizer", "num_training_steps"),
    "dataset": ("tokenizer",),
    "dataset_val": ("tokenizer",),
}
#: plain sections (no ``_component_``) that are keyword arguments of a class of ours, minus what the recipe passes.
_PLAIN_SECTIONS = {"loss_scaler": ("torchtune_ext.training._precision.LossScaler", ("enabled", "device"))}
#: counts: positive integers; the second set may be null.
_POSITIVE = ("batch_size", "gradient_accumulation_steps", "epochs", "log_every_n_steps", "loss.num_output_chunks")
_POSITIVE_OR_NULL = (
    "global_batch_size",
    "max_steps_per_epoch",
    "stop_after_step",
    "save_every_n_steps",
    "run_val_every_n_steps",
    "max_validation_steps",
    "tiled_mlp_tokens",
    "tokenizer.max_seq_len",
)
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
_GLOB_CHARS = ("*", "?", "[")


def check_config(cfg: DictConfig, *, dry_run: bool = False) -> None:
    """Every start-up check of a recipe config; nothing is loaded or written.

    Args:
        cfg (DictConfig): the recipe config.
        dry_run (bool): the memory estimate only: the device, tokenizer and data files are not needed.

    Raises:
        ConfigError: one line per problem found (``ConfigFileNotFoundError`` when the first is a missing file).
    """
    problems = [*_check_keys(cfg), *_check_ranges(cfg)]
    if not problems and not dry_run:
        problems += [*_check_device(cfg.get("device", None)), *_check_tokenizer_files(cfg), *_check_data_sets(cfg)]
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
    problems = _check_keys(cfg, known, sections)
    if not problems and not cfg.get("dry_run", False):
        problems += [*_check_device(cfg.get("device", None)), *_check_tokenizer_files(cfg)]
    _raise(problems)


def _raise(problems: List[ConfigError]) -> None:
    if problems:
        kind = ConfigFileNotFoundError if isinstance(problems[0], ConfigFileNotFoundError) else ConfigError
        raise kind("\n".join(str(p) for p in problems), problems[0].key)


def suggest(key: str, known: Iterable[str], prefix: str = "") -> str:
    """
    Args:
        key (str): an unknown key.
        known (Iterable[str]): the valid keys.
        prefix (str): the section of both (``model.``), for the message.

    Returns:
        str: ``": did you mean 'x'?"`` for the nearest valid key, or the list of valid keys.
    """
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f": did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {', '.join(known)}"


# ------------------------------------------------------------------------------------------------------ keys


def _component(path: str) -> Callable[..., Any]:
    from torchtune.config._utils import _get_component_from_path

    return _get_component_from_path(path)


def _parameters(target: Callable[..., Any]) -> Tuple[List[str], bool]:
    """The keyword names ``target`` takes, and whether it also takes ``**kwargs``."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return [], True
    names = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    var_keyword = [p for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD]
    if var_keyword and var_keyword[0].name == "load_dataset_kwargs":  # torchtune's data set builders forward these
        import datasets

        names += _parameters(datasets.load_dataset)[0]
    return names, bool(var_keyword)


def _sections(cfg: DictConfig) -> Iterator[Tuple[str, DictConfig]]:
    """Every ``_component_`` section, with its dotted key (lists of sections too, e.g. ``dataset[0]``)."""
    for key in cfg:
        if OmegaConf.is_missing(cfg, key):
            continue
        value = cfg[key]
        if isinstance(value, DictConfig) and "_component_" in value:
            yield str(key), value
        elif isinstance(value, ListConfig):
            for i, item in enumerate(value):
                if isinstance(item, DictConfig) and "_component_" in item:
                    yield f"{key}[{i}]", item


def _check_keys(
    cfg: DictConfig,
    known: frozenset = RECIPE_KEYS,
    components: Sequence[str] = (*REQUIRED_COMPONENTS, *OPTIONAL_COMPONENTS),
) -> List[ConfigError]:
    problems = []
    section_keys = {f"{name}.{k}": k for name, section in _sections(cfg) for k in section if k != "_component_"}
    for key in cfg:
        if key in known:
            if OmegaConf.is_missing(cfg, key):  # ``???`` in the config: the command line must give it
                why = "the config leaves it to the command line"
                problems.append(ConfigError(f"{key} must be set: {why} ({key}=...)", str(key)))
            continue
        nested = sorted(full for full, short in section_keys.items() if short == key)
        hint = f": did you mean {nested[0]!r}?" if nested else suggest(str(key), known)
        problems.append(ConfigError(f"unknown key {key!r}{hint}", str(key)))
    for key in components:
        problems += _check_is_section(cfg, key)
    for name, section in _sections(cfg):
        if not _is_none(section._component_):
            problems += _check_section_keys(name, section)
    for name, (path, passed) in _PLAIN_SECTIONS.items():
        section = cfg.get(name, None)
        if isinstance(section, DictConfig):
            params = [p for p in _parameters(_component(path))[0] if p not in passed]
            problems += [
                ConfigError(f"unknown key '{name}.{k}'{suggest(str(k), params, f'{name}.')}", f"{name}.{k}")
                for k in section
                if k not in params
            ]
    return problems


def _is_none(value: Any) -> bool:
    return value is None or isinstance(value, str) and value.lower() in ("none", "null")


def _check_is_section(cfg: DictConfig, key: str) -> List[ConfigError]:
    """A component section: present (if required) and with a ``_component_``. ``key=None`` on torchtune's command line
    sets ``key._component_`` to null (its shorthand for sections; sections cannot be removed there), and in a
    Python dotlist gives the string ``'None'``: both get the way to do without the section."""
    value = cfg.get(key, None)
    required = key in REQUIRED_COMPONENTS
    if value is None and not required:
        return []
    if value is None:
        return [ConfigError(f"{key} is missing: the recipe needs a {key} section with a _component_", key)]
    if isinstance(value, DictConfig) and "_component_" in value and not _is_none(value._component_):
        return []
    if key == "dataset" and isinstance(value, ListConfig):
        return []
    if _is_none(value) or isinstance(value, DictConfig) and _is_none(value.get("_component_", None)):
        fix = f"the recipe needs {key}: set {key}._component_" if required else _WITHOUT[key]
        return [ConfigError(f"{key}=None: a config section cannot be turned off with None; {fix}", key)]
    fix = f"a section with a _component_ and its arguments{'' if required else ', or null'}"
    return [bad_value(key, value, "is not a config section", fix)]


def _why_not_importable(path: str, err: Exception) -> Tuple[str, str]:
    """What of the dotted ``path`` is missing, and the fix: the nearest name of the deepest module that imports, or
    the package a module needs that is not installed; else the import's own error."""
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:end])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as missing:
            if missing.name and not module_name.startswith(missing.name):
                return f"{module_name} needs {missing.name}, which is not installed", f"pip install {missing.name}"
            continue
        except Exception as failed:
            return f"importing {module_name} failed ({type(failed).__name__}: {failed})", "fix that module"
        if hasattr(module, parts[end]):
            break
        names = [n for n in dir(module) if not n.startswith("_")]
        names += [m.name for m in pkgutil.iter_modules(getattr(module, "__path__", []))]  # submodules not imported yet
        close = difflib.get_close_matches(parts[end], names, n=1, cutoff=0.6)
        fix = f"did you mean '{module_name}.{close[0]}'?" if close else "check the name"
        return f"{module_name} has no {parts[end]!r}", fix
    cause = err.__cause__ or err
    return f"{type(cause).__name__}: {str(cause).splitlines()[0]}", "give the full dotted path of a class or function"


def _check_section_keys(name: str, section: DictConfig) -> List[ConfigError]:
    path = section._component_
    try:
        target = _component(path)
    except Exception as err:  # torchtune raises InstantiationError, or whatever the import raised
        problem, fix = _why_not_importable(str(path), err)
        return [bad_value(f"{name}._component_", path, f"cannot be imported: {problem}", fix)]
    params, var_keyword = _parameters(target)
    owner = name.split("[")[0]
    problems = []
    for key in section:
        if key == "_component_" or key in params and key not in _RECIPE_ARGS.get(owner, ()):
            continue
        full = f"{name}.{key}"
        if key in _RECIPE_ARGS.get(owner, ()):
            problems.append(ConfigError(f"{full} is set by the recipe; remove it from the config", full))
            continue
        close = difflib.get_close_matches(str(key), params, n=1, cutoff=0.8)
        if var_keyword and not close:
            continue  # passed on through **kwargs: only a near miss of a named argument is taken for a typo
        hint = suggest(str(key), params, f"{name}.")
        problems.append(ConfigError(f"unknown key {full!r} ({path} does not take it){hint}", full))
    return problems


# ---------------------------------------------------------------------------------------------------- ranges


def _lookup(cfg: DictConfig, dotted: str) -> Tuple[bool, Any]:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: the attention projections torchtune's LoRA builders take (``torchtune.modules.peft.LORA_ATTN_MODULES``).
_LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
#: the Hugging Face loaders of local files: without a dict of ``data_files`` per split, their one split is "train".
_LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")
#: (key, test, what the value must be): numbers checked when present.
_NUMBER_RANGES: Sequence[Tuple[str, Callable[[Any], bool], str]] = (
    ("model.lora_rank", lambda v: _is_int(v) and v >= 1, "an integer >= 1 (e.g. 8, 16, 64)"),
    ("model.lora_alpha", lambda v: _is_number(v) and v > 0, "a number > 0 (commonly 2 * lora_rank)"),
    ("model.lora_dropout", lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    ("optimizer.lr", lambda v: _is_number(v) and v > 0, "a number > 0 (e.g. 3e-4)"),
    ("optimizer.weight_decay", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    ("lr_scheduler.num_warmup_steps", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    ("clip_grad_norm", lambda v: v is None or _is_number(v) and v > 0, "a number > 0, or null (no clipping)"),
    ("device_memory_gb", lambda v: v is None or _is_number(v) and v > 0, "a number of GiB > 0, or null"),
    ("host_memory_gb", lambda v: v is None or _is_number(v) and v > 0, "a number of GiB > 0, or null"),
    ("seed", lambda v: v is None or _is_int(v) and v >= 0, "an integer >= 0, or null (a random seed)"),
)


def _check_ranges(cfg: DictConfig) -> List[ConfigError]:
    problems = []
    for key in (*_POSITIVE, *_POSITIVE_OR_NULL):
        present, value = _lookup(cfg, key)
        nullable = key in _POSITIVE_OR_NULL
        if present and not (value is None and nullable or _is_int(value) and value >= 1):
            problems.append(bad_value(key, value, f"must be a positive integer{' or null' if nullable else ''}"))
    for key, valid, what in _NUMBER_RANGES:
        present, value = _lookup(cfg, key)
        if present and not valid(value):
            problems.append(bad_value(key, value, f"must be {what}"))
    return problems + _check_lora_modules(cfg)


def _check_lora_modules(cfg: DictConfig) -> List[ConfigError]:
    """``model.lora_attn_modules``: a list of torchtune's attention projections (else it fails at the first save)."""
    key = "model.lora_attn_modules"
    present, value = _lookup(cfg, key)
    if not present or value is None:
        return []
    names = list(_LORA_ATTN_MODULES)
    if not isinstance(value, ListConfig):
        return [bad_value(key, value, "must be a list", f"e.g. {key}=[q_proj,v_proj] (any of {names})")]
    problems = []
    for module in value:
        if module not in names:
            close = difflib.get_close_matches(str(module), names, n=1, cutoff=0.6)
            fix = f"did you mean {close[0]!r}? ({key} takes any of {names})" if close else f"use any of {names}"
            problems.append(bad_value(key, list(value), f"has {module!r}, which is not an attention projection", fix))
    return problems


# ---------------------------------------------------------------------------------------------------- device


def available_devices() -> List[str]:
    """
    Returns:
        List[str]: the devices this machine has: ``cpu``, then each accelerator (``cuda:0``, ``mps``, ...).
    """
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    for name in ("xpu", "npu", "hpu", "mtia"):
        module = getattr(torch, name, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            count = getattr(module, "device_count", lambda: 1)()
            devices += [f"{name}:{i}" for i in range(count)]
    return devices


def _check_device(value: Any) -> List[ConfigError]:
    """``device`` must be one this machine has (null: torchtune's choice, the accelerator if any)."""
    import torch

    if value is None:
        return []
    available = available_devices()
    kinds = {d.split(":")[0] for d in available}
    listed = ", ".join(available)
    try:
        device = torch.device(str(value))
    except (RuntimeError, ValueError):
        return [bad_value("device", value, "is not a device", f"use one of this machine's: {listed}")]
    if device.type not in kinds:
        where = " (on Colab/Kaggle: choose a GPU runtime, then restart)" if device.type == "cuda" else ""
        return [
            bad_value(
                "device",
                value,
                f"is not available: this machine has no {device.type} device{where}",
                f"use one of this machine's: {listed} (device=cpu works everywhere, slowly)",
            )
        ]
    if device.index is not None and f"{device.type}:{device.index}" not in available:
        return [bad_value("device", value, "does not exist on this machine", f"use one of: {listed}")]
    return []


# ----------------------------------------------------------------------------------------------------- files


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


def _check_tokenizer_files(cfg: DictConfig) -> List[ConfigError]:
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


def _check_data_sets(cfg: DictConfig) -> List[ConfigError]:
    problems: List[ConfigError] = []
    for name, section in _sections(cfg):
        if name.split("[")[0] not in ("dataset", "dataset_val"):
            continue
        problems += _check_split(name, section)
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


def _check_split(name: str, section: DictConfig) -> List[ConfigError]:
    """``split`` names one of the data set's splits (``train[:90%]``, ``train+validation`` too), where they are known
    without loading: the tiny data set's, and a local loader's ("train", or the keys of a ``data_files`` dict)."""
    from torchtune_ext.data import TINY_SPLITS

    split, files = section.get("split", None), section.get("data_files", None)
    if split is None:
        return []
    if section._component_ == "torchtune_ext.data.tiny_instruct_dataset":  # a name, no slices
        known, names = sorted(TINY_SPLITS), {str(split)}
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

"""The key checks of a config: unknown top-level keys, and keys of each ``_component_`` section that the component
does not take (its signature), each with the nearest known key ("unknown key 'dtpye': did you mean 'dtype'?"); a
component section given as a string (``generate_base_checkpoint=None`` is the string ``'None'``), a ``_component_``
that does not import (the missing name and the nearest one)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_ext.config._errors import ConfigError, bad_value
from torchtune_ext.config._schema import OPTIONAL_COMPONENTS, RECIPE_KEYS, REQUIRED_COMPONENTS

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
    "loss_scaler": ("enabled", "device"),
}


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


def sections(cfg: DictConfig) -> Iterator[Tuple[str, DictConfig]]:
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


def check_keys(
    cfg: DictConfig,
    known: frozenset = RECIPE_KEYS,
    components: Sequence[str] = (*REQUIRED_COMPONENTS, *OPTIONAL_COMPONENTS),
    plain_sections: Mapping[str, Callable[..., Any]] = {},
) -> List[ConfigError]:
    """
    Args:
        cfg (DictConfig): the config.
        known (frozenset): its recipe's top-level keys.
        components (Sequence[str]): the sections that must be ``_component_`` sections (or null, where optional).
        plain_sections (Mapping[str, Callable[..., Any]]): sections without a ``_component_`` that are the keyword
            arguments of a class the recipe builds (``loss_scaler``: its loss scaler), by key.

    Returns:
        List[ConfigError]: one per unknown key, missing or malformed section, or ``_component_`` that does not import.
    """
    problems = []
    section_keys = {f"{name}.{k}": k for name, section in sections(cfg) for k in section if k != "_component_"}
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
    for name, section in sections(cfg):
        if not _is_none(section._component_):
            problems += _check_section_keys(name, section)
    for name, target in plain_sections.items():
        section = cfg.get(name, None)
        if isinstance(section, DictConfig):
            params = [p for p in _parameters(target)[0] if p not in _RECIPE_ARGS.get(name, ())]
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

"""Building a config section's component, with a value the component refuses reported as a config error: one line
naming the key, the value and the component's own reason, instead of a traceback from inside the component."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from omegaconf import DictConfig, OmegaConf
from torchtune import config
from torchtune.config._errors import InstantiationError

from torchtune_ext.config._errors import TRACEBACK_ENV, ConfigError, UserFacingError, bad_value

#: what a component raises for a value it refuses (an unknown choice, a wrong type, a missing or unknown argument),
#: or for a ``_component_`` (or a package it needs) that cannot be imported.
COMPONENT_VALUE_ERRORS = (TypeError, ValueError, ImportError, InstantiationError)
#: the most characters of the component's own message a config error quotes.
_REASON_CHARS = 300


def instantiate_component(section: Any, key: str, *args: Any, **kwargs: Any) -> Any:
    """torchtune's ``config.instantiate`` of the config section at ``key``, where an error the section's values cause
    is a :class:`ConfigError` (chained to it: ``TORCHTUNE_EXT_TRACEBACK=1`` shows where it was raised).

    Args:
        section (Any): the section, e.g. ``cfg.optimizer``.
        key (str): its config key path, e.g. ``optimizer``.
        *args (Any): positional arguments the recipe passes (the params, the tokenizer, ...).
        **kwargs (Any): keyword arguments the recipe passes; they override the section's.

    Returns:
        Any: the component.

    Raises:
        ConfigError: naming ``key``, the value at fault where the component's message quotes one (else the section's
            values), and the component's message, on one of :data:`COMPONENT_VALUE_ERRORS`; a
            :class:`UserFacingError` the component raises is passed on as it is.

    Example:
        >>> from omegaconf import OmegaConf
        >>> section = OmegaConf.create({"_component_": "torchtune_ext.data.write_tiny_checkpoint", "family": "gpt"})
        >>> instantiate_component(section, "generate_base_checkpoint", checkpoint_dir="unused")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        torchtune_ext.config._errors.ConfigError: generate_base_checkpoint.family='gpt' is refused by ...: Unknown ...
    """
    try:
        return config.instantiate(section, *args, **kwargs)
    except UserFacingError:
        raise
    except COMPONENT_VALUE_ERRORS as err:
        raise component_error(section, key, err) from err


def component_error(section: Any, key: str, error: Exception) -> ConfigError:
    """The config error for ``error``, raised building the component of the section at ``key``."""
    if not isinstance(section, DictConfig):
        return bad_value(key, section, "is not a section", f"give {key} a _component_ and its arguments")
    component = section.get("_component_")
    reason = " ".join(str(error).split())[:_REASON_CHARS] or type(error).__name__
    if reason.startswith(f"{key}.") or f" {key}." in reason:  # the component names the key itself
        return ConfigError(reason, key)
    values = _values(section)
    blamed = _quoted_values(values, reason)
    if len(blamed) == 1:
        name, value = blamed[0]
        return bad_value(f"{key}.{name}", value, f"is refused by {component}: {reason}")
    if isinstance(error, (ImportError, InstantiationError)):
        fix = f"install what it needs, or set another {key}._component_"
    else:
        given = ", ".join(f"{name}={value!r}" for name, value in values.items()) or "none"
        fix = f"fix the {key} values (given: {given}); {TRACEBACK_ENV}=1 shows where it failed"
    return ConfigError(f"{key}: {component} failed with {type(error).__name__}: {reason}; {fix}", key)


def _values(section: DictConfig) -> Dict[str, Any]:
    """The section's arguments, interpolations resolved (``config.instantiate`` resolved them before it failed)."""
    values = OmegaConf.to_container(section, resolve=True)
    return {str(name): value for name, value in values.items() if name != "_component_"}


def _quoted_values(values: Dict[str, Any], reason: str) -> List[Tuple[str, Any]]:
    """The string arguments whose value the message quotes (``'qwen2'``): the one at fault, where it is alone."""
    return [(name, value) for name, value in values.items() if isinstance(value, str) and repr(value) in reason]

"""The recipes' entry point: torchtune's ``config.parse`` with command-line values that hold ``=``
(``prompt="What is 2+2=?"``), which torchtune's override parser refuses (it splits each override on every ``=``)."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf
from torchtune.config._parse import TuneRecipeArgumentParser
from torchtune.config._utils import _merge_yaml_and_cli_args

from torchtune_ext.config._errors import ConfigError


def parse(recipe_main: Callable[[DictConfig], Any]) -> Callable[..., Any]:
    """Decorates a recipe's main as torchtune's ``config.parse`` does (``--config <yaml> [key=value ...]``), except
    that an override's value may hold ``=``: it is split at its first ``=``. A malformed override is a
    :class:`~torchtune_ext.config.ConfigError`.

    Args:
        recipe_main (Callable[[DictConfig], Any]): the recipe's main, taking the merged config.

    Returns:
        Callable[..., Any]: the decorated main (it exits with main's return value, as torchtune's).
    """

    @functools.wraps(recipe_main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        parser = TuneRecipeArgumentParser(
            description=recipe_main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        yaml_args, cli_args = parser.parse_known_args()
        # torchtune's merge splits on every "=": it gets the others (its `~key` and `_component_` handling applies)
        texts = [arg for arg in cli_args if not arg.startswith("~") and arg.count("=") > 1]
        try:
            conf = _merge_yaml_and_cli_args(yaml_args, [arg for arg in cli_args if arg not in texts])
        except ValueError as err:
            raise ConfigError(str(err)) from err
        sys.exit(recipe_main(OmegaConf.merge(conf, OmegaConf.from_dotlist(texts))))

    return wrapper

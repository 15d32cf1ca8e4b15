"""Config checks: everything a recipe config can get wrong, found before any weight or data is loaded and before
anything is written, reported one line per problem (:class:`ConfigError`) without a traceback."""

from torchtune_ext.config._check import (
    EVAL_KEYS,
    GENERATION_KEYS,
    RECIPE_KEYS,
    TOKENIZER_FILE_KEYS,
    available_devices,
    check_config,
    check_generation_config,
    missing_tokenizer_file,
    read_json_records,
    suggest,
)
from torchtune_ext.config._errors import (
    CONFIG_ERROR_DIR_ENV,
    CONFIG_ERROR_EXIT_CODE,
    TRACEBACK_ENV,
    ConfigError,
    ConfigFileNotFoundError,
    UserFacingError,
    bad_value,
    exit_on_config_error,
    print_config_error,
)
from torchtune_ext.config._instantiate import COMPONENT_VALUE_ERRORS, instantiate_component
from torchtune_ext.config._parse import parse
from torchtune_ext.config._validate import validate

__all__ = [
    "COMPONENT_VALUE_ERRORS",
    "CONFIG_ERROR_DIR_ENV",
    "CONFIG_ERROR_EXIT_CODE",
    "EVAL_KEYS",
    "GENERATION_KEYS",
    "RECIPE_KEYS",
    "TOKENIZER_FILE_KEYS",
    "TRACEBACK_ENV",
    "ConfigError",
    "ConfigFileNotFoundError",
    "UserFacingError",
    "available_devices",
    "bad_value",
    "check_config",
    "check_generation_config",
    "exit_on_config_error",
    "instantiate_component",
    "missing_tokenizer_file",
    "parse",
    "print_config_error",
    "read_json_records",
    "suggest",
    "validate",
]

"""The bottom layer: the errors every layer raises (:class:`UserFacingError`, :class:`ConfigError`, in ``_errors``),
the recipes' config schemas (``_schema``: every key once) and the config checks run before any work, reported one
line per problem without a traceback. It imports nothing else of torchtune_ext."""

from torchtune_ext.config._check import check_config, check_generation_config
from torchtune_ext.config._device import available_devices
from torchtune_ext.config._errors import (
    CONFIG_ERROR_DIR_ENV,
    CONFIG_ERROR_EXIT_CODE,
    TRACEBACK_ENV,
    ConfigError,
    ConfigFileNotFoundError,
    MissingExtraError,
    UserFacingError,
    bad_value,
    exit_on_config_error,
    print_config_error,
)
from torchtune_ext.config._files import TOKENIZER_FILE_KEYS, missing_tokenizer_file, read_json_records
from torchtune_ext.config._instantiate import COMPONENT_VALUE_ERRORS, instantiate_component
from torchtune_ext.config._keys import suggest
from torchtune_ext.config._parse import parse
from torchtune_ext.config._schema import (
    EVAL_KEYS,
    EVAL_SCHEMA,
    GENERATION_KEYS,
    GENERATION_SCHEMA,
    RECIPE_KEYS,
    RECIPE_SCHEMA,
    Key,
    Rule,
    check_setting,
    declared,
    key_table,
    key_tables,
    positive_integer,
    recipe_setting,
)

__all__ = [
    "COMPONENT_VALUE_ERRORS",
    "CONFIG_ERROR_DIR_ENV",
    "CONFIG_ERROR_EXIT_CODE",
    "EVAL_KEYS",
    "EVAL_SCHEMA",
    "GENERATION_KEYS",
    "GENERATION_SCHEMA",
    "RECIPE_KEYS",
    "RECIPE_SCHEMA",
    "TOKENIZER_FILE_KEYS",
    "TRACEBACK_ENV",
    "ConfigError",
    "ConfigFileNotFoundError",
    "Key",
    "Rule",
    "MissingExtraError",
    "UserFacingError",
    "available_devices",
    "bad_value",
    "check_config",
    "check_generation_config",
    "check_setting",
    "declared",
    "exit_on_config_error",
    "instantiate_component",
    "key_table",
    "key_tables",
    "missing_tokenizer_file",
    "parse",
    "positive_integer",
    "print_config_error",
    "read_json_records",
    "recipe_setting",
    "suggest",
]

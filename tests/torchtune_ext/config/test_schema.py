"""The config schemas: each key of the QLoRA, generate and eleuther_eval recipes declared once, and the unknown-key
checks, the range checks, the recipes' settings and the docs' key tables all read from them."""

import ast
import re
from pathlib import Path
from typing import Set

import pytest
from omegaconf import OmegaConf

from torchtune_ext.checkpoint import DEFAULT_KEEP_LAST_N, MERGE_BASES
from torchtune_ext.config import (
    EVAL_KEYS,
    EVAL_SCHEMA,
    GENERATION_KEYS,
    GENERATION_SCHEMA,
    RECIPE_KEYS,
    RECIPE_SCHEMA,
    ConfigError,
    check_config,
    key_tables,
    recipe_setting,
)
from torchtune_ext.config._schema import _SECTION_ARGUMENTS, COMPONENTS_OWN, REQUIRED
from torchtune_ext.evaluation import EleutherEvalRecipe
from torchtune_ext.generation import GenerationRecipe, SamplingSettings
from torchtune_ext.memory import DEFAULT_HEADROOM
from torchtune_ext.training import RecipeSettings

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny" / "qlora_single_device.yaml"
#: the code that reads a QLoRA recipe's config (as ``cfg``).
READERS = ("torchtune_ext/training/*.py", "torchtune_ext/memory/*.py", "recipes/qlora_finetune_*.py")
#: the code that reads the generate and the eleuther_eval recipes' configs, and their schemas.
OTHER_READERS = {
    "generate": (("torchtune_ext/generation/*.py", "recipes/generate.py"), GENERATION_SCHEMA),
    "eleuther_eval": (("torchtune_ext/evaluation/*.py", "recipes/eleuther_eval.py"), EVAL_SCHEMA),
}
#: the generate recipe's keys that are ``SamplingSettings``' fields.
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "use_cache")
GENERATION = ROOT / "configs" / "tiny" / "generation.yaml"
EVAL = ROOT / "configs" / "tiny" / "eleuther_eval.yaml"
#: modules whose ``cfg`` is a section, not the recipe config.
SECTION_READERS = ("_interrupt.py",)
#: RecipeSettings fields that are the value of a key of another name.
_FIELD_KEYS = {"keep_last_n": "keep_last_n_checkpoints", "max_seq_len": "tokenizer.max_seq_len"}
#: RecipeSettings fields derived from keys, not read as they are.
_DERIVED = {"device", "dtype", "adapter_dtype", "vocab_pruning", "keep_last_n"}


def test_the_docs_key_tables_are_the_schemas():
    docs = (ROOT / "docs" / "config-keys.md").read_text()
    generated = key_tables()
    assert generated.count("| key | type |") == 3
    tables = docs[docs.index(generated.splitlines()[0]) :]
    assert tables == generated, "regenerate docs/config-keys.md's tables (the command is in the file)"


@pytest.mark.parametrize(
    "schema, keys",
    [(RECIPE_SCHEMA, RECIPE_KEYS), (GENERATION_SCHEMA, GENERATION_KEYS), (EVAL_SCHEMA, EVAL_KEYS)],
    ids=["qlora", "generate", "eleuther_eval"],
)
def test_each_key_is_declared_once(schema, keys):
    names = [key.name for key in schema]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
    assert keys == {name for name in names if "." not in name}


def _keys_read(path: Path) -> Set[str]:
    """The top-level keys ``path`` reads from a ``cfg``: ``cfg.get("key", ...)``, ``cfg.key``, ``cfg["key"]``,
    ``recipe_setting(cfg, "key"[, schema])``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg":
            found.add(node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "cfg":
            if isinstance(node.slice, ast.Constant):
                found.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "recipe_setting":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                found.add(node.args[1].value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "cfg" and node.args:
                if isinstance(node.args[0], ast.Constant):
                    found.add(node.args[0].value)
    return found - {"get", "pop", "items", "keys"}


def test_every_key_the_recipe_reads_is_declared():
    files = [path for pattern in READERS for path in sorted(ROOT.glob(pattern)) if path.name not in SECTION_READERS]
    read = {key for path in files for key in _keys_read(path)}
    assert "batch_size" in read or "dry_run" in read  # the scan finds what it looks for
    assert sorted(read - RECIPE_KEYS) == []


@pytest.mark.parametrize("recipe", sorted(OTHER_READERS))
def test_every_key_the_generate_and_eval_recipes_read_is_declared(recipe):
    patterns, schema = OTHER_READERS[recipe]
    read = {key for pattern in patterns for path in sorted(ROOT.glob(pattern)) for key in _keys_read(path)}
    assert {"device", "dtype", "adapter_dir"} <= read  # the scan finds what it looks for
    assert sorted(read - {key.name for key in schema}) == []


def _config(path: Path, *overrides: str, drop=()):
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
    for key in drop:
        cfg.pop(key)
    return cfg


def test_absent_sampling_keys_read_as_the_schemas_defaults():
    settings = GenerationRecipe(_config(GENERATION, drop=SAMPLING_KEYS)).settings
    expected = SamplingSettings(max_new_tokens=128, temperature=0.0, top_k=None, top_p=None, seed=None, stop=())
    assert settings == SamplingSettings() == expected
    defaults = {key.name: key.default for key in GENERATION_SCHEMA}
    assert {key: getattr(settings, key) for key in SAMPLING_KEYS} == {key: defaults[key] for key in SAMPLING_KEYS}


@pytest.mark.parametrize("override", ["max_new_tokens=0", "temperature=-1", "top_k=0", "top_p=1.5", "max_seq_len=0"])
def test_the_generate_recipe_and_sampling_settings_refuse_a_value_alike(override):
    key = override.split("=")[0]
    cfg = _config(GENERATION, override)
    with pytest.raises(ConfigError) as read:
        GenerationRecipe(cfg)
    assert str(read.value).startswith(f"{override} must be")
    if key in SAMPLING_KEYS:
        with pytest.raises(ConfigError) as built:
            SamplingSettings(**{key: cfg[key]})
        assert str(built.value) == str(read.value)


@pytest.mark.parametrize(
    "overrides, drop, message",
    [
        (["batch_size=0"], (), "batch_size=0 must be a positive integer"),
        (["max_seq_len=null"], (), "max_seq_len=None must be a positive integer"),
        ([], ("batch_size",), "batch_size is missing: the recipe needs it"),
        (["tasks=[]"], (), "tasks is empty"),
    ],
)
def test_the_eval_recipe_refuses_what_its_schema_refuses(overrides, drop, message):
    cfg = _config(EVAL, "tasks=[x]", *overrides, drop=drop)
    with pytest.raises(ConfigError, match=re.escape(message)):
        EleutherEvalRecipe(cfg)


def test_defaults_agree_with_the_readers_constants():
    defaults = {key.name: key.default for key in RECIPE_SCHEMA}
    assert defaults["keep_last_n_checkpoints"] == DEFAULT_KEEP_LAST_N
    assert defaults["memory_headroom"] == DEFAULT_HEADROOM
    merge_base = next(key for key in RECIPE_SCHEMA if key.name == "merge_base")
    assert [base for base in MERGE_BASES if merge_base.rule.test(base)] == list(MERGE_BASES)
    assert not merge_base.rule.test("nf5")


def _settings(*overrides: str, drop=()) -> RecipeSettings:
    cfg = OmegaConf.merge(OmegaConf.load(TINY), OmegaConf.from_dotlist(list(overrides)))
    for key in drop:
        cfg.pop(key, None)
    return RecipeSettings.from_config(cfg)


def test_absent_keys_read_as_the_schemas_defaults():
    fields = [f for f in RecipeSettings.__dataclass_fields__ if f not in _DERIVED and f not in ("dry_run",)]
    keys = [_FIELD_KEYS.get(field, field) for field in fields]
    top_level = [key for key in keys if "." not in key]
    settings = _settings(drop=top_level)
    defaults = {key.name: key.default for key in RECIPE_SCHEMA}
    for field, key in zip(fields, keys):
        if "." not in key:
            assert getattr(settings, field) == defaults[key], key
    assert _settings(drop=["keep_last_n_checkpoints"]).keep_last_n == defaults["keep_last_n_checkpoints"]


@pytest.mark.parametrize(
    "override, field, value",
    [
        ("epochs=3", "epochs", 3),
        ("merge_base=original", "merge_base", "original"),
        ("tokenizer.max_seq_len=32", "max_seq_len", 32),
    ],
)
def test_settings_read_the_configs_values(override, field, value):
    assert getattr(_settings(override), field) == value


@pytest.mark.parametrize("override", ["epochs=0", "merge_base=nf5", "clip_grad_norm=-1", "tokenizer.max_seq_len=0"])
def test_settings_and_the_start_up_check_refuse_a_value_alike(override):
    cfg = OmegaConf.merge(OmegaConf.load(TINY), OmegaConf.from_dotlist([override]))
    with pytest.raises(ConfigError) as checked:
        check_config(cfg, dry_run=True)
    with pytest.raises(ConfigError) as read:
        RecipeSettings.from_config(cfg)
    assert str(read.value) == str(checked.value)
    assert str(read.value).startswith(override.split("=")[0] + "=")


def test_the_merge_base_message_names_both_bases():
    cfg = OmegaConf.merge(OmegaConf.load(TINY), OmegaConf.from_dotlist(["merge_base=nf5"]))
    with pytest.raises(
        ConfigError, match=re.escape("merge_base='nf5' is not supported; use merge_base=nf4 (merge onto")
    ):
        recipe_setting(cfg, "merge_base")


def test_a_missing_required_key_says_so():
    cfg = OmegaConf.load(TINY)
    cfg.pop("device")
    with pytest.raises(ConfigError, match="device is missing: the recipe needs it"):
        recipe_setting(cfg, "device")


def test_section_arguments_default_to_the_components_own():
    assert {key.default for key in _SECTION_ARGUMENTS} <= {COMPONENTS_OWN, None}
    assert REQUIRED not in {key.default for key in _SECTION_ARGUMENTS}
    with pytest.raises(ValueError, match="read by the component itself"):
        recipe_setting(OmegaConf.create({"model": {}}), "model.lora_rank")

"""``instantiate_component``: a value a component refuses is a one-line config error naming the key, the value and
the component's own reason (chained to it); anything else it raises passes unchanged."""

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ext.config import ConfigError, ConfigFileNotFoundError, instantiate_component


def _section(**values):
    return OmegaConf.create(values)


def test_the_quoted_value_is_named_with_its_key(tmp_path):
    section = _section(_component_="torchtune_ext.data.write_tiny_checkpoint", checkpoint_dir=str(tmp_path / "base"))
    section.family = "qwen2"
    with pytest.raises(ConfigError) as raised:
        instantiate_component(section, "generate_base_checkpoint")
    assert str(raised.value) == (
        "generate_base_checkpoint.family='qwen2' is refused by torchtune_ext.data.write_tiny_checkpoint: Unknown tiny "
        "model family 'qwen2'; use one of ['llama', 'qwen']."
    )
    assert raised.value.key == "generate_base_checkpoint.family"
    assert isinstance(raised.value.__cause__, ValueError)  # the component's own error, for TORCHTUNE_EXT_TRACEBACK=1
    assert not (tmp_path / "base").exists()


def test_an_unquoted_value_lists_the_section_values():
    section = _section(_component_="torch.optim.AdamW", lr=3e-3, betas=0.9)
    with pytest.raises(ConfigError) as raised:
        instantiate_component(section, "optimizer", [torch.nn.Parameter(torch.zeros(1))])
    assert str(raised.value) == (
        "optimizer: torch.optim.AdamW failed with TypeError: 'float' object is not subscriptable; fix the optimizer "
        "values (given: lr=0.003, betas=0.9); TORCHTUNE_EXT_TRACEBACK=1 shows where it failed"
    )
    assert raised.value.key == "optimizer"
    assert isinstance(raised.value.__cause__, TypeError)


def test_a_multi_line_reason_becomes_one_line():
    section = _section(_component_="torch.nn.Dropout", p=2.0)
    with pytest.raises(ConfigError) as raised:
        instantiate_component(section, "model.dropout")
    assert "\n" not in str(raised.value)
    assert str(raised.value).startswith("model.dropout: torch.nn.Dropout failed with ValueError: dropout probability")


def test_a_component_that_cannot_be_imported_says_to_install_or_replace_it():
    with pytest.raises(ConfigError) as raised:
        instantiate_component(_section(_component_="torch.optim.NoSuchOptimizer"), "optimizer", [])
    assert str(raised.value).endswith("install what it needs, or set another optimizer._component_")


def test_a_message_naming_the_key_is_kept_as_it_is(tmp_path):
    section = _section(
        _component_="torchtune_ext.checkpoint.QLoRAHFCheckpointer",
        checkpoint_dir=str(tmp_path),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA9",
        output_dir=str(tmp_path / "out"),
    )
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as raised:
        instantiate_component(section, "checkpointer")
    assert str(raised.value).startswith("checkpointer.model_type='LLAMA9' is not supported; use one of LLAMA2")


def test_user_facing_errors_and_other_failures_pass_unchanged(tmp_path):
    missing = _section(
        _component_="torchtune_ext.checkpoint.QLoRAHFCheckpointer",
        checkpoint_dir=str(tmp_path / "none"),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3_2",
        output_dir=str(tmp_path / "out"),
    )
    with pytest.raises(ConfigFileNotFoundError) as raised:
        instantiate_component(missing, "checkpointer")
    assert raised.value.__cause__ is None  # not re-wrapped
    # A RuntimeError is not a value the config got wrong: no config error hides it.
    with pytest.raises(RuntimeError, match="negative dimension"):
        instantiate_component(_section(_component_="torch.empty"), "buffer", -1)

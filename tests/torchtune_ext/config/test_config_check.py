"""``check_config``: every config mistake of issue 17 fails with one line naming the key, the value and the fix, before
anything is built (in-process; the printed one-liners and exit codes are tested in ``test_config_cli.py`` and
``tests/reliability/test_bad_input.py``)."""

import inspect
import json
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ext.config import (
    ConfigError,
    ConfigFileNotFoundError,
    _device,
    available_devices,
    check_config,
    read_json_records,
)
from torchtune_ext.data import TINY_SPLITS
from torchtune_ext.training import LossScaler

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny" / "qlora_single_device.yaml"
ALPACA = "dataset._component_=torchtune.datasets.alpaca_dataset"


def _check_as_the_recipe(cfg, dry_run: bool = False) -> None:
    """``check_config`` with what the QLoRA recipe passes: the tiny data set's splits, the loss scaler's arguments."""
    splits = {"torchtune_ext.data.tiny_instruct_dataset": TINY_SPLITS}
    check_config(cfg, dry_run=dry_run, splits=splits, plain_sections={"loss_scaler": LossScaler})


def _cfg(*overrides: str):
    return OmegaConf.merge(OmegaConf.load(TINY), OmegaConf.from_dotlist(list(overrides)))


def _error(*overrides: str, dry_run: bool = False) -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        _check_as_the_recipe(_cfg(*overrides), dry_run=dry_run)
    return raised.value


# the training recipes' configs (the generation and eleuther_eval recipes read other keys)
_OTHER_RECIPES = ("generation", "eleuther_eval")
TRAINING_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not p.stem.endswith(_OTHER_RECIPES))


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_passes(path):
    _check_as_the_recipe(OmegaConf.load(path), dry_run=True)  # the real models' files are not downloaded here


def test_the_tiny_config_passes_every_check():
    _check_as_the_recipe(_cfg(), dry_run=False)


# ------------------------------------------------------------------------------------------------------ keys


@pytest.mark.parametrize(
    "override, message",
    [
        ("dtpye=fp32", "unknown key 'dtpye': did you mean 'dtype'?"),
        ("lora_rank=-1", "unknown key 'lora_rank': did you mean 'model.lora_rank'?"),
        ("devcie=cpu", "unknown key 'devcie': did you mean 'device'?"),
        ("model.lora_rnak=8", "unknown key 'model.lora_rnak' (torchtune_ext.models.qlora_tiny_llama does not take it)"),
        ("optimizer.weight_decy=0.1", "did you mean 'optimizer.weight_decay'?"),
        ("tokenizer.max_seq_length=64", "did you mean 'tokenizer.max_seq_len'?"),
        ("loss_scaler.growth_intervall=100", "unknown key 'loss_scaler.growth_intervall': did you mean"),
        ("model.dtype=bf16", "model.dtype is set by the recipe; remove it from the config"),
        ("model._component_=torchtune_ext.models.no_such_builder", "model._component_='torchtune_ext.models.no_such"),
    ],
)
def test_unknown_keys_name_the_nearest_known_key(override, message):
    error = _error(override)
    assert message in str(error)
    assert len(str(error).splitlines()) == 1


def test_a_data_set_builder_forwarding_load_dataset_kwargs_catches_near_misses_only(tmp_path):
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}]))
    common = [ALPACA, "dataset.source=json"]
    error = _error(*common, f"dataset.data_file={data}")
    assert "unknown key 'dataset.data_file'" in str(error) and "did you mean 'dataset.data_files'?" in str(error)
    # `field` is a keyword of the json loader (passed through **load_dataset_kwargs): not a typo
    records = tmp_path / "records.json"
    records.write_text(json.dumps({"rows": [{"instruction": "a", "output": "b"}]}))
    _check_as_the_recipe(_cfg(*common, f"dataset.data_files={records}", "dataset.field=rows"))


def test_qlora_builders_have_the_torchtune_builders_signature():
    from torchtune_ext.models import QLORA_BUILDERS

    for ours, theirs in QLORA_BUILDERS.items():
        expected = [name for name in inspect.signature(theirs).parameters if name != "quantize_base"]
        names = list(inspect.signature(ours).parameters)
        assert [n for n in names if n in expected] == expected, ours.__name__
        assert {"dtype", "adapter_dtype", "frozen_dtype", "device", "seed"} <= set(names), ours.__name__
        assert "quantize_base" not in names


def test_several_problems_give_one_line_each():
    error = _error("dtpye=fp32", "model.lora_rank=0", "optimizer.lr=-1")
    lines = str(error).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("unknown key 'dtpye'")
    assert lines[1].startswith("model.lora_rank=0 must be")
    assert lines[2].startswith("optimizer.lr=-1 must be")


# -------------------------------------------------------------------------------------------------- sections


@pytest.mark.parametrize("tune_cli", [False, True], ids=["dotlist", "tune_run_command_line"])
def test_generate_base_checkpoint_none_gets_a_real_message(tune_cli):
    # torchtune's command line turns `key=None` for a section into `key._component_=null`
    override = "generate_base_checkpoint._component_=null" if tune_cli else "generate_base_checkpoint=None"
    error = _error(override)
    assert str(error) == (
        "generate_base_checkpoint=None: a config section cannot be turned off with None; it only writes the tiny base "
        "model when checkpointer.checkpoint_dir has none, so it can stay; or delete the section in your own copy of "
        "the config (tune-ext cp)"
    )
    _check_as_the_recipe(_cfg("generate_base_checkpoint=null"), dry_run=True)


def test_dataset_val_none_names_run_val_every_n_steps():
    assert "to skip validation set run_val_every_n_steps=null" in str(_error("dataset_val._component_=null"))


def test_a_required_section_that_is_none_or_missing():
    assert "the recipe needs model" in str(_error("model=None"))
    cfg = _cfg()
    cfg.pop("optimizer")
    with pytest.raises(ConfigError, match="optimizer is missing"):
        _check_as_the_recipe(cfg, dry_run=True)


# ---------------------------------------------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    "override",
    [
        "model.lora_rank=0",
        "model.lora_rank=-1",
        "model.lora_rank=2.5",
        "model.lora_alpha=0",
        "model.lora_alpha=-16",
        "model.lora_dropout=1.0",
        "model.lora_dropout=-0.1",
        "optimizer.lr=0",
        "optimizer.lr=-0.001",
        "optimizer.lr=fast",
        "batch_size=0",
        "global_batch_size=0",
        "gradient_accumulation_steps=0",
        "tokenizer.max_seq_len=0",
        "epochs=0",
        "max_steps_per_epoch=-5",
        "save_every_n_steps=0",
        "stop_after_step=0",
        "log_every_n_steps=0",
        "lr_scheduler.num_warmup_steps=-1",
        "clip_grad_norm=0",
        "seed=-1",
    ],
)
def test_values_out_of_range(override):
    key, value = override.split("=")
    error = _error(override)
    expected = OmegaConf.select(OmegaConf.from_dotlist([override]), key)
    assert str(error).startswith(f"{key}={expected!r} must be "), str(error)
    assert error.key == key


@pytest.mark.parametrize(
    "override",
    ["model.lora_rank=1", "model.lora_dropout=0.0", "max_steps_per_epoch=null", "tokenizer.max_seq_len=null"],
)
def test_values_at_the_edge_of_the_range_pass(override):
    _check_as_the_recipe(_cfg(override), dry_run=True)


# ---------------------------------------------------------------------------------------------------- device


def test_available_devices_are_this_machines():
    expected = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())] * torch.cuda.is_available()
    assert available_devices()[: len(expected)] == expected


@pytest.mark.parametrize(
    "devices, device, message",
    [
        (["cpu"], "cuda", "device='cuda' is not available: this machine has no cuda device (on Colab/Kaggle: choose"),
        (["cpu"], "mps", "device='mps' is not available: this machine has no mps device; use one of this machine's"),
        (["cpu", "cuda:0"], "cuda:1", "device='cuda:1' does not exist on this machine; use one of: cpu, cuda:0"),
        (["cpu", "cuda:0"], "cdua", "device='cdua' is not a device; use one of this machine's: cpu, cuda:0"),
    ],
)
def test_a_device_this_machine_lacks(monkeypatch, devices, device, message):
    monkeypatch.setattr(_device, "available_devices", lambda: devices)
    error = _error(f"device={device}")
    assert message in str(error)
    assert "device=cpu works everywhere" in str(error) or "cuda:1" in device or "cdua" in device


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0"])
def test_a_device_this_machine_has(monkeypatch, device):
    monkeypatch.setattr(_device, "available_devices", lambda: ["cpu", "cuda:0"])
    _check_as_the_recipe(_cfg(f"device={device}"))


def test_a_dry_run_needs_no_device(monkeypatch):
    monkeypatch.setattr(_device, "available_devices", lambda: ["cpu"])
    _check_as_the_recipe(_cfg("device=cuda"), dry_run=True)


# ----------------------------------------------------------------------------------------------------- files


def test_the_tokenizer_hint_keeps_the_subfolder(tmp_path):
    error = _error(
        "tokenizer._component_=torchtune.models.llama3.llama3_tokenizer",
        f"tokenizer.path={tmp_path}/Llama-3.2-1B/original/tokenizer.model",
        f"checkpointer.checkpoint_dir={tmp_path}/Llama-3.2-1B",
    )
    assert isinstance(error, ConfigFileNotFoundError) and isinstance(error, FileNotFoundError)
    assert "tokenizer.path=<checkpoint_dir>/original/tokenizer.model" in str(error)


def test_a_missing_data_file_names_dataset_data_files(tmp_path):
    missing = tmp_path / "no_such_data.json"
    error = _error(ALPACA, "dataset.source=json", f"dataset.data_files={missing}")
    assert isinstance(error, FileNotFoundError)
    assert str(error).startswith(f"dataset.data_files={str(missing)!r} does not exist")
    assert error.key == "dataset.data_files"


def test_a_missing_file_in_a_list_of_data_files(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"instruction": "a", "output": "b"}\n')
    error = _error(ALPACA, "dataset.source=json", f"dataset.data_files=[{good},{tmp_path}/b.jsonl]")
    assert f"'{tmp_path}/b.jsonl' does not exist" in str(error) and str(good) not in str(error)


def _bad_jsonl(tmp_path: Path) -> Tuple[Path, int, int]:
    lines = ['{"instruction": "a", "output": "b"}', '{"instruction": "c" "output": "d"}', '{"instruction": "e"}']
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, 2, lines[1].index('"output"') + 1


def test_jsonl_that_does_not_parse_names_file_line_and_column(tmp_path):
    path, line, column = _bad_jsonl(tmp_path)
    error = _error(ALPACA, "dataset.source=json", f"dataset.data_files={path}")
    assert str(error).startswith(f"dataset.data_files: {path}: line {line}, column {column}: invalid JSON"), str(error)


def test_a_json_array_that_does_not_parse_names_file_line_and_column(tmp_path):
    lines = ["[", '  {"instruction": "a", "output": "b"},', '  {"instruction": "c", "output": "d",}', "]"]
    path = tmp_path / "data.json"
    path.write_text("\n".join(lines))
    error = _error(ALPACA, "dataset.source=json", f"dataset.data_files={path}")
    assert f"{path}: line 3, column {lines[2].index('}') + 1}: invalid JSON" in str(error), str(error)


def test_read_json_records_reads_arrays_objects_and_lines(tmp_path):
    records: List[dict] = [{"a": 1}, {"a": 2}]
    (tmp_path / "array.json").write_text(json.dumps(records))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "field.json").write_text(json.dumps({"data": records}))
    assert read_json_records(tmp_path / "array.json") == records
    assert read_json_records(tmp_path / "lines.json") == records
    assert read_json_records(tmp_path / "field.json", "data") == records


def _question_answer(tmp_path: Path) -> Path:
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}]))
    return path


def test_columns_that_do_not_match_name_column_map_and_the_columns_found(tmp_path):
    path = _question_answer(tmp_path)
    error = _error(ALPACA, "dataset.source=json", f"dataset.data_files={path}")
    assert str(error) == (
        "dataset: the data's columns are ['answer', 'question'], but torchtune.datasets.alpaca_dataset reads "
        "['instruction', 'output']; map them with dataset.column_map='{instruction: <column>, output: <column>, "
        "input: <column>}'"
    )
    assert error.key == "dataset.column_map"
    mapped = ["dataset.column_map.instruction=question", "dataset.column_map.output=answer"]
    _check_as_the_recipe(_cfg(ALPACA, "dataset.source=json", f"dataset.data_files={path}", *mapped))


def test_a_column_map_to_a_column_the_data_lacks(tmp_path):
    path = _question_answer(tmp_path)
    mapped = ["dataset.column_map.instruction=question", "dataset.column_map.output=answr"]
    error = _error(ALPACA, "dataset.source=json", f"dataset.data_files={path}", *mapped)
    assert "reads ['answr']" in str(error) and "['answer', 'question']" in str(error)


def test_a_column_map_key_the_builder_does_not_read(tmp_path):
    path = _question_answer(tmp_path)
    error = _error(ALPACA, "dataset.source=json", f"dataset.data_files={path}", "dataset.column_map.prompt=question")
    assert "dataset.column_map has ['prompt']" in str(error) and "['instruction', 'output', 'input']" in str(error)


@pytest.mark.parametrize(
    "component, extra, message",
    [
        ("torchtune.datasets.instruct_dataset", [], "reads ['input', 'output']"),
        (
            "torchtune.datasets.chat_dataset",
            ["dataset.conversation_column=conversations", "dataset.conversation_style=sharegpt"],
            "reads ['conversations']",
        ),
    ],
)
def test_columns_of_other_builders(tmp_path, component, extra, message):
    path = _question_answer(tmp_path)
    error = _error(f"dataset._component_={component}", "dataset.source=json", f"dataset.data_files={path}", *extra)
    assert message in str(error)


def test_a_split_the_tiny_data_set_lacks():
    assert str(_error("dataset_val.split=valid")) == (
        "dataset_val.split='valid' is not a split of this data set, which has ['train', 'validation']; use "
        "dataset_val.split=validation (or another of ['train', 'validation'])"
    )


def test_the_validation_set_is_checked_too(tmp_path):
    path, line, _ = _bad_jsonl(tmp_path)
    cfg = _cfg()
    cfg.dataset_val = OmegaConf.create(
        {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json", "data_files": str(path)}
    )
    with pytest.raises(ConfigError) as raised:
        _check_as_the_recipe(cfg)
    assert str(raised.value).startswith(f"dataset_val.data_files: {path}: line {line}")

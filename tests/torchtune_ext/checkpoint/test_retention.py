"""Bounded disk: older step folders go once a newer save is complete (never the newest), the merged model is written
at the end unless asked every epoch, and the disk plan counts what a run writes."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipe
from torchtune_ext.checkpoint import (
    _safetensors,
    count_saves,
    merge_at_epoch_end,
    parse_keep_last_n,
    plan_disk,
    remove_old_checkpoints,
    remove_stale_temporaries,
    step_folders,
)
from torchtune_ext.config import ConfigError
from torchtune_ext.data import write_tiny_checkpoint
from torchtune_ext.models import qlora_tiny_llama

LORA = dict(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=8, lora_alpha=16)


def _steps(tmp_path: Path, *steps: int) -> None:
    for step in steps:
        (tmp_path / f"step_{step}" / "adapter").mkdir(parents=True)
        (tmp_path / f"step_{step}" / "adapter" / "adapter_model.safetensors").write_bytes(b"x" * step)


def test_keeps_the_newest_n_and_never_the_one_just_saved(tmp_path):
    _steps(tmp_path, 10, 20, 30, 40, 50)
    (tmp_path / ".step_60.tmp-0123abcd").mkdir()  # a save still being written is no checkpoint
    (tmp_path / "step_notes").mkdir()
    removed = remove_old_checkpoints(tmp_path, 2, tmp_path / "step_50")
    assert [p.name for p in removed] == ["step_10", "step_20", "step_30"]
    assert [step for step, _ in step_folders(tmp_path)] == [40, 50]
    assert (tmp_path / "step_notes").is_dir() and (tmp_path / ".step_60.tmp-0123abcd").is_dir()
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name]  # deleted, not left aside

    # keep 1: only the newest; a resume that saved an earlier step keeps that one, not the higher one.
    _steps(tmp_path, 45)
    assert [p.name for p in remove_old_checkpoints(tmp_path, 1, tmp_path / "step_45")] == ["step_40", "step_50"]
    assert [step for step, _ in step_folders(tmp_path)] == [45]
    assert remove_old_checkpoints(tmp_path, None, tmp_path / "step_45") == []
    with pytest.raises(ValueError, match="not a complete step folder"):
        remove_old_checkpoints(tmp_path, 1, tmp_path / "step_99")


def test_a_deletion_killed_midway_is_a_stale_temporary(tmp_path):
    (tmp_path / ".step_10.old-0123abcd" / "adapter").mkdir(parents=True)
    assert step_folders(tmp_path) == []
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [".step_10.old-0123abcd"]


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_keep_last_n_must_be_positive(value):
    with pytest.raises(ConfigError, match="keep_last_n_checkpoints="):
        parse_keep_last_n(value)


def test_counts_and_when_to_merge():
    assert parse_keep_last_n(None) is None and parse_keep_last_n(3) == 3
    assert count_saves(3, 10, None) == 3
    assert count_saves(2, 10, 4) == 2 + 4  # mid-epoch saves at global steps 4, 8, 12, 16
    assert [merge_at_epoch_end(e, 3, False) for e in (1, 2, 3)] == [False, False, True]
    assert [merge_at_epoch_end(e, 3, True) for e in (1, 2, 3)] == [True, True, True]


def test_plan_counts_adapters_optimizer_and_the_merged_model(tmp_path):
    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="bf16", seed=0)
    model = qlora_tiny_llama(**LORA, dtype=torch.bfloat16, device="meta")
    plan = plan_disk(model, tmp_path / "out", saves=7, keep_last_n=2, merged_dtype=torch.bfloat16)
    lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    lora_bytes = sum(v.numel() * 2 for v in lora.values())  # bf16 adapters
    assert plan.adapter_bytes == lora_bytes and plan.kept == 2 and plan.merged_count == 1
    assert plan.recipe_state_bytes == lora_bytes + sum(v.numel() for v in lora.values()) * 8
    # The merged model in bf16 has the size of the bf16 base checkpoint's tensors.
    header = _safetensors.read_header(base / "model.safetensors")
    assert plan.merged_bytes == sum(i["data_offsets"][1] - i["data_offsets"][0] for i in header.values())
    assert plan.total_bytes == 2 * lora_bytes + 2 * plan.recipe_state_bytes + plan.merged_bytes
    assert 0 < plan.free_bytes and "GiB free" in plan.format()

    every = plan_disk(
        model, tmp_path, saves=3, keep_last_n=None, merged_dtype=torch.float32, epochs=3, merge_every_epoch=True
    )
    assert every.kept == 3 and every.merged_count == 3 and every.merged_bytes == 2 * plan.merged_bytes
    assert plan_disk(model, tmp_path, saves=3, keep_last_n=2, merged_dtype=None).merged_bytes == 0


def test_dry_run_states_disk_and_the_kept_id_pass(tmp_path, capsys):
    cfg = OmegaConf.merge(
        OmegaConf.load("configs/tiny/qlora_single_device.yaml"),
        OmegaConf.from_dotlist(
            [
                "dry_run=True",
                f"output_dir={tmp_path}",
                "checkpointer.checkpoint_dir=/nonexistent/h25",
                "epochs=3",
                "save_every_n_steps=100",
                "vocab_pruning.enabled=True",
            ]
        ),
    )
    report = QLoRAFinetuneRecipe(cfg).dry_run(cfg)
    assert "Disk: up to" in report and "2 step folder(s)" in report and "1 merged model(s)" in report
    assert "the kept-id pass reads" in report and "measured on" in report


def test_dry_run_names_why_the_data_is_not_readable_in_full(tmp_path):
    missing = tmp_path / "not_downloaded_yet" / "tokenizer.model"
    cfg = OmegaConf.merge(
        OmegaConf.load("configs/tiny/qlora_single_device.yaml"),
        OmegaConf.from_dotlist(
            [
                "dry_run=True",
                f"output_dir={tmp_path / 'out'}",
                "checkpointer.checkpoint_dir=/nonexistent/h25",
                f"tokenizer.path={missing}",
            ]
        ),
    )
    report = QLoRAFinetuneRecipe(cfg).dry_run(cfg)
    line = next(line for line in report.splitlines() if "data not readable yet" in line)
    # The whole reason and its fix, not cut at a fixed width (it was cut mid-word).
    assert str(missing) in line and line.endswith("(e.g. tokenizer.path=<checkpoint_dir>/tokenizer.model)."), line

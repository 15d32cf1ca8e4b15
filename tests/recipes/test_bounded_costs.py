"""Issue 25 end to end on the tiny model: the kept-id pass is saved next to the recipe state and a resume reuses it;
old step folders go (keep_last_n_checkpoints); the merged model is written at the end of the run, not every epoch;
the start-up log states the disk the run will use."""

import json

import pytest
import torch
from test_qlora_finetune_single_device import SMALL, tune_run

from torchtune_ext.data import write_tiny_checkpoint

pytestmark = pytest.mark.integration_test


def test_kept_ids_reused_on_resume_and_disk_bounded(tmp_path):
    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="fp32", seed=0)
    out = tmp_path / "run"
    common = [f"output_dir={out}", f"checkpointer.checkpoint_dir={base}", *SMALL, "vocab_pruning.enabled=True"]
    common += ["max_steps_per_epoch=3", "save_every_n_steps=2", "keep_last_n_checkpoints=3"]
    first = tune_run(*common, "epochs=2")
    log = first.stdout + first.stderr
    assert "Vocab pruning: token ids" in log and "Disk: up to" in log and "3 step folder(s)" in log
    # Saves at steps 2, 3 (end of epoch 1), 4 and 6 (end of the run): the newest 3 stay.
    assert sorted(int(p.name[5:]) for p in out.glob("step_*")) == [3, 4, 6]
    assert not (out / "step_3" / "merged").exists()  # an epoch's end, not the run's
    assert (out / "step_6" / "merged" / "config.json").is_file()

    saved = torch.load(out / "recipe_state" / "kept_token_ids.pt", weights_only=True)
    adapter_config = json.loads((out / "step_6" / "adapter" / "adapter_config.json").read_text())
    assert saved["kept_ids"].tolist() == adapter_config["trainable_token_indices"]["embed_tokens"]

    resumed = tune_run(*common, "epochs=3", "resume_from_checkpoint=True", "keep_last_n_checkpoints=1")
    log = resumed.stdout + resumed.stderr
    assert "Vocab pruning: token ids" not in log  # no second pass over the data
    assert "Vocab pruning: keeping" in log
    assert sorted(int(p.name[5:]) for p in out.glob("step_*")) == [9]
    assert (out / "step_9" / "merged" / "config.json").is_file()

"""Unit tests of ``torchtune_ext.checkpoint.RecipeState``: stored as data (weights_only), the last two kept with a
fallback, the run's identity and its differences, the global data position, RNG states as plain data."""

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from torchtune_ext.checkpoint import (
    DataPosition,
    RecipeState,
    RunIdentity,
    UnsafeRecipeStateError,
    plain_rng_state,
    previous_path,
)
from torchtune_ext.checkpoint._recipe_state import native_rng_state
from torchtune_ext.config import ConfigError
from torchtune_ext.data import TINY_TOKENIZER_PATH, write_tiny_checkpoint
from torchtune_ext.training import rng_state, set_rng_state

CFG = OmegaConf.create(
    {
        "output_dir": "/out",
        "model": {"_component_": "m.builder", "lora_rank": 16, "lora_alpha": 32, "lora_attn_modules": ["q_proj"]},
        "tokenizer": {"_component_": "t.tok", "path": str(TINY_TOKENIZER_PATH), "max_seq_len": 64},
        "dataset": {"_component_": "d.data", "source": "json"},
        "checkpointer": {"model_type": "LLAMA3_2", "checkpoint_dir": "/base", "output_dir": "${output_dir}"},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-3},
        "seed": 0,
        "shuffle": True,
        "epochs": 1,
        "dtype": "fp32",
        "resume_from_checkpoint": False,
    }
)


def _identity(cfg, base_file: Path, **overrides) -> RunIdentity:
    kwargs = dict(
        checkpoint_paths=[base_file],
        dataset_size=64,
        global_batch_size=8,
        dtypes={"dtype": torch.float32, "adapter_dtype": torch.float32, "frozen_dtype": torch.float32},
    )
    return RunIdentity.from_config(cfg, **{**kwargs, **overrides})


def _state(run: RunIdentity, step: int = 3) -> RecipeState:
    torch.manual_seed(step)
    return RecipeState(
        global_step=step,
        epochs_run=0,
        steps_in_epoch_done=step,
        total_epochs=1,
        max_steps_per_epoch=None,
        identity=run.identity,
        settings=run.settings,
        position=DataPosition(epoch=0, samples_consumed=8 * step, dataset_size=64, seed=0, shuffle=True, world_size=2),
        adapter={"layers.0.attn.q_proj.lora_a.weight": torch.randn(4, 8)},
        optimizer={"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
        lr_scheduler={"base_lrs": [3e-3], "last_epoch": step, "lr_lambdas": [None]},
        loss_scaler={"scaler": {}, "skipped_steps": 0},
        rng_per_rank=[plain_rng_state(rng_state(torch.device("cpu")))],
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base"), family="llama", dtype="fp32", seed=0)


def test_saved_as_data_and_loaded_with_weights_only(base, tmp_path):
    run = _identity(CFG, base / "model.safetensors")
    state = _state(run)
    path = state.save(tmp_path / "recipe_state.pt")
    torch.load(path, weights_only=True)  # nothing but tensors and plain types
    loaded = RecipeState.load(path)
    assert loaded.global_step == 3 and loaded.identity == run.identity and loaded.position == state.position
    assert torch.equal(loaded.adapter["layers.0.attn.q_proj.lora_a.weight"], state.adapter[next(iter(state.adapter))])
    assert loaded.source == path


def test_a_pickled_callable_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "recipe_state.pt"
    torch.save({"format": 2, "global_step": 1, "payload": Payload()}, path)
    with pytest.raises(UnsafeRecipeStateError, match=r"holds Python objects.*system.*nothing in it ran"):
        RecipeState.load(path)
    assert not marker.exists()
    # The same file from an unsafe load would have run it (the test's payload is real).
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_the_previous_state_is_kept_and_a_truncated_newest_falls_back_to_it(base, tmp_path, caplog):
    run = _identity(CFG, base / "model.safetensors")
    path = tmp_path / "recipe_state.pt"
    _state(run, step=2).save(path)
    assert not previous_path(path).exists()
    _state(run, step=4).save(path)
    assert previous_path(path) == tmp_path / "recipe_state.prev.pt"
    assert RecipeState.load(path).global_step == 4
    assert RecipeState.load(previous_path(path)).global_step == 2
    _state(run, step=6).save(path)
    assert RecipeState.load(previous_path(path)).global_step == 4  # only two kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe_state.prev.pt", "recipe_state.pt"]

    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    state = RecipeState.load(path)
    assert state.global_step == 4 and state.source == previous_path(path)
    previous_path(path).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="is not a readable recipe state.*not readable either"):
        RecipeState.load(path)


def test_identity_lists_every_difference_and_allows_settings(base, tmp_path):
    saved = _identity(CFG, base / "model.safetensors")
    moved = tmp_path / "b" / "tokenizer.model"  # the same tokenizer in another folder: the same run
    moved.parent.mkdir()
    shutil.copy(TINY_TOKENIZER_PATH, moved)
    changed_cfg = OmegaConf.merge(
        CFG,
        {
            "model": {"lora_alpha": 4},
            "optimizer": {"lr": 1e-3},
            "epochs": 2,
            "tokenizer": {"path": str(moved)},
        },
    )
    other_base = write_tiny_checkpoint(tmp_path / "other", family="llama", dtype="fp32", seed=1)
    current = _identity(changed_cfg, other_base / "model.safetensors", global_batch_size=16)
    state = _state(saved)
    state.source = Path("recipe_state.pt")
    with pytest.raises(ConfigError) as raised:  # a config error: one line per problem, exit code 2
        state.check_resume(current, kept_ids=None, total_epochs=2)
    assert raised.value.key == "resume_from_checkpoint"
    text = str(raised.value)
    assert "model.lora_alpha: 32 -> 4" in text and "global_batch_size: 8 -> 16" in text
    # Other weights of the same shapes: the same header, other data.
    assert "base_checkpoint.model.safetensors" in text and "header" in text
    saved_base, other = (
        saved.identity["base_checkpoint.model.safetensors"],
        current.identity["base_checkpoint.model.safetensors"],
    )
    assert saved_base.split(", data")[0] == other.split(", data")[0] and saved_base != other
    for allowed in ("optimizer.lr", "epochs", "tokenizer.path"):
        assert allowed not in text

    same = _identity(OmegaConf.merge(CFG, {"optimizer": {"lr": 1e-3}, "epochs": 2}), base / "model.safetensors")
    lines = state.check_resume(same, kept_ids=None, total_epochs=2)
    assert lines == [
        "Resuming with changed settings (allowed):\n  epochs: 1 -> 2\n  optimizer.lr: 0.003 -> 0.001",
    ]
    assert state.describe_position(1, epoch=1, batch=6) == (
        "Resumed from step 3 (epoch 1, batch 6): sample 24 of 64, on 1 rank; saved on 2."
    )
    state.position.epoch, state.position.samples_consumed = 1, 0  # saved between epochs
    assert state.describe_position(2, epoch=1, batch=8) == (
        "Resumed from step 3 (epoch 1, batch 8): epoch 2 starts at sample 0 of 64, on 2 ranks; saved on 2."
    )
    with pytest.raises(ConfigError, match="vocab_pruning kept token ids"):
        state.check_resume(same, kept_ids=[1, 2], total_epochs=2)


def _with_tokenizer(path: Path):
    return OmegaConf.merge(CFG, {"tokenizer": {"path": str(path)}})


def test_another_tokenizer_is_refused_naming_both_files(base, tmp_path):
    """The tokenizer's files are in the identity by content: another file at another path, or the same path
    rewritten, is another run; the refusal names both files and the fix."""
    old, other = tmp_path / "old" / "tokenizer.model", tmp_path / "other" / "tokenizer.model"
    for path, extra in ((old, b""), (other, b"\n")):  # (any other content: the identity hashes all of it)
        path.parent.mkdir()
        path.write_bytes(TINY_TOKENIZER_PATH.read_bytes() + extra)
    state = _state(_identity(_with_tokenizer(old), base / "model.safetensors"))
    state.source = Path("recipe_state.pt")
    size = old.stat().st_size
    saved = state.identity["tokenizer_files"]["path"]
    assert saved.startswith(f"{size} bytes, sha256 ")

    with pytest.raises(ConfigError) as raised:
        state.check_resume(_identity(_with_tokenizer(other), base / "model.safetensors"), None, 1)
    new = f"{size + 1} bytes, sha256 "
    line = next(line for line in str(raised.value).splitlines() if line.startswith("  tokenizer.path: "))
    assert line.startswith(f"  tokenizer.path: {old} ({saved}) -> {other} ({new}")
    assert line.endswith(f": another tokenizer gives other token ids; set tokenizer.path={old}")

    old.write_bytes(other.read_bytes())  # rewritten in place
    with pytest.raises(ConfigError) as raised:
        state.check_resume(_identity(_with_tokenizer(old), base / "model.safetensors"), None, 1)
    assert f"  tokenizer.path: {old} ({saved}) -> {old} ({new}" in str(raised.value)
    assert f"; put back the {old} the run trained with" in str(raised.value)

    # A tokenizer file set where the saved run had none (the builder's default file) is another tokenizer too.
    state = _state(_identity(OmegaConf.merge(CFG, {"tokenizer": {"path": None}}), base / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"tokenizer.path: \(not set\) -> .*; remove tokenizer.path"):
        state.check_resume(_identity(_with_tokenizer(other), base / "model.safetensors"), None, 1)


def test_a_state_saved_before_tokenizer_files_were_recorded_resumes_saying_so(base):
    """Older recipe states have no ``tokenizer_files`` entry (and compared some tokenizer paths as config keys): they
    still resume, with a line saying the tokenizer was not compared."""
    run = _identity(CFG, base / "model.safetensors")
    old_identity = {k: v for k, v in run.identity.items() if k != "tokenizer_files"}
    old_identity["tokenizer.tokenizer_config_path"] = "/old/place/tokenizer_config.json"
    state = _state(RunIdentity(identity=old_identity, settings=run.settings))
    assert state.check_resume(run, kept_ids=None, total_epochs=1) == [
        "The recipe state does not record the tokenizer's files (saved by an earlier version): tokenizer.path not "
        "compared with the saved run's."
    ]


def test_vocab_pruning_turned_off_is_no_section_and_turned_on_is_compared(base):
    """A distributed run (``vocab_pruning`` section, ``enabled: False``) resumes on one device (no section), and
    back; with pruning on, its keys define the run."""
    off = {"enabled": False, "sharding": "sharded", "kept_ids": None}
    sectioned = _identity(OmegaConf.merge(CFG, {"vocab_pruning": off}), base / "model.safetensors")
    plain = _identity(CFG, base / "model.safetensors")
    for saved, current in ((sectioned, plain), (plain, sectioned)):
        assert _state(saved).check_resume(current, kept_ids=None, total_epochs=1) == []
    on = _identity(OmegaConf.merge(CFG, {"vocab_pruning": {**off, "enabled": True}}), base / "model.safetensors")
    with pytest.raises(ConfigError) as raised:
        _state(on).check_resume(plain, kept_ids=None, total_epochs=1)
    assert "vocab_pruning.enabled: True -> (unset)" in str(raised.value)
    assert "vocab_pruning.sharding: sharded -> (unset)" in str(raised.value)


def test_a_finished_run_says_so(base):
    run = _identity(CFG, base / "model.safetensors")
    state = _state(run)
    state.epochs_run, state.checkpoint, state.source = 1, "step_8", Path("/out/recipe_state/recipe_state.pt")
    (line,) = state.check_resume(run, kept_ids=None, total_epochs=1)
    assert line.startswith("This run had already finished: step 3, epoch 1 of 1") and "/out/step_8/adapter" in line


@pytest.mark.parametrize("saved_world, world", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_the_global_position_gives_every_world_size_the_same_next_samples(saved_world, world):
    """The samples rank r of W draws after resuming are those an uninterrupted run on the saved world size draws
    next (as a set per global batch, in the same global order)."""
    dataset, global_batch, consumed = list(range(64)), 8, 24

    def batches(world_size: int, position: int):
        streams = []
        for rank in range(world_size):
            sampler = StatefulDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=5)
            sampler.load_state_dict({"yielded": position // world_size})
            streams.append(list(sampler))
        per_rank = global_batch // world_size
        count = len(streams[0]) // per_rank
        return [sorted(i for s in streams for i in s[b * per_rank : (b + 1) * per_rank]) for b in range(count)]

    uninterrupted = batches(saved_world, 0)
    state = DataPosition(epoch=0, samples_consumed=consumed, dataset_size=64, seed=5, shuffle=True, world_size=2)
    resumed = batches(world, state.per_rank_start(world) * world)
    assert resumed == uninterrupted[consumed // global_batch :]
    with pytest.raises(ConfigError, match="global_batch_size"):
        DataPosition(0, 12, 64, 5, True, 1).per_rank_start(8)


def test_rng_states_round_trip_through_plain_data():
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    plain = plain_rng_state(rng_state(torch.device("cpu")))
    expected = (torch.rand(3), random.random(), np.random.standard_normal(2))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    set_rng_state(native_rng_state(plain), torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.standard_normal(2), expected[2])

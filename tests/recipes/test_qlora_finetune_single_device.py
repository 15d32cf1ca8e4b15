"""Integration tests of recipes/qlora_finetune_single_device.py on the tiny models (CPU, a few steps each).

Runs call the recipe's entry point in this process as ``tune run`` does (command-line overrides, exit codes); the
resume and the tiny default's run go through ``tune run`` in processes of their own (a fresh RNG on resume, the
console script a user types). Parity with torchtune's recipe, gradient dtypes and a simulated device without bf16
reach inside a recipe. Tolerances, measured on CPU with these settings:

- parity with torchtune's ``lora_finetune_single_device`` (fp32, quantize_base=True): first 4 losses within 1e-4
  (measured: 7e-7).
- bf16 vs fp32 losses (~8.5) over 6 steps: within 0.08 absolute, ~1% (measured 0.024). fp16 vs fp32: within 0.02
  (measured 0.005). Same data, adapters and dropout masks, so these bound the compute dtype's error.
- resume (6 steps straight vs 3 + resume + 3, with dropout, shuffling and gradient accumulation, and activation
  checkpointing after the resume): losses and final adapters within 1e-5 (measured: identical).
- vocab pruning keeping every id (shuffled, rows frozen) vs the unpruned run: losses and validation losses
  within 1e-5 relative (the same function; only the order of the logits and of fp32 sums changes).
- learning: the tiny default's validation loss after 100 steps is below 60% of the first step's loss (measured
  8.53 -> 3.70, 43%).
"""

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torchtune
from conftest import load_recipe, run_main, run_recipe_in_process
from omegaconf import OmegaConf
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtune_ext import _dtype
from torchtune_ext.checkpoint import HFConverter
from torchtune_ext.data import write_tiny_checkpoint
from torchtune_ext.modules import save_kept_ids
from torchtune_ext.nf4 import NF4Tensor, nf4_scaler_block_size, to_nf4

pytestmark = pytest.mark.integration_test

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "qlora_finetune_single_device.py"
CONFIG = REPO / "configs" / "tiny" / "qlora_single_device.yaml"
TUNE = Path(sys.executable).parent / "tune"
TORCHTUNE_RECIPE = Path(torchtune.__file__).parent.parent / "recipes" / "lora_finetune_single_device.py"

STEPS = 6
SMALL = [
    f"max_steps_per_epoch={STEPS}",
    "batch_size=8",
    "gradient_accumulation_steps=2",
    "model.lora_dropout=0.1",
    "run_val_every_n_steps=3",
    "max_validation_steps=2",
]


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tune_run(*overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    # No PYTHONPATH: `tune run recipes/...` from the clone must work as users type it.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [str(TUNE), "run", str(RECIPE.relative_to(REPO)), "--config", str(CONFIG), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"recipe failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def recipe_run(*overrides: str) -> None:
    """The recipe with the tiny config and ``overrides``, in this process (``tune run``'s argv)."""
    run_recipe_in_process(RECIPE, ["--config", str(CONFIG), *overrides], cwd=REPO)


def recipe_main(monkeypatch, capfd, *overrides: str) -> subprocess.CompletedProcess:
    """:func:`recipe_run` with its exit code and what it printed (``conftest.run_main``)."""
    argv = [str(RECIPE), "--config", str(CONFIG), *overrides]
    return run_main(load_recipe(RECIPE).recipe_main, argv, monkeypatch, capfd, cwd=REPO)


def scalars(output_dir: Path) -> Dict[str, Dict[int, float]]:
    """Every TensorBoard scalar under ``output_dir/logs`` (all runs, e.g. before and after a resume), by step."""
    found: Dict[str, Dict[int, float]] = {}
    for events in sorted((output_dir / "logs").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"tensors": 0, "scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            for event in acc.Tensors(tag):
                found.setdefault(tag, {})[event.step] = float(torch.tensor(event.tensor_proto.float_val[0]))
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                found.setdefault(tag, {})[event.step] = event.value
    return found


def losses(output_dir: Path) -> List[float]:
    by_step = scalars(output_dir)["loss"]
    return [by_step[s] for s in sorted(by_step)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qlora_single")


@pytest.fixture(scope="module")
def base(workdir) -> Path:
    return write_tiny_checkpoint(workdir / "base_llama", family="llama", dtype="fp32", seed=0)


@pytest.fixture(scope="module")
def runs(workdir, base):
    """Recipe runs shared by several tests, each started once: name -> output_dir."""
    done: Dict[str, Path] = {}

    def run(name: str, *overrides: str) -> Path:
        if name not in done:
            out = workdir / name
            recipe_run(f"output_dir={out}", f"checkpointer.checkpoint_dir={base}", *SMALL, *overrides)
            done[name] = out
        return done[name]

    return run


# ------------------------------------------------------------------------------------------------ parity


class _Capture:
    """Metric logger that keeps the logged losses (instantiated through the config by its dotted path)."""

    losses: List[float] = []

    def __init__(self, **kwargs):
        type(self).losses = []

    def log_config(self, config):
        pass

    def log_dict(self, payload, step):
        type(self).losses.append(float(payload["loss"]))

    def log(self, name, data, step):
        pass

    def close(self):
        pass


def _parity_cfg(base: Path, out: Path, ours: bool):
    lora = dict(
        lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
        apply_lora_to_mlp=True,
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=0.0,
    )
    cfg = {
        "output_dir": str(out),
        "model": {
            "_component_": "torchtune_ext.models.qlora_tiny_llama" if ours else "torchtune_ext.models.lora_tiny_llama",
            **lora,
            **({} if ours else {"quantize_base": True}),
        },
        "tokenizer": {"_component_": "torchtune_ext.data.tiny_tokenizer", "max_seq_len": 64},
        "checkpointer": {
            "_component_": "torchtune_ext.checkpoint.QLoRAHFCheckpointer"
            if ours
            else "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": str(base),
            "checkpoint_files": ["model.safetensors"],
            "model_type": "LLAMA3_2",
            "output_dir": str(out),
        },
        "resume_from_checkpoint": False,
        "save_adapter_weights_only": True,
        "dataset": {"_component_": "torchtune_ext.data.tiny_instruct_dataset", "num_samples": 64},
        "seed": 0,
        "shuffle": True,
        "batch_size": 4,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-3, "weight_decay": 0.01},
        "lr_scheduler": {
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 2,
        },
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "epochs": 1,
        "max_steps_per_epoch": 4,
        "gradient_accumulation_steps": 2,
        "clip_grad_norm": 1.0,
        "compile": False,
        "enable_activation_checkpointing": False,
        "enable_activation_offloading": False,
        "log_peak_memory_stats": False,
        "log_every_n_steps": 1,
        "metric_logger": {"_component_": f"{__name__}._Capture"},
        "device": "cpu",
        "dtype": "fp32",
    }
    return OmegaConf.create(cfg)


def _requantize_in_per_shape_groups_(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """torchtune's NF4 bases quantized again from the checkpoint, in our per-shape scale groups (torchao's 256
    where they split over 8 ranks, ``nf4_scaler_block_size``): both recipes then train on the same base."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, NF4Tensor):
            dense = state[f"{name}.weight"].to(weight.dtype)
            nf4 = to_nf4(dense, 64, nf4_scaler_block_size(dense.shape))
            module.weight = torch.nn.Parameter(nf4, requires_grad=False)


@pytest.mark.stack
def test_parity_with_torchtunes_lora_finetune_single_device(base, workdir):
    """Same tiny model, data, seed and adapters: our fp32 QLoRA losses equal torchtune's quantize_base recipe's.

    The adapters' random init differs by construction (torchtune draws it in module-construction order while
    building the whole model on the device; ours are drawn after streaming the base into a meta-built model), so
    ours start from torchtune's initial adapters; everything after that is each recipe's own code.
    """
    theirs_module = _load_module(TORCHTUNE_RECIPE, "torchtune_lora_finetune_single_device")
    ours_module = _load_module(RECIPE, "qlora_finetune_single_device_parity")

    theirs_cfg = _parity_cfg(base, workdir / "parity_theirs", ours=False)
    theirs = theirs_module.LoRAFinetuneRecipeSingleDevice(theirs_cfg)
    theirs.setup(theirs_cfg)
    _requantize_in_per_shape_groups_(theirs._model, theirs._checkpointer.load_checkpoint()["model"])
    initial_adapters = {k: v.clone() for k, v in theirs._model.state_dict().items() if "lora" in k}
    theirs.train()
    theirs.cleanup()
    theirs_losses = list(_Capture.losses)

    ours_cfg = _parity_cfg(base, workdir / "parity_ours", ours=True)
    ours = ours_module.QLoRAFinetuneRecipeSingleDevice(ours_cfg)
    ours.setup(ours_cfg)
    assert set(initial_adapters) == set(ours._adapter_params)
    with torch.no_grad():
        for name, value in initial_adapters.items():
            ours._adapter_params[name].copy_(value)
    ours.train()
    ours.cleanup()

    assert len(theirs_losses) == len(ours.loss_history) == 4
    assert ours.loss_history == pytest.approx(_Capture.losses, abs=0)
    diffs = [abs(a - b) for a, b in zip(ours.loss_history, theirs_losses)]
    print(f"parity: ours {ours.loss_history}, torchtune {theirs_losses}, max diff {max(diffs):.2e}")
    assert max(diffs) < 1e-4, (ours.loss_history, theirs_losses)
    assert ours.loss_history[0] != ours.loss_history[3]  # the adapters did train


# ------------------------------------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype, tolerance", [("bf16", 0.08), ("fp16", 0.02)])
def test_dtype_overrides_run_and_track_fp32(runs, dtype, tolerance):
    reference = losses(runs("fp32", "dtype=fp32"))
    other = losses(runs(dtype, f"dtype={dtype}"))
    assert len(reference) == len(other) == STEPS
    assert all(math.isfinite(x) for x in other)
    print(f"{dtype} vs fp32: max loss diff {max(abs(a - b) for a, b in zip(reference, other)):.2e}")
    assert max(abs(a - b) for a, b in zip(reference, other)) < tolerance, (reference, other)


# The merged model is in the base checkpoint's dtype (fp32 here) unless merged_dtype says otherwise.
@pytest.mark.parametrize(
    "dtype, extra, adapter_dtype, merged_dtype, hf_name",
    [
        ("fp32", (), torch.float32, torch.float32, "float32"),
        ("bf16", (), torch.bfloat16, torch.float32, "float32"),
        ("fp16", (), torch.float32, torch.float32, "float32"),
        ("fp32", ("merged_dtype=bf16",), torch.float32, torch.bfloat16, "bfloat16"),
    ],
)
def test_saved_tensors_have_the_documented_dtypes(runs, dtype, extra, adapter_dtype, merged_dtype, hf_name):
    out = runs("_".join((dtype, *extra)).replace("=", "_"), f"dtype={dtype}", *extra)
    step = out / f"step_{STEPS}"
    adapter = load_file(step / "adapter" / "adapter_model.safetensors")
    assert adapter and {v.dtype for v in adapter.values()} == {adapter_dtype}
    merged = {k: v for f in (step / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    assert merged and {v.dtype for v in merged.values()} == {merged_dtype}
    assert json.loads((step / "merged" / "config.json").read_text())["torch_dtype"] == hf_name
    state = torch.load(out / "recipe_state" / "recipe_state.pt", weights_only=False)
    assert {v.dtype for v in state["adapter"].values()} == {adapter_dtype}


def test_fp16_overflowed_steps_are_skipped_counted_and_logged(runs):
    """Too large an initial loss scale overflows fp16: those steps are skipped, the scale backs off, and training
    goes on; the default scale never overflows on this model."""
    fp16 = scalars(runs("fp16", "dtype=fp16"))
    assert sorted(fp16["loss_scale"]) == list(range(1, STEPS + 1))
    assert set(fp16["skipped_steps"].values()) == {0.0}
    assert "loss_scale" not in scalars(runs("fp32", "dtype=fp32"))

    overflow = scalars(runs("fp16_overflow", "dtype=fp16", "loss_scaler.init_scale=8192"))
    skipped = [overflow["skipped_steps"][s] for s in sorted(overflow["skipped_steps"])]
    scales = [overflow["loss_scale"][s] for s in sorted(overflow["loss_scale"])]
    assert skipped == sorted(skipped) and 1 <= skipped[-1] < STEPS, skipped
    assert scales[0] < 8192 and scales[-1] <= 8192 / 2 ** skipped[-1], scales
    assert all(math.isfinite(v) for v in overflow["loss"].values())


def test_tensorboard_events_hold_the_loss_and_metrics(runs):
    logged = scalars(runs("fp32", "dtype=fp32"))
    assert sorted(logged["loss"]) == list(range(1, STEPS + 1))
    assert all(0 < v < 20 for v in logged["loss"].values())
    for tag in ("lr", "tokens_per_second", "grad_norm", "peak_rss", "rss"):
        assert sorted(logged[tag]) == list(range(1, STEPS + 1)), tag
    assert all(v > 0 for v in logged["tokens_per_second"].values())
    assert sorted(logged["val_loss"]) == [3, 6]


@pytest.mark.parametrize(
    "dtype, loss",
    [
        ("fp32", "torchtune_ext.modules.LinearCrossEntropyLoss"),
        ("fp32", "torchtune.modules.loss.CEWithChunkedOutputLoss"),
        ("fp16", "torchtune_ext.modules.LinearCrossEntropyLoss"),
    ],
    ids=["fp32", "fp32-torchtune_loss", "fp16"],
)
def test_adapter_grads_are_fp32(base, workdir, dtype, loss):
    module = _load_module(RECIPE, f"qlora_grads_{dtype}")
    cfg = OmegaConf.load(CONFIG)
    cfg = OmegaConf.merge(
        cfg,
        OmegaConf.from_dotlist(
            [
                f"output_dir={workdir / ('grads_' + dtype)}",
                f"checkpointer.checkpoint_dir={base}",
                f"dtype={dtype}",
                f"loss._component_={loss}",
                "batch_size=4",
                "metric_logger._component_=torchtune.training.metric_logging.StdoutLogger",
            ]
        ),
    )
    recipe = module.QLoRAFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    batch = next(iter(recipe._dataloader))
    recipe.loss_step(batch).backward()
    adapters = recipe._adapter_params
    assert adapters and all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters.values())
    assert all(p.dtype == torch.float32 for p in adapters.values())
    frozen = [p for n, p in recipe._model.named_parameters() if n not in adapters]
    assert frozen and all(p.grad is None and not p.requires_grad for p in frozen)
    assert recipe._model.layers[0].attn.q_proj.weight.dtype == getattr(
        torch, {"fp32": "float32", "fp16": "float16"}[dtype]
    )
    if dtype == "fp32":
        _check_loss_step(recipe, next(iter(recipe._dataloader)))


def _check_loss_step(recipe, batch: Dict[str, torch.Tensor]) -> None:
    """The recipe's loss is the mean next-token cross-entropy over label tokens (an independent computation on the
    whole logits), and a micro-batch without label tokens gives exactly 0 with zero, finite gradients."""
    ignore = recipe._loss_fn.ignore_index
    tokens, labels = batch["tokens"], batch["labels"]
    model = recipe._model
    with torch.no_grad():
        switches = model.skip_output_layer, model.num_output_chunks
        model.skip_output_layer, model.num_output_chunks = False, 0  # the plain model: whole logits
        logits = model(tokens)
        model.skip_output_layer, model.num_output_chunks = switches
        expected = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=ignore
        )
        ours = recipe.loss_step(dict(batch))
    assert (labels[:, 1:] != ignore).any()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)

    recipe._optimizer.zero_grad(set_to_none=True)
    no_labels = recipe.loss_step({"tokens": tokens, "labels": torch.full_like(labels, ignore)})
    assert no_labels.item() == 0.0
    no_labels.backward()
    grads = [p.grad for p in recipe._adapter_params.values() if p.grad is not None]
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


# ------------------------------------------------------------------------------------------------ resume


def test_resume_mid_epoch_equals_a_straight_run(runs, workdir, base):
    straight = runs("fp32", "dtype=fp32")
    out = workdir / "resumed"
    common = [f"output_dir={out}", f"checkpointer.checkpoint_dir={base}", *SMALL, "dtype=fp32"]
    first = tune_run(*common, f"stop_after_step={STEPS // 2}")
    output = first.stdout + first.stderr
    assert "Stopped after step 3 (stop_after_step=3)" in output
    # The printed command (and the summary's) trains on to the end: stop_after_step dropped, resume set.
    continue_command = output.split("Continue to the end with:\n  ")[1].splitlines()[0]
    assert "resume_from_checkpoint=True" in continue_command and "stop_after_step" not in continue_command
    assert f"continue training:   {continue_command}" in output
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(("logs", "."))) == [
        "recipe_state",
        "step_3",
        "torchtune_config.yaml",
    ]
    assert not (out / "step_3" / "merged").exists()  # mid-run saves are adapter + recipe state
    # Activation checkpointing recomputes the same values (dropout masks included), so it may change mid-run.
    tune_run(*common, "resume_from_checkpoint=True", "enable_activation_checkpointing=True")

    expected, resumed = losses(straight), losses(out)
    assert len(resumed) == STEPS
    print(f"resume: max loss diff {max(abs(a - b) for a, b in zip(expected, resumed)):.2e}")
    assert max(abs(a - b) for a, b in zip(expected, resumed)) < 1e-5, (expected, resumed)
    final_straight = load_file(straight / f"step_{STEPS}" / "adapter" / "adapter_model.safetensors")
    final_resumed = load_file(out / f"step_{STEPS}" / "adapter" / "adapter_model.safetensors")
    for key, value in final_straight.items():
        torch.testing.assert_close(final_resumed[key], value, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ export


def _check_merged(out: Path, base: Path, model_type: str, rank: int, alpha: float, original: bool = False) -> None:
    """Merged weights == dequantized NF4 base (``original``: the base checkpoint's own weights) + (alpha / rank) *
    B @ A, from the files alone."""
    step = sorted(out.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    index = json.loads((step / "merged" / "model.safetensors.index.json").read_text())
    merged = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(step / "merged" / f).items()}
    peft = load_file(step / "adapter" / "adapter_model.safetensors")
    hf_base = load_file(base / "model.safetensors")
    assert merged.keys() == hf_base.keys() == index["weight_map"].keys()
    config = json.loads((base / "config.json").read_text())
    converter = HFConverter(
        model_type,
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["hidden_size"],
        config["hidden_size"] // config["num_attention_heads"],
        True,
    )
    lora_modules = 0
    for key, value in merged.items():
        expected = hf_base[key]
        if key.endswith("proj.weight"):
            if not original:
                # NF4 blocks run along the model's (torchtune-layout) rows.
                tune_key, tune_value = converter.to_tune(key, expected)
                # In the per-shape scale groups the model quantizes in (torchao's 256 where they split over 8).
                nf4 = to_nf4(tune_value, 64, nf4_scaler_block_size(tune_value.shape))
                expected = converter.to_hf(tune_key, nf4.get_original_weight())[1]
            prefix = "base_model.model." + key[: -len(".weight")]
            if f"{prefix}.lora_A.weight" in peft:
                lora_modules += 1
                expected = expected + (alpha / rank) * peft[f"{prefix}.lora_B.weight"] @ peft[f"{prefix}.lora_A.weight"]
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=key)
    assert lora_modules == len(peft) // 2 > 0


@pytest.mark.stack
def test_export_llama_merged_equals_dequantized_base_plus_lora(runs, base):
    _check_merged(runs("fp32", "dtype=fp32"), base, "LLAMA3_2", rank=16, alpha=32)


def test_vocab_pruning_keeping_every_id_equals_the_unpruned_run(runs, base, workdir):
    """All ids kept, in shuffled order (K = V, pruned rows frozen): the same function with permuted logits and
    remapped labels, so the losses match the unpruned run's; the merged export has the full vocabulary again."""
    vocab_size = json.loads((base / "config.json").read_text())["vocab_size"]
    kept_ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
    kept_file = workdir / "kept_all.json"
    save_kept_ids(kept_file, kept_ids)
    reference = runs("fp32", "dtype=fp32")
    pruned = runs(
        "fp32_pruned_all",
        "dtype=fp32",
        "vocab_pruning.enabled=True",
        f"vocab_pruning.kept_ids={kept_file}",
        "vocab_pruning.trainable=False",
    )
    assert len(losses(pruned)) == STEPS
    torch.testing.assert_close(losses(pruned), losses(reference), rtol=1e-5, atol=0)
    val = scalars(reference)["val_loss"]
    torch.testing.assert_close(scalars(pruned)["val_loss"], val, rtol=1e-5, atol=0)
    _check_merged(pruned, base, "LLAMA3_2", rank=16, alpha=32)
    config = json.loads((pruned / f"step_{STEPS}" / "adapter" / "adapter_config.json").read_text())
    assert "trainable_token_indices" not in config
    assert torch.load(pruned / "recipe_state" / "recipe_state.pt", weights_only=False)["kept_ids"] == kept_ids


def test_vocab_pruning_exports_the_trained_rows(runs, base):
    """Trained pruned rows (ids collected from the data): the merged embedding holds them at the kept ids and the
    base's rows elsewhere; the PEFT adapter carries the same rows as trainable tokens."""
    out = runs("fp32_pruned", "dtype=fp32", "vocab_pruning.enabled=True")
    kept_ids = torch.load(out / "recipe_state" / "recipe_state.pt", weights_only=False)["kept_ids"]
    step = out / f"step_{STEPS}"
    base_embedding = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    merged = {k: v for f in (step / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    embedding = merged["model.embed_tokens.weight"]
    assert embedding.shape == base_embedding.shape and 0 < len(kept_ids) < embedding.shape[0]
    others = torch.ones(embedding.shape[0], dtype=torch.bool)
    others[kept_ids] = False
    torch.testing.assert_close(embedding[others], base_embedding[others], rtol=0, atol=0)
    assert (embedding[kept_ids] - base_embedding[kept_ids]).abs().max() > 1e-4  # the rows trained
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == {"embed_tokens": kept_ids}
    adapter = load_file(step / "adapter" / "adapter_model.safetensors")
    rows = adapter["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    torch.testing.assert_close(rows, embedding[kept_ids], rtol=0, atol=0)


@pytest.mark.stack
def test_export_qwen_merged_onto_the_original_base_plus_lora(workdir):
    """``merge_base=original``: the merged model is the checkpoint's own weights + LoRA (PEFT's model)."""
    out, qwen_base = workdir / "qwen", workdir / "base_qwen"
    recipe_run(
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={qwen_base}",
        "generate_base_checkpoint.family=qwen",
        "model._component_=torchtune_ext.models.qlora_tiny_qwen",
        "checkpointer.model_type=QWEN2",
        "max_steps_per_epoch=2",
        "batch_size=4",
        "run_val_every_n_steps=null",
        "merge_base=original",
    )
    _check_merged(out, qwen_base, "QWEN2", rank=16, alpha=32, original=True)
    merged = load_file(next((out / "step_2" / "merged").glob("*.safetensors")))
    hf_base = load_file(qwen_base / "model.safetensors")
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.bias"], hf_base["model.layers.0.self_attn.q_proj.bias"])
    adapter_config = json.loads((out / "step_2" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(qwen_base.resolve())


# ------------------------------------------------------------------------------------------------ learning


def test_tiny_default_learns_and_prints_where_outputs_are(workdir):
    """The shipped config (its own base generation included) with fewer steps: the loss clearly falls."""
    out = workdir / "default"
    result = tune_run(
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={workdir / 'default_base'}",
        "max_steps_per_epoch=100",
        "run_val_every_n_steps=100",
        "max_validation_steps=8",
    )
    logged = scalars(out)
    first, val = logged["loss"][1], logged["val_loss"][100]
    print(f"learning: first-step loss {first:.3f}, validation loss after 100 steps {val:.3f}")
    assert val < 0.6 * first, (first, val)
    for line in ("adapter (PEFT):", "merged model (HF):", "TensorBoard logs:"):
        assert line in result.stdout
    assert str(out / "step_100" / "adapter") in result.stdout


# ------------------------------------------------------------------------------------------------ bad configs


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dtype=fp8"], "dtype='fp8' is not supported; use dtype=fp32, dtype=bf16 or dtype=fp16"),
        (["checkpointer.checkpoint_files=[missing.safetensors]"], "missing.safetensors"),
        (["model.intermediate_dim=200"], "does not match the configured model"),
    ],
)
def test_bad_config_fails_clearly_before_writing(base, workdir, overrides, message, monkeypatch, capfd):
    out = workdir / f"bad_{len(list(workdir.glob('bad_*')))}"
    result = recipe_main(monkeypatch, capfd, f"output_dir={out}", f"checkpointer.checkpoint_dir={base}", *overrides)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-3000:]
    assert not out.exists()


def test_bf16_where_unsupported_fails_before_writing(base, workdir, monkeypatch):
    monkeypatch.setattr(_dtype, "is_bf16_supported", lambda device: False)
    module = _load_module(RECIPE, "qlora_no_bf16")
    out = workdir / "no_bf16"
    cfg = OmegaConf.merge(
        OmegaConf.load(CONFIG),
        OmegaConf.from_dotlist([f"output_dir={out}", f"checkpointer.checkpoint_dir={base}", "dtype=bf16"]),
    )
    with pytest.raises(
        RuntimeError,
        match=r"dtype=bf16 was requested but cpu does not support bf16.*"
        r"dtype=fp32.*dtype=fp16",
    ):
        module.QLoRAFinetuneRecipeSingleDevice(cfg).setup(cfg)
    assert not out.exists()


@pytest.mark.stack
def test_fp32_keeps_a_16_bit_checkpoints_frozen_weights_in_16_bit(workdir, caplog):
    """dtype=fp32 on a bf16 checkpoint: the token embedding (tied output) stays bf16 by default, computing in fp32;
    the run equals one that stores it in fp32 (``frozen_dtype=fp32``): upcasting bf16 is exact."""
    bf16_base = write_tiny_checkpoint(workdir / "base_llama_bf16", family="llama", dtype="bf16", seed=0)
    common = [
        f"checkpointer.checkpoint_dir={bf16_base}",
        "dtype=fp32",
        "max_steps_per_epoch=3",
        "batch_size=4",
        "run_val_every_n_steps=null",
        "merged_dtype=fp32",  # the default is the checkpoint's bf16; compare the fp32 merges
    ]
    default, full = workdir / "frozen_default", workdir / "frozen_fp32"
    with caplog.at_level(logging.INFO):
        recipe_run(f"output_dir={default}", *common)
    assert "frozen embedding/output stored in torch.bfloat16" in caplog.text
    recipe_run(f"output_dir={full}", *common, "frozen_dtype=fp32")
    torch.testing.assert_close(losses(default), losses(full), rtol=1e-6, atol=0)
    merged, merged_full = (
        load_file(next((out / "step_3" / "merged").glob("*.safetensors"))) for out in (default, full)
    )
    for key in merged:
        torch.testing.assert_close(merged[key], merged_full[key], rtol=1e-5, atol=1e-6, msg=key)


def test_compile_trains_on_the_accelerator_code_path_from_cold_tables(base, workdir, monkeypatch):
    """``compile=True`` where our NF4 code takes its GPU branch (forced on CPU), with no decoding table made yet, as
    at a GPU run's start, and trainable pruned embedding rows, so the first compiled layer's input requires grad:
    dynamo then traces the NF4 autograd.Function as a subgraph and cannot trace a table's making inside it (a
    frozen embedding hides this: the first layer, traced inline, makes the table). The recipe makes the tables
    before the first compiled forward. The compiled loss and trainable gradients equal the eager ones."""
    from torchtune_ext.memory._fake import accelerator_code_path

    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")  # dynamo and AOTAutograd, without inductor's build time
    results = []
    for compile in (False, True):
        module = _load_module(RECIPE, f"qlora_compile_{compile}")
        cfg = OmegaConf.merge(
            OmegaConf.load(CONFIG),
            OmegaConf.from_dotlist(
                [
                    f"output_dir={workdir / f'compile_{compile}'}",
                    f"checkpointer.checkpoint_dir={base}",
                    f"compile={compile}",
                    "dtype=bf16",
                    "vocab_pruning.enabled=True",
                    "batch_size=2",
                    "metric_logger._component_=torchtune.training.metric_logging.StdoutLogger",
                ]
            ),
        )
        torch._dynamo.reset()
        with accelerator_code_path():  # also empties the table caches
            recipe = module.QLoRAFinetuneRecipeSingleDevice(cfg)
            recipe.setup(cfg)
            loss = recipe.loss_step(next(iter(recipe._dataloader)))
            loss.backward()
        results.append((loss.item(), {id: p.grad.clone() for id, p in enumerate(recipe._trainable_params)}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)  # measured: equal to 1e-6
    assert compiled_grads.keys() == eager_grads.keys()
    for index, grad in compiled_grads.items():
        torch.testing.assert_close(grad, eager_grads[index], rtol=1e-4, atol=1e-6, msg=str(index))

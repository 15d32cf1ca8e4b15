"""Bad input: every case fails with a clear error (the asserted text names the problem and, where there is one, the
fix), before anything is written under ``output_dir`` (a fresh output folder is not even created; a resumed one is
left byte for byte as it was).

Most cases call the single-device recipe's constructor and ``setup`` in-process (fast, and the exception text is
exact). The printed lines and the exit code come from the recipes' entry points (``recipe_main``), also called
in-process, as ``tune run`` calls them (``conftest.run_main``), the distributed recipe's as a launcher starts its one
worker. Real processes (the slow lane: ``integration_test``) only where the process is the point: one config error
through ``tune run`` (its exit code 2 and lines), the distributed recipe under torchrun on 2 ranks (more ranks than
samples: an error every rank finds after the process group started; a config error printed once; a value rank 0's
component refuses, which the others get). The state-dict tooling's argument errors are library calls.
"""

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Dict, List

import psutil
import pytest
import torch
from conftest import load_recipe, run_main
from omegaconf import OmegaConf
from reliability_utils import (
    DIST_CONFIG,
    DIST_RECIPE,
    REPO,
    RUN_TIMEOUT_S,
    SINGLE_CONFIG,
    SINGLE_RECIPE,
    TUNE,
    assert_no_leftovers,
    snapshot,
    tune,
)
from safetensors.torch import load_file, save_file

from torchtune_ext import _dtype
from torchtune_ext.config import CONFIG_ERROR_EXIT_CODE, TRACEBACK_ENV
from torchtune_ext.data import write_tiny_checkpoint

VOCAB_SIZE = 512
ALPACA = "dataset._component_=torchtune.datasets.alpaca_dataset"
#: a device type this machine lacks (the check lists the ones it has).
ABSENT_DEVICE = "mps" if torch.cuda.is_available() else "cuda"
RENAMED_FROM, RENAMED_TO = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate.weight"


@pytest.fixture(scope="module")
def recipe_module():
    return load_recipe(REPO / SINGLE_RECIPE)


def _cfg(out: Path, checkpoint_dir: Path, overrides: List[str]):
    cfg = OmegaConf.merge(
        OmegaConf.load(SINGLE_CONFIG),
        OmegaConf.from_dotlist(
            [
                f"output_dir={out}",
                f"checkpointer.checkpoint_dir={checkpoint_dir}",
                "dataset.num_samples=32",
                "batch_size=4",
                "max_steps_per_epoch=1",
                "run_val_every_n_steps=null",
                "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
                f"metric_logger.log_dir={out}/logs",
                *overrides,
            ]
        ),
    )
    cfg.pop("generate_base_checkpoint")  # the inputs are prepared by the fixture
    return cfg


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, recipe_module) -> Dict[str, Path]:
    """The good base checkpoint, broken copies of it, and a resumable output folder (one step of training)."""
    root = tmp_path_factory.mktemp("inputs")
    base = write_tiny_checkpoint(root / "base", family="llama", dtype="fp32", seed=0)
    paths = {"base": base}

    truncated = root / "truncated"
    shutil.copytree(base, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    paths["truncated"] = truncated

    renamed = root / "renamed"
    shutil.copytree(base, renamed)
    tensors = load_file(renamed / "model.safetensors")
    tensors[RENAMED_TO] = tensors.pop(RENAMED_FROM)
    save_file(tensors, renamed / "model.safetensors")
    paths["renamed"] = renamed

    kept = root / "kept_ids.json"
    kept.write_text(json.dumps([0, 1, 2, VOCAB_SIZE + 7]))
    paths["kept_out_of_range"] = kept
    a_file = root / "a_file"
    a_file.write_text("not a folder")
    paths["a_file"] = a_file
    question_answer = root / "qa.json"
    question_answer.write_text(json.dumps([{"question": "2+2?", "answer": "4"}] * 8))
    paths["question_answer"] = question_answer
    bad_jsonl = root / "bad.jsonl"
    bad_jsonl.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c" "output": "d"}\n')
    paths["bad_jsonl"] = bad_jsonl

    trained = root / "trained"
    cfg = _cfg(trained, base, ["stop_after_step=1", "max_steps_per_epoch=2"])
    recipe = recipe_module.QLoRAFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()
    assert (trained / "recipe_state" / "recipe_state.pt").is_file()
    paths["trained"] = trained
    return paths


# Each case: config overrides ({name} = a path from `inputs`; {out} = the output folder), the text the error must
# contain, and how the output folder is prepared: "fresh" (must not be created), "resume" (a copy of the trained
# run, which must stay unchanged), or "resume:<how the recipe state is damaged>".
SINGLE_DEVICE_CASES = [
    pytest.param(
        ["dtype=fp8"],
        "dtype='fp8' is not supported; use dtype=fp32, dtype=bf16 or dtype=fp16",
        "fresh",
        id="unknown_dtype",
    ),
    pytest.param(
        ["dtype=bf16", "#no_bf16"],
        "dtype=bf16 was requested but cpu does not support bf16 (e.g. a T4). Use dtype=fp32",
        "fresh",
        id="bf16_where_unsupported",
    ),
    pytest.param(
        ["dtype=fp16", "adapter_dtype=fp16"],
        "adapter_dtype=fp16 is not supported: use adapter_dtype=fp32",
        "fresh",
        id="fp16_adapters_in_fp16",
    ),
    pytest.param(
        ["dtype=fp16", "loss_scaler.growth_intervall=100"],
        "growth_intervall",
        "fresh",
        id="fp16_unknown_loss_scaler_option",
    ),
    pytest.param(
        ["model.intermediate_dim=200"], "does not match the configured model", "fresh", id="checkpoint_shape_mismatch"
    ),
    pytest.param(
        ["enable_activation_offloading=True"],
        "enable_activation_offloading=True needs a CUDA device",
        "fresh",
        id="activation_offloading_off_cuda",
    ),
    pytest.param(["merge_base=fp8"], "merge_base='fp8' is not supported; use merge_base=nf4", "fresh", id="merge_base"),
    pytest.param(
        ["checkpointer.checkpoint_files=[missing.safetensors]"],
        "Checkpoint file(s) not found",
        "fresh",
        id="missing_checkpoint_file",
    ),
    pytest.param(
        ["checkpointer.checkpoint_dir={out}_no_such_model"],
        "does not exist. Download the model first",
        "fresh",
        id="missing_checkpoint_dir",
    ),
    pytest.param(
        ["checkpointer.checkpoint_files=[../model.bin]"],
        "are not safetensors files",
        "fresh",
        id="not_a_safetensors_file",
    ),
    pytest.param(
        ["checkpointer.checkpoint_dir={truncated}"],
        "model.safetensors is truncated",
        "fresh",
        id="truncated_checkpoint_file",
    ),
    pytest.param(
        ["checkpointer.checkpoint_dir={renamed}"],
        [RENAMED_TO, "layers.0.mlp.w1.weight"],
        "fresh",
        id="checkpoint_keys_do_not_match_the_model",
    ),
    pytest.param(
        ["model.vocab_size=1024"],
        "but the configured model expects (1024, 256)",
        "fresh",
        id="checkpoint_shapes_do_not_match_the_model",
    ),
    pytest.param(
        ["checkpointer.model_type=GPT2"],
        "checkpointer.model_type='GPT2' is not supported",
        "fresh",
        id="unknown_model_type",
    ),
    pytest.param(
        ["output_dir={base}/out"],
        "is inside checkpointer.checkpoint_dir",
        "fresh",
        id="output_dir_inside_the_base_model",
    ),
    pytest.param(
        ["tokenizer._component_=torchtune.models.llama3.llama3_tokenizer", "tokenizer.path={out}_none/tokenizer.model"],
        ["tokenizer.path=", "does not exist", "set tokenizer.path to the file in the model's folder"],
        "fresh",
        id="missing_tokenizer_file",
    ),
    pytest.param(
        [
            "tokenizer._component_=torchtune.models.qwen2_5.qwen2_5_tokenizer",
            "tokenizer.path={a_file}",
            "tokenizer.merges_file={out}_none/merges.txt",
        ],
        ["tokenizer.merges_file=", "does not exist"],
        "fresh",
        id="missing_tokenizer_merges_file",
    ),
    pytest.param(
        ["dataset._component_=torchtune.datasets.alpaca_dataset", "#offline"],
        ["dataset: the data set 'tatsu-lab/alpaca' could not be loaded", "dataset.source=json dataset.data_files="],
        "fresh",
        id="data_set_not_reachable_offline",
    ),
    pytest.param(["dataset.num_samples=0"], "The data set gives 0 batches", "fresh", id="empty_data_set"),
    # config checks (torchtune_ext.config.check_config), before anything is built
    pytest.param(["dtpye=fp32"], "unknown key 'dtpye': did you mean 'dtype'?", "fresh", id="typo_in_a_key"),
    pytest.param(["lora_rank=-1"], "did you mean 'model.lora_rank'?", "fresh", id="section_key_at_top_level"),
    pytest.param(["model.lora_rank=0"], "model.lora_rank=0 must be an integer >= 1", "fresh", id="lora_rank_0"),
    pytest.param(["model.lora_rank=-1"], "model.lora_rank=-1 must be an integer >= 1", "fresh", id="negative_rank"),
    pytest.param(["model.lora_alpha=0"], "model.lora_alpha=0 must be a number > 0", "fresh", id="lora_alpha_0"),
    pytest.param(["optimizer.lr=0"], "optimizer.lr=0 must be a number > 0", "fresh", id="lr_0"),
    pytest.param(["epochs=0"], "epochs=0 must be a positive integer", "fresh", id="zero_epochs"),
    pytest.param(
        ["device=" + ABSENT_DEVICE], f"device='{ABSENT_DEVICE}' is not available", "fresh", id="device_not_there"
    ),
    pytest.param(
        [ALPACA, "dataset.source=json", "dataset.data_files={out}_none/data.json"],
        ["dataset.data_files=", "_none/data.json' does not exist"],
        "fresh",
        id="missing_data_file",
    ),
    pytest.param(
        [ALPACA, "dataset.source=json", "dataset.data_files={bad_jsonl}"],
        ["dataset.data_files: ", "bad.jsonl: line 2, column 21: invalid JSON"],
        "fresh",
        id="jsonl_that_does_not_parse",
    ),
    pytest.param(
        [ALPACA, "dataset.source=json", "dataset.data_files={question_answer}"],
        ["the data's columns are ['answer', 'question']", "dataset.column_map="],
        "fresh",
        id="columns_that_do_not_match",
    ),
    pytest.param(["tokenizer.max_seq_len=4"], "max_seq_len", "fresh", id="max_seq_len_smaller_than_a_prompt"),
    pytest.param(["batch_size=0"], "batch_size=0 must be a positive integer", "fresh", id="zero_batch_size"),
    pytest.param(
        ["vocab_pruning.enabled=True", "vocab_pruning.kept_ids={kept_out_of_range}"],
        f"kept_ids has 1 id(s) outside the vocabulary [0, {VOCAB_SIZE}): [{VOCAB_SIZE + 7}]",
        "fresh",
        id="vocab_pruning_ids_out_of_range",
    ),
    pytest.param(
        ["resume_from_checkpoint=True"], "resume_from_checkpoint=True but", "fresh", id="resume_without_recipe_state"
    ),
    pytest.param(
        ["resume_from_checkpoint=True"], "is not a readable recipe state", "resume:garbage", id="corrupt_recipe_state"
    ),
    pytest.param(
        ["resume_from_checkpoint=True"],
        "is not a readable recipe state",
        "resume:truncated",
        id="truncated_recipe_state",
    ),
    pytest.param(
        ["resume_from_checkpoint=True", "model.lora_rank=8"],
        "model.lora_rank: 16 -> 8",
        "resume",
        id="resume_with_another_lora_rank",
    ),
    pytest.param(
        ["resume_from_checkpoint=True", "model.lora_attn_modules=[q_proj,v_proj]"],
        "model.lora_attn_modules: ['q_proj', 'k_proj', 'v_proj', 'output_proj'] -> ['q_proj', 'v_proj']",
        "resume",
        id="resume_with_other_lora_modules",
    ),
    pytest.param(
        ["resume_from_checkpoint=True", "dtype=bf16"],
        "dtype: float32 -> bfloat16",
        "resume",
        id="resume_with_another_dtype",
    ),
]


def _damage(state_file: Path, how: str) -> None:
    if how == "garbage":
        state_file.write_bytes(b"\x00not a recipe state" * 100)
    elif how == "truncated":
        data = state_file.read_bytes()
        state_file.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("overrides, message, output", SINGLE_DEVICE_CASES)
def test_single_device_bad_input_fails_before_writing(
    recipe_module, inputs, tmp_path, monkeypatch, overrides, message, output
):
    out = tmp_path / "out"
    if output.startswith("resume"):
        shutil.copytree(inputs["trained"], out)
        if ":" in output:
            _damage(out / "recipe_state" / "recipe_state.pt", output.split(":")[1])
    if "#no_bf16" in overrides:  # a device without bf16 (e.g. a T4), simulated
        monkeypatch.setattr(_dtype, "is_bf16_supported", lambda device: False)
    if "#offline" in overrides:  # no network (as here, without the retries): the Hub libraries' offline mode
        import datasets
        import huggingface_hub

        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    values = {**{k: str(v) for k, v in inputs.items()}, "out": str(out)}
    cfg = _cfg(out, inputs["base"], [o.format(**values) for o in overrides if not o.startswith("#")])
    out = Path(cfg.output_dir)
    before = snapshot(out)

    with pytest.raises(Exception) as raised:
        recipe = recipe_module.QLoRAFinetuneRecipeSingleDevice(cfg)
        recipe.setup(cfg)
    text = str(raised.value)
    for expected in [message] if isinstance(message, str) else message:
        assert expected in text, f"expected {expected!r} in the error, got {type(raised.value).__name__}: {text}"
    assert snapshot(out) == before, f"written before the error: {sorted(set(snapshot(out)) - set(before))}"
    if not before:
        assert not out.exists()


# ------------------------------------------------------------------------------------- entry points (tune run)


def _recipe_main(recipe_module, overrides: List[str], monkeypatch, capfd, **env: str) -> subprocess.CompletedProcess:
    """The single-device recipe's entry point on the tiny config, in this process, as ``tune run`` calls it."""
    argv = [SINGLE_RECIPE, "--config", str(SINGLE_CONFIG), *overrides]
    return run_main(recipe_module.recipe_main, argv, monkeypatch, capfd, cwd=REPO, **env)


def test_output_folder_not_writable_fails_with_exit_code(recipe_module, inputs, monkeypatch, capfd):
    out = inputs["a_file"] / "out"  # a folder below a regular file can never be created (even by root)
    children = psutil.Process().children(recursive=True)
    overrides = [f"output_dir={out}", f"checkpointer.checkpoint_dir={inputs['base']}", "dataset.num_samples=32"]
    run = _recipe_main(recipe_module, overrides, monkeypatch, capfd)
    assert run.returncode != 0
    assert psutil.Process().children(recursive=True) == children  # it started no process
    assert f"output_dir={str(out)!r} is not writable" in run.stderr, run.stderr[-3000:]
    assert inputs["a_file"].read_text() == "not a folder"


#: bad input through the distributed entry point: overrides ({name}: a path from `inputs`), the text the output must
#: hold; the output folder is fresh (must not be created), or a copy of the single-device run's (the recipes share
#: its format) where a case resumes.
DISTRIBUTED_CASES = [
    pytest.param(
        ["vocab_pruning.enabled=True", "vocab_pruning.kept_ids={kept_out_of_range}"],
        f"kept_ids has 1 id(s) outside the vocabulary [0, {VOCAB_SIZE}): [{VOCAB_SIZE + 7}]",
        id="vocab_pruning_ids_out_of_range",
    ),
    pytest.param(["tokenizer.max_seq_len=4"], "Raise tokenizer.max_seq_len", id="max_seq_len_smaller_than_a_prompt"),
    pytest.param(
        ["resume_from_checkpoint=True", "model.lora_rank=8"],
        "model.lora_rank: 16 -> 8",
        id="resume_with_another_lora_rank",
    ),
]


def _distributed_overrides(inputs: Dict[str, Path], out: Path, overrides: List[str]) -> List[str]:
    """The distributed tiny config's paths and ``overrides``; a resume starts from a copy of the trained run."""
    if "resume_from_checkpoint=True" in overrides:
        shutil.copytree(inputs["trained"], out)
    values = {k: str(v) for k, v in inputs.items()}
    return [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={inputs['base']}",
        "process_group_timeout_s=30",
        *[o.format(**values) for o in overrides],
    ]


@pytest.mark.parametrize("overrides, message", DISTRIBUTED_CASES)
def test_distributed_bad_input_fails_before_writing(inputs, tmp_path, monkeypatch, capfd, caplog, overrides, message):
    """The distributed entry point as a launcher starts its one worker (``--nproc_per_node 1``), in this process."""
    out = tmp_path / "out"
    argv = [DIST_RECIPE, "--config", str(DIST_CONFIG), *_distributed_overrides(inputs, out, overrides)]
    before = snapshot(out)
    launched = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    run = run_main(
        _use_recipe("qlora_finetune_distributed").recipe_main, argv, monkeypatch, capfd, cwd=REPO, **launched
    )
    output = run.stdout + run.stderr + caplog.text
    assert run.returncode != 0
    assert message in output, output[-3000:]
    assert snapshot(out) == before, f"written before the error: {sorted(set(snapshot(out)) - set(before))}"
    if not before:
        assert not out.exists()


@pytest.mark.integration_test
@pytest.mark.distributed
def test_more_ranks_than_samples_fails_with_exit_code(inputs, tmp_path):
    """An error every rank finds after the process group started (2 ranks): all stop, none is left."""
    out = tmp_path / "out"
    overrides = _distributed_overrides(inputs, out, ["dataset.num_samples=1", "batch_size=1"])
    run = tune(DIST_RECIPE, DIST_CONFIG, overrides, tmp_path / "run.log", nproc=2)
    rc = run.wait()
    assert rc != 0
    assert_no_leftovers([run])
    message = "the training set has 1 samples, fewer than one batch per rank (2 ranks x batch_size 1 = 2)"
    assert message in run.output, run.output[-3000:]
    assert not out.exists()


# config and input errors print one line each, exit 2, no traceback (TORCHTUNE_EXT_TRACEBACK=1: one)
ONE_LINE_CASES = [
    pytest.param(["dtpye=fp32"], ["unknown key 'dtpye': did you mean 'dtype'?"], id="typo_in_a_key"),
    pytest.param(
        ["dtpye=fp32", "model.lora_rank=0"],
        ["unknown key 'dtpye': did you mean 'dtype'?", "model.lora_rank=0 must be an integer >= 1 (e.g. 8, 16, 64)"],
        id="two_problems",
    ),
    pytest.param(
        ["generate_base_checkpoint=None"],
        ["generate_base_checkpoint=None: a config section cannot be turned off with None; it only writes the tiny"],
        id="generate_base_checkpoint_none",
    ),
    pytest.param(["device=" + ABSENT_DEVICE], [f"device='{ABSENT_DEVICE}' is not available"], id="device_not_there"),
    pytest.param(
        ["enable_activation_offloading=True"],
        ["enable_activation_offloading=True needs a CUDA device"],
        id="activation_offloading_off_cuda",
    ),
    pytest.param(
        [ALPACA, "dataset.source=json", "dataset.data_files={question_answer}"],
        ["dataset: the data's columns are ['answer', 'question'], but torchtune.datasets.alpaca_dataset reads"],
        id="columns_that_do_not_match",
    ),
    pytest.param(["dtype=int8"], ["dtype='int8' is not supported; use dtype=fp32, dtype=bf16"], id="int8"),
    pytest.param(
        ["checkpointer.checkpoint_dir={out}_no_such_model", "generate_base_checkpoint.checkpoint_dir={out}_elsewhere"],
        ["_no_such_model' does not exist. Download the model first"],
        id="missing_checkpoint_dir",
    ),
    pytest.param(["output_dir={a_file}/out"], ["/a_file/out' is not writable"], id="output_dir_below_a_file"),
    pytest.param(["merge_base=fp8"], ["merge_base='fp8' is not supported; use merge_base=nf4"], id="merge_base"),
    pytest.param(
        ["resume_from_checkpoint=True"],
        ["resume_from_checkpoint=True but {out}/recipe_state/recipe_state.pt does not exist: resume with the same"],
        id="resume_without_recipe_state",
    ),
    pytest.param(
        ["dataset.num_samples=4", "batch_size=4", "gradient_accumulation_steps=2"],
        ["The data set gives 1 batches of batch_size=4, fewer than gradient_accumulation_steps=2: lower either."],
        id="too_few_batches",
    ),
    pytest.param(
        ["vocab_pruning.enabled=True", "vocab_pruning.sharding=both"],
        ["vocab_pruning.sharding='both' is not supported; use one of ['sharded', 'replicated']."],
        id="vocab_pruning_sharding",
    ),
    pytest.param(
        [ALPACA, "dataset.source=json", "dataset.data_files={out}_none/data.json"],
        ["_none/data.json' does not exist (relative paths start at"],
        id="missing_data_file",
    ),
    pytest.param(
        ["optimizer.lr=0", "model.lora_alpha=-1", "batch_size=0"],
        [
            "batch_size=0 must be a positive integer",
            "model.lora_alpha=-1 must be a number > 0",
            "optimizer.lr=0 must be a number > 0",
        ],
        id="bad_ranges",
    ),  # fmt: skip
    pytest.param(
        ["optimizer._component_=torch.optim.AdamWW"],
        [
            "optimizer._component_='torch.optim.AdamWW' cannot be imported: torch.optim has no 'AdamWW'; did you mean "
            "'torch.optim.AdamW'?"
        ],
        id="component_typo",
    ),
    # a value the component itself refuses (torchtune_ext.config.instantiate_component), before anything is loaded
    pytest.param(
        ["generate_base_checkpoint.family=qwen2"],
        [
            "generate_base_checkpoint.family='qwen2' is refused by torchtune_ext.data.write_tiny_checkpoint: Unknown "
            "tiny model family 'qwen2'; use one of ['llama', 'qwen']."
        ],
        id="component_refuses_a_value",
    ),
    pytest.param(
        ["optimizer.betas=0.9"],
        [
            "optimizer: torch.optim.AdamW failed with TypeError: 'float' object is not subscriptable; fix the "
            "optimizer values (given: lr=0.003, weight_decay=0.0, betas=0.9); "
            "TORCHTUNE_EXT_TRACEBACK=1 shows where it failed"
        ],
        id="optimizer_refuses_a_value",
    ),  # before: the base loaded, the output folder written, then a traceback
    pytest.param(
        ["loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss", "loss.num_output_chunks=abc"],
        ["loss.num_output_chunks='abc' must be a positive integer"],
        id="loss_chunks",
    ),  # before: a traceback from the first forward pass
    pytest.param(
        ["model.lora_attn_modules=[q_prj]"],
        ["model.lora_attn_modules=['q_prj'] has 'q_prj', which is not an attention projection; did you mean 'q_proj'?"],
        id="lora_module_typo",
    ),  # before: trained, then failed at the first save
    pytest.param(
        ["dataset_val.split=valid"],
        [
            "dataset_val.split='valid' is not a split of this data set, which has ['train', 'validation']; use "
            "dataset_val.split=validation"
        ],
        id="tiny_split_typo",
    ),
    pytest.param(
        [ALPACA, "dataset.source=json", "dataset.data_files={question_answer}", "dataset.split=test"],
        [
            "dataset.split='test' is not a split of this data set, which has ['train']; use dataset.split=train",
            "dataset: the data's columns are ['answer', 'question']",
        ],
        id="json_split_and_columns",
    ),
]


def _recipe_run(overrides: List[str], cwd: Path) -> subprocess.CompletedProcess:
    """``tune run`` of the single-device recipe on the tiny config, with the inherited environment."""
    full_env = {**{k: v for k, v in os.environ.items() if k != TRACEBACK_ENV}, "OMP_NUM_THREADS": "1"}
    args = [str(TUNE), "run", SINGLE_RECIPE, "--config", str(SINGLE_CONFIG), *overrides]
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _assert_one_line_each(run: subprocess.CompletedProcess, lines: List[str], values: Dict[str, str]) -> None:
    assert run.returncode == CONFIG_ERROR_EXIT_CODE, run.stderr[-4000:]
    output = run.stdout + run.stderr
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("qlora_finetune_single_device: error: ")]
    assert len(errors) == len(lines), output[-4000:]
    for error, expected in zip(errors, lines):
        assert expected.format(**values) in error, error


@pytest.mark.parametrize("overrides, lines", ONE_LINE_CASES)
def test_config_errors_print_one_line_each_and_exit_2(
    recipe_module, inputs, tmp_path, monkeypatch, capfd, overrides, lines
):
    out = tmp_path / "out"
    values = {**{k: str(v) for k, v in inputs.items()}, "out": str(out)}
    paths = [f"output_dir={out}", f"checkpointer.checkpoint_dir={inputs['base']}"]
    run = _recipe_main(recipe_module, [*paths, *[o.format(**values) for o in overrides]], monkeypatch, capfd)
    _assert_one_line_each(run, lines, values)
    assert not out.exists()


@pytest.mark.integration_test
def test_tune_run_prints_the_lines_and_exits_2(inputs, tmp_path):
    """The same through ``tune run`` in a process of its own: the exit code and the lines a user gets."""
    out = tmp_path / "out"
    paths = [f"output_dir={out}", f"checkpointer.checkpoint_dir={inputs['base']}"]
    run = _recipe_run([*paths, "dtpye=fp32", "model.lora_rank=0"], REPO)
    lines = ["unknown key 'dtpye': did you mean 'dtype'?", "model.lora_rank=0 must be an integer >= 1 (e.g. 8, 16, 64)"]
    _assert_one_line_each(run, lines, {})
    assert not out.exists()


@pytest.mark.parametrize("damage", ["garbage", "code"])
def test_an_unusable_recipe_state_prints_one_line_and_exits_2(
    recipe_module, inputs, tmp_path, monkeypatch, capfd, damage
):
    """A resume from a recipe state that cannot be read, or that carries code, with nothing older to fall back to:
    one line naming the file and the fix, exit 2, nothing written (and the code never runs)."""
    out = tmp_path / "out"
    shutil.copytree(inputs["trained"], out)
    state_file = out / "recipe_state" / "recipe_state.pt"
    (out / "recipe_state" / "recipe_state.prev.pt").unlink(missing_ok=True)
    marker = tmp_path / "the_payload_ran"
    if damage == "code":

        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        torch.save({**torch.load(state_file, weights_only=True), "payload": Payload()}, state_file)
    else:
        _damage(state_file, damage)
    before = snapshot(out)
    overrides = [f"output_dir={out}", f"checkpointer.checkpoint_dir={inputs['base']}", "resume_from_checkpoint=True"]
    run = _recipe_main(recipe_module, overrides, monkeypatch, capfd)
    output = run.stdout + run.stderr
    assert run.returncode == CONFIG_ERROR_EXIT_CODE, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("qlora_finetune_single_device: error: ")]
    expected = "holds Python objects" if damage == "code" else "is not a readable recipe state"
    assert len(errors) == 1 and f"{state_file} {expected}" in errors[0], output[-4000:]
    assert snapshot(out) == before
    assert not marker.exists()


def test_a_resume_that_differs_prints_its_lines_and_exits_2(recipe_module, inputs, tmp_path, monkeypatch, capfd):
    """The refusal of a resume into another run's state: one line per difference, exit 2, no traceback, and the
    saved run left as it was."""
    out = tmp_path / "out"
    shutil.copytree(inputs["trained"], out)
    before = snapshot(out)
    same_run = [  # the trained run's settings (see `inputs`), but for the LoRA rank
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={inputs['base']}",
        "dataset.num_samples=32",
        "batch_size=4",
        "max_steps_per_epoch=2",
        "run_val_every_n_steps=null",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs",
    ]
    run = _recipe_main(
        recipe_module, [*same_run, "resume_from_checkpoint=True", "model.lora_rank=8"], monkeypatch, capfd
    )
    output = run.stdout + run.stderr
    assert run.returncode == CONFIG_ERROR_EXIT_CODE, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    prefix = "qlora_finetune_single_device: error: "
    errors = [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]
    assert errors[0].startswith("resume_from_checkpoint=True, but this run is not the one saved in "), errors
    assert "  model.lora_rank: 16 -> 8" in errors, errors
    assert errors[-1] == "Resume with the saved values, or start a new run in another output_dir.", errors
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "flags, line",
    [
        ([], "holds another run's checkpoints (recipe_state/recipe_state.pt, step_1). Continue that run with "
         "resume_from_checkpoint=True, replace it with overwrite_output_dir=True (deletes them), or set another "
         "output_dir."),
        (["resume_from_checkpoint=True", "overwrite_output_dir=True"],
         "resume_from_checkpoint=True and overwrite_output_dir=True contradict each other"),
    ],
    ids=["another_runs_state", "resume_and_overwrite"],
)  # fmt: skip
def test_a_used_output_dir_prints_one_line_and_exits_2(
    recipe_module, inputs, tmp_path, monkeypatch, capfd, flags, line
):
    """A second run into an output_dir holding another run's checkpoints is refused before it writes anything."""
    out = tmp_path / "out"
    shutil.copytree(inputs["trained"], out)
    before = snapshot(out)
    overrides = [f"output_dir={out}", f"checkpointer.checkpoint_dir={inputs['base']}", *flags]
    run = _recipe_main(recipe_module, overrides, monkeypatch, capfd)
    output = run.stdout + run.stderr
    assert run.returncode == CONFIG_ERROR_EXIT_CODE, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("qlora_finetune_single_device: error: ")]
    assert len(errors) == 1 and line in errors[0], output[-4000:]
    assert snapshot(out) == before


@functools.cache
def _use_recipe(name: str) -> ModuleType:
    return load_recipe(REPO / "recipes" / f"{name}.py")


@pytest.mark.parametrize(
    "recipe, overrides, line",
    [
        ("generate", ["promt=hi"], "unknown key 'promt': did you mean 'prompt'?"),  # before: the config's prompts ran
        ("generate", ["model.lora_rnk=4"], "unknown key 'model.lora_rnk' (torchtune_ext.models.qlora_tiny_llama does"),
        ("generate", [f"device={ABSENT_DEVICE}"], f"device='{ABSENT_DEVICE}' is not available"),  # before: on the CPU
        ("eleuther_eval", ["taks=[x]", "tasks=[x]"], "unknown key 'taks': did you mean 'tasks'?"),
        ("eleuther_eval", [], "tasks must be set: the config leaves it to the command line (tasks=...)"),
        ("eleuther_eval", ["tasks=[x]", f"device={ABSENT_DEVICE}"], f"device='{ABSENT_DEVICE}' is not available"),
        ("eleuther_eval", ["tasks=[x]", "include_path=/no/such/tasks"], "include_path=/no/such/tasks is not a folder"),
        # before: each a traceback and exit code 1 ({trained}: a training run's output folder)
        ("generate", ["adapter_dir={trained}/nowhere"], "adapter_dir='{trained}/nowhere' is not a folder; set "
         "adapter_dir to an adapter folder (adapter_config.json + adapter_model.safetensors: a training run writes"),
        ("generate", ["adapter_dir={trained}/step_1"], "adapter_dir='{trained}/step_1' is a checkpoint folder, not "
         "its adapter; set adapter_dir='{trained}/step_1/adapter'."),
        ("generate", ["adapter_dir={trained}/step_1/adapter", "model.lora_rank=8"], "adapter_dir='{trained}/step_1/"
         "adapter': the adapter does not fit the model (adapter_config.json names base model"),
        ("generate", ["prompts_file={trained}/nonexist.jsonl"], "prompts_file='{trained}/nonexist.jsonl' is not a "
         "file; set prompts_file to a JSONL file"),
        ("generate", ["temperature=-1"], "temperature=-1 must be a number >= 0; 0: greedy, e.g. 0.7: sampled"),
        ("generate", ["max_new_tokens=0"], "max_new_tokens=0 must be a positive integer; e.g. 128"),
        ("generate", ["top_p=1.5"], "top_p=1.5 must be in (0, 1] or null; e.g. 0.9"),
        ("eleuther_eval", ["tasks=[arc_easy]", "adapter_dir={trained}/nowhere"], "adapter_dir='{trained}/nowhere' "
         "is not a folder; set adapter_dir to an adapter folder"),
        ("eleuther_eval", ["tasks=[arc_easy]", "merged_dir={trained}"], "merged_dir='{trained}' has no config.json; "
         "merged_dir must be an HF-format model folder"),
    ],
    ids=[
        "generate-typo_in_a_key", "generate-typo_in_a_section_key", "generate-device_not_there",
        "eval-typo_in_a_key", "eval-tasks_not_set", "eval-device_not_there", "eval-missing_include_path",
        "generate-missing_adapter", "generate-adapter_s_step_folder", "generate-adapter_does_not_fit",
        "generate-missing_prompts_file", "generate-negative_temperature", "generate-no_new_tokens",
        "generate-top_p_above_1", "eval-missing_adapter", "eval-merged_dir_not_a_model",
    ],
)  # fmt: skip
def test_use_recipe_config_errors_print_one_line_and_exit_2(
    inputs, tmp_path, monkeypatch, capfd, recipe, overrides, line
):
    """The generation and evaluation recipes check their config before they load anything, as training does."""
    overrides, line = [o.format(trained=inputs["trained"]) for o in overrides], line.format(trained=inputs["trained"])
    config = REPO / "configs" / "tiny" / ("generation.yaml" if recipe == "generate" else "eleuther_eval.yaml")
    written = tmp_path / "written.json"
    paths = [f"checkpointer.checkpoint_dir={inputs['base']}", "adapter_dir=null"]
    paths.append(f"answers_file={written}" if recipe == "generate" else f"output_file={written}")
    argv = [f"recipes/{recipe}.py", "--config", str(config), *paths, *overrides]
    run = run_main(_use_recipe(recipe).recipe_main, argv, monkeypatch, capfd, cwd=REPO)
    output = run.stdout + run.stderr
    assert run.returncode == CONFIG_ERROR_EXIT_CODE, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    errors = [error for error in output.splitlines() if error.startswith(f"{recipe}: error: ")]
    assert len(errors) == 1 and line in errors[0], output[-4000:]
    assert not written.exists() and "Loaded" not in output


@pytest.mark.integration_test
@pytest.mark.distributed
@pytest.mark.parametrize(
    "override, line",
    [
        ("dtpye=fp32", "unknown key 'dtpye': did you mean 'dtype'?"),
        # rank 0 writes the tiny base; the others get its error instead of a lost peer at the barrier
        ("generate_base_checkpoint.family=qwen2", "generate_base_checkpoint.family='qwen2' is refused by "
         "torchtune_ext.data.write_tiny_checkpoint: Unknown tiny model family 'qwen2'; use one of ['llama', 'qwen']."),
    ],
    ids=["typo_in_a_key", "component_refuses_a_value_on_rank_0"],
)  # fmt: skip
def test_a_config_error_on_2_ranks_prints_its_line_once(tmp_path, override, line):
    """Every rank finds it before the process group starts (or gets rank 0's); rank 0 prints it, and the launcher
    exits 2 like its workers, without torchrun's traceback (torchtune_ext._compat)."""
    full_env = {**{k: v for k, v in os.environ.items() if k != TRACEBACK_ENV}, "OMP_NUM_THREADS": "1"}
    args = [str(TUNE), "run", "--standalone", "--nproc_per_node", "2", DIST_RECIPE, "--config", str(DIST_CONFIG)]
    out, base = tmp_path / "out", tmp_path / "base"
    run = subprocess.run(
        [*args, f"output_dir={out}", f"checkpointer.checkpoint_dir={base}", override], cwd=REPO, env=full_env,
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == CONFIG_ERROR_EXIT_CODE, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("qlora_finetune_distributed: error: ")]
    assert errors == [f"qlora_finetune_distributed: error: {line}"], output[-4000:]
    assert "ConfigError" not in output  # no rank's traceback
    assert not out.exists() and not base.exists()


def test_the_traceback_on_request(recipe_module, tmp_path, monkeypatch, capfd):
    run = _recipe_main(
        recipe_module, [f"output_dir={tmp_path / 'out'}", "dtpye=fp32"], monkeypatch, capfd, **{TRACEBACK_ENV: "1"}
    )
    assert run.returncode == 1
    assert "Traceback (most recent call last)" in run.stderr
    assert "ConfigError: unknown key 'dtpye': did you mean 'dtype'?" in run.stderr


# ---------------------------------------------------------------------------------------------------- library


@pytest.fixture(scope="module")
def tiny_model():
    from torchtune_ext.models import qlora_tiny_llama

    torch.manual_seed(0)
    return qlora_tiny_llama(lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)


def test_include_keys_and_ignore_keys_together(tiny_model):
    from torchtune_ext.distributed import get_full_state_dict

    with pytest.raises(ValueError, match="include_keys and ignore_keys are mutually exclusive; pass one of them."):
        get_full_state_dict(tiny_model, include_keys="layers.*", ignore_keys="*.lora_*")


def test_unmatched_glob_names_the_nearest_keys(tiny_model):
    from torchtune_ext.distributed import get_full_state_dict

    with pytest.raises(ValueError) as raised:
        get_full_state_dict(tiny_model, include_keys=["layers.*.attn.q_proj.*", "layers.*.attn.qproj.*"])
    text = str(raised.value)
    assert "include_keys pattern 'layers.*.attn.qproj.*' matches no state-dict key. Nearest keys: [" in text, text
    assert "layers.0.attn.q_proj" in text.split("Nearest keys:")[1]


def test_eval_without_lm_eval_prints_how_to_install_it_in_one_line(inputs, monkeypatch, capfd):
    """Without the ``eval`` extra, the evaluation recipe says how to install it in one line, before any load."""
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)  # its import raises ImportError, as when absent
    monkeypatch.delitem(sys.modules, "torchtune_ext.evaluation._lm", raising=False)
    config = REPO / "configs" / "tiny" / "eleuther_eval.yaml"
    argv = ["recipes/eleuther_eval.py", "--config", str(config), f"checkpointer.checkpoint_dir={inputs['base']}"]
    run = run_main(_use_recipe("eleuther_eval").recipe_main, [*argv, "tasks=[x]"], monkeypatch, capfd, cwd=REPO)
    output = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert errors == [
        "eleuther_eval: error: lm-eval is not installed: the eleuther_eval recipe needs EleutherAI's lm-eval harness: "
        "pip install 'torchtune_ext[eval]' (or pip install 'lm-eval>=0.4.5')."
    ], output[-4000:]
    assert "Loaded" not in output

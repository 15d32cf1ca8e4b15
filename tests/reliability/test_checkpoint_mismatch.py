"""A checkpoint that is not the configured model is refused before any weight is read, naming both sides (issue 24):
an untied checkpoint (its own ``lm_head.weight``) under a tied builder and the reverse, another model type or
attention geometry in ``config.json``, and a git-lfs pointer file in place of the weights. Nothing is written under
``output_dir`` (it is not even created).

The recipe runs in-process (constructor and ``setup``), as in ``test_bad_input.py``.
"""

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Dict, List

import pytest
from omegaconf import OmegaConf
from reliability_utils import REPO, SINGLE_CONFIG, SINGLE_RECIPE

from torchtune_ext.checkpoint import _safetensors
from torchtune_ext.data import write_tiny_checkpoint

BUILDER = "torchtune_ext.models.qlora_tiny_llama"
LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    "size 2471645608\n"
)


@pytest.fixture(scope="module")
def recipe_module():
    spec = importlib.util.spec_from_file_location("reliability_mismatch_recipe", REPO / SINGLE_RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {
        "tied": write_tiny_checkpoint(root / "tied", family="llama", dtype="fp32", seed=0),
        "untied": write_tiny_checkpoint(root / "untied", dtype="fp32", seed=0, tie_word_embeddings=False),
    }
    # config.json says untied but the files have no lm_head.weight (what transformers would fill with random weights)
    paths["untied_without_lm_head"] = root / "untied_without_lm_head"
    shutil.copytree(paths["tied"], paths["untied_without_lm_head"])
    _edit_config(paths["untied_without_lm_head"], tie_word_embeddings=False)
    paths["qwen2_config"] = root / "qwen2_config"
    shutil.copytree(paths["tied"], paths["qwen2_config"])
    _edit_config(paths["qwen2_config"], model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    paths["other_heads"] = root / "other_heads"
    shutil.copytree(paths["tied"], paths["other_heads"])
    heads = json.loads((paths["tied"] / "config.json").read_text())["num_attention_heads"]
    _edit_config(paths["other_heads"], num_attention_heads=heads * 2, num_key_value_heads=heads * 2)
    paths["lfs_pointer"] = root / "lfs_pointer"
    shutil.copytree(paths["tied"], paths["lfs_pointer"])
    (paths["lfs_pointer"] / "model.safetensors").write_text(LFS_POINTER)
    return paths


def _setup(recipe_module, out: Path, checkpoint_dir: Path, overrides: List[str]):
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
    cfg.pop("generate_base_checkpoint")
    recipe = recipe_module.QLoRAFinetuneRecipeSingleDevice(cfg)
    recipe.setup(cfg)
    return recipe


CASES = [
    pytest.param(
        "untied",
        [],
        [
            f"does not match the model builder {BUILDER}",
            "the checkpoint has its own output projection (config.json tie_word_embeddings: false, lm_head.weight in "
            "its files) but the model ties its output to the token embedding",
        ],
        id="untied_checkpoint_under_tied_builder",
    ),
    pytest.param(
        "untied_without_lm_head",
        [],
        ["config.json tie_word_embeddings: false, lm_head.weight not in its files", "ties its output"],
        id="config_says_untied_without_lm_head",
    ),
    pytest.param(
        "tied",
        ["model.tie_word_embeddings=False"],
        [
            "the checkpoint ties its output projection to the token embedding (config.json tie_word_embeddings: "
            "true, lm_head.weight not in its files) but the model has its own output weight",
        ],
        id="tied_checkpoint_under_untied_builder",
    ),
    pytest.param(
        "qwen2_config",
        [],
        [
            "config.json has model_type 'qwen2' (Qwen2ForCausalLM) but checkpointer.model_type=LLAMA3_2 reads "
            "'llama' checkpoints"
        ],
        id="model_type_of_another_family",
    ),
    pytest.param(
        "other_heads",
        [],
        ["config.json has num_attention_heads=8 but the model has 4 attention heads"],
        id="attention_heads_differ",
    ),
    pytest.param(
        "lfs_pointer",
        [],
        [
            f"model.safetensors ({len(LFS_POINTER)} bytes, standing for a 2.47 GB file)",
            "is a git-lfs pointer, not the weights",
            "Run `git lfs pull` in",
        ],
        id="git_lfs_pointer",
    ),
]


@pytest.mark.parametrize("checkpoint, overrides, messages", CASES)
def test_mismatched_checkpoint_is_refused_before_anything_is_written(
    recipe_module, checkpoints, tmp_path, checkpoint, overrides, messages
):
    out = tmp_path / "out"
    with pytest.raises(ValueError) as raised:
        _setup(recipe_module, out, checkpoints[checkpoint], overrides)
    text = str(raised.value)
    for message in messages:
        assert message in text, text
    assert not out.exists()


def test_matching_untied_checkpoint_loads(recipe_module, checkpoints, tmp_path):
    """The checks refuse only mismatches: the untied checkpoint under the untied builder sets up (its lm_head is the
    model's output weight, bit for bit)."""
    recipe = _setup(recipe_module, tmp_path / "out", checkpoints["untied"], ["model.tie_word_embeddings=False"])
    lm_head = _safetensors.read_tensor(checkpoints["untied"] / "model.safetensors", "lm_head.weight")
    assert recipe._model.output.weight.dtype == lm_head.dtype
    assert (recipe._model.output.weight.detach() == lm_head).all()


def test_not_a_safetensors_header_is_a_clear_error(tmp_path):
    """A file whose first 8 bytes announce a header longer than the file (any non-safetensors file) is named as not
    a safetensors file, instead of a MemoryError from reading that many bytes."""
    path = tmp_path / "model.safetensors"
    path.write_text(LFS_POINTER)
    with pytest.raises(ValueError, match="is not a safetensors file \\(its header length exceeds the file's size\\)"):
        _safetensors.read_header(path)

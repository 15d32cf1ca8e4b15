"""Every shipped single-device QLoRA config builds its model (on the meta device) and names real components."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config
from torchtune.config._utils import _get_component_from_path

from torchtune_ext.checkpoint import SUPPORTED_MODEL_TYPES

pytestmark = pytest.mark.integration_test

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REAL = sorted(p for p in CONFIGS.glob("*/*_qlora_single_device.yaml"))


def test_every_model_family_has_a_config():
    names = {str(p.relative_to(CONFIGS)) for p in REAL}
    assert names == {
        "llama2/7B_qlora_single_device.yaml",
        "llama3_1/8B_qlora_single_device.yaml",
        "llama3_2/1B_qlora_single_device.yaml",
        "llama3_2/3B_qlora_single_device.yaml",
        "mistral/7B_qlora_single_device.yaml",
        "qwen2_5/0.5B_qlora_single_device.yaml",
        "qwen2_5/1.5B_qlora_single_device.yaml",
        "qwen2_5/3B_qlora_single_device.yaml",
        "qwen2_5/7B_qlora_single_device.yaml",
        "smollm2/135M_qlora_single_device.yaml",
        "smollm2/360M_qlora_single_device.yaml",
        "smollm2/1.7B_qlora_single_device.yaml",
        "qwen3/0.6B_qlora_single_device.yaml",
        "qwen3/1.7B_qlora_single_device.yaml",
        "qwen3/4B_qlora_single_device.yaml",
        "qwen3/8B_qlora_single_device.yaml",
        "qwen3/14B_qlora_single_device.yaml",
        "gemma2/2B_qlora_single_device.yaml",
        "gemma2/9B_qlora_single_device.yaml",
        "gemma2/27B_qlora_single_device.yaml",
        "phi3/mini_qlora_single_device.yaml",
        "phi3/mini_4_qlora_single_device.yaml",
    }


@pytest.mark.parametrize("path", REAL, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_config_builds_and_points_at_hf_checkpoints(path):
    text = path.read_text()
    cfg = OmegaConf.load(path)
    assert cfg.dtype == "bf16" and "dtype=fp32" in text and "dtype=fp16" in text and "T4" in text
    assert "tune download" in text
    assert cfg.checkpointer._component_ == "torchtune_ext.checkpoint.QLoRAHFCheckpointer"
    assert cfg.checkpointer.model_type in SUPPORTED_MODEL_TYPES
    assert all(str(f).endswith(".safetensors") for f in cfg.checkpointer.checkpoint_files)
    assert str(cfg.tokenizer.path).startswith(str(cfg.checkpointer.checkpoint_dir))
    for key in ("tokenizer", "dataset", "optimizer", "lr_scheduler", "loss", "metric_logger"):
        assert callable(_get_component_from_path(cfg[key]._component_)), key
    model = config.instantiate(cfg.model, dtype=torch.bfloat16, adapter_dtype=torch.bfloat16, device="meta")
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_configs_name_only_public_components(path):
    """Configs name public paths only (a private module path moves with the code and breaks users' configs)."""
    components = [line.split(":", 1)[1].strip() for line in path.read_text().splitlines() if "_component_:" in line]
    ours = [c for c in components if c.startswith("torchtune_ext.")]
    assert ours and all(not part.startswith("_") for c in ours for part in c.split(".")), ours

"""SmolLM2 against transformers: a 2-layer checkpoint written by transformers' ``LlamaForCausalLM`` from
SmolLM2-135M's real config (dim 576, 9 heads / 3 KV heads of dim 64, MLP 1536, vocab 49152, plain RoPE with theta
100,000, RMSNorm eps 1e-5, tied embeddings; random weights at its init std), loaded by our builders.

- unquantized: the torchtune-layout model that ``torchtune_builder_for`` picks for the checkpoint's ``config.json``
  (our ``lora_smollm2``: torchtune's ``lora_llama3`` with a tied output), with the HF weights converted tensor by
  tensor, gives transformers' logits;
- NF4 and the recipe: ``configs/smollm2/135M_qlora_single_device.yaml`` (2 layers, the tiny tokenizer and data set)
  trains a few fp32 steps; before training our QLoRA model gives the logits of transformers run on the dequantized
  NF4 weights, and after training the merged folder (in transformers) and the PEFT adapter on the dequantized base
  (in peft) give the recipe model's logits.

Tolerance: 2e-5 absolute + 1e-5 relative on logits of magnitude ~1 (measured differences ~1e-6: the same fp32
function in a different order of operations). Using RoPE theta 10,000 instead of 100,000 moves the logits by far
more (asserted), as does the adapter.
"""

from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
from _hf_runner import hf_logits
from _tiny_recipe import run_recipe, tiny_training_args
from omegaconf import DictConfig
from safetensors.torch import load_file
from test_hf_peft_interop import _ours

from torchtune_ext.checkpoint import HFConverter, read_hf_config
from torchtune_ext.models import lora_smollm2, lora_smollm2_135m, torchtune_builder_for

pytestmark = [pytest.mark.integration_test, pytest.mark.stack]

CONFIG = "configs/smollm2/135M_qlora_single_device.yaml"
NUM_LAYERS = 2
STEPS = 3
SEQ_LEN = 128
ATOL, RTOL = 2e-5, 1e-5
RUN_TIMEOUT_S = 300

#: HuggingFaceTB/SmolLM2-135M(-Instruct) config.json, less num_hidden_layers.
SMOLLM2_135M_CONFIG = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    rope_scaling=None,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.041666666666666664,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("smollm2")


@pytest.fixture(scope="module")
def base(workdir) -> Path:
    """transformers writes the checkpoint (fp32, tied: no ``lm_head.weight``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_CONFIG, num_hidden_layers=NUM_LAYERS))
    folder = workdir / "base"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, SMOLLM2_135M_CONFIG["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _unquantized_logits(base: Path, input_ids: torch.Tensor, **arch_overrides) -> torch.Tensor:
    """The fp32 torchtune-layout model for the checkpoint's config.json, its weights converted from HF."""
    builder, args, model_type = torchtune_builder_for(read_hf_config(base))
    model = builder(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16, **{**args, **arch_overrides})
    converter = HFConverter.for_model(model_type, model)
    converted = (converter.to_tune(k, v) for k, v in load_file(base / "model.safetensors").items())
    missing, unexpected = model.load_state_dict(dict(c for c in converted if c is not None), strict=False)
    assert not unexpected and all("lora" in k for k in missing), (unexpected, missing)
    return model.eval()(input_ids)  # lora_b starts at zero: the base model's logits


def test_config_json_picks_the_smollm2_builder_with_the_135m_sizes(base):
    builder, args, model_type = torchtune_builder_for(read_hf_config(base))
    assert builder is lora_smollm2 and model_type == "LLAMA3_2"
    assert {**args, "num_layers": 30} == {k: lora_smollm2_135m.keywords[k] for k in args}


def test_unquantized_logits_equal_transformers(base, input_ids, workdir):
    hf, report = hf_logits(input_ids, [{"name": "base", "model": str(base)}], workdir / "hf_base")
    assert report["base"]["class"] == "LlamaForCausalLM" and report["base"]["tied"]
    ours = _unquantized_logits(base, input_ids)
    torch.testing.assert_close(ours, hf["base"], atol=ATOL, rtol=RTOL)
    # The RoPE theta matters at these positions: theta 10,000 (Llama 2's) would fail the comparison above.
    assert (_unquantized_logits(base, input_ids, rope_base=10_000.0) - hf["base"]).abs().max() > 100 * ATOL


def _train(out: Path, base: Path) -> DictConfig:
    """A few fp32 CPU steps of the shipped config on the 2-layer checkpoint, the tiny tokenizer and data set."""
    args = [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        f"model.num_layers={NUM_LAYERS}",
        *tiny_training_args(out, STEPS),
    ]
    return run_recipe(CONFIG, args, RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def trained(base, input_ids, workdir) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor], Dict]:
    """Our logits after and before training, and transformers' / peft's on the exported folders."""
    run_dir = workdir / "run"
    cfg = _train(run_dir, base)
    ours, untrained, dequantized = _ours(cfg, run_dir, input_ids, None)
    step = run_dir / f"step_{STEPS}"
    runs = [
        {"name": "dequantized", "model": str(dequantized)},
        {"name": "merged", "model": str(step / "merged")},
        {"name": "peft", "model": str(dequantized), "adapter": str(step / "adapter")},
    ]
    hf, report = hf_logits(input_ids, runs, workdir / "hf_trained")
    return ours, untrained, hf, report


def test_nf4_logits_equal_transformers_on_the_dequantized_weights(trained):
    _, untrained, hf, report = trained
    assert report["dequantized"]["class"] == "LlamaForCausalLM" and report["dequantized"]["tied"]
    torch.testing.assert_close(untrained, hf["dequantized"], atol=ATOL, rtol=RTOL)


def test_merged_model_and_adapter_in_transformers_and_peft_give_the_recipe_logits(trained):
    ours, untrained, hf, report = trained
    assert (ours - untrained).abs().max() > 1000 * ATOL  # the adapter trained: a dropped one would fail
    assert report["merged"]["class"] == "LlamaForCausalLM" and report["merged"]["tied"]
    torch.testing.assert_close(hf["merged"], ours, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(hf["peft"], ours, atol=ATOL, rtol=RTOL)

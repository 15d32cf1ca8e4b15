"""One RoPE cache per model: torchtune's per-layer Qwen caches and Llama's long shared one become one module sized for
the run, grown on demand; outputs equal the unshared model's bit for bit, and the memory estimate counts one cache."""

import copy

import pytest
import torch
from conftest import family_marks
from omegaconf import OmegaConf
from torchtune.models.gemma2._attention import Gemma2Attention
from torchtune.modules import MultiHeadAttention

from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipe
from torchtune_ext.memory._tracker import BUFFERS
from torchtune_ext.models import QLORA_BUILDERS, lora_tiny_llama, lora_tiny_qwen
from torchtune_ext.modules import share_rope_

LORA = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True)


def _ropes(model):
    attention = (MultiHeadAttention, Gemma2Attention)
    return {id(m.pos_embeddings): m.pos_embeddings for m in model.modules() if isinstance(m, attention)}


@pytest.mark.parametrize("builder", [lora_tiny_qwen, lora_tiny_llama])
def test_shared_rope_gives_the_same_outputs_and_grows_on_demand(builder):
    torch.manual_seed(0)
    reference = builder(**LORA)  # torchtune's modules, caches for 512 positions
    for module in reference.modules():
        if hasattr(module, "lora_b"):
            torch.nn.init.normal_(module.lora_b.weight)  # LoRA contributes
    shared = copy.deepcopy(reference)
    n_before = len(_ropes(reference))
    ropes = share_rope_(shared, max_seq_len=16)
    assert len(ropes) == 1 and len(_ropes(shared)) == 1
    assert n_before == (len(reference.layers) if builder is lora_tiny_qwen else 1)
    assert ropes[0].cache.shape[0] == 16

    tokens = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        expected, got = reference(tokens), shared(tokens)
    assert ropes[0].cache.shape[0] == 64  # grown to the next power of two
    assert torch.equal(got, expected)
    # Rows are those of the long table.
    assert torch.equal(ropes[0].cache, _ropes(reference).popitem()[1].cache[:64])

    # Positions beyond the sequence (a decode step) grow it too.
    positions = torch.tensor([[100, 101, 102]])
    with torch.no_grad():
        expected, got = reference(tokens[:1, :3], input_pos=positions), shared(tokens[:1, :3], input_pos=positions)
    assert ropes[0].cache.shape[0] == 128 and torch.equal(got, expected)


@pytest.mark.parametrize("builder", [pytest.param(b, id=b.__name__, marks=family_marks(b)) for b in QLORA_BUILDERS])
def test_every_shipped_builder_has_one_rope(builder):
    model = builder(lora_attn_modules=["q_proj", "v_proj"], device="meta")
    assert len(_ropes(model)) == 1


def test_bad_length():
    with pytest.raises(ValueError, match="max_seq_len=0 must be a positive integer"):
        share_rope_(lora_tiny_qwen(["q_proj"]), 0)


def test_the_estimate_counts_one_cache_of_the_run_length():
    cfg = OmegaConf.merge(
        OmegaConf.load("configs/tiny/qlora_single_device.yaml"),
        OmegaConf.from_dotlist(
            ["dry_run=True", "checkpointer.checkpoint_dir=/nonexistent/h25", "tokenizer.max_seq_len=96"]
        ),
    )
    cfg.model._component_ = "torchtune_ext.models.qlora_tiny_qwen"
    estimate = QLoRAFinetuneRecipe(cfg).memory_estimator(cfg).estimate(1, 96)
    head_dim = 256 // 4
    one_cache = 96 * head_dim * 2 * 4  # fp32 (cos, sin) rows of head_dim each
    theta = 512  # head_dim / 2 fp32 frequencies, one 512-byte block
    assert estimate.breakdown[BUFFERS] == one_cache + theta  # torchtune's builder: 2 layers x 512 positions

"""Qwen3 against transformers: 2-layer checkpoints written by transformers' ``Qwen3ForCausalLM`` from a
``Qwen3Config`` with Qwen3's real head geometry (head_dim 128 independent of the hidden size 256: 4 query heads,
2 KV heads, q/k RMSNorm per head, no q/k/v bias, RoPE theta 1,000,000, RMSNorm eps 1e-6), a small vocabulary (512,
the tiny tokenizer's) and MLP (512), tied (as 0.6B/1.7B/4B) and untied (as 8B/14B). Every RMSNorm weight, the q/k
norms included, is drawn around 1 (transformers initialises them to exactly 1, which would hide a norm applied at
the wrong place or not at all), then loaded by our builders:

- unquantized: the torchtune-layout model that ``torchtune_builder_for`` picks for the checkpoint's ``config.json``
  (our ``lora_qwen3``), with the HF weights converted tensor by tensor, gives transformers' logits;
- the q/k-norm quirk: the same weights through torchtune 0.6.1's ``MultiHeadAttention`` (norms after RoPE) or with
  the q/k norm weights at 1 move the logits far past the tolerance;
- NF4 and the recipe: ``configs/qwen3/0.6B_qlora_single_device.yaml`` (tied) and ``8B_qlora_single_device.yaml``
  (untied), shrunk to the checkpoint's sizes, train a few fp32 steps; before training our QLoRA model gives the
  logits of transformers run on the dequantized NF4 weights, and after training the merged folder (in
  transformers, as ``Qwen3ForCausalLM``) and the PEFT adapter on the dequantized base (in peft) give the recipe
  model's logits; the same for the distributed ``14B_qlora.yaml`` on 2 gloo ranks (untied);
- KV-cache decoding (generation's path) gives the full-sequence logits;
- bad input: a checkpoint that is not the configured model fails in ``validate`` (headers and config.json only,
  before any weight is read), naming the config key and both values.

Tolerance: 2e-5 absolute + 1e-5 relative on logits of magnitude ~2 (the same fp32 function in a different order of
operations; the unquantized logits measured equal to transformers' sdpa ones to the bit). torchtune 0.6.1's norm
order moves them by 0.6-0.8.
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
from torchtune.modules import MultiHeadAttention

from torchtune_ext.checkpoint import HFConverter, QLoRAHFCheckpointer, read_hf_config
from torchtune_ext.models import (
    lora_qwen3,
    lora_qwen3_0_6b,
    lora_qwen3_1_7b,
    lora_qwen3_4b,
    lora_qwen3_8b,
    lora_qwen3_14b,
    qlora_qwen3,
    torchtune_builder_for,
)

pytestmark = [pytest.mark.integration_test, pytest.mark.stack]

NUM_LAYERS = 2
STEPS = 3
SEQ_LEN = 128
ATOL, RTOL = 2e-5, 1e-5
RUN_TIMEOUT_S = 300

#: the shared settings of every Qwen/Qwen3-{0.6B,...,14B} config.json.
QWEN3_COMMON = dict(
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling=None,
    attention_bias=False,
    hidden_act="silu",
)
#: size -> (the size's config.json entries, our builder of it).
QWEN3_SIZES = {
    "0.6B": (
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            tie_word_embeddings=True,
        ),
        lora_qwen3_0_6b,
    ),
    "1.7B": (
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            tie_word_embeddings=True,
        ),
        lora_qwen3_1_7b,
    ),
    "4B": (
        dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
        ),
        lora_qwen3_4b,
    ),
    "8B": (
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
        lora_qwen3_8b,
    ),
    "14B": (
        dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
        lora_qwen3_14b,
    ),
}
#: the test checkpoints: Qwen3's heads and norms, small hidden size, MLP and vocabulary.
SMALL = dict(
    QWEN3_COMMON,
    vocab_size=512,
    max_position_embeddings=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
)
#: tied -> the shipped config whose builder has that output (the other sizes are the same function).
CONFIGS = {True: "configs/qwen3/0.6B_qlora_single_device.yaml", False: "configs/qwen3/8B_qlora_single_device.yaml"}
TIED_IDS = {True: "tied", False: "untied"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen3")


@pytest.fixture(scope="module", params=[True, False], ids=TIED_IDS.get)
def base(request, workdir) -> Path:
    """transformers writes the checkpoint (fp32), every RMSNorm weight drawn around 1."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=request.param))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.5 * torch.randn_like(param))
    folder = workdir / f"base_{TIED_IDS[request.param]}"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("size", list(QWEN3_SIZES))
def test_config_json_picks_the_qwen3_builder_with_the_size_s_architecture(size):
    from transformers import Qwen3Config

    entries, sized = QWEN3_SIZES[size]
    builder, args, model_type = torchtune_builder_for(Qwen3Config(**QWEN3_COMMON, **entries).to_dict())
    assert builder is lora_qwen3 and model_type == "QWEN3"
    assert args == {k: sized.keywords[k] for k in args}


def _unquantized(base: Path, **arch_overrides) -> torch.nn.Module:
    """The fp32 torchtune-layout model for the checkpoint's config.json, its weights converted from HF."""
    builder, args, model_type = torchtune_builder_for(read_hf_config(base))
    model = builder(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16, **{**args, **arch_overrides})
    converter = HFConverter.for_model(model_type, model)
    converted = (converter.to_tune(k, v) for k, v in load_file(base / "model.safetensors").items())
    missing, unexpected = model.load_state_dict(dict(c for c in converted if c is not None), strict=False)
    assert not unexpected and all("lora" in k for k in missing), (unexpected, missing)
    return model.eval()  # lora_b starts at zero: the base model


@pytest.fixture(scope="module")
def hf_base(base, input_ids, workdir) -> Tuple[torch.Tensor, Dict]:
    hf, report = hf_logits(input_ids, [{"name": "base", "model": str(base)}], workdir / f"hf_{base.name}")
    return hf["base"], report["base"]


@torch.no_grad()
def test_unquantized_logits_equal_transformers(base, input_ids, hf_base):
    hf, report = hf_base
    tied = read_hf_config(base)["tie_word_embeddings"]
    assert report["class"] == "Qwen3ForCausalLM" and report["tied"] == tied
    model = _unquantized(base)
    assert model.layers[0].attn.head_dim == 128 and model.layers[0].attn.q_proj.in_dim == 256
    torch.testing.assert_close(model(input_ids), hf, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_q_k_norms_apply_per_head_before_rope(base, input_ids, hf_base):
    """The same weights with torchtune 0.6.1's attention (q/k norms after RoPE), or with the q/k norm weights at 1,
    are other functions: either would fail the comparison above."""
    hf, _ = hf_base
    model = _unquantized(base)
    for layer in model.layers:
        layer.attn.__class__ = MultiHeadAttention  # torchtune 0.6.1's forward: RoPE, then the norms
    assert (model(input_ids) - hf).abs().max() > 100 * ATOL
    model = _unquantized(base)
    for layer in model.layers:
        layer.attn.q_norm.scale.fill_(1.0)
        layer.attn.k_norm.scale.fill_(1.0)
    assert (model(input_ids) - hf).abs().max() > 100 * ATOL


def _train(out: Path, base: Path, config: str, nproc: int = 0) -> DictConfig:
    """A few fp32 CPU steps of the shipped config, shrunk to the checkpoint, with the tiny tokenizer and data set
    (``nproc`` > 0: the distributed recipe on that many gloo ranks)."""
    arch = {k: SMALL[k] for k in ("vocab_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")}
    args = [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        "checkpointer.checkpoint_files=[model.safetensors]",
        f"model.num_layers={NUM_LAYERS}",
        f"model.embed_dim={SMALL['hidden_size']}",
        f"model.vocab_size={arch['vocab_size']}",
        f"model.num_heads={arch['num_attention_heads']}",
        f"model.num_kv_heads={arch['num_key_value_heads']}",
        f"model.intermediate_dim={arch['intermediate_size']}",
        f"model.max_seq_len={SMALL['max_position_embeddings']}",
        "model.lora_rank=8",
        "model.lora_alpha=16",
        *tiny_training_args(out, STEPS),
    ]
    return run_recipe(config, args, RUN_TIMEOUT_S, nproc)


@pytest.fixture(scope="module")
def trained(base, input_ids, workdir) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor], Dict]:
    """Our logits after and before training, and transformers' / peft's on the exported folders."""
    tied = read_hf_config(base)["tie_word_embeddings"]
    run_dir = workdir / f"run_{TIED_IDS[tied]}"
    cfg = _train(run_dir, base, CONFIGS[tied])
    ours, untrained, dequantized = _ours(cfg, run_dir, input_ids, None)
    step = run_dir / f"step_{STEPS}"
    runs = [
        {"name": "dequantized", "model": str(dequantized)},
        {"name": "merged", "model": str(step / "merged")},
        {"name": "peft", "model": str(dequantized), "adapter": str(step / "adapter")},
    ]
    hf, report = hf_logits(input_ids, runs, workdir / f"hf_trained_{TIED_IDS[tied]}")
    return ours, untrained, hf, report


def test_nf4_logits_equal_transformers_on_the_dequantized_weights(base, trained):
    _, untrained, hf, report = trained
    tied = read_hf_config(base)["tie_word_embeddings"]
    assert report["dequantized"]["class"] == "Qwen3ForCausalLM" and report["dequantized"]["tied"] == tied
    torch.testing.assert_close(untrained, hf["dequantized"], atol=ATOL, rtol=RTOL)


def test_merged_model_and_adapter_in_transformers_and_peft_give_the_recipe_logits(base, trained):
    ours, untrained, hf, report = trained
    tied = read_hf_config(base)["tie_word_embeddings"]
    assert (ours - untrained).abs().max() > 1000 * ATOL  # the adapter trained: a dropped one would fail
    assert report["merged"]["class"] == "Qwen3ForCausalLM" and report["merged"]["tied"] == tied
    merged_config = read_hf_config(Path(report["merged"]["folder"]))
    assert merged_config["model_type"] == "qwen3" and merged_config["head_dim"] == 128
    torch.testing.assert_close(hf["merged"], ours, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(hf["peft"], ours, atol=ATOL, rtol=RTOL)


def test_tune_ext_merge_from_config_json_equals_the_recipe_s_merged_folder(base, trained, workdir, tmp_path):
    """``tune-ext merge`` builds the model from the base's config.json (``model_type: qwen3``): byte for byte the
    recipe's merged folder."""
    from torchtune_ext.cli import main

    step = workdir / f"run_{TIED_IDS[read_hf_config(base)['tie_word_embeddings']]}" / f"step_{STEPS}"
    main(["merge", "--base", str(base), "--adapter", str(step / "adapter"), "--output", str(tmp_path / "merged")])
    files = lambda folder: {p.name: p.read_bytes() for p in sorted(folder.iterdir())}  # noqa: E731
    assert files(tmp_path / "merged") == files(step / "merged")


def test_distributed_14b_config_trains_and_exports_what_transformers_and_peft_load(base, input_ids, workdir):
    """``configs/qwen3/14B_qlora.yaml`` (untied, as 14B), shrunk to the checkpoint, on 2 gloo ranks: the merged folder
    and the adapter give our model's logits with the adapters from the recipe state."""
    if read_hf_config(base)["tie_word_embeddings"]:
        pytest.skip("the distributed config is 14B's: untied output")
    run_dir = workdir / "run_distributed"
    cfg = _train(run_dir, base, "configs/qwen3/14B_qlora.yaml", nproc=2)
    ours, untrained, dequantized = _ours(cfg, run_dir, input_ids, None)
    step = run_dir / f"step_{STEPS}"
    runs = [
        {"name": "merged", "model": str(step / "merged")},
        {"name": "peft", "model": str(dequantized), "adapter": str(step / "adapter")},
    ]
    hf, report = hf_logits(input_ids, runs, workdir / "hf_distributed")
    assert (ours - untrained).abs().max() > 1000 * ATOL
    assert report["merged"]["class"] == "Qwen3ForCausalLM" and not report["merged"]["tied"]
    torch.testing.assert_close(hf["merged"], ours, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(hf["peft"], ours, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "model_type, overrides, expected",
    [
        ("QWEN2", {}, "config.json has model_type 'qwen3' (Qwen3ForCausalLM) but checkpointer.model_type=QWEN2"),
        ("QWEN3", {"head_dim": 64}, "config.json has head_dim=128 but the model has 64"),
        ("QWEN3", {"rope_base": 10_000.0}, "config.json has rope_theta=1000000.0 but the model has 10000.0"),
        ("QWEN3", {"norm_eps": 1e-5}, "config.json has rms_norm_eps=1e-06 but the model has 1e-05"),
        ("QWEN3", {"num_kv_heads": 4}, "config.json has num_key_value_heads=2 but the model has 4 key/value heads"),
        ("QWEN3", {"tie_word_embeddings": None}, "tie_word_embeddings"),
    ],
    ids=["model_type", "head_dim", "rope_theta", "rms_norm_eps", "kv_heads", "tying"],
)
def test_a_checkpoint_that_is_not_the_configured_model_fails_before_reading_weights(
    base, tmp_path, model_type, overrides, expected
):
    """``validate`` reads the files' headers and config.json only; the recipe calls it before loading the base."""
    tied = read_hf_config(base)["tie_word_embeddings"]
    arch = dict(
        vocab_size=SMALL["vocab_size"],
        num_layers=NUM_LAYERS,
        num_heads=SMALL["num_attention_heads"],
        num_kv_heads=SMALL["num_key_value_heads"],
        embed_dim=SMALL["hidden_size"],
        intermediate_dim=SMALL["intermediate_size"],
        max_seq_len=SMALL["max_position_embeddings"],
        tie_word_embeddings=tied,
    )
    if "tie_word_embeddings" in overrides:
        overrides = {"tie_word_embeddings": not tied}
    model = qlora_qwen3(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16, **{**arch, **overrides})
    checkpointer = QLoRAHFCheckpointer(str(base), str(tmp_path / "out"), model_type)
    with pytest.raises(ValueError, match="config.json") as error:
        checkpointer.validate(model, "torchtune_ext.models.qlora_qwen3")
    assert expected in str(error.value)


@torch.no_grad()
def test_kv_cache_decoding_gives_the_full_sequence_logits(base, input_ids, hf_base):
    """Token-by-token decoding through the KV caches (generation's path through ``Qwen3Attention``) gives the
    logits of the whole sequence at once, i.e. transformers'."""
    hf, _ = hf_base
    model = _unquantized(base)
    length = 16
    model.setup_caches(batch_size=input_ids.shape[0], dtype=torch.float32, decoder_max_seq_len=length)
    mask = torch.tril(torch.ones(length, length, dtype=torch.bool))
    steps = [
        model(input_ids[:, i : i + 1], input_pos=torch.tensor([[i]] * input_ids.shape[0]), mask=mask[None, i : i + 1])
        for i in range(length)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), hf[:, :length], atol=ATOL, rtol=RTOL)

"""Phi-3 / Phi-3.5 / Phi-4-mini against transformers: small checkpoints written by transformers'
``Phi3ForCausalLM`` from ``Phi3Config`` with the real models' per-head geometry and settings, loaded by our builders.

- Phi-3.5-mini: head dim 96 (4 heads of Phi-3.5-mini's 32: dim 384), MLP 1024, vocab 32064, RMSNorm eps 1e-5, rope
  theta 10,000, LongRoPE (original context 4096 extended to 131,072: attention factor 1.19), untied output.
  LongRoPE's 48 short / long factors are made up here (the real ones are checkpoint data our builder reads from the
  checkpoint's ``config.json``; the code path is the same).
- Phi-3.5-mini past the original context: the same with ``original_max_position_embeddings`` 64 < the 128 tokens
  fed, so transformers and we take the long factors.
- Phi-3-mini-4k: plain RoPE (torchtune's own ``lora_phi3_mini`` layout).
- Phi-4-mini: 3 query / 1 key-value heads of dim 128 (Phi-4-mini's 24 / 8), RoPE on the first 96 dims
  (``partial_rotary_factor`` 0.75), LongRoPE, output tied to the embedding; vocab 4096 instead of 200,064 (the
  vocabulary size changes no code path; the checkpoint stays small).

Checked: the unquantized torchtune-layout model that ``torchtune_builder_for`` picks for each ``config.json`` (our
``lora_phi``; for Phi-3-mini also torchtune's ``lora_phi3``) gives transformers' logits; the fused ``qkv_proj`` /
``gate_up_proj`` split into exactly transformers' q/k/v and gate/up rows and concatenate back bit for bit; and
``configs/phi3/mini_qlora_single_device.yaml`` (2 layers, the tiny tokenizer and data set) trains a few fp32 steps:
before training our NF4 model gives the logits of transformers on the dequantized NF4 weights, after training the
merged folder (transformers) and the PEFT adapter on ``qkv_proj`` / ``gate_up_proj`` (peft, on the dequantized base)
give the recipe model's logits; Phi-4-mini (GQA, partial rotary, tied) goes the same way through our QLoRA model
with random adapters on every projection, LoRA and DoRA; a random Phi base we write has transformers' keys and
shapes. Bad input: a Phi-3.5 checkpoint for a plain-RoPE Phi model (torchtune's ``qlora_phi3_mini`` layout), or with
another geometry, or DoRA on part of a fused module, fails in ``validate`` (file headers only) naming the config
keys.

Tolerance: 2e-5 absolute + 1e-5 relative on logits of magnitude ~1-4 (measured differences ~2e-6: the same fp32
function in a different order of operations). Dropping LongRoPE (plain RoPE) moves the logits by far more
(asserted), as does the adapter.
"""

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import transformers
from _hf_runner import hf_logits
from _tiny_recipe import run_recipe, tiny_training_args
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from test_hf_peft_interop import _ours
from torchtune.models.phi3 import lora_phi3

from torchtune_ext.checkpoint import HFConverter, QLoRAHFCheckpointer, read_hf_config
from torchtune_ext.generation import load_model_with_adapter
from torchtune_ext.models import lora_phi, qlora_phi3_5_mini, torchtune_builder_for

pytestmark = [pytest.mark.integration_test, pytest.mark.stack]
_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

CONFIG = "configs/phi3/mini_qlora_single_device.yaml"
NUM_LAYERS = 2
STEPS = 3
SEQ_LEN = 128
ATOL, RTOL = 2e-5, 1e-5
RUN_TIMEOUT_S = 600

_HALF = 48  # rotated frequencies of a 96-dim head
_LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(_HALF)],
    "long_factor": [1.0 + 1.3 * i for i in range(_HALF)],
}
#: Phi-3.5-mini-instruct's config.json but for its width (4 of its 32 heads), layers and LongRoPE factor values.
PHI3_5_MINI: Dict[str, Any] = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=32064,
    max_position_embeddings=131072,
    original_max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=_LONGROPE,
    tie_word_embeddings=False,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=32000,
    pad_token_id=32000,
)
VARIANTS: Dict[str, Dict[str, Any]] = {
    "phi3_5_mini": PHI3_5_MINI,
    "phi3_5_mini_long": {**PHI3_5_MINI, "original_max_position_embeddings": 64},
    "phi3_mini_4k": {**PHI3_5_MINI, "rope_scaling": None, "max_position_embeddings": 4096},
    "phi4_mini": {
        **PHI3_5_MINI,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "vocab_size": 4096,
        "partial_rotary_factor": 0.75,
        # 48 factors again: RoPE on 96 of each head's 128 dims (transformers 5 checks it inside rope_parameters;
        # 4.x refuses a rope_scaling with more than its three keys and reads the top-level factor)
        "rope_scaling": {**_LONGROPE, **({"partial_rotary_factor": 0.75} if _TRANSFORMERS_5 else {})},
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    },
}


def _write(folder: Path, hf_config: Dict[str, Any]) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**hf_config, num_hidden_layers=NUM_LAYERS))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("phi3")


@pytest.fixture(scope="module")
def bases(workdir) -> Dict[str, Path]:
    """transformers writes one checkpoint per variant (fp32, fused qkv_proj / gate_up_proj)."""
    return {name: _write(workdir / name, config) for name, config in VARIANTS.items()}


def _input_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))


def _converted(base: Path, model: torch.nn.Module, model_type: str) -> Dict[str, torch.Tensor]:
    converter = HFConverter.for_model(model_type, model)
    state = {}
    for key, value in load_file(base / "model.safetensors").items():
        state.update(converter.to_tune_all(key, value))
    return state


@torch.no_grad()
def _unquantized_logits(base: Path, input_ids: torch.Tensor, builder=None, **arch_overrides) -> torch.Tensor:
    """The fp32 torchtune-layout model for the checkpoint's config.json, its weights converted from HF."""
    picked, args, model_type = torchtune_builder_for(read_hf_config(base))
    model = (builder or picked)(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16, **{**args, **arch_overrides})
    missing, unexpected = model.load_state_dict(_converted(base, model, model_type), strict=False)
    assert not unexpected and all("lora" in k for k in missing), (unexpected, missing)
    return model.eval()(input_ids)  # lora_b starts at zero: the base model's logits


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unquantized_logits_equal_transformers(variant, bases, workdir):
    base = bases[variant]
    input_ids = _input_ids(VARIANTS[variant]["vocab_size"])
    hf, report = hf_logits(input_ids, [{"name": "base", "model": str(base)}], workdir / f"hf_{variant}")
    assert report["base"]["class"] == "Phi3ForCausalLM"
    assert report["base"]["tied"] == VARIANTS[variant]["tie_word_embeddings"]
    ours = _unquantized_logits(base, input_ids)
    torch.testing.assert_close(ours, hf["base"], atol=ATOL, rtol=RTOL)
    if VARIANTS[variant]["rope_scaling"] is None:  # Phi-3-mini-4k: torchtune's own builder too
        ours_only = ("partial_rotary_factor", "rope_scaling", "tie_word_embeddings")
        torchtune_phi3 = lambda *a, **k: lora_phi3(*a, **{n: v for n, v in k.items() if n not in ours_only})  # noqa: E731
        torch.testing.assert_close(
            _unquantized_logits(base, input_ids, builder=torchtune_phi3), hf["base"], atol=ATOL, rtol=RTOL
        )
    else:  # LongRoPE matters at these positions: plain RoPE would fail the comparison above
        plain = _unquantized_logits(base, input_ids, rope_scaling=None)
        assert (plain - hf["base"]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("variant", ["phi3_5_mini", "phi4_mini"])
def test_fused_qkv_and_gate_up_split_into_transformers_rows_and_fuse_back(variant, bases):
    """q/k/v rows by the head geometry (GQA for Phi-4-mini), gate/up by halves; the merged layout is the file's."""
    base, config = bases[variant], VARIANTS[variant]
    hf = load_file(base / "model.safetensors")
    builder, args, model_type = torchtune_builder_for(read_hf_config(base))
    with torch.device("meta"):
        model = builder(["q_proj"], lora_rank=8, lora_alpha=16, **args)
    converter = HFConverter.for_model(model_type, model)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    qkv = hf["model.layers.1.self_attn.qkv_proj.weight"]
    split = dict(converter.to_tune_all("model.layers.1.self_attn.qkv_proj.weight", qkv))
    assert list(split) == [f"layers.1.attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(split["layers.1.attn.q_proj.weight"], qkv[:q])
    assert torch.equal(split["layers.1.attn.k_proj.weight"], qkv[q : q + kv])
    assert torch.equal(split["layers.1.attn.v_proj.weight"], qkv[q + kv :])
    gate_up = hf["model.layers.0.mlp.gate_up_proj.weight"]
    mlp = dict(converter.to_tune_all("model.layers.0.mlp.gate_up_proj.weight", gate_up))
    inter = config["intermediate_size"]
    assert torch.equal(mlp["layers.0.mlp.w1.weight"], gate_up[:inter])
    assert torch.equal(mlp["layers.0.mlp.w3.weight"], gate_up[inter:])

    state = _converted(base, model, model_type)
    groups = converter.hf_groups({k: v.shape for k, v in state.items()})
    assert set(groups) == set(hf) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    for hf_key, (keys, shape) in groups.items():
        key, tensor = converter.group_to_hf({k: state[k] for k in keys})
        assert key == hf_key and tensor.shape == shape and torch.equal(tensor, hf[hf_key]), hf_key


def _validate(base: Path, model: torch.nn.Module, out: Path, model_type: str = "PHI3_MINI") -> None:
    QLoRAHFCheckpointer(str(base), str(out), model_type).validate(model)


def test_mismatched_checkpoints_fail_in_validate_naming_the_config_keys(bases, workdir):
    base = bases["phi3_5_mini"]
    # A plain-RoPE Phi model (torchtune's Phi-3-mini-4k layout) for a Phi-3.5 (LongRoPE) checkpoint: every weight
    # fits, the RoPE does not.
    args = torchtune_builder_for(read_hf_config(base))[1]
    with torch.device("meta"):
        model = lora_phi(["q_proj"], lora_rank=8, lora_alpha=16, **{**args, "rope_scaling": None})
    with pytest.raises(ValueError, match=r"rope_scaling of type 'longrope'.*model.rope_scaling_config"):
        _validate(base, model, workdir / "out_plain")
    # The shipped Phi-3.5 builder without the LongRoPE factors' config.json named: the same error.
    model = qlora_phi3_5_mini(
        ["q_proj"], num_layers=NUM_LAYERS, embed_dim=384, num_heads=4, num_kv_heads=4, intermediate_dim=1024
    )
    with pytest.raises(ValueError, match=r"model.rope_scaling_config"):
        _validate(base, model, workdir / "out_plain2")
    # Another checkpoint's LongRoPE factors.
    other = workdir / "other_config.json"
    edited = read_hf_config(base)
    edited["rope_parameters" if _TRANSFORMERS_5 else "rope_scaling"]["long_factor"][0] = 1.5
    other.write_text(json.dumps(edited))
    model = qlora_phi3_5_mini(
        ["q_proj"],
        num_layers=NUM_LAYERS,
        embed_dim=384,
        num_heads=4,
        num_kv_heads=4,
        intermediate_dim=1024,
        rope_scaling_config=str(other),
    )
    with pytest.raises(ValueError, match=r"short_factor / long_factor differ.*model.rope_scaling_config"):
        _validate(base, model, workdir / "out_other")
    # Phi-4-mini's checkpoint (GQA, tied, partial rotary) for the Phi-3.5 geometry: heads, tying and RoPE named.
    model = qlora_phi3_5_mini(
        ["q_proj"],
        num_layers=NUM_LAYERS,
        embed_dim=384,
        num_heads=4,
        num_kv_heads=4,
        intermediate_dim=1024,
        vocab_size=4096,
        rope_scaling_config=str(bases["phi4_mini"] / "config.json"),
    )
    with pytest.raises(ValueError) as error:
        _validate(bases["phi4_mini"], model, workdir / "out_phi4")
    message = str(error.value)
    assert "num_attention_heads=3" in message and "num_key_value_heads=1" in message
    assert "tie_word_embeddings" in message and "partial_rotary_factor=0.75" in message
    # A Llama model type for a Phi checkpoint.
    with pytest.raises(ValueError, match=r"model_type 'phi3'.*checkpointer.model_type=LLAMA3_2"):
        _validate(base, model, workdir / "out_llama", "LLAMA3_2")


def _train(out: Path, base: Path) -> Any:
    """A few fp32 CPU steps of the shipped config on the 2-layer checkpoint, the tiny tokenizer and data set."""
    args = [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        "checkpointer.checkpoint_files=[model.safetensors]",
        f"model.num_layers={NUM_LAYERS}",
        "model.embed_dim=384",
        "model.num_heads=4",
        "model.num_kv_heads=4",
        "model.intermediate_dim=1024",
        *tiny_training_args(out, STEPS),
    ]
    cfg = run_recipe(CONFIG, args, RUN_TIMEOUT_S)
    OmegaConf.resolve(cfg)
    return cfg


@pytest.fixture(scope="module")
def trained(bases, workdir):
    """Our logits after and before training, and transformers' / peft's on the exported folders."""
    base, run_dir = bases["phi3_5_mini"], workdir / "run"
    input_ids = _input_ids(PHI3_5_MINI["vocab_size"])
    cfg = _train(run_dir, base)
    ours, untrained, dequantized = _ours(cfg, run_dir, input_ids, None)
    step = run_dir / f"step_{STEPS}"
    runs = [
        {"name": "dequantized", "model": str(dequantized)},
        {"name": "merged", "model": str(step / "merged")},
        {"name": "peft", "model": str(dequantized), "adapter": str(step / "adapter")},
    ]
    hf, report = hf_logits(input_ids, runs, workdir / "hf_trained")
    return ours, untrained, hf, report, step, cfg, dequantized


def test_nf4_logits_equal_transformers_on_the_dequantized_weights(trained):
    _, untrained, hf, report, *_ = trained
    assert report["dequantized"]["class"] == "Phi3ForCausalLM" and not report["dequantized"]["tied"]
    torch.testing.assert_close(untrained, hf["dequantized"], atol=ATOL, rtol=RTOL)


def test_merged_model_and_fused_adapter_in_transformers_and_peft_give_the_recipe_logits(trained):
    ours, untrained, hf, report, step, *_ = trained
    assert (ours - untrained).abs().max() > 1000 * ATOL  # the adapter trained: a dropped one would fail
    assert report["merged"]["class"] == "Phi3ForCausalLM"
    torch.testing.assert_close(hf["merged"], ours, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(hf["peft"], ours, atol=ATOL, rtol=RTOL)
    # The adapter targets transformers' fused modules: rank 2r on qkv_proj (q and v adapted, k's rows of lora_B
    # zero) and on gate_up_proj (the config's rank r=16, alpha 32).
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert config["r"] == 16 and config["rank_pattern"] == {"qkv_proj": 32, "gate_up_proj": 32}
    assert config["alpha_pattern"] == {"qkv_proj": 64, "gate_up_proj": 64}
    b = load_file(step / "adapter" / "adapter_model.safetensors")[
        "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"
    ]
    assert b.shape == (3 * 384, 32) and not b[384:768].any() and b[:384, :16].any() and not b[:384, 16:].any()


def test_fused_adapter_loads_back_with_the_training_model_section(trained, bases):
    """Generation / eval's ``adapter_dir``: the base streamed into NF4 plus the fused adapter split back into the
    q/v and w1/w3 LoRAs gives the recipe model's logits (and peft's), greedy tokens included."""
    ours, _, hf, _, step, cfg, _ = trained
    base, adapter = bases["phi3_5_mini"], step / "adapter"
    input_ids = _input_ids(PHI3_5_MINI["vocab_size"])
    loaded = load_model_with_adapter(base, adapter, model=cfg.model, dtype="fp32")
    with torch.no_grad():
        logits = loaded(input_ids)
    torch.testing.assert_close(logits, ours, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits, hf["peft"], atol=ATOL, rtol=RTOL)
    assert torch.equal(logits.argmax(-1), ours.argmax(-1))
    # Which two of q/k/v trained (rank 2r on qkv_proj) only the training config says: without it, a clear error.
    with pytest.raises(ValueError, match=r"qkv_proj has rank 2 x r: 2 of \['q_proj', 'k_proj', 'v_proj'\].*model"):
        load_model_with_adapter(base, adapter, dtype="fp32")
    # Other LoRA modules than the training run's: v_proj's trained rows have no LoRA to go to.
    other = OmegaConf.merge(cfg.model, {"lora_attn_modules": ["q_proj", "k_proj", "output_proj"]})
    with pytest.raises(ValueError, match=r"qkv_proj.lora_B.weight' has nonzero rows for \['v_proj'\]"):
        load_model_with_adapter(base, adapter, model=other, dtype="fp32")


def test_a_peft_lora_shared_by_the_fused_members_loads_without_a_model_section(trained, bases, workdir):
    """PEFT's own adapter on Phi3ForCausalLM (rank r on qkv_proj / gate_up_proj: one lora_A the members share), with
    random weights: built from its adapter_config.json alone, our NF4 model gives peft's logits on the same base."""
    _, _, _, _, _, _, dequantized = trained
    folder, r = workdir / "peft_shared", 8
    folder.mkdir()
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=r, lora_alpha=16, lora_dropout=0.0, bias="none")
    config["target_modules"] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    shapes = {"self_attn.qkv_proj": (3 * 384, 384), "self_attn.o_proj": (384, 384)}
    shapes.update({"mlp.gate_up_proj": (2 * 1024, 384), "mlp.down_proj": (384, 1024)})
    generator = torch.Generator().manual_seed(2)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module, (rows, cols) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, cols, generator=generator) / cols**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, r, generator=generator) * 0.02
    save_file(tensors, folder / "adapter_model.safetensors")
    input_ids = _input_ids(PHI3_5_MINI["vocab_size"])
    hf, _ = hf_logits(input_ids, [{"name": "peft", "model": str(dequantized), "adapter": str(folder)}], folder / "hf")
    loaded = load_model_with_adapter(bases["phi3_5_mini"], folder, dtype="fp32")
    with torch.no_grad():
        logits = loaded(input_ids)
    torch.testing.assert_close(logits, hf["peft"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_phi4_mini_nf4_merged_and_fused_adapter_in_transformers_and_peft(use_dora, bases, workdir):
    """Phi-4-mini (GQA: k/v rows a third of q's, partial rotary, tied output) through our QLoRA model, the streaming
    loader and both exports, with random (nonzero) adapters on every projection; DoRA too (every member of each
    fused module adapted, so the magnitudes stack)."""
    from torchtune_ext.checkpoint import load_base_
    from torchtune_ext.distributed import get_full_state_dict
    from torchtune_ext.models import build_qlora, init_adapters_

    base, name = bases["phi4_mini"], f"phi4_{'dora' if use_dora else 'lora'}"
    builder, args, model_type = torchtune_builder_for(read_hf_config(base))
    modules = ["q_proj", "k_proj", "v_proj", "output_proj"]
    lora = dict(lora_rank=8, lora_alpha=16, apply_lora_to_mlp=True, use_dora=use_dora)
    model = build_qlora(builder, dtype=torch.float32, lora_attn_modules=modules, **lora, **args)
    checkpointer = QLoRAHFCheckpointer(str(base), str(workdir / name), model_type)
    checkpointer.validate(model)
    load_base_(model, checkpointer, torch.device("cpu"))
    init_adapters_(model, "cpu")
    input_ids = _input_ids(VARIANTS["phi4_mini"]["vocab_size"])
    adapter_config = dict(target_modules=[*modules, "w1", "w2", "w3"], rank=8, alpha=16, dropout=0.0, use_dora=use_dora)
    with torch.no_grad():
        untrained = model.eval()(input_ids)
        state = get_full_state_dict(model, keep_nf4=True, cpu_offload=False)
        dequantized = checkpointer.save(state, 0, adapter_config, save_merged=True, dtype=torch.float32) / "merged"
        generator = torch.Generator().manual_seed(1)
        for key, param in model.named_parameters():
            if ".lora_b." in key or key.endswith(".magnitude"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
        ours = model(input_ids)
    state = get_full_state_dict(model, keep_nf4=True, cpu_offload=False)
    step = checkpointer.save(state, 1, adapter_config, save_merged=True, dtype=torch.float32)
    runs = [
        {"name": "dequantized", "model": str(dequantized)},
        {"name": "merged", "model": str(step / "merged")},
        {"name": "peft", "model": str(dequantized), "adapter": str(step / "adapter")},
    ]
    hf, report = hf_logits(input_ids, runs, workdir / f"hf_{name}")
    assert report["merged"]["class"] == "Phi3ForCausalLM" and report["merged"]["tied"]
    assert (ours - untrained).abs().max() > 1000 * ATOL
    torch.testing.assert_close(untrained, hf["dequantized"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(hf["merged"], ours, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(hf["peft"], ours, atol=ATOL, rtol=RTOL)
    # Every member adapted (rank 3r / 2r): the adapter loads back from its adapter_config.json alone.
    loaded = load_model_with_adapter(base, step / "adapter", dtype="fp32")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids), ours, atol=ATOL, rtol=RTOL)


def test_dora_on_part_of_a_fused_module_is_refused_before_loading(bases, workdir):
    base = bases["phi3_5_mini"]
    builder, args, model_type = torchtune_builder_for(read_hf_config(base))
    from torchtune_ext.models import build_qlora

    model = build_qlora(
        builder, lora_attn_modules=["q_proj", "v_proj"], lora_rank=8, lora_alpha=16, use_dora=True, **args
    )
    with pytest.raises(ValueError, match=r"use_dora=True adapts \['q_proj', 'v_proj'\] of Phi's fused qkv_proj"):
        _validate(base, model, workdir / "out_dora")


def test_a_random_phi_base_has_transformers_keys_and_shapes(bases, workdir):
    from torchtune_ext.checkpoint import write_random_hf_checkpoint

    base = bases["phi4_mini"]
    hf_config = read_hf_config(base)
    builder, args, model_type = torchtune_builder_for(hf_config)
    with torch.device("meta"):
        model = builder(["q_proj"], lora_rank=8, lora_alpha=16, **args)
    folder = write_random_hf_checkpoint(workdir / "random_phi4", model, model_type, hf_config, torch.float32)
    ours, theirs = load_file(folder / "model.safetensors"), load_file(base / "model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


def test_the_phi4_mini_config_trains_on_chat_data_through_its_tokenizer(bases, workdir):
    """``configs/phi3/mini_4_qlora_single_device.yaml`` with its own tokenizer component
    (``phi4_mini_tokenizer`` on a small BPE ``tokenizer.json`` with Phi-4-mini's chat tokens) and torchtune's
    ``chat_dataset``: an fp32 CPU step on the 2-layer Phi-4-mini checkpoint trains the adapter (the assistant turn
    is labelled: all-masked labels would leave every lora_B zero), and both exports are written."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = workdir / "phi4_chat"
    folder.mkdir()
    chat = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42."},
    ]
    (folder / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=alphabet)
    tokenizer.train_from_iterator([m["content"] for m in chat], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": special[0], "eos_token": special[0]}))
    # The shipped config less the keys run_recipe drops for the tiny tokenizer; they come back as overrides.
    shipped = OmegaConf.load("configs/phi3/mini_4_qlora_single_device.yaml")
    del shipped.tokenizer["path"], shipped.dataset["packed"]
    OmegaConf.save(shipped, folder / "config.yaml")
    out = folder / "out"
    tiny = [a for a in tiny_training_args(out, STEPS) if not a.startswith(("tokenizer.", "dataset."))]
    args = [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={bases['phi4_mini']}",
        "checkpointer.checkpoint_files=[model.safetensors]",
        f"model.num_layers={NUM_LAYERS}",
        "model.embed_dim=384",
        "model.num_heads=3",
        "model.num_kv_heads=1",
        "model.intermediate_dim=1024",
        "model.vocab_size=4096",
        *tiny,
        f"tokenizer.path={folder / 'tokenizer.json'}",
        "tokenizer.max_seq_len=48",
        "dataset._component_=torchtune.datasets.chat_dataset",
        "dataset.source=json",
        f"dataset.data_files={folder / 'chat.jsonl'}",
        "dataset.conversation_column=messages",
        "dataset.conversation_style=openai",
        "batch_size=1",
    ]
    cfg = run_recipe(str(folder / "config.yaml"), args, RUN_TIMEOUT_S)
    assert cfg.tokenizer._component_ == "torchtune_ext.models.phi4_mini_tokenizer"
    step = out / "step_1"
    adapter = load_file(step / "adapter" / "adapter_model.safetensors")
    lora_b = [tensor for key, tensor in adapter.items() if "lora_B" in key]
    assert lora_b and all(tensor.abs().max() > 0 for tensor in lora_b)
    merged = json.loads((step / "merged" / "config.json").read_text())
    assert merged["tie_word_embeddings"] and merged["num_key_value_heads"] == 1

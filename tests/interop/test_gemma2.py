"""Gemma 2 against transformers: a 3-layer checkpoint written by transformers' ``Gemma2ForCausalLM`` from a
``Gemma2Config`` with Gemma 2's real head dim (256, 8 heads / 4 KV heads: wider than ``hidden_size / heads``), its
RMSNorm eps, RoPE theta, tied embeddings, gelu-tanh MLP and soft-capping values (attention 50, logits 30), a
``query_pre_attn_scalar`` (64) that is not the head dim, and a sliding window of 16 tokens on layers 0 and 2 (the
inputs are 48 tokens long); hidden size 256 and vocab 512 keep it small. Weights are random at std 0.2 (so that
the attention scores and logits reach the caps' nonlinear range) and the norm weights too (transformers starts them
at zero, which would hide a swapped norm).

- unquantized: the model that ``torchtune_builder_for`` picks for the checkpoint's ``config.json`` (our
  ``lora_gemma2``), with the HF weights converted tensor by tensor, gives transformers' logits (eager attention);
  each quirk is shown to matter by building it wrong: no logit capping, no attention capping, no sliding window,
  the head-dim query scaling, unscaled embeddings: each moves the logits far outside the tolerance;
- NF4 and the recipe: ``configs/gemma2/2B_qlora_single_device.yaml`` at these sizes (the tiny tokenizer and data set)
  trains a few fp32 steps; before training our QLoRA model gives the logits of transformers on the dequantized NF4
  weights, and after training the merged folder (``Gemma2ForCausalLM``) and the PEFT adapter on the dequantized base
  (in peft) give the recipe model's logits;
- the loss the recipe uses is the cross-entropy of the capped logits; the adapter loads back for generation
  (``load_model_with_adapter``) with the recipe's logits, and KV-cached decoding gives the uncached tokens;
- ``configs/gemma2/9B_qlora.yaml`` on 2 ranks (gloo) exports a merged folder transformers loads;
- bad input: a config that says another sliding window or layer pattern, or a 9B builder on this checkpoint, fails
  in ``validate`` (before any weight is read) naming the config key.

Tolerance: 1e-4 absolute + 1e-5 relative on logits up to 28 in magnitude (std 3.8): the same fp32 function in
another order of operations, measured max difference 4.4e-5. Each wrongly built quirk moves them by 1.4 (query
scaling) to 20 (logit capping); torchtune's own key mapping (pre/post-MLP norms swapped) by far more than 100x too.
"""

import json
import os
import subprocess
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch
from _hf_runner import ROOT, hf_logits
from _tiny_recipe import TUNE, run_recipe, tiny_training_args
from omegaconf import DictConfig
from safetensors.torch import load_file
from test_hf_peft_interop import _ours

from torchtune_ext.checkpoint import HFConverter, QLoRAHFCheckpointer, read_hf_config
from torchtune_ext.models import lora_gemma2, qlora_gemma2_9b, torchtune_builder_for

pytestmark = [pytest.mark.integration_test, pytest.mark.stack]

CONFIG = "configs/gemma2/2B_qlora_single_device.yaml"
STEPS = 3
SEQ_LEN = 48
ATOL, RTOL = 1e-4, 1e-5
RUN_TIMEOUT_S = 300

#: Gemma 2 2B's config.json but for the sizes (layers, hidden size, MLP, vocab), the window and the query scaling.
GEMMA2_CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    vocab_size=512,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    query_pre_attn_scalar=64,
    sliding_window=16,
    initializer_range=0.2,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
#: the recipe's model overrides for these sizes.
MODEL_ARGS = dict(
    num_layers=3,
    embed_dim=256,
    intermediate_dim=512,
    vocab_size=512,
    sliding_window_size=16,
    query_pre_attn_scalar=64,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemma2")


@pytest.fixture(scope="module")
def base(workdir) -> Path:
    """transformers writes the checkpoint (fp32, tied: no ``lm_head.weight``), norm weights random too."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**GEMMA2_CONFIG))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    folder = workdir / "base"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, GEMMA2_CONFIG["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_base(base, input_ids, workdir) -> torch.Tensor:
    hf, report = hf_logits(input_ids, [{"name": "base", "model": str(base)}], workdir / "hf_base")
    assert report["base"]["class"] == "Gemma2ForCausalLM" and report["base"]["tied"]
    return hf["base"]


@torch.no_grad()
def _unquantized_model(base: Path, **arch_overrides) -> torch.nn.Module:
    """The fp32 torchtune-layout model for the checkpoint's config.json, its weights converted from HF."""
    builder, args, model_type = torchtune_builder_for(read_hf_config(base))
    model = builder(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16, **{**args, **arch_overrides})
    converter = HFConverter.for_model(model_type, model)
    converted = (converter.to_tune(k, v) for k, v in load_file(base / "model.safetensors").items())
    missing, unexpected = model.load_state_dict(dict(c for c in converted if c is not None), strict=False)
    assert not unexpected and all("lora" in k for k in missing), (unexpected, missing)
    return model.eval()  # lora_b starts at zero: the base model


def _unquantized_logits(base: Path, input_ids: torch.Tensor, **arch_overrides) -> torch.Tensor:
    with torch.no_grad():
        return _unquantized_model(base, **arch_overrides)(input_ids)


def test_config_json_picks_the_gemma2_builder_with_its_settings(base):
    builder, args, model_type = torchtune_builder_for(read_hf_config(base))
    assert builder is lora_gemma2 and model_type == "GEMMA2"
    assert args["head_dim"] == 256 and args["query_pre_attn_scalar"] == 64 and args["sliding_window_size"] == 16
    assert (args["attn_logit_softcapping"], args["final_logit_softcapping"]) == (50.0, 30.0)


def test_unquantized_logits_equal_transformers(base, input_ids, hf_base):
    ours = _unquantized_logits(base, input_ids)
    torch.testing.assert_close(ours, hf_base, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "quirk, overrides",
    [
        ("logit soft-capping", dict(final_logit_softcapping=1e9)),
        ("attention soft-capping", dict(attn_logit_softcapping=1e9)),
        ("sliding window", dict(sliding_window_size=10_000)),
        ("query_pre_attn_scalar", dict(query_pre_attn_scalar=256)),
    ],
)
def test_each_gemma2_quirk_matters(base, input_ids, hf_base, quirk, overrides):
    """Building the model without the quirk (a cap or window too large to act, the default query scaling) moves
    the logits far outside the tolerance that the right model meets."""
    wrong = _unquantized_logits(base, input_ids, **overrides)
    assert (wrong - hf_base).abs().max() > 100 * ATOL, quirk


def test_torchtune_s_own_key_mapping_would_swap_the_mlp_norms(base, input_ids, hf_base):
    """torchtune 0.6.1's ``gemma2_hf_to_tune`` loads ``pre_feedforward_layernorm`` into the norm after the MLP and
    ``post_feedforward_layernorm`` into the one before: the corrected mapping is what gives transformers' logits."""
    from torchtune.models.gemma2._convert_weights import gemma2_hf_to_tune

    model = _unquantized_model(base)
    attn = model.layers[0].attn
    geometry = dict(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, dim=256, head_dim=attn.head_dim)
    theirs = gemma2_hf_to_tune(load_file(base / "model.safetensors"), **geometry)
    theirs["norm.scale"] = theirs.pop("norm.rms_norm.scale")
    model.load_state_dict(theirs, strict=False)
    with torch.no_grad():
        assert (model(input_ids) - hf_base).abs().max() > 100 * ATOL


def test_scaled_embeddings_matter(base, input_ids, hf_base):
    """Gemma 2 multiplies the embeddings by sqrt(hidden_size) (16 here) in the compute dtype: without it the
    logits differ."""
    model = _unquantized_model(base)
    assert torch.equal(model.tok_embeddings(input_ids[:, :4]), model.tok_embeddings.weight[input_ids[:, :4]] * 16.0)
    model.tok_embeddings.forward = lambda ids: torch.nn.functional.embedding(ids, model.tok_embeddings.weight)
    with torch.no_grad():
        assert (model(input_ids) - hf_base).abs().max() > 100 * ATOL


def test_logits_are_capped_at_the_final_softcap(base, input_ids):
    """The capped logits stay inside (-30, 30) while the uncapped ones go past: the cap acts on the logits."""
    uncapped = _unquantized_logits(base, input_ids, final_logit_softcapping=1e9)
    capped = _unquantized_logits(base, input_ids)
    assert uncapped.abs().max() > 30.0 > capped.abs().max()


def test_cached_decoding_within_the_window_equals_the_full_forward(base, input_ids):
    """A prefill of 10 tokens then 6 cached steps (the KV cache as long as the 16-token window) give the logits
    of one forward over the 16 tokens; a cache longer than the window is refused (torchtune's attention would
    place the window wrongly past it)."""
    model = _unquantized_model(base)
    tokens = input_ids[:1, :16]
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=16)
        causal = torch.tril(torch.ones(16, 16, dtype=torch.bool))[None]
        steps = [model(tokens[:, :10], mask=causal[:, :10], input_pos=torch.arange(10)[None])]
        for pos in range(10, 16):
            step = slice(pos, pos + 1)
            steps.append(model(tokens[:, step], mask=causal[:, step], input_pos=torch.tensor([[pos]])))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=RTOL)

    model = _unquantized_model(base)
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=32)
    with pytest.raises(ValueError, match="KV cache of 32 tokens.*sliding window \\(16 tokens"):
        model(tokens[:, :1], mask=torch.ones(1, 1, 32, dtype=torch.bool), input_pos=torch.tensor([[0]]))


def test_the_recipe_loss_is_the_cross_entropy_of_the_capped_logits(base, input_ids):
    """``LinearCrossEntropyLoss`` (the configs' loss) projects the hidden state through the model's output, capping
    included, in chunks sized by the real vocabulary: the loss and gradients of the capped logits' cross-entropy."""
    from torchtune_ext.modules import LinearCrossEntropyLoss, use_contiguous_chunks_
    from torchtune_ext.modules.loss import _vocab_size

    model = use_contiguous_chunks_(_unquantized_model(base))  # the decoder class of our QLoRA models
    labels = input_ids.roll(-1, dims=1)
    expected = torch.nn.functional.cross_entropy(model(input_ids).flatten(0, 1), labels.flatten())
    loss_fn = LinearCrossEntropyLoss(chunk_size=32)
    loss_fn.set_model_output(model)
    torch.testing.assert_close(loss_fn(model(input_ids), labels), expected, atol=1e-5, rtol=1e-5)
    uncapped = model.output.projection(model(input_ids)).float()
    assert abs(torch.nn.functional.cross_entropy(uncapped.flatten(0, 1), labels.flatten()) - expected) > 1e-3
    # the automatic chunk sees the vocabulary through the capping (else: 2048 tokens x 256k logits per chunk)
    assert _vocab_size(model.output) == GEMMA2_CONFIG["vocab_size"]


def _train(out: Path, base: Path) -> DictConfig:
    """A few fp32 CPU steps of the shipped 2B config at the checkpoint's sizes, the tiny tokenizer and data set."""
    args = [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        "checkpointer.checkpoint_files=[model.safetensors]",
        *(f"model.{k}={v}" for k, v in MODEL_ARGS.items()),
        *tiny_training_args(out, STEPS),
    ]
    return run_recipe(CONFIG, args, RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def trained(base, input_ids, workdir) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor], Dict, Path]:
    """Our logits after and before training, transformers' / peft's on the exported folders, the step folder."""
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
    return ours, untrained, hf, report, step


def test_nf4_logits_equal_transformers_on_the_dequantized_weights(trained):
    _, untrained, hf, report, _ = trained
    assert report["dequantized"]["class"] == "Gemma2ForCausalLM" and report["dequantized"]["tied"]
    torch.testing.assert_close(untrained, hf["dequantized"], atol=ATOL, rtol=RTOL)


def test_merged_model_and_adapter_in_transformers_and_peft_give_the_recipe_logits(trained):
    ours, untrained, hf, report, step = trained
    assert (ours - untrained).abs().max() > 1000 * ATOL  # the adapter trained: a dropped one would fail
    assert report["merged"]["class"] == "Gemma2ForCausalLM" and report["merged"]["tied"]
    assert json.loads((step / "merged" / "config.json").read_text())["model_type"] == "gemma2"
    adapter_config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    torch.testing.assert_close(hf["merged"], ours, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(hf["peft"], ours, atol=ATOL, rtol=RTOL)


def test_the_adapter_loads_back_for_generation(trained, base, input_ids):
    """``load_model_with_adapter`` (what ``tune-ext generate --base`` runs) builds the model from config.json and the
    PEFT adapter and gives the recipe's logits; greedy decoding with KV caches (chunked prefill) gives the tokens of
    decoding without them."""
    from torchtune_ext.data import tiny_tokenizer
    from torchtune_ext.generation import Generator, SamplingSettings, load_model_with_adapter

    ours, _, _, _, step = trained
    model = load_model_with_adapter(base, step / "adapter", dtype="fp32")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), ours, atol=ATOL, rtol=RTOL)
    generator = Generator(model, tiny_tokenizer(), torch.float32, torch.device("cpu"), prefill_chunk=4)
    prompt = input_ids[0, :10].tolist()
    cached = generator.generate(prompt, SamplingSettings(6, ignore_eos=True))
    uncached = generator.generate(prompt, SamplingSettings(6, ignore_eos=True, use_cache=False))
    assert cached.tokens == uncached.tokens and len(cached.tokens) == 6


def test_frozen_dtype_stores_the_scaled_embedding_in_16_bits(base, input_ids):
    """``frozen_dtype=bf16`` under fp32 compute (the T4 fp32 setting): the table (and so the tied output) is stored
    in bf16, still scaled by sqrt(hidden_size) and capped: the logits of the fp32 model whose table was rounded to
    bf16. Both are the base alone (no adapter: torchtune's Gemma 2 builder needs a LoRA module, ours does not)."""
    from torchtune_ext.generation import load_model_with_adapter

    stored = load_model_with_adapter(base, None, dtype="fp32", frozen_dtype=torch.bfloat16)
    assert stored.tok_embeddings.weight.dtype == torch.bfloat16
    assert stored.output.projection.tied_module is stored.tok_embeddings
    reference = load_model_with_adapter(base, None, dtype="fp32")
    with torch.no_grad():
        reference.tok_embeddings.weight.copy_(reference.tok_embeddings.weight.bfloat16().float())
        torch.testing.assert_close(stored(input_ids), reference(input_ids), atol=ATOL, rtol=RTOL)


def test_the_distributed_config_trains_and_exports(base, input_ids, workdir):
    """``configs/gemma2/9B_qlora.yaml`` at the checkpoint's sizes, 2 ranks over gloo: its merged folder loads as
    ``Gemma2ForCausalLM`` and gives the logits of its base + adapter as our generation loads them."""
    from torchtune_ext.generation import load_model_with_adapter

    out = workdir / "dist"
    args = [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        "checkpointer.checkpoint_files=[model.safetensors]",
        *(f"model.{k}={v}" for k, v in {**MODEL_ARGS, "num_heads": 8, "num_kv_heads": 4}.items()),
        *("dtype=fp32", "device=cpu", "optimizer.fused=False", "batch_size=2", "gradient_accumulation_steps=1"),
        *("max_steps_per_epoch=2", "lr_scheduler.num_warmup_steps=0", "optimizer.lr=3e-3"),
        *("tokenizer._component_=torchtune_ext.data.tiny_tokenizer", "tokenizer.max_seq_len=48", "~tokenizer.path"),
        *("dataset._component_=torchtune_ext.data.tiny_instruct_dataset", "dataset.num_samples=32", "~dataset.packed"),
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs",
    ]
    recipe = ["recipes/qlora_finetune_distributed.py", "--config", "configs/gemma2/9B_qlora.yaml"]
    result = subprocess.run(
        [str(TUNE), "run", "--nproc_per_node", "2", *recipe, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, f"distributed run failed (rc {result.returncode}):\n{result.stderr[-6000:]}"
    hf, report = hf_logits(input_ids, [{"name": "merged", "model": str(out / "step_2" / "merged")}], out / "hf")
    assert report["merged"]["class"] == "Gemma2ForCausalLM" and report["merged"]["tied"]
    with torch.no_grad():
        ours = load_model_with_adapter(base, out / "step_2" / "adapter", dtype="fp32")(input_ids)
    torch.testing.assert_close(hf["merged"], ours, atol=ATOL, rtol=RTOL)


def _copy_with_config(base: Path, folder: Path, **changes) -> Path:
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(base / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**read_hf_config(base), **changes}))
    return folder


def test_a_config_json_with_another_architecture_fails_before_loading(base, workdir, monkeypatch):
    """A window or layer pattern that no weight's shape shows, and a 9B builder on the small checkpoint: each fails
    in validate, before any tensor is read, naming the config key and what the checkpoint holds."""
    from torchtune_ext.checkpoint import _safetensors

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(_safetensors, "read_tensor", no_reads)
    monkeypatch.setattr(_safetensors, "iter_tensors", no_reads)
    model = lora_gemma2(["q_proj"], lora_rank=8, lora_alpha=16, **torchtune_builder_for(read_hf_config(base))[1])
    other = _copy_with_config(base, workdir / "window_4096", sliding_window=4096)
    checkpointer = QLoRAHFCheckpointer(str(other), str(workdir / "out_bad"), "GEMMA2")
    with pytest.raises(ValueError, match=r"sliding_window=4096 but the model has 16"):
        checkpointer.validate(model, "torchtune_ext.models.qlora_gemma2")

    other = _copy_with_config(base, workdir / "all_full", layer_types=["full_attention"] * 3)
    checkpointer = QLoRAHFCheckpointer(str(other), str(workdir / "out_bad"), "GEMMA2")
    with pytest.raises(ValueError, match=r"layer_types\[0\]='full_attention' but the model's layer 0 is 'sliding"):
        checkpointer.validate(model, "torchtune_ext.models.qlora_gemma2")

    big = qlora_gemma2_9b(["q_proj"], device="meta")
    checkpointer = QLoRAHFCheckpointer(str(base), str(workdir / "out_bad"), "GEMMA2")
    with pytest.raises(ValueError, match=r"num_attention_heads=8 but the model has 16 attention heads"):
        checkpointer.validate(big, "torchtune_ext.models.qlora_gemma2_9b")

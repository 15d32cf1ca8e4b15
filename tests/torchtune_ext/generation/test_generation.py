"""Generation with the model as it trained (NF4 base + PEFT adapter): greedy tokens equal transformers' ``generate``
on the ``merge_base=nf4`` merged model (our tiny Llama and Qwen layouts, and a Llama 3.2 checkpoint and LoRA adapter
that transformers and PEFT wrote); KV-cached decoding equals re-running the sequence; sampling is seeded; stop
strings cut; bad adapters fail before any weight is read, naming the file and the mismatch."""

import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_ADAPTER_CONFIG, TINY_LORA, tiny_trained_state
from omegaconf import OmegaConf

from torchtune_ext.checkpoint import llama3_2_hf_config, write_random_hf_checkpoint
from torchtune_ext.data import write_tiny_checkpoint
from torchtune_ext.export import merge_adapter
from torchtune_ext.generation import (
    Generator,
    SamplingSettings,
    kv_cache_bytes,
    load_model_with_adapter,
    read_prompts,
    sample_next_token,
)
from torchtune_ext.models import TINY_LLAMA_ARGS, lora_tiny_llama

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 40


def _trained_run(tmp: Path, family: str) -> Path:
    """The folders a run of the recipe leaves (step_1/adapter, step_1/merged with merge_base=nf4) for a tiny model
    with non-zero adapters, written by the recipe's own checkpointer."""
    base = write_tiny_checkpoint(tmp / "base", family=family, dtype="fp32", seed=3)
    _, checkpointer, state = tiny_trained_state(base, tmp / "out", family)
    return checkpointer.save(state, 1, TINY_ADAPTER_CONFIG, save_merged=True, dtype=torch.float32)


@pytest.fixture(scope="module", params=["llama", "qwen"])
def run(request, tmp_path_factory):
    family = request.param
    step = _trained_run(tmp_path_factory.mktemp(f"gen_{family}"), family)
    model = load_model_with_adapter(step.parents[1] / "base", step / "adapter", dtype="fp32")
    return family, step, model


class _IdsTokenizer:
    """Decodes ids as their numbers (a random model's ids lie beyond the tiny tokenizer's 96 pieces)."""

    eos_id = 2

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _prompt(length: int = 12, seed: int = 0):
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _transformers_greedy(folder: Path, prompt, new_tokens: int):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def _ours_greedy(model, prompt, new_tokens: int, use_cache: bool = True, prefill_chunk: int = 512):
    generator = Generator(model, _IdsTokenizer(), torch.float32, torch.device("cpu"), prefill_chunk=prefill_chunk)
    settings = SamplingSettings(max_new_tokens=new_tokens, ignore_eos=True, use_cache=use_cache)
    return generator.generate(prompt, settings).tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_tokens_equal_transformers_on_the_nf4_merged_model(run, seed):
    _, step, model = run
    prompt = _prompt(seed=seed)
    ours = _ours_greedy(model, prompt, NEW_TOKENS)
    assert len(ours) == NEW_TOKENS
    assert ours == _transformers_greedy(step / "merged", prompt, NEW_TOKENS)


def test_cached_decoding_equals_uncached_argmax(run):
    _, _, model = run
    prompt = _prompt(seed=2)
    uncached = _ours_greedy(model, prompt, 24, use_cache=False)
    assert _ours_greedy(model, prompt, 24, use_cache=True) == uncached
    assert _ours_greedy(model, prompt, 24, use_cache=True, prefill_chunk=5) == uncached  # a prompt in 3 chunks


def test_loader_without_a_model_config_builds_the_adapter_s_model(run):
    """From the base's config.json and the adapter's config (tune-ext, PEFT/Unsloth adapters) = from `model:`."""
    family, step, model = run
    builder = {"llama": "qlora_tiny_llama", "qwen": "qlora_tiny_qwen"}[family]
    cfg = OmegaConf.create({"_component_": f"torchtune_ext.models.{builder}", **TINY_LORA, "lora_alpha": 16})
    from_cfg = load_model_with_adapter(step.parents[1] / "base", step / "adapter", model=cfg, dtype="fp32")
    tokens = torch.tensor([_prompt()])
    torch.testing.assert_close(from_cfg(tokens), model(tokens), rtol=0, atol=0)


def test_transformers_written_llama_3_2_and_peft_adapter(tmp_path):
    """A Llama 3.2-layout checkpoint saved by transformers and a LoRA adapter saved by PEFT: our NF4 + adapter
    greedy tokens equal transformers' on the merge_base=nf4 merged model."""
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        hf.model.embed_tokens.weight.normal_(0, 0.06)
    hf.save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = peft.get_peft_model(hf, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged", merged_dtype="fp32")
    model = load_model_with_adapter(tmp_path / "base", tmp_path / "adapter", dtype="fp32")
    prompt = _prompt(seed=5)
    ours = _ours_greedy(model, prompt, 32)
    assert len(ours) == 32 and ours == _transformers_greedy(merged, prompt, 32)


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    draws = lambda settings: [  # noqa: E731
        int(sample_next_token(logits, settings, torch.Generator().manual_seed(i))) for i in range(200)
    ]
    assert set(draws(SamplingSettings(temperature=1.0, top_k=2))) == {0, 1}
    # softmax: p0 = 0.64, p0 + p1 = 0.87: top_p=0.8 keeps tokens 0 and 1, top_p=0.5 token 0 only
    assert set(draws(SamplingSettings(temperature=1.0, top_p=0.8))) == {0, 1}
    assert set(draws(SamplingSettings(temperature=1.0, top_p=0.5))) == {0}
    generator = torch.Generator().manual_seed(0)
    many = [int(sample_next_token(logits, SamplingSettings(temperature=2.0), generator)) for _ in range(4000)]
    frequencies = torch.bincount(torch.tensor(many), minlength=5) / len(many)
    torch.testing.assert_close(frequencies, (logits[0] / 2.0).softmax(-1), atol=0.03, rtol=0)
    assert draws(SamplingSettings(temperature=0.7, seed=1)) == draws(SamplingSettings(temperature=0.7, seed=1))
    assert int(sample_next_token(logits, SamplingSettings())) == 0  # greedy


def test_stop_strings_cut_the_answer(run):
    _, _, model = run
    generator = Generator(model, _IdsTokenizer(), torch.float32, torch.device("cpu"))
    prompt = _prompt(seed=3)
    full = generator.generate(prompt, SamplingSettings(max_new_tokens=24, ignore_eos=True))
    stop = f"<{full.tokens[10]}>"
    cut = generator.generate(prompt, SamplingSettings(max_new_tokens=24, ignore_eos=True, stop=(stop,)))
    assert cut.stop_reason == "stop_string" and cut.text == full.text[: full.text.find(stop)]


def test_kv_cache_bytes_match_torchtune_s_caches(run):
    _, _, model = run
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=100)
    try:
        cached = sum(b.nbytes for name, b in model.named_buffers() if "kv_cache" in name and "cache_pos" not in name)
    finally:
        from torchtune.modules.common_utils import delete_kv_caches

        delete_kv_caches(model)
    assert cached == kv_cache_bytes(model, 100, torch.float32) > 0


# ------------------------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    return _trained_run(tmp_path_factory.mktemp("bad_adapter"), "llama")


def _spy_load(monkeypatch):
    calls = []
    import torchtune_ext.generation._model as loader

    monkeypatch.setattr(loader, "load_base_", lambda *a, **k: calls.append(a))
    return calls


def test_missing_adapter_fails_naming_the_file(llama_run, tmp_path, monkeypatch):
    calls = _spy_load(monkeypatch)
    adapter = tmp_path / "adapter"
    shutil.copytree(llama_run / "adapter", adapter)
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors not found"):
        load_model_with_adapter(llama_run.parents[1] / "base", adapter)
    with pytest.raises(FileNotFoundError, match="nowhere. is not a folder"):
        load_model_with_adapter(llama_run.parents[1] / "base", tmp_path / "nowhere")
    assert not calls


@pytest.mark.parametrize(
    "model_override, match",
    [
        ({"lora_rank": 16}, r"rank r=8 but the model has lora_rank=16"),
        ({"apply_lora_to_mlp": False}, r"target modules \[.*'w1'.*\] but the model adapts \[.*\]"),
        ({"lora_alpha": 8}, r"lora_alpha=16 but the model has lora_alpha=8"),
    ],
)
def test_mismatched_adapter_fails_before_loading(llama_run, monkeypatch, model_override, match):
    calls = _spy_load(monkeypatch)
    cfg = OmegaConf.create({"_component_": "torchtune_ext.models.qlora_tiny_llama", **TINY_LORA, "lora_alpha": 16})
    cfg.update(model_override)
    with pytest.raises(ValueError, match=match) as error:
        load_model_with_adapter(llama_run.parents[1] / "base", llama_run / "adapter", model=cfg)
    assert str(llama_run / "adapter") in str(error.value)
    assert not calls


def test_adapter_of_another_base_model_fails_before_loading(llama_run, tmp_path, monkeypatch):
    """A base with a wider MLP: the adapter's shapes name the mismatch."""
    args = {**TINY_LLAMA_ARGS, "intermediate_dim": 1024}
    with torch.device("meta"):
        meta = lora_tiny_llama(lora_attn_modules=["q_proj"], intermediate_dim=1024)
    other = write_random_hf_checkpoint(
        tmp_path / "other", meta, "LLAMA3_2", llama3_2_hf_config(**args, dtype=torch.float32), dtype=torch.float32
    )
    calls = _spy_load(monkeypatch)
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: layers.0.mlp.w1.lora_b.weight has shape") as e:
        load_model_with_adapter(other, llama_run / "adapter")
    assert "another base model" in str(e.value) and not calls


def test_prompts_file_errors_name_the_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert read_prompts(str(path)) == ["a", [{"role": "user", "content": "b"}]]
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2 needs \"prompt\""):
        read_prompts(str(path))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"use_rslora": True}, "use_rslora=True"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"target_modules": ["q_proj", "gate_proj"]}, "LoRA on part of the MLP"),
        ({"target_modules": "all-linear"}, "a list of module names is needed"),
    ],
)
def test_unsupported_peft_settings_fail_naming_the_file(llama_run, tmp_path, monkeypatch, change, match):
    import json

    calls = _spy_load(monkeypatch)
    adapter = tmp_path / "adapter"
    shutil.copytree(llama_run / "adapter", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=match) as error:
        load_model_with_adapter(llama_run.parents[1] / "base", adapter)
    assert str(adapter / "adapter_config.json") in str(error.value) and not calls

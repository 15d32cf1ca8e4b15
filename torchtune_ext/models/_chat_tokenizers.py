"""Each family's model tokenizer with its published chat format: a generation prompt ends with the assistant header
and nothing after it (transformers' ``apply_chat_template(..., add_generation_prompt=True)``), the end of every
assistant turn is trained at any ``max_seq_len``, generation stops at the family's end-of-turn tokens, and a
tokenizer file without the family's chat tokens or a prompt template of another family is refused when built.

Why these subclasses of torchtune 0.6.1's tokenizers (the config's ``tokenizer._component_`` names the builders):

- ``Qwen2Tokenizer`` / ``Qwen2_5Tokenizer`` (SmolLM2, Qwen 2.5, Qwen3): ``__call__`` ignores ``inference``, so a
  prompt ends ``<|im_start|>assistant\\n<|im_end|>``; with ``max_seq_len`` set, the final ``<|im_end|>`` is masked
  out of the labels (upstream torchtune issue 2792); the default system message of the SmolLM2 and Qwen 2.5
  templates is missing. Here the sequence is the template's, ``<|im_end|>\\n`` closing every turn.
- ``Phi3MiniTokenizer``: an inference prompt ends ``<|assistant|>\\n<|end|>\\n``; turns are split by ``</s><s>``
  and the whole starts with ``<s>``, which Phi-3's template does not write; generation does not stop at ``<|end|>``.
- ``GemmaTokenizer``: no chat format (Gemma 2's ``<start_of_turn>``/``<end_of_turn>`` turns) and ``__call__``
  ignores ``inference`` (a prompt ends with ``<eos>``); generation does not stop at ``<end_of_turn>``.
- ``Llama2Tokenizer`` / ``MistralTokenizer`` with their ``[INST]`` templates: the pieces of a turn are encoded apart
  (``" [/INST]"`` gets a second "▁"), the spaces Llama-2-chat's template writes around an answer are dropped,
  Mistral's gets ``<s>`` before every turn where its template writes one at the start, ``MistralTokenizer`` ignores
  ``inference`` (a prompt ends ``[/INST]</s>``), ``Llama2Tokenizer`` at inference leaves out the ``</s>`` closing
  each earlier answer, and with ``max_seq_len`` set both put ``</s>`` over the last token of every sample.
- ``Llama3Tokenizer``: Llama 3.1 / 3.2 / 3.3-Instruct's templates open every conversation with a system turn that
  holds ``Cutting Knowledge Date: December 2023`` and ``Today Date: {date_string}`` before the system message (none
  given: an empty one); torchtune writes none, and ends a sample with ``<|end_of_text|>``, which the templates do not.

Every truncation here is a plain cut at ``max_seq_len`` (as transformers / TRL truncate): the labels of the tokens
kept are those of the untruncated sample.
"""

import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import regex
from torchtune.data import Message
from torchtune.data._prompt_templates import _TemplateType
from torchtune.models.gemma import GemmaTokenizer
from torchtune.models.llama3 import Llama3Tokenizer
from torchtune.models.phi3 import Phi3MiniTokenizer
from torchtune.models.phi3._tokenizer import PHI3_SPECIAL_TOKENS
from torchtune.models.qwen2 import Qwen2Tokenizer
from torchtune.models.qwen2._tokenizer import QWEN2_SPECIAL_TOKENS
from torchtune.models.qwen2_5._tokenizer import (
    QWEN2_5_SPECIAL_TOKENS,  # noqa: I001
    Qwen2_5Tokenizer,
)
from torchtune.modules.transforms.tokenizers import parse_hf_tokenizer_json

from torchtune_ext.config import ConfigError
from torchtune_ext.models._chat_format import (
    CHAT_TOKENS,
    _cut,
    _missing_chat_tokens,
    _open_end,
    _template,
    _text,
)

#: the default system message of SmolLM2-Instruct's chat template (its ``tokenizer_config.json``), written when a
#: conversation has none.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#: the default system message of Qwen2.5-Instruct's chat template (its ``tokenizer_config.json``).
QWEN2_5_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

#: Llama 3.1-Instruct's (and 3.3's) ``date_string`` default; Llama 3.2's template writes today's date instead, which
#: would make samples depend on the day: the same fixed date is used for every Llama 3.x.
LLAMA3_DATE_STRING = "26 Jul 2024"


class _ChatMLMixin:
    """ChatML turns as SmolLM2's and Qwen's templates write them:
    ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, the default system message first when the
    conversation has none, and a generation prompt ending ``<|im_start|>assistant\n``."""

    default_system: Optional[str] = None

    def tokenize_messages(self, messages: List[Message], *, add_eos: bool = True) -> Tuple[List[int], List[bool]]:
        """
        Args:
            messages (List[Message]): the conversation.
            add_eos (bool): False (inference): a last assistant message stays open (no ``<|im_end|>``).

        Returns:
            Tuple[List[int], List[bool]]: tokens and masks (True: not trained on), cut at ``max_seq_len``.
        """
        messages = list(messages)
        if self.default_system is not None and messages and messages[0].role != "system":
            masked = messages[0].masked if messages[0].role != "assistant" else True
            messages.insert(0, Message(role="system", content=self.default_system, masked=masked))
        # torchtune's without its end token: the last assistant message lacks its footer; the cut is plain
        tokens, mask = super().tokenize_messages(messages, add_eos=False)
        last = messages[-1]
        if add_eos and last.role == "assistant" and not (self.max_seq_len and len(tokens) >= self.max_seq_len):
            end = [self.im_end_id, *self.encode("\n", add_bos=False, add_eos=False)]
            tokens, mask = tokens + end, mask + [last.masked] * len(end)
        return _cut(tokens, mask, self.max_seq_len)

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replaces ``sample["messages"]`` with their ``tokens`` and ``mask`` (``inference``: the last assistant
        message stays open)."""
        messages = sample.pop("messages")
        sample["tokens"], sample["mask"] = self.tokenize_messages(messages, add_eos=not inference)
        return sample


#: SmolLM2's pre-tokenizer (its ``tokenizer.json``): every digit on its own (``Digits(individual_digits=True)``), then
#: GPT-2's byte-level split of each piece. torchtune's Qwen2 split differs (``"\n\n"`` one piece, not two).
_DIGIT = regex.compile(r"(\p{N})")
_GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


class SmolLM2Tokenizer(_ChatMLMixin, Qwen2Tokenizer):
    """torchtune's ``Qwen2Tokenizer`` with SmolLM2-Instruct's chat template (see the module docstring) and its own
    pre-tokenizer (digits one by one, then GPT-2's split)."""

    default_system = SMOLLM2_DEFAULT_SYSTEM

    def _tokenize(self, text: str) -> List[str]:
        pieces = (piece for part in _DIGIT.split(text) if part for piece in _GPT2_SPLIT.findall(part))
        byte_pieces = ("".join(self.byte_encoder[b] for b in piece.encode("utf-8")) for piece in pieces)
        return [token for piece in byte_pieces for token in self._bpe(piece).split(" ")]


class Qwen2_5ChatTokenizer(_ChatMLMixin, Qwen2_5Tokenizer):  # noqa: N801
    """torchtune's ``Qwen2_5Tokenizer`` with Qwen2.5-Instruct's chat template (see the module docstring)."""

    default_system = QWEN2_5_DEFAULT_SYSTEM


class Qwen3ChatTokenizer(_ChatMLMixin, Qwen2_5Tokenizer):
    """torchtune's ``Qwen2_5Tokenizer`` with Qwen3's chat template: no default system message; an answer after the
    last user message is written ``<think>\n{reasoning}\n</think>\n\n{answer}`` (the last answer always, with an
    empty block when it has no reasoning), an earlier answer without its reasoning; the generation prompt is the
    template's default (thinking on), ``<|im_start|>assistant\n``."""

    def tokenize_messages(self, messages: List[Message], *, add_eos: bool = True) -> Tuple[List[int], List[bool]]:
        """
        Args:
            messages (List[Message]): the conversation (an answer's reasoning, if any, in ``<think>...</think>``
                before it).
            add_eos (bool): False (inference): a last assistant message stays open (no ``<|im_end|>``, no
                ``<think>`` block).

        Returns:
            Tuple[List[int], List[bool]]: tokens and masks (True: not trained on), cut at ``max_seq_len``.
        """
        return super().tokenize_messages(_qwen3_answers(messages, _open_end(messages, add_eos)), add_eos=add_eos)


def _qwen3_answers(messages: Sequence[Message], open_end: bool) -> List[Message]:
    """The assistant contents Qwen3's template writes (its ``reasoning_content`` taken from ``<think>...</think>``
    in the content, as the template does)."""
    users = [index for index, message in enumerate(messages) if message.role == "user"]
    last_query = users[-1] if users else len(messages) - 1
    written = []
    for index, message in enumerate(messages):
        last = index == len(messages) - 1
        if message.role != "assistant" or (open_end and last):
            written.append(message)
            continue
        content, reasoning = _text(message), ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if index > last_query and (last or reasoning):
            content = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        written.append(
            Message(role="assistant", content=content, masked=message.masked, ipython=message.ipython, eot=message.eot)
        )
    return written


def _chatml_tokenizer(
    cls: Callable[..., Any],
    family: str,
    defaults: Dict[str, int],
    path: str,
    merges_file: Optional[str],
    special_tokens_path: Optional[str],
    max_seq_len: Optional[int],
    prompt_template: Optional[_TemplateType],
    **kwargs: Any,
) -> Any:
    """Builds a ChatML tokenizer after checking its special tokens against ``vocab.json``: the chat tokens must be
    there, and a token that ``vocab.json`` holds too must have the same id (SmolLM2's ``<|im_start|>`` is 1, not
    torchtune's default 151644)."""
    special = defaults if special_tokens_path is None else parse_hf_tokenizer_json(special_tokens_path)
    fix = "set tokenizer.special_tokens_path to the chat model's tokenizer.json (beside its vocab.json)."
    _missing_chat_tokens(family, special, "tokenizer.special_tokens_path", fix)
    with open(path, encoding="utf-8") as handle:
        vocab = json.load(handle)
    for token, token_id in special.items():
        if vocab.get(token, token_id) != token_id:
            source = special_tokens_path or "unset: torchtune's Qwen ids"
            raise ConfigError(
                f"tokenizer.special_tokens_path ({source}) gives {token} id {token_id}, tokenizer.path={path} "
                f"{vocab[token]}; {fix}",
                "tokenizer.special_tokens_path",
            )
    return cls(
        path=path,
        merges_file=merges_file,
        special_tokens=special,
        max_seq_len=max_seq_len,
        prompt_template=_template(prompt_template, family),
        **kwargs,
    )


_CHATML_ARGS = """
    Args:
        path (str): ``vocab.json``.
        merges_file (Optional[str]): ``merges.txt``.
        special_tokens_path (Optional[str]): the model's ``tokenizer.json`` (its special tokens and their ids);
            None: torchtune's defaults (Qwen's ids).
        max_seq_len (Optional[int]): samples are cut at this length.
        prompt_template (Optional[_TemplateType]): a task template applied to the messages first (not a chat
            format: the tokenizer writes ChatML itself).
        **kwargs (Any): the rest of torchtune's ``Qwen2Tokenizer`` arguments.

    Raises:
        ConfigError: if the special tokens lack ``<|im_start|>``/``<|im_end|>`` or disagree with ``vocab.json``, or
            ``prompt_template`` is a chat format.
"""


def smollm2_tokenizer(
    path: str,
    merges_file: Optional[str] = None,
    special_tokens_path: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[_TemplateType] = None,
    **kwargs: Any,
) -> SmolLM2Tokenizer:
    return _chatml_tokenizer(
        SmolLM2Tokenizer, "smollm2", QWEN2_SPECIAL_TOKENS, path, merges_file, special_tokens_path, max_seq_len,
        prompt_template, **kwargs,
    )  # fmt: skip


def qwen2_5_tokenizer(
    path: str,
    merges_file: Optional[str] = None,
    special_tokens_path: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[_TemplateType] = None,
    **kwargs: Any,
) -> Qwen2_5ChatTokenizer:
    return _chatml_tokenizer(
        Qwen2_5ChatTokenizer, "qwen2_5", QWEN2_5_SPECIAL_TOKENS, path, merges_file, special_tokens_path, max_seq_len,
        prompt_template, **kwargs,
    )  # fmt: skip


def qwen3_tokenizer(
    path: str,
    merges_file: Optional[str] = None,
    special_tokens_path: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[_TemplateType] = None,
    **kwargs: Any,
) -> Qwen3ChatTokenizer:
    return _chatml_tokenizer(
        Qwen3ChatTokenizer, "qwen3", QWEN2_5_SPECIAL_TOKENS, path, merges_file, special_tokens_path, max_seq_len,
        prompt_template, **kwargs,
    )  # fmt: skip


smollm2_tokenizer.__doc__ = "SmolLM2-Instruct's tokenizer (:class:`SmolLM2Tokenizer`).\n" + _CHATML_ARGS
qwen2_5_tokenizer.__doc__ = "Qwen2.5-Instruct's tokenizer (:class:`Qwen2_5ChatTokenizer`).\n" + _CHATML_ARGS
qwen3_tokenizer.__doc__ = "Qwen3's tokenizer (:class:`Qwen3ChatTokenizer`).\n" + _CHATML_ARGS


class Phi3ChatTokenizer(Phi3MiniTokenizer):
    """torchtune's ``Phi3MiniTokenizer`` writing Phi-3.5-mini-instruct's chat template (its
    ``tokenizer_config.json``): ``<|role|>\n{content}<|end|>\n`` per message, no ``<s>``, ``<|endoftext|>`` once at
    the end of a training sample, a generation prompt ending ``<|assistant|>\n``; generation stops at ``<|end|>``
    too (its ``generation_config.json``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.stop_tokens = [self.eos_id, self.special_tokens["<|end|>"]]

    def tokenize_messages(
        self, messages: List[Message], *, add_eos: bool = True, ignore_system_prompt: bool = False
    ) -> Tuple[List[int], List[bool]]:
        """
        Args:
            messages (List[Message]): the conversation.
            add_eos (bool): False (inference): a last assistant message stays open (no ``<|end|>``).
            ignore_system_prompt (bool): leave system messages out.

        Returns:
            Tuple[List[int], List[bool]]: tokens and masks (True: not trained on), cut at ``max_seq_len``.
        """
        templated = self.prompt_template(messages) if self.prompt_template is not None else messages
        open_end = _open_end(templated, add_eos)
        newline = self.encode("\n", add_bos=False, add_eos=False)
        tokens: List[int] = []
        mask: List[bool] = []
        for index, message in enumerate(templated):
            text = _text(message)
            if message.role == "system" and (ignore_system_prompt or not text):
                continue  # the template writes no empty system message
            role = self.special_tokens.get(f"<|{message.role}|>")
            if role is None:
                raise ValueError(f"Phi-3 has no chat role {message.role!r}: use system, user or assistant.")
            # torchtune's content encoding (trailing spaces cut, leading whitespace trimmed as transformers does)
            content = self.encode(text.rstrip(" "), add_bos=False, add_eos=False, trim_leading_whitespace=True)
            ids = [role, *newline, *(content if text else [])]
            if not (open_end and index == len(templated) - 1):
                ids += [self.special_tokens["<|end|>"], *newline]
            tokens, mask = tokens + ids, mask + [message.masked] * len(ids)
        if add_eos and templated:
            tokens, mask = tokens + [self.eos_id], mask + [templated[-1].masked]
        return _cut(tokens, mask, self.max_seq_len)

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replaces ``sample["messages"]`` with their ``tokens`` and ``mask`` (``inference``: the last assistant
        message stays open)."""
        messages = sample.pop("messages")
        sample["tokens"], sample["mask"] = self.tokenize_messages(messages, add_eos=not inference)
        return sample


def phi3_mini_tokenizer(
    path: str,
    special_tokens_path: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[_TemplateType] = None,
) -> Phi3ChatTokenizer:
    """Phi-3 / Phi-3.5-mini's tokenizer (:class:`Phi3ChatTokenizer`; torchtune's ``phi3_mini_tokenizer`` keys).

    Args:
        path (str): ``tokenizer.model``.
        special_tokens_path (Optional[str]): ``tokenizer.json``; None: torchtune's Phi-3 special tokens.
        max_seq_len (Optional[int]): samples are cut at this length.
        prompt_template (Optional[_TemplateType]): a task template applied to the messages first.

    Returns:
        Phi3ChatTokenizer: the tokenizer.

    Raises:
        ConfigError: if the special tokens lack Phi-3's chat tokens or ``prompt_template`` is a chat format.
    """
    special = None if special_tokens_path is None else parse_hf_tokenizer_json(special_tokens_path)
    fix = "set tokenizer.special_tokens_path to Phi-3's tokenizer.json (or leave it unset)."
    _missing_chat_tokens(
        "phi3", PHI3_SPECIAL_TOKENS if special is None else special, "tokenizer.special_tokens_path", fix
    )
    return Phi3ChatTokenizer(path, special, max_seq_len, _template(prompt_template, "phi3"))


class Gemma2ChatTokenizer(GemmaTokenizer):
    """torchtune's ``GemmaTokenizer`` writing Gemma 2-it's chat template: ``<bos>``, then
    ``<start_of_turn>{user|model}\n{content, trimmed}<end_of_turn>\n`` per message, a generation prompt ending
    ``<start_of_turn>model\n``; generation stops at ``<end_of_turn>`` too (its ``generation_config.json``). Gemma 2
    has no system role (its template refuses one): put the instructions in the first user message."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        processor = self._spm_model.spm_model
        self.start_of_turn_id = processor.piece_to_id("<start_of_turn>")
        self.end_of_turn_id = processor.piece_to_id("<end_of_turn>")
        self.stop_tokens = [self.eos_id, self.end_of_turn_id]

    def tokenize_messages(self, messages: List[Message], *, add_eos: bool = True) -> Tuple[List[int], List[bool]]:
        """
        Args:
            messages (List[Message]): the conversation.
            add_eos (bool): False (inference): a last assistant message stays open (no ``<end_of_turn>``).

        Returns:
            Tuple[List[int], List[bool]]: tokens and masks (True: not trained on), cut at ``max_seq_len``.

        Raises:
            ValueError: for a system message or a role other than user and assistant.
        """
        templated = self.prompt_template(messages) if self.prompt_template is not None else messages
        open_end = _open_end(templated, add_eos)
        tokens, mask = [self.bos_id], [templated[0].masked if templated else True]
        for index, message in enumerate(templated):
            if message.role not in ("user", "assistant"):
                raise ValueError(
                    f"Gemma 2 has no {message.role!r} role (its chat template takes user and assistant turns): put "
                    "system instructions at the start of the first user message."
                )
            role = "model" if message.role == "assistant" else "user"
            ids = [
                self.start_of_turn_id,
                *self.encode(f"{role}\n{_text(message).strip()}", add_bos=False, add_eos=False),
            ]
            if not (open_end and index == len(templated) - 1):
                ids += [self.end_of_turn_id, *self.encode("\n", add_bos=False, add_eos=False)]
            tokens, mask = tokens + ids, mask + [message.masked] * len(ids)
            if self.max_seq_len and len(tokens) >= self.max_seq_len:
                break
        return _cut(tokens, mask, self.max_seq_len)

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replaces ``sample["messages"]`` with their ``tokens`` and ``mask`` (``inference``: the last assistant
        message stays open)."""
        messages = sample.pop("messages")
        sample["tokens"], sample["mask"] = self.tokenize_messages(messages, add_eos=not inference)
        return sample


def gemma_tokenizer(
    path: str, max_seq_len: Optional[int] = None, prompt_template: Optional[_TemplateType] = None
) -> Gemma2ChatTokenizer:
    """Gemma 2's tokenizer (:class:`Gemma2ChatTokenizer`; torchtune's ``gemma_tokenizer`` keys).

    Args:
        path (str): ``tokenizer.model``.
        max_seq_len (Optional[int]): samples are cut at this length.
        prompt_template (Optional[_TemplateType]): a task template applied to the messages first.

    Returns:
        Gemma2ChatTokenizer: the tokenizer.

    Raises:
        ConfigError: if ``tokenizer.model`` lacks ``<start_of_turn>``/``<end_of_turn>`` or ``prompt_template`` is a
            chat format.
    """
    tokenizer = Gemma2ChatTokenizer(path, max_seq_len, _template(prompt_template, "gemma"))
    processor = tokenizer._spm_model.spm_model
    pieces = {token: processor.piece_to_id(token) for token in CHAT_TOKENS["gemma"]}
    present = {token: token_id for token, token_id in pieces.items() if token_id != processor.unk_id()}
    _missing_chat_tokens("gemma", present, "tokenizer.path", "set tokenizer.path to Gemma 2's tokenizer.model.")
    return tokenizer


class Llama3ChatTokenizer(Llama3Tokenizer):
    """torchtune's ``Llama3Tokenizer`` writing Llama 3.1-Instruct's chat template (its ``tokenizer_config.json``; no
    tools): ``<|begin_of_text|>``, a system turn ``Cutting Knowledge Date: December 2023\nToday Date:
    {date_string}\n\n{system message}``, then ``<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>``
    per message; a generation prompt ends ``<|start_header_id|>assistant<|end_header_id|>\n\n``.

    Args:
        *args (Any): torchtune's ``Llama3Tokenizer`` arguments.
        date_string (str): the template's ``date_string``.
        **kwargs (Any): torchtune's ``Llama3Tokenizer`` keyword arguments.
    """

    def __init__(self, *args: Any, date_string: str = LLAMA3_DATE_STRING, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.date_string = date_string

    def tokenize_messages(
        self, messages: List[Message], *, add_end_tokens: bool = True
    ) -> Tuple[List[int], List[bool]]:
        """
        Args:
            messages (List[Message]): the conversation.
            add_end_tokens (bool): False (inference): a last assistant message stays open (no ``<|eot_id|>``).

        Returns:
            Tuple[List[int], List[bool]]: tokens and masks (True: not trained on), cut at ``max_seq_len``.
        """
        templated = list(self.prompt_template(messages) if self.prompt_template is not None else messages)
        system = templated.pop(0) if templated and templated[0].role == "system" else None
        text = f"Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n"
        text += _text(system).strip() if system is not None else ""
        masked = system.masked if system is not None else (templated[0].masked if templated else True)
        header = self._tokenize_header(Message(role="system", content=""))
        ids = [*header, *self.encode(text, add_bos=False, add_eos=False), self.eot_id]
        tokens, mask = [self.bos_id, *ids], [True] + [masked] * len(ids)
        open_end = _open_end(templated, add_end_tokens)
        for index, message in enumerate(templated):
            ids = self.tokenize_message(message, add_end_tokens=not (open_end and index == len(templated) - 1))
            tokens, mask = tokens + ids, mask + [message.masked] * len(ids)
            if self.max_seq_len and len(tokens) >= self.max_seq_len:
                break
        return _cut(tokens, mask, self.max_seq_len)


def llama3_tokenizer(
    path: str,
    special_tokens_path: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[_TemplateType] = None,
    date_string: str = LLAMA3_DATE_STRING,
) -> Llama3ChatTokenizer:
    """Llama 3.x-Instruct's tokenizer (:class:`Llama3ChatTokenizer`; torchtune's ``llama3_tokenizer`` keys plus
    ``date_string``), refusing special tokens without Llama 3's chat tokens and another family's chat format.

    Args:
        path (str): ``original/tokenizer.model`` (tiktoken).
        special_tokens_path (Optional[str]): ``tokenizer.json``; None: torchtune's Llama 3 special tokens.
        max_seq_len (Optional[int]): samples are cut at this length.
        prompt_template (Optional[_TemplateType]): a task template applied to the messages first.
        date_string (str): the ``Today Date`` of the system turn.

    Returns:
        Llama3ChatTokenizer: the tokenizer.

    Raises:
        ConfigError: if the special tokens lack Llama 3's chat tokens or ``prompt_template`` is a chat format.
    """
    template = _template(prompt_template, "llama3")
    special = None
    if special_tokens_path is not None:
        fix = "set tokenizer.special_tokens_path to Llama 3's tokenizer.json (or leave it unset)."
        special = parse_hf_tokenizer_json(special_tokens_path)
        _missing_chat_tokens("llama3", special, "tokenizer.special_tokens_path", fix)
    return Llama3ChatTokenizer(path, special, max_seq_len, template, date_string=date_string)

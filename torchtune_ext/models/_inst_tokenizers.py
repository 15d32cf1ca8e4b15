"""Llama 2's and Mistral's ``[INST]`` chat tokenizers (split from :mod:`._chat_tokenizers`, which holds the other
families and the reasons for these forks): torchtune's ``MistralTokenizer`` ends a prompt ``[/INST]</s>`` and
``Llama2Tokenizer`` at inference leaves out the ``</s>`` that closes each earlier answer; here each writes its
published template token for token, truncation a plain cut."""

from typing import Any, List, Mapping, Optional, Tuple

from torchtune.data import Message
from torchtune.data._prompt_templates import _TemplateType
from torchtune.models.llama2 import Llama2Tokenizer
from torchtune.models.mistral import MistralTokenizer

from torchtune_ext.models._chat_format import _cut, _open_end, _template, _text


class _InstMixin:
    """``[INST]`` turns as Llama-2-chat's and Mistral-Instruct's chat templates write them, each run of text between
    special tokens encoded as their ``tokenizer.json`` encodes it: a "▁" before a run that follows ``<s>`` or
    ``</s>``, none before an answer, which goes on from ``[/INST]`` in the same run."""

    #: the family's own chat format among torchtune's templates (the tokenizer writes it itself).
    chat_format: str = ""

    def _user_text(self, content: str, system: Optional[str], first: bool) -> str:
        raise NotImplementedError

    def _answer_text(self, content: str, open_end: bool) -> str:
        raise NotImplementedError

    def _turn_bos(self, index: int) -> List[int]:
        """``<s>`` before the user turn at ``index``."""
        raise NotImplementedError

    def tokenize_messages(self, messages: List[Message], *, add_eos: bool = True) -> Tuple[List[int], List[bool]]:
        """
        Args:
            messages (List[Message]): the conversation (a system message first, where the family has one).
            add_eos (bool): False (inference): a last assistant message stays open (no ``</s>``).

        Returns:
            Tuple[List[int], List[bool]]: tokens and masks (True: not trained on), cut at ``max_seq_len``.

        Raises:
            ValueError: for a role other than system, user and assistant.
        """
        turns = list(self.prompt_template(messages) if self.prompt_template is not None else messages)
        system = _text(turns.pop(0)) if turns and turns[0].role == "system" else None
        open_end = _open_end(turns, add_eos)
        tokens: List[int] = []
        mask: List[bool] = []
        for index, message in enumerate(turns):
            if message.role == "user":
                text = self._user_text(_text(message), system, first=index == 0)
                ids = [*self._turn_bos(index), *self.encode(text, add_bos=False, add_eos=False)]
            elif message.role == "assistant":
                last = open_end and index == len(turns) - 1
                text = self._answer_text(_text(message), open_end=last)
                ids = self.encode(text, add_bos=False, add_eos=False, trim_leading_whitespace=True) if text else []
                ids += [] if last else [self.eos_id]
            else:
                raise ValueError(f"The [INST] chat format has no {message.role!r} role: use system, user, assistant.")
            tokens, mask = tokens + ids, mask + [message.masked] * len(ids)
        return _cut(tokens, mask, self.max_seq_len)

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replaces ``sample["messages"]`` with their ``tokens`` and ``mask`` (``inference``: the last assistant
        message stays open)."""
        messages = sample.pop("messages")
        # the template's own keywords: Llama2ChatTokenizer keeps torchtune's add_end_tokens for its callers
        sample["tokens"], sample["mask"] = _InstMixin.tokenize_messages(self, messages, add_eos=not inference)
        return sample


class Llama2ChatTokenizer(_InstMixin, Llama2Tokenizer):
    """torchtune's ``Llama2Tokenizer`` writing Llama-2-chat's chat template (its ``tokenizer_config.json``, the same
    as Meta's reference ``chat_completion``): ``<s>[INST] {user, stripped} [/INST]`` per user turn, the system
    message as ``<<SYS>>\n{system}\n<</SYS>>\n\n`` at the start of the first, `` {answer, stripped} </s>`` per
    answer; a generation prompt ends ``[/INST]``."""

    chat_format = "torchtune.models.llama2.Llama2ChatTemplate"

    def tokenize_messages(  # torchtune's Llama2Tokenizer keywords
        self, messages: List[Message], *, add_start_tokens: bool = True, add_end_tokens: bool = True
    ) -> Tuple[List[int], List[bool]]:
        """The chat template's tokens and mask (see :meth:`_InstMixin.tokenize_messages`); ``add_end_tokens=False``
        (inference) leaves a last assistant message open. ``add_start_tokens=False`` drops the leading ``<s>``."""
        tokens, mask = super().tokenize_messages(messages, add_eos=add_end_tokens)
        return (tokens, mask) if add_start_tokens or tokens[:1] != [self.bos_id] else (tokens[1:], mask[1:])

    def _user_text(self, content: str, system: Optional[str], first: bool) -> str:
        if first and system is not None:
            content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
        return f"[INST] {content.strip()} [/INST]"

    def _answer_text(self, content: str, open_end: bool) -> str:
        if open_end:
            return f" {content.strip()}" if content.strip() else ""
        return f" {content.strip()} "

    def _turn_bos(self, index: int) -> List[int]:
        return [self.bos_id]


class MistralChatTokenizer(_InstMixin, MistralTokenizer):
    """torchtune's ``MistralTokenizer`` writing Mistral-7B-Instruct-v0.2's chat template (Mixtral-8x7B-Instruct-v0.1's
    is the same): ``<s>`` once, ``[INST] {user} [/INST]`` per user turn, ``{answer}</s>`` per answer; a generation
    prompt ends ``[/INST]``. The template has no system role (it refuses one)."""

    chat_format = "torchtune.models.mistral.MistralChatTemplate"

    def _user_text(self, content: str, system: Optional[str], first: bool) -> str:
        if system is not None:
            raise ValueError(
                "Mistral-Instruct's chat template has no system role: put the instructions at the start of the "
                "first user message."
            )
        return f"[INST] {content} [/INST]"

    def _answer_text(self, content: str, open_end: bool) -> str:
        return content

    def _turn_bos(self, index: int) -> List[int]:
        return [self.bos_id] if index == 0 else []


def _inst_template(prompt_template: Optional[_TemplateType], family: str, own: str) -> Any:
    """A task template for an ``[INST]`` tokenizer: the family's own chat format (the builders' default) is the
    tokenizer's to write, so it is not applied twice."""
    return _template(None if prompt_template == own else prompt_template, family)


def llama2_tokenizer(
    path: str,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[_TemplateType] = Llama2ChatTokenizer.chat_format,
) -> Llama2ChatTokenizer:
    """Llama 2's tokenizer (:class:`Llama2ChatTokenizer`; torchtune's ``llama2_tokenizer`` keys), refusing another
    family's chat format.

    Args:
        path (str): ``tokenizer.model``.
        max_seq_len (Optional[int]): samples are cut at this length.
        prompt_template (Optional[_TemplateType]): a task template applied to the messages first; Llama 2's own
            (the default) or None: none (the tokenizer writes the chat format itself).

    Returns:
        Llama2ChatTokenizer: the tokenizer.

    Raises:
        ConfigError: if ``prompt_template`` is another family's chat format.
    """
    template = _inst_template(prompt_template, "llama2", Llama2ChatTokenizer.chat_format)
    return Llama2ChatTokenizer(path, max_seq_len, template)


def mistral_tokenizer(
    path: str,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[_TemplateType] = MistralChatTokenizer.chat_format,
) -> MistralChatTokenizer:
    """Mistral's tokenizer (:class:`MistralChatTokenizer`; torchtune's ``mistral_tokenizer`` keys), refusing another
    family's chat format.

    Args:
        path (str): ``tokenizer.model``.
        max_seq_len (Optional[int]): samples are cut at this length.
        prompt_template (Optional[_TemplateType]): a task template applied to the messages first; Mistral's own
            (the default) or None: none (the tokenizer writes the chat format itself).

    Returns:
        MistralChatTokenizer: the tokenizer.

    Raises:
        ConfigError: if ``prompt_template`` is another family's chat format.
    """
    template = _inst_template(prompt_template, "mistral", MistralChatTokenizer.chat_format)
    return MistralChatTokenizer(path, max_seq_len, template)

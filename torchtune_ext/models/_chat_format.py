"""What every family's chat tokenizer shares: which chat format and chat tokens each family takes (refused
otherwise, one line naming the key), a plain cut at ``max_seq_len``, and whether a conversation's last answer stays
open (generation)."""

from typing import Any, List, Mapping, Optional, Sequence, Tuple

from torchtune.data import Message
from torchtune.data._prompt_templates import _get_prompt_template, _TemplateType

from torchtune_ext.config import ConfigError

#: torchtune's chat-format templates, by the family that uses them; a family takes only its own (task templates
#: such as a summarisation prompt are not chat formats and are taken by any family).
CHAT_FORMAT_TEMPLATES = {
    "torchtune.data.ChatMLTemplate": "chatml",
    "torchtune.models.llama2.Llama2ChatTemplate": "llama2",
    "torchtune.models.mistral.MistralChatTemplate": "mistral",
}
#: each family's chat tokens (what a tokenizer file must hold to write its chat format).
CHAT_TOKENS = {
    "smollm2": ("<|im_start|>", "<|im_end|>"),
    "qwen2_5": ("<|im_start|>", "<|im_end|>"),
    "qwen3": ("<|im_start|>", "<|im_end|>"),
    "phi3": ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}


def _cut(tokens: List[int], mask: List[bool], max_seq_len: Optional[int]) -> Tuple[List[int], List[bool]]:
    """A plain cut at ``max_seq_len`` (no token replaced, no mask changed)."""
    if max_seq_len:
        return tokens[:max_seq_len], mask[:max_seq_len]
    return tokens, mask


def _open_end(messages: Sequence[Message], add_end: bool) -> bool:
    """Whether the conversation ends with an assistant message left open for the model to continue (inference)."""
    return not add_end and bool(messages) and messages[-1].role == "assistant"


def _text(message: Message) -> str:
    if any(item["type"] != "text" for item in message.content):
        raise RuntimeError(f"This tokenizer takes text content only, not {message.content!r}.")
    return "".join(item["content"] for item in message.content)


def check_prompt_template(prompt_template: Any, family: str) -> None:
    """Refuses another family's chat format as ``tokenizer.prompt_template``.

    Args:
        prompt_template (Any): the config's value (a dotpath, a dict of tags or None).
        family (str): the tokenizer's family (a key of ``CHAT_TOKENS``, or ``llama2`` / ``mistral``).

    Raises:
        ConfigError: naming ``tokenizer.prompt_template`` and the fix.
    """
    if not isinstance(prompt_template, str):
        return
    owner = CHAT_FORMAT_TEMPLATES.get(prompt_template)
    if owner is not None and owner != family:  # ChatML families write ChatML themselves: refused too
        raise ConfigError(
            f"tokenizer.prompt_template={prompt_template} is the {owner} chat format; this {family} tokenizer writes "
            "its own: remove tokenizer.prompt_template (or set it to a task template).",
            "tokenizer.prompt_template",
        )


def _template(prompt_template: Optional[_TemplateType], family: str) -> Any:
    check_prompt_template(prompt_template, family)
    return None if prompt_template is None else _get_prompt_template(prompt_template)


def _missing_chat_tokens(family: str, special_tokens: Mapping[str, int], key: str, fix: str) -> None:
    missing = [token for token in CHAT_TOKENS[family] if token not in special_tokens]
    if missing:
        raise ConfigError(f"{key}: the tokenizer lacks {family}'s chat tokens {missing}; {fix}", key)

"""Phi-4-mini's model tokenizer: its ``tokenizer.json`` (o200k byte-level BPE) through torchtune's
``HuggingFaceBaseTokenizer``, and its chat format
``<|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|><|endoftext|>`` (the ``chat_template`` of
Phi-4-mini-instruct's ``tokenizer_config.json``; no BOS, no newlines between turns).
"""

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from torchtune.data import Message, PromptTemplate, truncate
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer, ModelTokenizer

#: Phi-4-mini's chat tokens; their ids are read from ``tokenizer.json`` (Phi-4-mini-instruct: ``<|endoftext|>``
#: 199999, ``<|assistant|>`` 200019, ``<|end|>`` 200020, ``<|user|>`` 200021, ``<|system|>`` 200022).
PHI4_MINI_CHAT_TOKENS = ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>")
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}


class Phi4MiniTokenizer(ModelTokenizer, Transform):
    """Phi-4-mini's tokenizer: text through ``tokenizer.json``, messages in Phi-4-mini's chat format.

    ``<|endoftext|>`` is BOS, EOS and padding (as in Phi-4-mini-instruct's ``tokenizer_config.json``); generation
    stops at ``<|end|>`` or ``<|endoftext|>`` (its ``generation_config.json``).

    Args:
        path (str): Phi-4-mini's ``tokenizer.json``.
        tokenizer_config_path (Optional[str]): its ``tokenizer_config.json`` (BOS / EOS); None: the one beside
            ``path``.
        max_seq_len (Optional[int]): tokenized messages are truncated to this length.
        prompt_template (Optional[PromptTemplate]): applied to the messages before they are tokenized.

    Raises:
        FileNotFoundError: if the ``tokenizer_config.json`` is missing.
        ValueError: if ``tokenizer.json`` lacks one of Phi-4-mini's chat tokens.
    """

    def __init__(
        self,
        path: str,
        tokenizer_config_path: Optional[str] = None,
        max_seq_len: Optional[int] = None,
        prompt_template: Optional[PromptTemplate] = None,
    ):
        config_path = tokenizer_config_path or str(Path(path).with_name("tokenizer_config.json"))
        if not Path(config_path).is_file():
            raise FileNotFoundError(
                f"{config_path} (BOS / EOS) does not exist: it ships with Phi-4-mini beside tokenizer.json; "
                "set tokenizer.tokenizer_config_path to where it is."
            )
        self._base = HuggingFaceBaseTokenizer(path, tokenizer_config_json_path=config_path)
        self.special_tokens = _chat_token_ids(self._base, path)
        self.bos_id = self._base.bos_id
        self.eos_id = self._base.eos_id
        self.pad_id = self.special_tokens["<|endoftext|>"]
        self.end_id = self.special_tokens["<|end|>"]
        self.stop_tokens = [self.end_id, self.eos_id]
        self.max_seq_len = max_seq_len
        self.prompt_template = prompt_template

    @property
    def vocab_size(self) -> int:
        """The number of ids in ``tokenizer.json``, special tokens included."""
        return self._base.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> List[int]:
        """Encodes text (special tokens written in it become their ids, as in transformers).

        Args:
            text (str): the text.
            add_bos (bool): prepend ``bos_id``.
            add_eos (bool): append ``eos_id``.

        Returns:
            List[int]: the ids.
        """
        return self._base.encode(text, add_bos=add_bos, add_eos=add_eos)

    def decode(self, token_ids: List[int], skip_special_tokens: bool = True) -> str:
        """Decodes ids to text.

        Args:
            token_ids (List[int]): the ids.
            skip_special_tokens (bool): leave the special tokens out.

        Returns:
            str: the text.
        """
        return self._base.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def tokenize_messages(
        self, messages: List[Message], *, add_end_tokens: bool = True
    ) -> Tuple[List[int], List[bool]]:
        """Tokenizes messages as Phi-4-mini's chat template does: ``<|role|>`` + content + ``<|end|>`` per message,
        then ``<|endoftext|>``. Each token's mask is its message's ``masked`` (the final ``<|endoftext|>`` takes
        the last tokenized message's).

        Args:
            messages (List[Message]): the conversation.
            add_end_tokens (bool): False (inference): a last assistant message ends open, without ``<|end|>``,
                and no ``<|endoftext|>`` follows (the template's ``add_generation_prompt``).

        Returns:
            Tuple[List[int], List[bool]]: the tokens and their masks (True: not trained on).

        Raises:
            ValueError: for a role other than system, user or assistant.
            RuntimeError: for content other than text.
        """
        templated = self.prompt_template(messages) if self.prompt_template is not None else messages
        tokens: List[int] = []
        mask: List[bool] = []
        for index, message in enumerate(templated):
            if message.role not in ROLE_TOKENS:
                raise ValueError(f"Phi-4-mini has no chat role {message.role!r}: use one of {sorted(ROLE_TOKENS)}.")
            open_end = not add_end_tokens and message.role == "assistant" and index == len(templated) - 1
            ids = [self.special_tokens[ROLE_TOKENS[message.role]], *self._content_ids(message)]
            if not open_end:
                ids.append(self.end_id)
            tokens.extend(ids)
            mask.extend([message.masked] * len(ids))
            if self.max_seq_len and len(tokens) >= self.max_seq_len:
                break
        if add_end_tokens:
            tokens.append(self.eos_id)
            mask.append(message.masked)
        if self.max_seq_len and len(tokens) > self.max_seq_len:
            tokens = truncate(tokens, self.max_seq_len, self.eos_id if add_end_tokens else None)
            mask = truncate(mask, self.max_seq_len, message.masked if add_end_tokens else None)
        return tokens, mask

    def _content_ids(self, message: Message) -> List[int]:
        ids: List[int] = []
        for item in message.content:
            if item["type"] != "text":
                raise RuntimeError(f"Phi-4-mini's tokenizer takes text only, not {item['type']!r} content.")
            ids += self.encode(item["content"], add_bos=False, add_eos=False)
        return ids

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replaces ``sample["messages"]`` with their ``tokens`` and ``mask``.

        Args:
            sample (Mapping[str, Any]): a sample with a ``messages`` list.
            inference (bool): tokenize for generation (``add_end_tokens=False``).

        Returns:
            Mapping[str, Any]: the sample with ``tokens`` and ``mask``.
        """
        messages = sample.pop("messages")
        sample["tokens"], sample["mask"] = self.tokenize_messages(messages, add_end_tokens=not inference)
        return sample


def _chat_token_ids(base: HuggingFaceBaseTokenizer, path: str) -> Dict[str, int]:
    ids = {token: base.tokenizer.token_to_id(token) for token in PHI4_MINI_CHAT_TOKENS}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(f"{path} lacks Phi-4-mini's chat tokens {missing}: tokenizer.path must be Phi-4-mini's.")
    return ids


def phi4_mini_tokenizer(
    path: str,
    tokenizer_config_path: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[PromptTemplate] = None,
) -> Phi4MiniTokenizer:
    """Phi-4-mini's tokenizer (config ``tokenizer._component_``); see :class:`Phi4MiniTokenizer`.

    Args:
        path (str): Phi-4-mini's ``tokenizer.json``.
        tokenizer_config_path (Optional[str]): its ``tokenizer_config.json``; None: the one beside ``path``.
        max_seq_len (Optional[int]): tokenized messages are truncated to this length.
        prompt_template (Optional[PromptTemplate]): applied to the messages before they are tokenized.

    Returns:
        Phi4MiniTokenizer: the tokenizer.
    """
    return Phi4MiniTokenizer(path, tokenizer_config_path, max_seq_len, prompt_template)

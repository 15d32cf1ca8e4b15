"""Decoding: greedy or sampled (temperature, top-k, top-p, seed) next tokens, with torchtune's KV caches, stopping at
EOS or stop strings; prompts as text or chat messages (the tokenizer's chat template)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchtune.data import Message
from torchtune.modules.common_utils import delete_kv_caches

from torchtune_ext.config import GENERATION_SCHEMA, bad_value, check_setting, declared
from torchtune_ext.modules import cached_nf4_scales

#: prompt tokens per cached forward (see ``Generator``).
PREFILL_CHUNK = 512


def _default(key: str) -> Any:
    return declared(key, GENERATION_SCHEMA).default


@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen and when decoding stops; the defaults and allowed values are the generate
    recipe's config schema's (``torchtune_ext.config.GENERATION_SCHEMA``).

    Args:
        max_new_tokens (int): at most this many new tokens.
        temperature (float): 0: greedy (argmax); else the logits are divided by it before sampling.
        top_k (Optional[int]): sample among the ``top_k`` most likely tokens.
        top_p (Optional[float]): sample among the most likely tokens whose probabilities add up to ``top_p``.
        seed (Optional[int]): seed of the sampling RNG (None: nondeterministic).
        stop (Tuple[str, ...]): strings that end the answer (cut before them); EOS always ends it.
        use_cache (bool): decode with KV caches (one new token per forward) instead of re-running the sequence.
        ignore_eos (bool): keep decoding past EOS (benchmarks, comparisons at a fixed length).

    Raises:
        ConfigError: on a non-positive ``max_new_tokens``, a negative temperature, ``top_k < 1`` or ``top_p`` outside
            (0, 1], naming the setting (a ``ValueError``).
    """

    max_new_tokens: int = _default("max_new_tokens")
    temperature: float = _default("temperature")
    top_k: Optional[int] = _default("top_k")
    top_p: Optional[float] = _default("top_p")
    seed: Optional[int] = _default("seed")
    stop: Tuple[str, ...] = _default("stop")
    use_cache: bool = _default("use_cache")
    ignore_eos: bool = False

    def __post_init__(self):
        for key in ("max_new_tokens", "temperature", "top_k", "top_p"):
            check_setting(key, getattr(self, key), GENERATION_SCHEMA)


def sample_next_token(
    logits: torch.Tensor, settings: SamplingSettings, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """The next token for each row of ``logits``.

    Args:
        logits (torch.Tensor): ``(batch, vocab)`` logits of the last position.
        settings (SamplingSettings): greedy (temperature 0) or temperature / top-k / top-p sampling.
        generator (Optional[torch.Generator]): the sampling RNG.

    Returns:
        torch.Tensor: ``(batch,)`` token ids.
    """
    logits = logits.float()
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / settings.temperature
    if settings.top_k is not None:
        kth = torch.topk(logits, min(settings.top_k, logits.size(-1))).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p (the most likely one always stays)
        drop = probs.cumsum(dim=-1) - probs >= settings.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@dataclass
class Answer:
    """One decoded answer.

    Args:
        text (str): the answer, cut before a stop string.
        tokens (List[int]): the new tokens (EOS excluded).
        stop_reason (str): ``"eos"``, ``"stop_string"``, ``"max_new_tokens"`` or ``"max_seq_len"``.
        seconds (float): decoding time.
    """

    text: str
    tokens: List[int]
    stop_reason: str
    seconds: float


class Generator:
    """Decodes answers from a torchtune decoder and a torchtune tokenizer.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` (e.g. from ``load_model_with_adapter``).
        tokenizer (Any): a torchtune model tokenizer (``encode``, ``decode``, ``eos_id``; chat prompts go through
            its ``tokenize_messages``, which applies its chat template).
        dtype (torch.dtype): dtype of the KV caches (the compute dtype).
        device (torch.device): the model's device.
        max_seq_len (Optional[int]): prompt + answer length limit; None: the model's ``max_seq_len``.
        prefill_chunk (int): the prompt goes through the cached model this many tokens at a time, so that a long
            prompt's activations (and, for a decoder without the ``skip_output_layer`` switch, its logits) are never
            all held.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        dtype: torch.dtype,
        device: torch.device,
        max_seq_len: Optional[int] = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_seq_len = min(max_seq_len or model.max_seq_len, model.max_seq_len)
        self.stop_ids = set(getattr(tokenizer, "stop_tokens", None) or [tokenizer.eos_id])
        self._vocab_size = getattr(tokenizer, "vocab_size", None)

    def decode(self, tokens: Sequence[int]) -> str:
        """
        Args:
            tokens (Sequence[int]): token ids.

        Returns:
            str: their text; ids beyond the tokenizer's vocabulary (a model's padded rows) are left out.
        """
        if self._vocab_size is not None:
            tokens = [t for t in tokens if t < self._vocab_size]
        return self.tokenizer.decode(list(tokens))

    def encode_prompt(self, prompt: Any, chat: bool) -> List[int]:
        """
        Args:
            prompt (Any): a string, or chat messages (``[{"role": ..., "content": ...}]``).
            chat (bool): apply the tokenizer's chat template to a string (as one user message).

        Returns:
            List[int]: the prompt's tokens (a chat prompt ends where the assistant's answer starts).
        """
        if isinstance(prompt, str) and not chat:
            return list(self.tokenizer.encode(prompt, add_bos=True, add_eos=False))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages = [Message(role=m["role"], content=m["content"]) for m in messages]
        messages.append(Message(role="assistant", content=""))
        return list(self.tokenizer({"messages": messages}, inference=True)["tokens"])

    @torch.no_grad()
    def generate(self, prompt_tokens: Sequence[int], settings: SamplingSettings) -> Answer:
        """Decodes one answer.

        Args:
            prompt_tokens (Sequence[int]): the prompt.
            settings (SamplingSettings): sampling and stopping.

        Returns:
            Answer: the answer.

        Raises:
            ValueError: if the prompt leaves no room for a new token within ``max_seq_len``.
        """
        prompt_len = len(prompt_tokens)
        budget = min(settings.max_new_tokens, self.max_seq_len - prompt_len)
        if budget < 1:
            raise ValueError(
                f"The prompt has {prompt_len} tokens, leaving no room for an answer within max_seq_len="
                f"{self.max_seq_len}; shorten it or raise max_seq_len."
            )
        generator = None
        if settings.seed is not None:
            generator = torch.Generator().manual_seed(settings.seed)
        start = time.perf_counter()
        new: List[int] = []
        reason = "max_new_tokens" if budget == settings.max_new_tokens else "max_seq_len"
        decoding = contextlib.closing(self._decode(list(prompt_tokens), budget, settings, generator))
        with cached_nf4_scales(), decoding as tokens:  # CPU: each NF4 weight's block scales dequantized once
            for token in tokens:  # closing: the KV caches go as soon as decoding stops
                if token in self.stop_ids and not settings.ignore_eos:
                    reason = "eos"
                    break
                new.append(token)
                if settings.stop and any(s in self.decode(new) for s in settings.stop):
                    reason = "stop_string"
                    break
        text = self.decode(new)
        if reason == "stop_string":
            text = text[: min(text.find(s) for s in settings.stop if s in text)]
        return Answer(text=text, tokens=new, stop_reason=reason, seconds=time.perf_counter() - start)

    def _decode(self, tokens: List[int], budget: int, settings: SamplingSettings, generator):
        """Yields new tokens one at a time (KV-cached or re-running the whole sequence)."""
        ids = torch.tensor([tokens], device=self.device)
        if not settings.use_cache:
            for _ in range(budget):
                token = sample_next_token(self._last_logits(ids), settings, generator)
                yield int(token)
                ids = torch.cat([ids, token.view(1, 1)], dim=1)
            return
        total = len(tokens) + budget
        with self.device:
            self.model.setup_caches(batch_size=1, dtype=self.dtype, decoder_max_seq_len=total)
        try:
            causal = torch.tril(torch.ones(total, total, dtype=torch.bool, device=self.device))
            positions = torch.arange(total, device=self.device)
            length = len(tokens)
            for start in range(0, length, self.prefill_chunk):
                chunk = slice(start, min(start + self.prefill_chunk, length))
                logits = self._last_logits(ids[:, chunk], positions[None, chunk], causal[None, chunk])
            for step in range(budget):
                token = sample_next_token(logits, settings, generator)
                yield int(token)
                if step == budget - 1:
                    break
                at = slice(length + step, length + step + 1)
                logits = self._last_logits(token.view(1, 1), positions[None, at], causal[None, at])
        finally:
            delete_kv_caches(self.model)

    def _last_logits(
        self, ids: torch.Tensor, input_pos: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``(batch, vocab)`` logits of the last position of a forward (cached: with ``input_pos`` and ``mask``;
        else the whole sequence). A decoder with the ``skip_output_layer`` switch (ours) projects that position only
        (a prompt's other positions need no logits: transformers' ``generate`` skips them too), whatever the switch
        was left at (the training loss sets it); any other gets torchtune's logits of every position."""
        if not hasattr(self.model, "skip_output_layer"):
            return self.model(ids, input_pos=input_pos, mask=mask)[:, -1]
        skipped = self.model.skip_output_layer  # the training loss may have set it (and expects it kept)
        self.model.skip_output_layer = True
        try:
            hidden = self.model(ids, input_pos=input_pos, mask=mask)
        finally:
            self.model.skip_output_layer = skipped
        return self.model.output(hidden[:, -1]).float()


def check_chat_prompt(tokenizer: Any, component: str) -> None:
    """Refuses a tokenizer whose chat prompt ends with a token that stops generation (torchtune 0.6.1's Qwen2,
    Qwen2.5, Gemma and Mistral tokenizers end it with their end token, Phi-3's with ``<|end|>\n``): every answer
    would then open a new turn.

    Args:
        tokenizer (Any): the model tokenizer.
        component (str): its config ``tokenizer._component_``, for the message.

    Raises:
        ConfigError: naming ``tokenizer._component_`` and the fix.
    """
    messages = [Message(role="user", content="Hi"), Message(role="assistant", content="")]
    tokens = list(tokenizer({"messages": messages}, inference=True)["tokens"])
    stop_ids = set(getattr(tokenizer, "stop_tokens", None) or [tokenizer.eos_id])
    end = tokens[-1] if tokens else None
    if end in stop_ids or (end is not None and end == getattr(tokenizer, "eos_id", None)):
        raise bad_value(
            "tokenizer._component_",
            component,
            f"writes a chat prompt that ends with the end token {end} instead of the assistant header, so every "
            "answer would start a new turn",
            "use the family's builder in torchtune_ext.models (e.g. torchtune_ext.models.qwen2_5_tokenizer, "
            "smollm2_tokenizer, gemma_tokenizer, phi3_mini_tokenizer, mistral_tokenizer), or chat=False",
        )


def kv_cache_bytes(model: nn.Module, seq_len: int, dtype: torch.dtype, batch_size: int = 1) -> int:
    """Bytes of the KV caches of ``model`` at ``seq_len`` tokens.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder``.
        seq_len (int): cached tokens.
        dtype (torch.dtype): cache dtype.
        batch_size (int): sequences.

    Returns:
        int: bytes (keys and values, every layer).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * batch_size * layer.attn.num_kv_heads * seq_len * layer.attn.head_dim * itemsize for layer in model.layers
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a (meta or materialised) model's params and buffers, NF4 weights as stored (4-bit codes and their
    scalers).

    Args:
        model (nn.Module): the model.

    Returns:
        int: bytes.
    """
    from torchtune_ext.nf4 import NF4_SHARDED_TENSORS, NF4Tensor

    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
        if isinstance(data, NF4Tensor):
            total += sum(getattr(data, name).nbytes for name in NF4_SHARDED_TENSORS)
        else:
            total += data.nbytes
    return total


def answers_record(prompt: Any, answer: Answer) -> Dict[str, Any]:
    """
    Args:
        prompt (Any): the prompt as given (string or messages).
        answer (Answer): its answer.

    Returns:
        Dict[str, Any]: one JSONL record: ``prompt``, ``answer``, ``new_tokens``, ``stop_reason``.
    """
    return {
        "prompt": prompt,
        "answer": answer.text,
        "new_tokens": len(answer.tokens),
        "stop_reason": answer.stop_reason,
    }

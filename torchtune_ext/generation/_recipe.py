"""The generate recipe: answers from the model as it trained (NF4 base + PEFT adapter), for prompts from the config,
the command line or a JSONL file; tokens/s and peak memory; ``dry_run=True`` for the memory it needs."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune import utils

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.checkpoint import check_writable, read_hf_config
from torchtune_ext.config import (
    GENERATION_SCHEMA,
    ConfigError,
    ConfigFileNotFoundError,
    check_generation_config,
    instantiate_component,
    recipe_setting,
)
from torchtune_ext.generation._generate import (
    PREFILL_CHUNK,
    Generator,
    SamplingSettings,
    answers_record,
    check_chat_prompt,
    kv_cache_bytes,
    weight_bytes,
)
from torchtune_ext.generation._model import load_model_with_adapter
from torchtune_ext.memory import GIB
from torchtune_ext.training import (
    build_qlora_model,
    build_tokenizer,
    format_memory_stats,
    frozen_weights_dtype,
    memory_stats,
)


def read_prompts(path: str) -> List[Any]:
    """Reads a JSONL prompts file: one object per line with ``prompt`` (a string) or ``messages`` (chat messages,
    ``[{"role": ..., "content": ...}]``).

    Args:
        path (str): the file.

    Returns:
        List[Any]: the prompts (strings or message lists).

    Raises:
        ConfigFileNotFoundError: if the file does not exist (a ``FileNotFoundError``).
        ConfigError: naming the file and line of an invalid record, or a file without prompts (a ``ValueError``).
    """
    if not Path(path).is_file():
        raise ConfigFileNotFoundError(
            f"prompts_file={path!r} is not a file; set prompts_file to a JSONL file with one "
            '{"prompt": "..."} per line.',
            "prompts_file",
        )
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"prompts_file: {path}:{number} is not JSON ({err}).", "prompts_file") from err
        prompt = record.get("messages", record.get("prompt")) if isinstance(record, dict) else None
        valid_messages = isinstance(prompt, list) and all(
            isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt
        )
        if not (isinstance(prompt, str) or valid_messages):
            raise ConfigError(
                f'prompts_file: {path}:{number} needs "prompt" (a string) or "messages" (a list of '
                '{"role", "content"} objects).',
                "prompts_file",
            )
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"prompts_file={path!r} holds no prompts; add one per line.", "prompts_file")
    return prompts


class GenerationRecipe:
    """Generation with the model as it trained; every setting is checked in ``__init__``, before any weight loads.

    Config keys: those of ``torchtune_ext.config.GENERATION_SCHEMA`` (their types, defaults and allowed values:
    ``docs/config-keys.md``); ``adapter_dir`` is not needed by a dry run.

    Args:
        cfg (DictConfig): the config.

    Raises:
        ConfigError: on invalid settings or prompts, a missing prompts file or adapter, or an adapter that does not
            fit ``model``, naming the key; all before anything loads.
    """

    def __init__(self, cfg: DictConfig):
        self._dry_run = bool(recipe_setting(cfg, "dry_run", GENERATION_SCHEMA))
        if self._dry_run and OmegaConf.is_missing(cfg, "adapter_dir"):
            cfg.adapter_dir = None  # the estimate takes the LoRA shape from `model:`; it reads no adapter
        check_generation_config(cfg)  # unknown keys, a device that is not there: one line, exit 2
        device = recipe_setting(cfg, "device", GENERATION_SCHEMA)
        self._device = torch.device(device) if self._dry_run else utils.get_device(device=device)
        dtype = recipe_setting(cfg, "dtype", GENERATION_SCHEMA)
        self._dtype = parse_dtype(dtype, None if self._dry_run else self._device)
        stop = recipe_setting(cfg, "stop", GENERATION_SCHEMA) or ()
        self.settings = SamplingSettings(
            max_new_tokens=recipe_setting(cfg, "max_new_tokens", GENERATION_SCHEMA),
            temperature=recipe_setting(cfg, "temperature", GENERATION_SCHEMA),
            top_k=recipe_setting(cfg, "top_k", GENERATION_SCHEMA),
            top_p=recipe_setting(cfg, "top_p", GENERATION_SCHEMA),
            seed=recipe_setting(cfg, "seed", GENERATION_SCHEMA),
            stop=tuple([stop] if isinstance(stop, str) else stop),
            use_cache=bool(recipe_setting(cfg, "use_cache", GENERATION_SCHEMA)),
        )
        self._chat = bool(recipe_setting(cfg, "chat", GENERATION_SCHEMA))
        self._max_seq_len = recipe_setting(cfg, "max_seq_len", GENERATION_SCHEMA)
        self._mode = recipe_setting(cfg, "mode", GENERATION_SCHEMA)
        self.prompts = self._read_prompts(cfg)
        if not self.prompts and self._mode != "chat" and not self._dry_run:
            raise ConfigError("No prompts: set prompt=<text> (or a list) or prompts_file=<file.jsonl>.", "prompt")
        self._answers_file = recipe_setting(cfg, "answers_file", GENERATION_SCHEMA)
        if self._answers_file:
            check_writable(Path(self._answers_file).parent, "answers_file")

    @staticmethod
    def _read_prompts(cfg: DictConfig) -> List[Any]:
        """`prompts_file` replaces the config's prompts; `prompt` (the command line's) replaces its default
        `prompts`."""
        prompts_file = recipe_setting(cfg, "prompts_file", GENERATION_SCHEMA)
        if prompts_file:
            return read_prompts(prompts_file)
        prompt = recipe_setting(cfg, "prompt", GENERATION_SCHEMA)
        prompt = recipe_setting(cfg, "prompts", GENERATION_SCHEMA) if prompt is None else prompt
        prompts = list(prompt) if isinstance(prompt, (list, ListConfig)) else ([prompt] if prompt else [])
        return [_prompt_text(p) for p in prompts]

    def setup(self, cfg: DictConfig) -> None:
        """Loads the tokenizer and the model (the base streamed into NF4 + the adapter, checked first)."""
        start = time.perf_counter()
        checkpointer = instantiate_component(cfg.checkpointer, "checkpointer")
        self._tokenizer = build_tokenizer(cfg.tokenizer)
        if self._chat:
            check_chat_prompt(self._tokenizer, cfg.tokenizer.get("_component_", ""))
        adapter_dir = recipe_setting(cfg, "adapter_dir", GENERATION_SCHEMA)
        model = load_model_with_adapter(
            checkpointer, adapter_dir, model=cfg.model, dtype=self._dtype, device=self._device
        )
        self.generator = Generator(model, self._tokenizer, self._dtype, self._device, self._max_seq_len)
        print(
            f"Loaded {checkpointer.checkpoint_dir} into NF4 + adapter {adapter_dir} in "
            f"{time.perf_counter() - start:.1f} s (compute dtype {self._dtype}, device {self._device}).",
            flush=True,
        )

    def answer(self, prompt: Any) -> Dict[str, Any]:
        """
        Args:
            prompt (Any): a string or chat messages.

        Returns:
            Dict[str, Any]: the JSONL record of its answer (``prompt``, ``answer``, ``new_tokens``,
            ``stop_reason``) plus ``seconds``.
        """
        tokens = self.generator.encode_prompt(prompt, self._chat)
        answer = self.generator.generate(tokens, self.settings)
        return {**answers_record(prompt, answer), "seconds": answer.seconds}

    def generate(self) -> List[Dict[str, Any]]:
        """Answers every prompt, prints each answer, tokens/s and peak memory, and writes ``answers_file``.

        Returns:
            List[Dict[str, Any]]: the answers' records.
        """
        records = []
        for prompt in self.prompts:
            record = self.answer(prompt)
            print(f"\n>>> {prompt}\n{record['answer']}", flush=True)
            records.append(record)
        tokens = sum(r["new_tokens"] for r in records)
        seconds = sum(r.pop("seconds") for r in records)
        print(
            f"\n{len(records)} answer(s), {tokens} new tokens in {seconds:.2f} s: {tokens / max(seconds, 1e-9):.1f} "
            f"tokens/s; memory: {format_memory_stats(memory_stats(self._device))}",
            flush=True,
        )
        if self._answers_file:
            _write_jsonl(Path(self._answers_file), records)
            print(f"Answers written to {self._answers_file}", flush=True)
        return records

    def chat(self, stdin: TextIO = sys.stdin) -> None:
        """An interactive chat on ``stdin``: the conversation so far is the prompt (the tokenizer's chat template);
        ``/reset`` starts over, an empty line or EOF ends it.

        Args:
            stdin (TextIO): where the user's lines come from.
        """
        messages: List[Dict[str, str]] = []
        print("Chat (empty line or Ctrl-D ends, /reset starts over).", flush=True)
        while True:
            print("you> ", end="", flush=True)
            line = stdin.readline()
            if not line.strip():
                return
            if line.strip() == "/reset":
                messages = []
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            record = self.answer(messages)
            tokens_per_second = record["new_tokens"] / max(record["seconds"], 1e-9)
            print(f"model> {record['answer']}   [{record['new_tokens']} tokens, {tokens_per_second:.1f} tokens/s]")
            messages.append({"role": "assistant", "content": record["answer"]})

    def dry_run(self, cfg: DictConfig) -> str:
        """The device memory generation needs, without loading weights: the model's weights as stored (NF4 bases,
        16-bit or fp32 frozen embedding/output, adapters) plus the KV caches at the longest length
        (``max_seq_len``, else the model's).

        Returns:
            str: the report (also printed).
        """
        path = Path(str(cfg.checkpointer.get("checkpoint_dir", ""))) / "config.json"
        hf_config = read_hf_config(path.parent) if path.is_file() else {"dtype": "bfloat16"}
        frozen = frozen_weights_dtype(None, self._dtype, hf_config)
        model = build_qlora_model(cfg.model, self._dtype, self._dtype, frozen)
        length = min(self._max_seq_len or model.max_seq_len, model.max_seq_len)
        weights, cache = weight_bytes(model), kv_cache_bytes(model, length, self._dtype)
        logits = min(PREFILL_CHUNK, length) * model.tok_embeddings.num_embeddings * 4  # one prefill chunk, fp32
        report = (
            f"Generation memory (dtype {self._dtype}, frozen embedding/output in {frozen}): weights "
            f"{weights / GIB:.3f} GiB + KV cache at {length} tokens {cache / GIB:.3f} GiB = "
            f"{(weights + cache) / GIB:.3f} GiB, plus the activations of one forward (the logits of a "
            f"{min(PREFILL_CHUNK, length)}-token prefill chunk: {logits / GIB:.3f} GiB)."
        )
        print(report, flush=True)
        return report


def _prompt_text(prompt: Any) -> Any:
    """A prompt from the config: a string, chat messages, or a string that YAML read as a one-key mapping (the
    command line's ``prompt=Reverse: abc`` is ``{"Reverse": "abc"}`` to OmegaConf), turned back into its text."""
    if isinstance(prompt, DictConfig) and len(prompt) == 1:
        ((key, value),) = prompt.items()
        if not isinstance(value, (DictConfig, ListConfig)):
            return f"{key}: {value}"
    if isinstance(prompt, (DictConfig, ListConfig)):
        prompt = OmegaConf.to_container(prompt)
    if not isinstance(prompt, (str, list)):
        raise ConfigError(f"prompt={prompt!r}: a prompt is a string or a list of chat messages.", "prompt")
    return prompt


def _write_jsonl(path: Path, records: List[Dict[str, Any]]) -> None:
    """Writes ``records`` as JSONL atomically (a temporary file renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    os.replace(tmp, path)


def run_generation(cfg: DictConfig) -> Optional[List[Dict[str, Any]]]:
    """Runs the recipe for a config: ``dry_run=True`` (memory only), ``mode=chat`` (interactive) or the prompts.

    Args:
        cfg (DictConfig): the config.

    Returns:
        Optional[List[Dict[str, Any]]]: the answers' records (None for a dry run or a chat).
    """
    recipe = GenerationRecipe(cfg)
    if recipe._dry_run:
        recipe.dry_run(cfg)
        return None
    recipe.setup(cfg)
    if recipe._mode == "chat":
        recipe.chat()
        return None
    return recipe.generate()

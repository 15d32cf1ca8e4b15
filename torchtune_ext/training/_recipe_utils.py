"""Pieces the single-device and distributed QLoRA recipes share: config parsing, model/data building, vocab
pruning setup, the loss step and the end-of-run summary."""

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig
from safetensors import safe_open
from torch import nn
from torch.utils.data import Dataset
from torchtune import config
from torchtune.datasets import ConcatDataset
from torchtune.modules.peft import get_lora_module_names

from torchtune_ext.modules.vocab_pruning import VocabPruning, collect_token_ids, load_kept_ids, validate_kept_ids
from torchtune_ext.training import _safetensors
from torchtune_ext.training._distributed import VOCAB_PRUNING_SHARDING
from torchtune_ext.training._hf import HFConverter
from torchtune_ext.training._precision import parse_dtype


def rng_state(device: torch.device) -> Dict[str, Any]:
    """
    Args:
        device (torch.device): the training device (its CUDA generator is included on CUDA).

    Returns:
        Dict[str, Any]: the torch, python, numpy (and CUDA) RNG states, for a bit-exact resume.
    """
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Dict[str, Any], device: torch.device) -> None:
    """Restores what :func:`rng_state` returned.

    Args:
        state (Dict[str, Any]): the saved states.
        device (torch.device): the training device.
    """
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def positive_int(cfg: DictConfig, key: str, default: Optional[int]) -> Optional[int]:
    """
    Args:
        cfg (DictConfig): the recipe config.
        key (str): a top-level key.
        default (Optional[int]): its value when absent.

    Returns:
        Optional[int]: ``cfg[key]``.

    Raises:
        ValueError: if it is not a positive integer (or null, where the default is None).
    """
    value = cfg.get(key, default)
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{key}={value!r} must be a positive integer{' or null' if default is None else ''}.")
    return value


@dataclass(frozen=True)
class LoRASettings:
    """The LoRA settings of a ``model:`` config section, for the PEFT adapter config.

    Args:
        rank (int): LoRA rank.
        alpha (float): LoRA alpha.
        dropout (float): LoRA dropout.
        use_dora (bool): DoRA.
        attn_modules (Tuple[str, ...]): ``lora_attn_modules``.
        apply_lora_to_mlp (bool): LoRA on the MLP.
        apply_lora_to_output (bool): LoRA on the output projection.
    """

    rank: int
    alpha: float
    dropout: float
    use_dora: bool
    attn_modules: Tuple[str, ...]
    apply_lora_to_mlp: bool
    apply_lora_to_output: bool

    @classmethod
    def from_config(cls, cfg_model: DictConfig) -> "LoRASettings":
        """
        Args:
            cfg_model (DictConfig): the ``model`` section (a torchtune_ext QLoRA builder's args).

        Returns:
            LoRASettings: its LoRA settings.
        """
        return cls(
            rank=cfg_model.lora_rank,
            alpha=cfg_model.lora_alpha,
            dropout=cfg_model.get("lora_dropout", 0.0),
            use_dora=cfg_model.get("use_dora", False),
            attn_modules=tuple(cfg_model.lora_attn_modules),
            apply_lora_to_mlp=cfg_model.get("apply_lora_to_mlp", False),
            apply_lora_to_output=cfg_model.get("apply_lora_to_output", False),
        )

    def adapter_config(self, pruning: Optional[VocabPruning] = None) -> Dict[str, Any]:
        """The ``adapter_config`` argument of ``QLoRAHFCheckpointer.save``.

        Args:
            pruning (Optional[VocabPruning]): the model's vocab pruning, if any. When its rows train, the adapter
                also carries them as PEFT trainable tokens (``embed_tokens``, and ``lm_head`` when untied).

        Returns:
            Dict[str, Any]: the config.
        """
        config: Dict[str, Any] = dict(
            target_modules=get_lora_module_names(
                list(self.attn_modules), self.apply_lora_to_mlp, self.apply_lora_to_output
            ),
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            use_dora=self.use_dora,
        )
        if pruning is not None and pruning.trainable:
            kept: List[int] = pruning.kept_ids.tolist()
            config["trainable_token_indices"] = {"embed_tokens": kept, **({} if pruning.tied else {"lm_head": kept})}
        return config


def shifted_labels(labels: torch.Tensor, ignore_labels_cache: torch.Tensor) -> torch.Tensor:
    """Labels shifted left by one, the last position ignored: equivalent to ``labels[..., 1:]`` against
    ``logits[..., :-1, :]`` without slicing the logits.

    Args:
        labels (torch.Tensor): ``(batch, seq)`` labels.
        ignore_labels_cache (torch.Tensor): ``(max_batch, 1)`` filled with the loss's ignore index.

    Returns:
        torch.Tensor: the shifted labels.
    """
    return torch.hstack((labels[..., 1:], ignore_labels_cache[: labels.shape[0]]))


def build_qlora_model(cfg_model: DictConfig, dtype: torch.dtype, adapter_dtype: torch.dtype) -> nn.Module:
    """Builds the QLoRA model on the meta device (no memory); shape errors (NF4) surface here.

    Args:
        cfg_model (DictConfig): the ``model`` section, a torchtune_ext QLoRA builder.
        dtype (torch.dtype): compute dtype.
        adapter_dtype (torch.dtype): dtype of the LoRA/DoRA params.

    Returns:
        nn.Module: the model, on meta.

    Raises:
        ValueError: if the builder does not take ``dtype``/``adapter_dtype``/``device``.
    """
    try:
        return config.instantiate(cfg_model, dtype=dtype, adapter_dtype=adapter_dtype, device="meta")
    except TypeError as err:
        if "dtype" not in str(err) and "device" not in str(err):
            raise
        raise ValueError(
            f"model._component_={cfg_model._component_} is not a torchtune_ext QLoRA builder (it does not take "
            "dtype/adapter_dtype/device); use e.g. torchtune_ext.models.qlora_llama3_2_1b."
        ) from err


def build_dataset(cfg_dataset: Any, tokenizer: Any) -> Dataset:
    """
    Args:
        cfg_dataset (Any): a ``dataset`` section, or a list of them (concatenated).
        tokenizer (Any): the tokenizer.

    Returns:
        Dataset: the data set.
    """
    if isinstance(cfg_dataset, ListConfig):
        return ConcatDataset(datasets=[config.instantiate(c, tokenizer) for c in cfg_dataset])
    return config.instantiate(cfg_dataset, tokenizer)


#: keys of ``vocab_pruning:`` in a recipe config.
VOCAB_PRUNING_KEYS = ("enabled", "kept_ids", "dtype", "sharding", "unknown_token_id", "trainable")
#: torchtune state-dict keys of the base model that vocab pruning replaces (a key and a prefix).
_VOCAB_KEYS = ("tok_embeddings.weight", "output.")


def is_vocab_key(key: str) -> bool:
    """
    Args:
        key (str): a torchtune state-dict key.

    Returns:
        bool: whether vocab pruning replaces it (``tok_embeddings.weight``, ``output.*``).
    """
    return key == _VOCAB_KEYS[0] or key.startswith(_VOCAB_KEYS[1])


def parse_vocab_pruning(section: Optional[DictConfig]) -> Optional[Dict[str, Any]]:
    """Reads a ``vocab_pruning:`` config section.

    Args:
        section (Optional[DictConfig]): the section: ``enabled`` (default True when the section exists),
            ``kept_ids`` (a file, see ``load_kept_ids``; null: the ids the data uses), ``dtype`` (of the pruned
            rows, default fp32), ``sharding`` (distributed only: ``sharded`` or ``replicated``),
            ``unknown_token_id``, ``trainable`` (default True).

    Returns:
        Optional[Dict[str, Any]]: the settings, None when pruning is off.

    Raises:
        ValueError: on an unknown key, dtype or sharding.
    """
    if section is None or not section.get("enabled", True):
        return None
    unknown = sorted(set(section) - set(VOCAB_PRUNING_KEYS))
    if unknown:
        raise ValueError(f"vocab_pruning has unknown key(s) {unknown}; known keys: {sorted(VOCAB_PRUNING_KEYS)}.")
    sharding = section.get("sharding", "sharded")
    if sharding not in VOCAB_PRUNING_SHARDING:
        raise ValueError(
            f"vocab_pruning.sharding={sharding!r} is not supported; use one of {list(VOCAB_PRUNING_SHARDING)}."
        )
    return {
        "kept_ids": section.get("kept_ids", None),
        "dtype": parse_dtype(section.get("dtype", "fp32"), torch.device("cpu"), "vocab_pruning.dtype"),
        "sharding": sharding,
        "unknown_token_id": section.get("unknown_token_id", None),
        "trainable": bool(section.get("trainable", True)),
    }


def resolve_kept_ids(
    source: Optional[str], vocab_size: int, tokenizer: Any, datasets: Sequence[Optional[Dataset]]
) -> List[int]:
    """The kept token ids of vocab pruning.

    Args:
        source (Optional[str]): a kept-ids file (``vocab_pruning.kept_ids``); None: every id ``datasets`` use plus
            the tokenizer's special ids (``bos_id``, ``eos_id``, ``pad_id``).
        vocab_size (int): the model's vocabulary size.
        tokenizer (Any): the tokenizer.
        datasets (Sequence[Optional[Dataset]]): the training (and validation) data; None entries are skipped.

    Returns:
        List[int]: the kept ids, validated.

    Raises:
        ValueError: on invalid ids (out of range, duplicates) or an unreadable file.
    """
    if source is not None:
        ids = load_kept_ids(source, vocab_size=vocab_size)
    else:
        special = [getattr(tokenizer, name, None) for name in ("bos_id", "eos_id", "pad_id")]
        data = [sample for dataset in datasets if dataset is not None for sample in dataset]
        ids = collect_token_ids(data, always_keep=special, vocab_size=vocab_size)
    validate_kept_ids(ids, vocab_size)
    return list(ids)


def read_base_vocab_state(checkpoint_paths: Sequence[Path], converter: HFConverter) -> Dict[str, torch.Tensor]:
    """The base checkpoint's full-vocabulary embedding/output tensors (torchtune keys), to export a vocab-pruned
    model into (``export_full_vocab_state_dict``); reads only those tensors.

    Args:
        checkpoint_paths (Sequence[Path]): the base's safetensors files.
        converter (HFConverter): the HF -> torchtune key converter of the unpruned model.

    Returns:
        Dict[str, torch.Tensor]: ``tok_embeddings.weight`` and ``output.*`` (untied).
    """
    vocab = {}
    for path in checkpoint_paths:
        wanted = []
        for hf_key, info in _safetensors.read_header(path).items():
            converted = converter.to_tune(hf_key, torch.empty(info["shape"], device="meta"))
            if converted is not None and is_vocab_key(converted[0]):
                wanted.append(hf_key)
        if wanted:
            with safe_open(path, framework="pt") as f:
                for hf_key in wanted:
                    key, tensor = converter.to_tune(hf_key, f.get_tensor(hf_key))
                    vocab[key] = tensor
    return vocab

"""Reading a QLoRA recipe's config: positive counts, LoRA settings (for the PEFT adapter config), the model (built on
the meta device), data sets; and the RNG state a resume restores."""

import inspect
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.utils.data import Dataset
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from torchtune.datasets import ConcatDataset
from torchtune.modules.peft import get_lora_module_names

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.config import TOKENIZER_FILE_KEYS, ConfigError, missing_tokenizer_file
from torchtune_ext.modules.vocab_pruning import VocabPruning


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
        raise ConfigError(f"{key}={value!r} must be a positive integer{' or null' if default is None else ''}.")
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


def shifted_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Labels shifted left by one, the last position ignored: equivalent to ``labels[..., 1:]`` against
    ``logits[..., :-1, :]`` without slicing the logits (or the hidden states).

    Args:
        labels (torch.Tensor): ``(batch, seq)`` labels.
        ignore_index (int): the loss's ignore index.

    Returns:
        torch.Tensor: the shifted labels.
    """
    last = torch.full((labels.shape[0], 1), ignore_index, dtype=labels.dtype, device=labels.device)
    return torch.hstack((labels[..., 1:], last))


def frozen_weights_dtype(
    name: Optional[str], dtype: torch.dtype, hf_config: Dict[str, Any], what: str = "frozen_dtype"
) -> torch.dtype:
    """The storage dtype of the frozen weights that are not NF4 (token embedding, untied output projection).

    Args:
        name (Optional[str]): the config's ``frozen_dtype`` (fp32, bf16, fp16); None: the checkpoint's own dtype
            when it is 16-bit and the compute dtype is fp32 (a T4 stores bf16 but has no bf16 compute: the upcast
            per use is exact, at half the memory), else the compute dtype.
        dtype (torch.dtype): the compute dtype.
        hf_config (Dict[str, Any]): the base checkpoint's ``config.json``.
        what (str): the config key, for errors.

    Returns:
        torch.dtype: the storage dtype.
    """
    if name is not None:
        return parse_dtype(name, what=what)
    stored = parse_dtype(hf_config.get("dtype") or hf_config.get("torch_dtype"), what="config.json dtype")
    return stored if dtype == torch.float32 and stored in (torch.bfloat16, torch.float16) else dtype


def dtype_or_checkpoints(name: Optional[str], hf_config: Dict[str, Any], what: str = "merged_dtype") -> torch.dtype:
    """``merged_dtype`` (the merged export's dtype; [issue 18]): the named dtype, or by default the base
    checkpoint's own, so that an fp32 run on a 16-bit checkpoint exports a 16-bit model.

    Args:
        name (Optional[str]): fp32, bf16, fp16 or None.
        hf_config (Dict[str, Any]): the base checkpoint's ``config.json`` (bf16 if it names no dtype).
        what (str): the config key, for errors.

    Returns:
        torch.dtype: the dtype.
    """
    if name is not None:
        return parse_dtype(name, what=what)
    return parse_dtype(hf_config.get("dtype") or hf_config.get("torch_dtype") or "bf16", what="config.json dtype")


def build_qlora_model(
    cfg_model: DictConfig, dtype: torch.dtype, adapter_dtype: torch.dtype, frozen_dtype: Optional[torch.dtype] = None
) -> nn.Module:
    """Builds the QLoRA model on the meta device (no memory); shape errors (NF4) surface here.

    Args:
        cfg_model (DictConfig): the ``model`` section, a torchtune_ext QLoRA builder.
        dtype (torch.dtype): compute dtype.
        adapter_dtype (torch.dtype): dtype of the LoRA/DoRA params.
        frozen_dtype (Optional[torch.dtype]): storage dtype of the frozen non-NF4 weights (see
            :func:`frozen_weights_dtype`); None: ``dtype``.

    Returns:
        nn.Module: the model, on meta.

    Raises:
        ValueError: if the builder does not take ``dtype``/``adapter_dtype``/``frozen_dtype``/``device``.
    """
    extra = {} if frozen_dtype is None or frozen_dtype == dtype else {"frozen_dtype": frozen_dtype}
    try:
        return config.instantiate(cfg_model, dtype=dtype, adapter_dtype=adapter_dtype, device="meta", **extra)
    except TypeError as err:
        if "dtype" not in str(err) and "device" not in str(err):
            raise
        raise ValueError(
            f"model._component_={cfg_model._component_} is not a torchtune_ext QLoRA builder (it does not take "
            "dtype/adapter_dtype/frozen_dtype/device); use e.g. torchtune_ext.models.qlora_llama3_2_1b."
        ) from err


#: where network / hub failures come from (a data set that cannot be reached offline).
_NETWORK_ERROR_MODULES = ("requests", "httpx", "urllib3", "huggingface_hub", "datasets")


def build_tokenizer(cfg_tokenizer: DictConfig, checkpoint_dir: Optional[str] = None) -> Any:
    """Builds the tokenizer, first checking the files it names.

    Args:
        cfg_tokenizer (DictConfig): the ``tokenizer`` section.
        checkpoint_dir (Optional[str]): the model's folder, for the hint of a missing file.

    Returns:
        Any: the tokenizer.

    Raises:
        FileNotFoundError: naming the config key of a missing tokenizer file and the fix.
    """
    for key in TOKENIZER_FILE_KEYS:
        value = cfg_tokenizer.get(key, None)
        if isinstance(value, str) and not Path(value).is_file():
            raise missing_tokenizer_file(key, value, checkpoint_dir)  # [issue 17] the hint keeps the subfolder
    return config.instantiate(cfg_tokenizer)


def _network_failure(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        module = type(error).__module__.split(".")[0]
        if isinstance(error, (ConnectionError, TimeoutError)) or module in _NETWORK_ERROR_MODULES:
            return True
        error = error.__cause__ or error.__context__
    return False


def _default_source(component: str) -> str:
    """The ``source`` a data set builder uses when the config gives none (e.g. alpaca_dataset's tatsu-lab/alpaca)."""
    parameter = inspect.signature(_get_component_from_path(component)).parameters.get("source")
    return parameter.default if parameter is not None and isinstance(parameter.default, str) else component


def build_dataset(cfg_dataset: Any, tokenizer: Any, what: str = "dataset") -> Dataset:
    """
    Args:
        cfg_dataset (Any): a ``dataset`` section, or a list of them (concatenated).
        tokenizer (Any): the tokenizer.
        what (str): the section's config key, for errors.

    Returns:
        Dataset: the data set.

    Raises:
        RuntimeError: if the data set cannot be downloaded (offline, unknown repository), naming the key and the
            local-file alternative.
    """
    if isinstance(cfg_dataset, ListConfig):
        return ConcatDataset(datasets=[build_dataset(c, tokenizer, what) for c in cfg_dataset])
    try:
        return config.instantiate(cfg_dataset, tokenizer)
    except Exception as err:
        if not _network_failure(err):
            raise
        source = cfg_dataset.get("source", _default_source(cfg_dataset.get("_component_")))
        raise RuntimeError(
            f"{what}: the data set {source!r} could not be loaded from the Hugging Face Hub and is not in the local "
            f"cache ({type(err).__name__}: {str(err)[:300]}). Offline, train on a local file instead, e.g. "
            f"{what}.source=json {what}.data_files=/path/to/data.json (with the column names the "
            f"{what}._component_ expects), or download the data set once while online."
        ) from err

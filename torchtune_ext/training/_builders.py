"""Builders for what a recipe config names: the QLoRA model (on the meta device), the tokenizer, the data sets and a
check of the optimizer and LR schedule, each failing with the config key and the fix
(:func:`torchtune_ext.config.instantiate_component`)."""

import inspect
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.utils.data import Dataset
from torchtune.config._utils import _get_component_from_path
from torchtune.datasets import ConcatDataset

from torchtune_ext.config import TOKENIZER_FILE_KEYS, ConfigError, instantiate_component, missing_tokenizer_file
from torchtune_ext.distributed import optimizer_param_groups


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
        ConfigError: if the builder does not take ``dtype``/``adapter_dtype``/``frozen_dtype``/``device``, or refuses
            a value of the ``model`` section.
    """
    extra = {} if frozen_dtype is None or frozen_dtype == dtype else {"frozen_dtype": frozen_dtype}
    try:
        return instantiate_component(
            cfg_model, "model", dtype=dtype, adapter_dtype=adapter_dtype, device="meta", **extra
        )
    except ConfigError as err:
        cause = err.__cause__
        if not isinstance(cause, TypeError) or ("dtype" not in str(cause) and "device" not in str(cause)):
            raise
        raise ConfigError(
            f"model._component_={cfg_model._component_} is not a torchtune_ext QLoRA builder (it does not take "
            "dtype/adapter_dtype/frozen_dtype/device); use e.g. torchtune_ext.models.qlora_llama3_2_1b.",
            "model._component_",
        ) from cause


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
        ConfigError: naming the config key of a missing tokenizer file and the fix (a ``FileNotFoundError``), or a
            value the tokenizer refuses.
    """
    for key in TOKENIZER_FILE_KEYS:
        value = cfg_tokenizer.get(key, None)
        if isinstance(value, str) and not Path(value).is_file():
            raise missing_tokenizer_file(key, value, checkpoint_dir)  # the hint keeps the subfolder
    return instantiate_component(cfg_tokenizer, "tokenizer")


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
        ConfigError: on a value the data set builder refuses.
        RuntimeError: if the data set cannot be downloaded (offline, unknown repository), naming the key and the
            local-file alternative.
    """
    if isinstance(cfg_dataset, ListConfig):
        return ConcatDataset(datasets=[build_dataset(c, tokenizer, what) for c in cfg_dataset])
    try:
        return instantiate_component(cfg_dataset, what, tokenizer)
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


def build_optimizer(
    cfg_optimizer: DictConfig, cfg_lr_scheduler: DictConfig, params: List[nn.Parameter]
) -> Tuple[Any, Any]:
    """The optimizer over ``params`` (in param groups that fused and foreach optimizers accept,
    :func:`torchtune_ext.distributed.optimizer_param_groups`) and its LR schedule for one training step: what the
    dry run's copy of the step uses, and (over one parameter) the check that a value they refuse (``betas=0.9``, a
    scheduler argument of the wrong type) fails before the weights load, not after.

    Args:
        cfg_optimizer (DictConfig): the ``optimizer`` section.
        cfg_lr_scheduler (DictConfig): the ``lr_scheduler`` section.
        params (List[nn.Parameter]): the parameters it optimizes.

    Returns:
        Tuple[Any, Any]: the optimizer and the LR schedule.

    Raises:
        ConfigError: naming the key and the value refused.
    """
    optimizer = instantiate_component(cfg_optimizer, "optimizer", optimizer_param_groups(params))
    return optimizer, instantiate_component(cfg_lr_scheduler, "lr_scheduler", optimizer, num_training_steps=1)

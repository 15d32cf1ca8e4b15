"""The model as it trained, for inference: the base checkpoint streamed into NF4 (the training loader) plus a PEFT
LoRA adapter folder (ours, or one PEFT or Unsloth wrote for a supported model), in a compute dtype."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.checkpoint import (
    PeftAdapter,
    QLoRAHFCheckpointer,
    check_adapter_fits,
    load_base_,
    read_adapter_state,
    read_hf_config,
    read_peft_adapter,
)
from torchtune_ext.models import build_qlora, init_adapters_, torchtune_builder_for
from torchtune_ext.training import build_qlora_model, frozen_weights_dtype

PathLike = Union[str, Path]


def open_base_checkpoint(checkpoint_dir: PathLike, model_type: Optional[str] = None) -> QLoRAHFCheckpointer:
    """A read-only :class:`QLoRAHFCheckpointer` over an HF model folder.

    Args:
        checkpoint_dir (PathLike): the folder (``config.json`` + safetensors).
        model_type (Optional[str]): checkpointer model type; None: from ``config.json``'s ``model_type``.

    Returns:
        QLoRAHFCheckpointer: the checkpointer (its ``output_dir`` is never written).
    """
    if model_type is None:
        model_type = torchtune_builder_for(read_hf_config(Path(checkpoint_dir)))[2]
    return QLoRAHFCheckpointer(str(checkpoint_dir), output_dir=tempfile.gettempdir(), model_type=model_type)


def build_model_for(
    checkpointer: QLoRAHFCheckpointer,
    adapter: Optional[PeftAdapter],
    model: Union[DictConfig, Dict[str, Any], None],
    dtype: torch.dtype,
    frozen_dtype: Optional[torch.dtype] = None,
) -> nn.Module:
    """The QLoRA model on the meta device, checked against the checkpoint's and the adapter's headers.

    Args:
        checkpointer (QLoRAHFCheckpointer): the base checkpoint.
        adapter (Optional[PeftAdapter]): the adapter (None: the base with zero adapters).
        model (Union[DictConfig, Dict[str, Any], None]): a ``model:`` config section (a torchtune_ext QLoRA
            builder); None: torchtune's builder for the base's ``config.json`` with the adapter's LoRA settings.
        dtype (torch.dtype): compute dtype (also the adapters').
        frozen_dtype (Optional[torch.dtype]): storage of the frozen embedding/output; None: as in training.

    Returns:
        nn.Module: the model, on meta.

    Raises:
        ValueError: if the checkpoint or the adapter does not fit the model (naming the file and the mismatch).
    """
    frozen_dtype = frozen_dtype or frozen_weights_dtype(None, dtype, checkpointer.hf_config)
    if model is not None:
        cfg = model if isinstance(model, DictConfig) else OmegaConf.create(model)
        meta = build_qlora_model(cfg, dtype, dtype, frozen_dtype)
    else:
        builder, args, _ = torchtune_builder_for(checkpointer.hf_config)
        lora = (
            adapter.lora_settings() if adapter is not None else dict(lora_attn_modules=[], lora_rank=8, lora_alpha=16)
        )
        extra = {} if frozen_dtype == dtype else {"frozen_dtype": frozen_dtype}
        meta = build_qlora(builder, dtype=dtype, adapter_dtype=dtype, **extra, **args, **lora)
    checkpointer.validate(meta)
    if adapter is not None:
        check_adapter_fits(adapter, meta, checkpointer.converter)
    return meta


@torch.no_grad()
def load_model_with_adapter(
    checkpointer: Union[QLoRAHFCheckpointer, PathLike],
    adapter_dir: Optional[PathLike] = None,
    *,
    model: Union[DictConfig, Dict[str, Any], None] = None,
    dtype: Union[torch.dtype, str] = torch.float32,
    device: Union[str, torch.device] = "cpu",
    frozen_dtype: Optional[torch.dtype] = None,
) -> nn.Module:
    """Loads the model as it trained: the base streamed into NF4 (one tensor at a time) plus a PEFT LoRA adapter.

    The adapter (config and weights' header) is checked against the model before any weight is read.

    Args:
        checkpointer (Union[QLoRAHFCheckpointer, PathLike]): the base checkpoint, or its HF folder.
        adapter_dir (Optional[PathLike]): a PEFT adapter folder (``adapter_config.json`` +
            ``adapter_model.safetensors``: ours, PEFT's or Unsloth's); None: the base alone.
        model (Union[DictConfig, Dict[str, Any], None]): the ``model:`` section the adapter trained with (a
            torchtune_ext QLoRA builder); None: built from the base's ``config.json`` and the adapter's config.
        dtype (Union[torch.dtype, str]): compute dtype: fp32, bf16 or fp16.
        device (Union[str, torch.device]): where the model goes.
        frozen_dtype (Optional[torch.dtype]): storage of the frozen embedding/output; None: as in training (the
            checkpoint's 16-bit dtype under fp32 compute).

    Returns:
        nn.Module: the model in eval mode, no gradients.

    Raises:
        FileNotFoundError: on a missing checkpoint or adapter file.
        ValueError: on an adapter that does not fit the model (rank, alpha, target modules, shapes of another
            base model; a Phi adapter's fused LoRA the model's LoRA modules cannot hold), naming the file and the
            mismatch.
    """
    device = torch.device(device)
    dtype = parse_dtype(dtype, device) if isinstance(dtype, str) else dtype
    if not isinstance(checkpointer, QLoRAHFCheckpointer):
        checkpointer = open_base_checkpoint(checkpointer)
    adapter = read_peft_adapter(adapter_dir) if adapter_dir is not None else None
    result = build_model_for(checkpointer, adapter, model, dtype, frozen_dtype)
    tokens: Dict[str, Any] = {}
    state = None
    if adapter is not None:  # before the base: the adapter's values are checked too
        state, tokens = read_adapter_state(adapter, checkpointer.converter, dtype)
    load_base_(result, checkpointer, device)
    init_adapters_(result, device, state)
    params = dict(result.named_parameters())
    for key, (ids, rows) in tokens.items():
        weight = params[key]
        weight[torch.as_tensor(ids, device=weight.device)] = rows.to(weight.device, weight.dtype)
    return result.eval().requires_grad_(False)

"""Qwen3's HF <-> torchtune key mapping, and the config.json checks its builder needs before any weight is read.

torchtune 0.6.1 has no Qwen3 converter. Qwen3's HF layout is Qwen2's (no q/k permutation: both use half-split
RoPE) without the q/k/v biases and with two more tensors per layer, ``self_attn.q_norm.weight`` and
``self_attn.k_norm.weight``, which are our ``Qwen3Attention``'s ``attn.q_norm.scale`` / ``attn.k_norm.scale``
(torchtune's later Qwen3 converter uses the same keys).

Settings that no weight's shape shows (RoPE theta, RMSNorm epsilon, the head dim that q/k norms share) are checked
by :func:`qwen3_config_problems` against the built model.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn
from torchtune.models.convert_weights import get_mapped_key
from torchtune.models.qwen2._convert_weights import _FROM_HF as _QWEN2_FROM_HF

#: HF key -> torchtune key of our Qwen3 models (Qwen2's table plus the q/k norms).
QWEN3_FROM_HF: Dict[str, Any] = {
    **_QWEN2_FROM_HF,
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.scale",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.scale",
}
_QWEN3_TO_HF = {tune: hf for hf, tune in QWEN3_FROM_HF.items() if tune is not None}


def hf_to_tune(
    state_dict: Dict[str, torch.Tensor], tie_word_embeddings: bool = False, **_: Any
) -> Dict[str, torch.Tensor]:
    """HF Qwen3 tensors in torchtune's keys (no layout change; a tied ``lm_head`` and RoPE buffers dropped).

    Args:
        state_dict (Dict[str, torch.Tensor]): HF tensors.
        tie_word_embeddings (bool): whether the model ties its output to the token embedding.
        **_: the other converters' geometry arguments (unused: nothing is permuted).

    Returns:
        Dict[str, torch.Tensor]: torchtune tensors.
    """
    return {
        get_mapped_key(key, QWEN3_FROM_HF): value
        for key, value in state_dict.items()
        if not (tie_word_embeddings and key == "lm_head.weight") and "rotary_emb.inv_freq" not in key
    }


def tune_to_hf(state_dict: Dict[str, torch.Tensor], **_: Any) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_tune`.

    Args:
        state_dict (Dict[str, torch.Tensor]): torchtune tensors.
        **_: the other converters' geometry arguments (unused).

    Returns:
        Dict[str, torch.Tensor]: HF tensors.
    """
    return {get_mapped_key(key, _QWEN3_TO_HF): value for key, value in state_dict.items()}


def qwen3_config_problems(hf_config: Dict[str, Any], model_type: str, model: nn.Module) -> List[str]:
    """The ``config.json`` settings of a checkpoint read as ``QWEN3`` that the model does not have.

    Args:
        hf_config (Dict[str, Any]): the checkpoint's ``config.json``.
        model_type (str): ``checkpointer.model_type`` (other types than QWEN3 have no problems here).
        model (nn.Module): the model (meta is fine).

    Returns:
        List[str]: one line per disagreement naming the config key, its value and the model's; empty for another
        model type (or a config that agrees).
    """
    if model_type != "QWEN3":
        return []
    attn = model.layers[0].attn
    built = {
        "head_dim": attn.head_dim,
        "rope_theta": getattr(attn.pos_embeddings, "base", None),
        "rms_norm_eps": model.norm.eps,
    }
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    problems = []
    for key, value in built.items():
        found = hf_config.get(key, rope.get(key))
        if found is not None and (value is None or abs(float(found) - float(value)) > 1e-6 * abs(float(found))):
            problems.append(f"config.json has {key}={found} but the model has {value}")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in (None, "default"):
        problems.append(f"config.json has rope_type={rope_type!r} but the model has plain RoPE (no scaling)")
    if hf_config.get("attention_bias"):
        problems.append("config.json has attention_bias=true but Qwen3 models have bias-free q/k/v/o projections")
    return problems

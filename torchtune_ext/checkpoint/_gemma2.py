"""Gemma 2's HF <-> torchtune key mapping, and the config.json checks its builder needs before any weight is read.

torchtune 0.6.1's ``gemma2_hf_to_tune`` / ``gemma2_tune_to_hf`` do the q/k permutation right but map HF's
``pre_feedforward_layernorm`` to ``mlp_scale`` (applied after the MLP) and ``post_feedforward_layernorm`` to
``mlp_norm`` (applied before it), and ``model.norm`` to ``Gemma2FinalNorm``'s ``norm.rms_norm.scale``, which our
``lora_gemma2`` replaces by a plain ``norm``. These functions call torchtune's and correct those keys.

Architecture settings that no weight's shape shows (soft-capping values, sliding window, query scaling, RoPE theta,
activation) are checked by :func:`gemma2_config_problems` against the built model.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn
from torchtune.models.gemma2._attention import Gemma2Attention
from torchtune.models.gemma2._convert_weights import _GEMMA2_FROM_HF, gemma2_hf_to_tune, gemma2_tune_to_hf

#: HF key -> torchtune key of our Gemma 2 models (torchtune's table, corrected).
GEMMA2_FROM_HF: Dict[str, Any] = {
    **_GEMMA2_FROM_HF,
    "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.mlp_norm.scale",
    "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.mlp_scale.scale",
    "model.norm.weight": "norm.scale",
}


def _fix(key: str) -> str:
    """Swaps ``mlp_norm`` / ``mlp_scale`` and renames the final norm (the map is its own inverse)."""
    if key in ("norm.rms_norm.scale", "norm.scale"):
        return "norm.scale" if key == "norm.rms_norm.scale" else "norm.rms_norm.scale"
    for old, new in ((".mlp_norm.", ".mlp_scale."), (".mlp_scale.", ".mlp_norm.")):
        if old in key:
            return key.replace(old, new)
    return key


def hf_to_tune(state_dict: Dict[str, torch.Tensor], **kwargs: Any) -> Dict[str, torch.Tensor]:
    """torchtune's ``gemma2_hf_to_tune`` with corrected norm keys.

    Args:
        state_dict (Dict[str, torch.Tensor]): HF tensors.
        **kwargs: ``num_heads``, ``num_kv_heads``, ``dim``, ``head_dim``.

    Returns:
        Dict[str, torch.Tensor]: torchtune tensors.
    """
    return {_fix(k): v for k, v in gemma2_hf_to_tune(state_dict, **kwargs).items()}


def tune_to_hf(state_dict: Dict[str, torch.Tensor], **kwargs: Any) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_tune` (torchtune's ``gemma2_tune_to_hf`` after the key correction).

    Args:
        state_dict (Dict[str, torch.Tensor]): torchtune tensors.
        **kwargs: ``num_heads``, ``num_kv_heads``, ``dim``, ``head_dim``.

    Returns:
        Dict[str, torch.Tensor]: HF tensors.
    """
    return gemma2_tune_to_hf({_fix(k): v for k, v in state_dict.items()}, **kwargs)


def gemma2_config_problems(hf_config: Dict[str, Any], model: nn.Module) -> List[str]:
    """The ``config.json`` settings of a Gemma 2 checkpoint that the built model does not have.

    Args:
        hf_config (Dict[str, Any]): the checkpoint's ``config.json``.
        model (nn.Module): the model (meta is fine).

    Returns:
        List[str]: one line per disagreement naming the config key, its value and the model's; empty for a model
        that is not Gemma 2 (or a config that agrees).
    """
    attns = [layer.attn for layer in model.layers]
    if not attns or not isinstance(attns[0], Gemma2Attention):
        return []
    return _setting_problems(hf_config, model, attns) + _layer_type_problems(hf_config, attns)


def _setting_problems(hf_config: Dict[str, Any], model: nn.Module, attns: List[Gemma2Attention]) -> List[str]:
    attn = attns[0]
    built = {
        "head_dim": attn.head_dim,
        "attn_logit_softcapping": attn.softcapping,
        "final_logit_softcapping": getattr(model.output, "capping_value", None),
        "sliding_window": next((a.sliding_window_size for a in attns if a.sliding_window_size is not None), None),
        "query_pre_attn_scalar": round(attn.scaling**-2),
        "rope_theta": getattr(attn.pos_embeddings, "base", None),
        "rms_norm_eps": model.norm.eps,
    }
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    problems = []
    for key, value in built.items():
        found = hf_config.get(key, rope.get(key))
        if found is not None and (value is None or abs(float(found) - float(value)) > 1e-6 * abs(float(found))):
            problems.append(f"config.json has {key}={found} but the model has {value}")
    activation = hf_config.get("hidden_activation") or hf_config.get("hidden_act")
    if activation not in (None, "gelu_pytorch_tanh"):
        problems.append(f"config.json has hidden_activation={activation!r} but the model uses 'gelu_pytorch_tanh'")
    return problems


def _layer_type_problems(hf_config: Dict[str, Any], attns: List[Gemma2Attention]) -> List[str]:
    built = ["full_attention" if a.sliding_window_size is None else "sliding_attention" for a in attns]
    found = hf_config.get("layer_types") or built
    differ = [i for i, (a, b) in enumerate(zip(found, built)) if a != b]
    if not differ:
        return []
    i = differ[0]
    return [f"config.json has layer_types[{i}]={found[i]!r} but the model's layer {i} is {built[i]!r}"]

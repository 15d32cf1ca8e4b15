"""A QLoRA model for an HF checkpoint's ``config.json``: torchtune's component builder of its family with the
config's sizes, for tools that take a model folder instead of a recipe config (``tune-ext merge``,
``tune-ext generate --base``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from torchtune.models.llama3 import lora_llama3
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.models.qwen2 import lora_qwen2
from torchtune.modules import TransformerDecoder

from torchtune_ext.models._gemma2 import gemma2_builder_args, lora_gemma2
from torchtune_ext.models._phi3 import lora_phi
from torchtune_ext.models._qwen3 import lora_qwen3
from torchtune_ext.models._smollm2 import lora_smollm2
from torchtune_ext.modules import hf_rope_scaling

#: HF ``model_type`` -> our checkpointer's model type.
HF_MODEL_TYPES = {
    "llama": "LLAMA3_2",
    "mistral": "MISTRAL",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "gemma2": "GEMMA2",
    "phi3": "PHI3_MINI",
}


def torchtune_builder_for(hf_config: Dict[str, Any]) -> Tuple[Callable[..., TransformerDecoder], Dict[str, Any], str]:
    """The torchtune ``lora_*`` component builder and its architecture arguments for an HF ``config.json``.

    Args:
        hf_config (Dict[str, Any]): the config (``model_type`` llama, mistral, qwen2, qwen3 or gemma2).

    Returns:
        Tuple[Callable[..., TransformerDecoder], Dict[str, Any], str]: the builder, its arguments (no LoRA
        settings) and the checkpointer's ``model_type``.

    Raises:
        ValueError: on an unsupported ``model_type`` or RoPE scaling.
    """
    model_type = hf_config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"config.json has model_type={model_type!r}; supported: {sorted(HF_MODEL_TYPES)} (Llama 2/3.x, Mistral, "
            "Qwen 2/2.5, Qwen3, Gemma 2)."
        )
    if model_type == "gemma2":
        return lora_gemma2, gemma2_builder_args(hf_config), HF_MODEL_TYPES[model_type]
    heads = hf_config["num_attention_heads"]
    args = dict(
        vocab_size=hf_config["vocab_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf_config.get("num_key_value_heads", heads),
        embed_dim=hf_config["hidden_size"],
        intermediate_dim=hf_config["intermediate_size"],
        max_seq_len=hf_config.get("max_position_embeddings", 4096),
        norm_eps=hf_config.get("rms_norm_eps", 1e-5),
    )
    # transformers 5 writes rope_parameters (with rope_theta inside); 4.x rope_scaling and rope_theta
    scaling = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    args["rope_base"] = hf_config.get("rope_theta", scaling.get("rope_theta", 10_000.0))
    tied = bool(hf_config.get("tie_word_embeddings", False))
    if model_type == "qwen3":  # head_dim is not hidden_size // heads (0.6B, 4B)
        if scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"config.json has rope_scaling={scaling}; Qwen3 is supported without RoPE scaling.")
        qwen3 = dict(head_dim=hf_config.get("head_dim", args["embed_dim"] // heads), tie_word_embeddings=tied)
        return lora_qwen3, {**args, **qwen3}, HF_MODEL_TYPES[model_type]
    if model_type == "phi3":  # Phi-3 / 3.5 / 4 / 4-mini
        phi = dict(
            partial_rotary_factor=hf_config.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0)),
            tie_word_embeddings=tied,
        )
        return lora_phi, {**args, **phi, "rope_scaling": hf_rope_scaling(hf_config)}, HF_MODEL_TYPES[model_type]
    if model_type == "qwen2":
        return lora_qwen2, {**args, "tie_word_embeddings": tied}, HF_MODEL_TYPES[model_type]
    rope_type = scaling.get("rope_type", scaling.get("type"))
    rope_type = None if rope_type == "default" else rope_type
    if rope_type == "llama3":
        args.update(scale_factor=scaling["factor"], tie_word_embeddings=tied)
        return lora_llama3_2, args, HF_MODEL_TYPES[model_type]
    if rope_type is not None:
        raise ValueError(
            f"config.json has rope_scaling={scaling}; supported: Llama 3.1-style scaling ('llama3') or none "
            "(Llama 2/3, Mistral, SmolLM2)."
        )
    if tied:  # plain RoPE, tied output: SmolLM2
        return lora_smollm2, args, HF_MODEL_TYPES[model_type]
    return lora_llama3, args, HF_MODEL_TYPES[model_type]

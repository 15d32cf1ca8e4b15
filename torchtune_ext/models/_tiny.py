"""Tiny Llama-style and Qwen-style models with NF4-compatible dims, for tests and the embedded demo.

``lora_tiny_*`` are plain torchtune builders (so torchtune's own recipes can build them from a config for parity
tests); ``qlora_tiny_*`` are their QLoRA versions. Every linear's numel is a multiple of 64 * 256.
"""

from typing import Any, Dict, List

from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.models.qwen2 import lora_qwen2
from torchtune.modules import TransformerDecoder

from torchtune_ext.models._qlora import qlora_builder

TINY_LLAMA_ARGS: Dict[str, Any] = dict(
    vocab_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=256,
    intermediate_dim=512,
    max_seq_len=512,
    rope_base=500_000,
    scale_factor=32,
    tie_word_embeddings=True,
)

TINY_QWEN_ARGS: Dict[str, Any] = dict(
    vocab_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=256,
    intermediate_dim=512,
    max_seq_len=512,
    rope_base=1_000_000.0,
    norm_eps=1e-6,
    tie_word_embeddings=True,
)


def lora_tiny_llama(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    **overrides: Any,
) -> TransformerDecoder:
    """A 2-layer, 256-dim Llama 3.2-style LoRA model (tied embeddings, GQA, scaled RoPE).

    Args:
        lora_attn_modules (List[str]): attention projections that get LoRA.
        apply_lora_to_mlp (bool): LoRA on the MLP too.
        apply_lora_to_output (bool): LoRA on the output projection (not with tied embeddings).
        lora_rank (int): LoRA rank.
        lora_alpha (float): LoRA alpha.
        lora_dropout (float): LoRA dropout.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): torchtune's NF4 base (torchao's compute path).
        **overrides: replace any of ``TINY_LLAMA_ARGS`` (e.g. ``vocab_size``).

    Returns:
        TransformerDecoder: the model.
    """
    return lora_llama3_2(
        lora_attn_modules,
        apply_lora_to_mlp,
        apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **{**TINY_LLAMA_ARGS, **overrides},
    )


def lora_tiny_qwen(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    **overrides: Any,
) -> TransformerDecoder:
    """A 2-layer, 256-dim Qwen 2.5-style LoRA model (q/k/v biases, tied embeddings).

    Args:
        lora_attn_modules (List[str]): attention projections that get LoRA.
        apply_lora_to_mlp (bool): LoRA on the MLP too.
        apply_lora_to_output (bool): LoRA on the output projection (not with tied embeddings).
        lora_rank (int): LoRA rank.
        lora_alpha (float): LoRA alpha.
        lora_dropout (float): LoRA dropout.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): torchtune's NF4 base (torchao's compute path).
        **overrides: replace any of ``TINY_QWEN_ARGS``.

    Returns:
        TransformerDecoder: the model.
    """
    return lora_qwen2(
        lora_attn_modules,
        apply_lora_to_mlp,
        apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **{**TINY_QWEN_ARGS, **overrides},
    )


qlora_tiny_llama = qlora_builder(lora_tiny_llama)
qlora_tiny_qwen = qlora_builder(lora_tiny_qwen)

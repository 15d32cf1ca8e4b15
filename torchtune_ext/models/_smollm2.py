"""SmolLM2 (135M, 360M, 1.7B): the Llama architecture with plain RoPE and tied input/output embeddings.

torchtune 0.6.1 has no SmolLM2 builder, and neither of its Llama component builders fits as is: ``lora_llama3``
has plain RoPE but an untied output projection, ``lora_llama3_2`` ties the output but always scales RoPE (Llama 3.1
style). :func:`lora_smollm2` is ``lora_llama3`` with its output projection tied to the token embedding (torchtune's
``TiedLinear``), as ``lora_llama3_2`` ties it. The sizes are those of the HF ``config.json`` of
``HuggingFaceTB/SmolLM2-{135M,360M,1.7B}(-Instruct)``.
"""

from typing import Any, Callable, Dict, List

from torchtune.models.llama3 import lora_llama3
from torchtune.models.llama3._component_builders import LORA_ATTN_MODULES
from torchtune.modules import TransformerDecoder

from torchtune_ext.models._common import check_no_lora_on_tied_output, sized_builder, tie_output_


def lora_smollm2(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    max_seq_len: int,
    intermediate_dim: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    rope_base: float = 10_000.0,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """A SmolLM2-style LoRA model: torchtune's ``lora_llama3`` (plain RoPE) with the output tied to the embedding.

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): attention projections that get LoRA.
        apply_lora_to_mlp (bool): LoRA on the MLP too.
        apply_lora_to_output (bool): must be False: the output projection is the (frozen) token embedding.
        vocab_size (int): vocabulary size.
        num_layers (int): decoder layers.
        num_heads (int): query heads.
        num_kv_heads (int): key/value heads.
        embed_dim (int): model dim.
        max_seq_len (int): maximum sequence length (RoPE cache, KV caches).
        intermediate_dim (int): MLP hidden dim.
        attn_dropout (float): attention dropout.
        norm_eps (float): RMSNorm epsilon.
        rope_base (float): RoPE theta.
        lora_rank (int): LoRA rank.
        lora_alpha (float): LoRA alpha.
        lora_dropout (float): LoRA dropout.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): torchtune's NF4 base.

    Returns:
        TransformerDecoder: the model.

    Raises:
        ValueError: if ``apply_lora_to_output`` is set.
    """
    check_no_lora_on_tied_output(apply_lora_to_output, True, "SmolLM2")
    model = lora_llama3(
        lora_attn_modules,
        apply_lora_to_mlp,
        False,
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        intermediate_dim=intermediate_dim,
        attn_dropout=attn_dropout,
        norm_eps=norm_eps,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )
    return tie_output_(model)


#: the architecture of each size, from its HF ``config.json`` (all: vocab 49152, RMSNorm eps 1e-5, tied output).
#: RoPE theta is 100,000 for 135M / 360M and 130,000 for 1.7B (no RoPE scaling); max_position_embeddings 8192.
SMOLLM2_ARCHS: Dict[str, Dict[str, Any]] = {
    "135m": dict(num_layers=30, num_heads=9, num_kv_heads=3, embed_dim=576, intermediate_dim=1536),
    "360m": dict(num_layers=32, num_heads=15, num_kv_heads=5, embed_dim=960, intermediate_dim=2560),
    "1_7b": dict(num_layers=24, num_heads=32, num_kv_heads=32, embed_dim=2048, intermediate_dim=8192),
}
_ROPE_BASES = {"135m": 100_000.0, "360m": 100_000.0, "1_7b": 130_000.0}


def _sized(size: str) -> Callable[..., TransformerDecoder]:
    return sized_builder(
        lora_smollm2,
        f"lora_smollm2_{size}",
        f"SmolLM2-{size.replace('_', '.').upper()}: :func:`lora_smollm2` with {SMOLLM2_ARCHS[size]}, "
        f"rope_base={_ROPE_BASES[size]}, vocab 49152, max_seq_len 8192.",
        vocab_size=49_152,
        max_seq_len=8192,
        norm_eps=1e-5,
        rope_base=_ROPE_BASES[size],
        **SMOLLM2_ARCHS[size],
    )


lora_smollm2_135m = _sized("135m")
lora_smollm2_360m = _sized("360m")
lora_smollm2_1_7b = _sized("1_7b")

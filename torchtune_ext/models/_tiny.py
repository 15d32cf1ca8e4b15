"""Tiny Llama-style and Qwen-style models with NF4-compatible dims, for tests and the embedded demo.

``lora_tiny_*`` are plain torchtune builders (so torchtune's own recipes can build them from a config for parity
tests); ``qlora_tiny_*`` are their QLoRA versions. Every linear's numel is a multiple of 64 * 256.
"""

import inspect
from typing import Any, Callable, Dict, List

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


#: LoRA settings of the tiny builders unless given (torchtune's builders require ``lora_rank`` and ``lora_alpha``).
_LORA_DEFAULTS: Dict[str, Any] = dict(lora_rank=8, lora_alpha=16, lora_dropout=0.0, use_dora=False, quantize_base=False)


def _tiny_builder(
    lora_builder: Callable[..., TransformerDecoder], arch: Dict[str, Any], name: str, what: str
) -> Callable[..., TransformerDecoder]:
    """A torchtune ``lora_*`` builder with the tiny architecture ``arch`` and :data:`_LORA_DEFAULTS`."""

    def builder(
        lora_attn_modules: List[str],
        apply_lora_to_mlp: bool = False,
        apply_lora_to_output: bool = False,
        **kwargs: Any,
    ) -> TransformerDecoder:
        return lora_builder(
            lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, **{**_LORA_DEFAULTS, **arch, **kwargs}
        )

    builder.__name__ = builder.__qualname__ = name
    # The keys a config may set (what config checks read): the torchtune builder's, with the tiny defaults.
    defaults = {**_LORA_DEFAULTS, **arch}
    builder.__signature__ = inspect.signature(lora_builder).replace(
        parameters=[
            p.replace(default=defaults[p.name]) if p.name in defaults else p
            for p in inspect.signature(lora_builder).parameters.values()
        ]
    )
    builder.__doc__ = f"""A 2-layer, 256-dim {what} LoRA model.

    Args:
        lora_attn_modules (List[str]): attention projections that get LoRA.
        apply_lora_to_mlp (bool): LoRA on the MLP too.
        apply_lora_to_output (bool): LoRA on the output projection (not with tied embeddings).
        **kwargs: ``lora_rank`` (8), ``lora_alpha`` (16), ``lora_dropout`` (0.0), ``use_dora`` (False),
            ``quantize_base`` (False: torchtune's NF4 base if True), or any architecture setting to replace.

    Returns:
        TransformerDecoder: the model.
    """
    return builder


lora_tiny_llama = _tiny_builder(
    lora_llama3_2, TINY_LLAMA_ARGS, "lora_tiny_llama", "Llama 3.2-style (tied embeddings, GQA, scaled RoPE)"
)
lora_tiny_qwen = _tiny_builder(
    lora_qwen2, TINY_QWEN_ARGS, "lora_tiny_qwen", "Qwen 2.5-style (q/k/v biases, tied embeddings)"
)
qlora_tiny_llama = qlora_builder(lora_tiny_llama)
qlora_tiny_qwen = qlora_builder(lora_tiny_qwen)

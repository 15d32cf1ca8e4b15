"""Gemma 2 (2B, 9B, 27B): torchtune's ``lora_gemma2`` with the final logit soft-capping where HF applies it.

torchtune 0.6.1's Gemma 2 builders are right about the attention (its own ``Gemma2Attention``: tanh soft-capping of
the attention scores, a sliding window on every even layer, ``query_pre_attn_scalar``), the scaled embeddings
(``GemmaNormEmbeddings``: ``embedding * sqrt(dim)`` in the compute dtype, as transformers), the ``(1 + w)`` RMSNorms
(computed in fp32, cast back: transformers' order) and the tied output, but differ from the HF models in three ways
that :func:`lora_gemma2` and the key mapping (``torchtune_ext.checkpoint._gemma2``) correct:

- its sized builders swap the two capping values (attention 30, final 50; the HF configs have
  ``attn_logit_softcapping=50``, ``final_logit_softcapping=30``);
- its final "norm" (``Gemma2FinalNorm``) soft-caps the normed hidden state instead of the logits: here the final norm
  is a plain ``GemmaRMSNorm`` and the output is :class:`LogitSoftCapping` around the tied projection;
- its HF key mapping swaps ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``.

Precision: the logit capping runs in fp32 (the logits are returned in fp32, as torchtune's decoder returns them);
the attention scores are capped in the compute dtype and their softmax is fp32, as in transformers' eager attention.
"""

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torchtune.models.gemma.gemma_norm_embedding import GemmaNormEmbeddings
from torchtune.models.gemma.rms_norm import GemmaRMSNorm
from torchtune.models.gemma2._component_builders import lora_gemma2 as torchtune_lora_gemma2
from torchtune.modules import FrozenNF4Linear, TiedLinear, TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from torchtune_ext.models._common import check_no_lora_on_tied_output, sized_builder
from torchtune_ext.modules.low_precision import FrozenEmbedding, FrozenTiedLinear


class LogitSoftCapping(nn.Module):
    """The output projection followed by Gemma 2's final logit soft-capping, ``cap * tanh(logits / cap)`` in fp32.

    It is not a plain linear map, so :class:`~torchtune_ext.modules.LinearCrossEntropyLoss` calls it chunk by chunk
    (its checkpointed path) and the loss sees the capped logits.

    Args:
        projection (Callable[[torch.Tensor], torch.Tensor]): the projection (a ``TiedLinear``: no parameters here).
        capping_value (float): the cap (``final_logit_softcapping``).
    """

    def __init__(self, projection: Callable[[torch.Tensor], torch.Tensor], capping_value: float) -> None:
        super().__init__()
        self.projection = projection
        self.capping_value = capping_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): last hidden state ``(..., embed_dim)``.

        Returns:
            torch.Tensor: capped fp32 logits ``(..., vocab_size)``.
        """
        logits = self.projection(x).float()
        return torch.tanh(logits / self.capping_value) * self.capping_value


class FrozenGemmaNormEmbeddings(FrozenEmbedding):
    """torchtune's ``GemmaNormEmbeddings`` (rows times ``sqrt(embedding_dim)`` in the compute dtype) with the table
    stored in another dtype (:class:`~torchtune_ext.modules.low_precision.FrozenEmbedding`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input (torch.Tensor): token ids.

        Returns:
            torch.Tensor: their scaled embeddings in the compute dtype.
        """
        x = super().forward(input)
        return x * torch.tensor(self.embedding_dim**0.5, dtype=x.dtype)


def store_gemma2_frozen_weights_in_(model: TransformerDecoder, dtype: torch.dtype, storage_dtype: torch.dtype) -> None:
    """A Gemma 2 model's token embedding (and so its tied output) stored in ``storage_dtype``, computing in ``dtype``.

    Args:
        model (TransformerDecoder): a :func:`lora_gemma2` model (on meta); other models are left as they are.
        dtype (torch.dtype): compute dtype.
        storage_dtype (torch.dtype): storage dtype of the table.
    """
    embedding = model.tok_embeddings
    if type(embedding) is not GemmaNormEmbeddings or not isinstance(model.output, LogitSoftCapping):
        return
    vocab_size, embed_dim = embedding.num_embeddings, embedding.embedding_dim
    model.tok_embeddings = FrozenGemmaNormEmbeddings(vocab_size, embed_dim, dtype, storage_dtype)
    model.output.projection = FrozenTiedLinear(model.tok_embeddings, dtype)


def _check_cache_within_window(attn: nn.Module, args: Any) -> None:
    """Forward pre-hook of the sliding-window layers: no KV cache longer than the window.

    torchtune's ``Gemma2Attention`` places the window by the row of the mask, not the token's position: right for
    a whole sequence (training, a prefill from position 0), wrong for a cached decoding step past the window.

    Raises:
        ValueError: naming the cache length and the window.
    """
    cache = attn.kv_cache
    if attn.cache_enabled and cache is not None and cache.k_cache.shape[2] > attn.sliding_window_size:
        raise ValueError(
            f"Gemma 2 with a KV cache of {cache.k_cache.shape[2]} tokens: cached decoding is only right up to the "
            f"sliding window ({attn.sliding_window_size} tokens, torchtune's Gemma2Attention); set max_seq_len <= "
            f"{attn.sliding_window_size} (or use_cache=False)."
        )


def lora_gemma2(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 10_000.0,
    attn_logit_softcapping: float = 50.0,
    final_logit_softcapping: float = 30.0,
    sliding_window_size: int = 4096,
    query_pre_attn_scalar: Optional[int] = None,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """A Gemma 2 LoRA model as transformers' ``Gemma2ForCausalLM`` computes it (see the module docstring).

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): attention projections that get LoRA (may be empty).
        apply_lora_to_mlp (bool): LoRA on the MLP too.
        apply_lora_to_output (bool): must be False: the output projection is the (frozen) token embedding.
        vocab_size (int): vocabulary size.
        num_layers (int): decoder layers (even ones use the sliding window).
        num_heads (int): query heads.
        head_dim (int): head dim (256 for 2B / 9B: not ``embed_dim // num_heads``).
        num_kv_heads (int): key/value heads.
        embed_dim (int): model dim.
        intermediate_dim (int): MLP hidden dim.
        max_seq_len (int): maximum sequence length (RoPE cache, KV caches).
        attn_dropout (float): attention dropout.
        norm_eps (float): RMSNorm epsilon.
        rope_base (float): RoPE theta.
        attn_logit_softcapping (float): cap of the attention scores (HF ``attn_logit_softcapping``).
        final_logit_softcapping (float): cap of the logits (HF ``final_logit_softcapping``).
        sliding_window_size (int): window of the even layers (HF ``sliding_window``).
        query_pre_attn_scalar (Optional[int]): scores are scaled by its inverse square root; None: ``head_dim``.
        lora_rank (int): LoRA rank.
        lora_alpha (float): LoRA alpha.
        lora_dropout (float): LoRA dropout.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): torchtune's NF4 base.

    Returns:
        TransformerDecoder: the model; its output is :class:`LogitSoftCapping` around the tied embedding.

    Raises:
        ValueError: if ``apply_lora_to_output`` is set.
    """
    check_no_lora_on_tied_output(apply_lora_to_output, True, "Gemma 2")
    model = torchtune_lora_gemma2(
        lora_attn_modules or ["q_proj"],  # torchtune's builder wants one; undone below
        apply_lora_to_mlp,
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        norm_eps=norm_eps,
        rope_base=rope_base,
        hidden_capping_value=attn_logit_softcapping,
        final_capping_value=final_logit_softcapping,
        sliding_window_size=sliding_window_size,
        query_pre_attn_scalar=query_pre_attn_scalar,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )
    if not lora_attn_modules:  # the base model alone (e.g. generation without an adapter)
        linear = FrozenNF4Linear if quantize_base else nn.Linear
        for layer in model.layers:
            layer.attn.q_proj = linear(embed_dim, num_heads * head_dim, bias=False)
    model.norm = GemmaRMSNorm(embed_dim, eps=norm_eps)
    for layer in model.layers:
        if layer.attn.sliding_window_size is not None:
            layer.attn.register_forward_pre_hook(_check_cache_within_window)
    model.output = LogitSoftCapping(TiedLinear(model.tok_embeddings), final_logit_softcapping)
    return model


#: the architecture of each size, from its HF ``config.json`` (all: vocab 256000, RMSNorm eps 1e-6, RoPE theta 10,000,
#: sliding window 4096 on even layers, attention cap 50, logit cap 30, tied output, max_position_embeddings 8192).
GEMMA2_ARCHS: Dict[str, Dict[str, Any]] = {
    "2b": dict(
        num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256, embed_dim=2304, intermediate_dim=9216,
        query_pre_attn_scalar=256,
    ),
    "9b": dict(
        num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256, embed_dim=3584, intermediate_dim=14336,
        query_pre_attn_scalar=256,
    ),
    "27b": dict(
        num_layers=46, num_heads=32, num_kv_heads=16, head_dim=128, embed_dim=4608, intermediate_dim=36864,
        query_pre_attn_scalar=144,
    ),
}  # fmt: skip


def _sized(size: str) -> Callable[..., TransformerDecoder]:
    return sized_builder(
        lora_gemma2,
        f"lora_gemma2_{size}",
        f"Gemma 2 {size.upper()}: :func:`lora_gemma2` with {GEMMA2_ARCHS[size]}, vocab 256000.",
        vocab_size=256_000,
        max_seq_len=8192,
        norm_eps=1e-6,
        rope_base=10_000.0,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window_size=4096,
        **GEMMA2_ARCHS[size],
    )


lora_gemma2_2b = _sized("2b")
lora_gemma2_9b = _sized("9b")
lora_gemma2_27b = _sized("27b")


def gemma2_builder_args(hf_config: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`lora_gemma2`'s architecture arguments for a Gemma 2 ``config.json``.

    Args:
        hf_config (Dict[str, Any]): the config (``model_type`` gemma2).

    Returns:
        Dict[str, Any]: the arguments (no LoRA settings).

    Raises:
        ValueError: if ``layer_types`` is not sliding on even layers, full on odd ones (what the builder builds).
    """
    check_gemma2_layer_types(hf_config)
    scaling = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    heads = hf_config["num_attention_heads"]
    return dict(
        vocab_size=hf_config["vocab_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf_config.get("num_key_value_heads", heads),
        head_dim=hf_config.get("head_dim", hf_config["hidden_size"] // heads),
        embed_dim=hf_config["hidden_size"],
        intermediate_dim=hf_config["intermediate_size"],
        max_seq_len=hf_config.get("max_position_embeddings", 8192),
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_base=hf_config.get("rope_theta", scaling.get("rope_theta", 10_000.0)),
        attn_logit_softcapping=hf_config.get("attn_logit_softcapping", 50.0),
        final_logit_softcapping=hf_config.get("final_logit_softcapping", 30.0),
        sliding_window_size=hf_config.get("sliding_window", 4096),
        query_pre_attn_scalar=hf_config.get("query_pre_attn_scalar", 256),
    )


def check_gemma2_layer_types(hf_config: Dict[str, Any]) -> None:
    """Fails unless the config's layers are what :func:`lora_gemma2` builds: sliding window on even layers.

    Args:
        hf_config (Dict[str, Any]): a Gemma 2 ``config.json`` (no ``layer_types``: transformers' default, which is).

    Raises:
        ValueError: naming ``layer_types`` and the first layer that differs.
    """
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        return
    for i, found in enumerate(layer_types):
        expected = "sliding_attention" if i % 2 == 0 else "full_attention"
        if found != expected:
            raise ValueError(
                f"config.json has layer_types[{i}]={found!r}, but Gemma 2 builders (torchtune's) use "
                f"{expected!r} there (a sliding window on even layers only); this checkpoint's layer pattern is "
                "not supported."
            )

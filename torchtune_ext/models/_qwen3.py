"""Qwen3 dense (0.6B, 1.7B, 4B, 8B, 14B): Qwen2's decoder with a per-head RMSNorm on q and k before RoPE, no q/k/v
bias, and a head dim (128) that is not ``embed_dim // num_heads``.

torchtune 0.6.1 has no Qwen3 builder, and its ``MultiHeadAttention`` applies ``q_norm`` / ``k_norm`` *after* RoPE
(which, with the norm's per-channel scale, is another function): :class:`Qwen3Attention` is that module with the
norms moved before RoPE, as transformers' ``Qwen3Attention`` and torchtune's later Qwen3 builders apply them.
Everything else is torchtune's: ``LoRALinear`` / ``DoRALinear``, ``RMSNorm``, Qwen2's RoPE (half-split, the HF
layout: no q/k permutation), ``lora_qwen2_mlp``, ``TransformerSelfAttentionLayer``, ``TransformerDecoder`` and
``TiedLinear``. The sizes are those of the HF ``config.json`` of ``Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B}``.
"""

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torchtune.models.qwen2._component_builders import lora_qwen2_mlp, qwen2_mlp
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.attention_utils import _MaskType
from torchtune.modules.peft import LORA_ATTN_MODULES, DoRALinear, LoRALinear

from torchtune_ext.models._common import check_no_lora_on_tied_output, sized_builder


class Qwen3Attention(MultiHeadAttention):
    """torchtune's ``MultiHeadAttention`` with ``q_norm`` / ``k_norm`` applied per head *before* RoPE (Qwen3's
    order; torchtune 0.6.1 applies them after). Same arguments, submodules and state-dict keys."""

    def forward(
        self,
        x: torch.Tensor,
        y: Optional[torch.Tensor] = None,
        *,
        mask: Optional[_MaskType] = None,
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): query input, ``[b, s_x, d]``.
            y (Optional[torch.Tensor]): key/value input, ``[b, s_y, d]``; None reads the KV cache.
            mask (Optional[_MaskType]): as ``MultiHeadAttention.forward``.
            input_pos (Optional[torch.Tensor]): token positions, as ``MultiHeadAttention.forward``.

        Returns:
            torch.Tensor: ``[b, s_x, d]``.

        Raises:
            ValueError: if ``y`` is None without an enabled KV cache.
        """
        b, s_x, _ = x.shape
        q = self._normed_rope(self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim), self.q_norm, input_pos)
        q = q.transpose(1, 2)
        if y is None:
            if self.kv_cache is None or not self.cache_enabled:
                raise ValueError("Must provide y input or use kv_cache to enable streaming decoding")
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
        else:
            s_y = y.shape[1]
            k = self.k_proj(y).view(b, s_y, -1, self.head_dim)
            k = self._normed_rope(k, self.k_norm, input_pos).transpose(1, 2)
            v = self.v_proj(y).view(b, s_y, -1, self.head_dim).transpose(1, 2)
            if self.kv_cache is not None and self.cache_enabled:
                k, v = self.kv_cache.update(k, v)
        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, self.num_heads // self.num_kv_heads, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)
        output = self._attention_call(
            q,
            k,
            v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s_x, -1))

    def _normed_rope(
        self, heads: torch.Tensor, norm: Optional[nn.Module], input_pos: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """``[b, s, n, h_d]`` heads: the per-head norm (over ``h_d``), then RoPE."""
        if norm is not None:
            heads = norm(heads)
        return heads if self.pos_embeddings is None else self.pos_embeddings(heads, input_pos=input_pos)


def _projection(
    name: str,
    in_dim: int,
    out_dim: int,
    lora_modules: List[LORA_ATTN_MODULES],
    adapter: Dict[str, Any],
) -> nn.Module:
    """A bias-free attention projection: LoRA/DoRA if ``name`` is in ``lora_modules``, else ``nn.Linear``."""
    if name not in lora_modules:
        return nn.Linear(in_dim, out_dim, bias=False)
    cls = DoRALinear if adapter["use_dora"] else LoRALinear
    return cls(
        in_dim,
        out_dim,
        rank=adapter["lora_rank"],
        alpha=adapter["lora_alpha"],
        dropout=adapter["lora_dropout"],
        quantize_base=adapter["quantize_base"],
    )


def lora_qwen3_self_attention(
    lora_modules: List[LORA_ATTN_MODULES],
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> Qwen3Attention:
    """Qwen3 self-attention with LoRA on ``lora_modules``: bias-free q/k/v/output projections of ``head_dim``-wide
    heads, per-head RMSNorm on q and k before Qwen2's RoPE.

    Args:
        lora_modules (List[LORA_ATTN_MODULES]): projections that get LoRA (``q_proj``, ``k_proj``, ``v_proj``,
            ``output_proj``).
        embed_dim (int): model dim.
        num_heads (int): query heads.
        num_kv_heads (int): key/value heads.
        head_dim (int): head dim (Qwen3: 128 at every size).
        max_seq_len (int): RoPE cache length.
        attn_dropout (float): attention dropout.
        norm_eps (float): q/k RMSNorm epsilon.
        rope_base (float): RoPE theta.
        lora_rank (int): LoRA rank.
        lora_alpha (float): LoRA alpha.
        lora_dropout (float): LoRA dropout.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): torchtune's NF4 base.

    Returns:
        Qwen3Attention: the attention module.

    Raises:
        ValueError: if ``lora_modules`` is empty.
    """
    if not lora_modules:
        raise ValueError("model.lora_attn_modules is empty: name one or more of q_proj, k_proj, v_proj, output_proj.")
    adapter = dict(
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    return Qwen3Attention(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_proj=_projection("q_proj", embed_dim, q_dim, lora_modules, adapter),
        k_proj=_projection("k_proj", embed_dim, kv_dim, lora_modules, adapter),
        v_proj=_projection("v_proj", embed_dim, kv_dim, lora_modules, adapter),
        output_proj=_projection("output_proj", q_dim, embed_dim, lora_modules, adapter),
        pos_embeddings=Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base),
        q_norm=RMSNorm(dim=head_dim, eps=norm_eps),
        k_norm=RMSNorm(dim=head_dim, eps=norm_eps),
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
    )


def lora_qwen3(
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int = 128,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """A Qwen3 dense LoRA model: :func:`lora_qwen3_self_attention` layers, Qwen2's MLP, RMSNorms, and an output
    projection tied to the token embedding or its own.

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): attention projections that get LoRA.
        apply_lora_to_mlp (bool): LoRA on the MLP too.
        apply_lora_to_output (bool): LoRA on an untied output projection.
        vocab_size (int): vocabulary size.
        num_layers (int): decoder layers.
        num_heads (int): query heads.
        num_kv_heads (int): key/value heads.
        embed_dim (int): model dim.
        intermediate_dim (int): MLP hidden dim.
        max_seq_len (int): maximum sequence length (RoPE cache, KV caches).
        head_dim (int): head dim (HF ``head_dim``; 128 for every Qwen3 size).
        attn_dropout (float): attention dropout.
        norm_eps (float): RMSNorm epsilon (all norms).
        rope_base (float): RoPE theta.
        tie_word_embeddings (bool): output projection = token embedding (0.6B, 1.7B, 4B).
        lora_rank (int): LoRA rank.
        lora_alpha (float): LoRA alpha.
        lora_dropout (float): LoRA dropout.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): torchtune's NF4 base.

    Returns:
        TransformerDecoder: the model.

    Raises:
        ValueError: if ``apply_lora_to_output`` with a tied output.
    """
    check_no_lora_on_tied_output(apply_lora_to_output, tie_word_embeddings, "Qwen3 (0.6B/1.7B/4B: tied)")
    lora = dict(lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, quantize_base=quantize_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = lora_qwen3_self_attention(
            lora_attn_modules,
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
            norm_eps=norm_eps,
            rope_base=rope_base,
            use_dora=use_dora,
            **lora,
        )
        mlp = (
            lora_qwen2_mlp(dim=embed_dim, hidden_dim=intermediate_dim, use_dora=use_dora, **lora)
            if apply_lora_to_mlp
            else qwen2_mlp(dim=embed_dim, hidden_dim=intermediate_dim)
        )
        norms = dict(sa_norm=RMSNorm(embed_dim, eps=norm_eps), mlp_norm=RMSNorm(embed_dim, eps=norm_eps))
        layers.append(TransformerSelfAttentionLayer(attn=attn, mlp=mlp, **norms))
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    if tie_word_embeddings:
        output = TiedLinear(tok_embeddings)
    elif apply_lora_to_output:
        cls = DoRALinear if use_dora else LoRALinear
        output = cls(embed_dim, vocab_size, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)
    else:
        output = nn.Linear(embed_dim, vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )


#: the architecture of each size, from its HF ``config.json`` (all: head_dim 128, vocab 151936, RMSNorm eps 1e-6,
#: RoPE theta 1,000,000 without scaling, max_position_embeddings 40960).
QWEN3_ARCHS: Dict[str, Dict[str, Any]] = {
    "0_6b": dict(num_layers=28, num_heads=16, num_kv_heads=8, embed_dim=1024, intermediate_dim=3072),
    "1_7b": dict(num_layers=28, num_heads=16, num_kv_heads=8, embed_dim=2048, intermediate_dim=6144),
    "4b": dict(num_layers=36, num_heads=32, num_kv_heads=8, embed_dim=2560, intermediate_dim=9728),
    "8b": dict(num_layers=36, num_heads=32, num_kv_heads=8, embed_dim=4096, intermediate_dim=12288),
    "14b": dict(num_layers=40, num_heads=40, num_kv_heads=8, embed_dim=5120, intermediate_dim=17408),
}
_TIED = {"0_6b": True, "1_7b": True, "4b": True, "8b": False, "14b": False}


def _sized(size: str) -> Callable[..., TransformerDecoder]:
    return sized_builder(
        lora_qwen3,
        f"lora_qwen3_{size}",
        f"Qwen3-{size.replace('_', '.').upper()}: :func:`lora_qwen3` with {QWEN3_ARCHS[size]}, head_dim 128, "
        f"{'tied' if _TIED[size] else 'untied'} output, rope_base 1e6, vocab 151936, max_seq_len 40960.",
        vocab_size=151_936,
        max_seq_len=40_960,
        head_dim=128,
        norm_eps=1e-6,
        rope_base=1_000_000.0,
        tie_word_embeddings=_TIED[size],
        **QWEN3_ARCHS[size],
    )


lora_qwen3_0_6b = _sized("0_6b")
lora_qwen3_1_7b = _sized("1_7b")
lora_qwen3_4b = _sized("4b")
lora_qwen3_8b = _sized("8b")
lora_qwen3_14b = _sized("14b")

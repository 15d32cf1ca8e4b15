"""Phi-3.5-mini and Phi-4-mini: torchtune's ``lora_phi3`` component builder with the RoPE their checkpoints use.

torchtune 0.6.1's ``lora_phi3_mini`` is Phi-3-mini-4k (plain RoPE, theta 10,000), which Phi-3.5-mini-instruct
is not quite: its ``config.json`` has LongRoPE (``rope_scaling.type: longrope``), i.e. per-frequency ``short_factor``
divisors up to ``original_max_position_embeddings`` (4096) positions and ``long_factor`` ones beyond, and cos/sin
scaled by ``sqrt(1 + ln(max_position_embeddings / original) / ln(original))`` (1.19 for 131072 / 4096) at every
length. Phi-4-mini-instruct (3.8B) also differs from torchtune's ``lora_phi4_14b`` (which is Phi-4 14B): 24 query /
8 key-value heads of dim 128, RoPE on the first 75% of each head (``partial_rotary_factor: 0.75``), LongRoPE, a
200,064-token vocabulary and the output tied to the embedding. :func:`lora_phi` builds either (transformers'
``Phi3ForCausalLM`` is the reference): ``lora_phi3`` with :class:`PhiRotaryEmbeddings` in every layer and, when
tied, torchtune's ``TiedLinear`` output.

LongRoPE's factors were searched per checkpoint, not derived, so the sized builders read them from the checkpoint's
own ``config.json`` (``rope_scaling_config``: in a recipe config, ``${checkpointer.checkpoint_dir}/config.json``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torchtune.models.phi3 import lora_phi3
from torchtune.models.phi3._component_builders import LORA_ATTN_MODULES
from torchtune.modules import MultiHeadAttention, TransformerDecoder

from torchtune_ext.models._common import check_no_lora_on_tied_output, sized_builder, tie_output_
from torchtune_ext.modules import hf_rope_scaling


class PhiRotaryEmbeddings(nn.Module):
    """Phi's RoPE (rotating halves, as transformers' ``Phi3RotaryEmbedding``) with LongRoPE and partial rotation.

    Without LongRoPE and with ``rotary_dim == head_dim`` it is torchtune's ``Phi3RotaryPositionalEmbeddings``.
    LongRoPE settings given as a ``config.json`` path are read when a cache is first built on a real device (or
    :meth:`longrope` is called): a model built on the meta device or in fake tensors (a config check, the memory
    estimate of a dry run before the download) does not need the file.

    Args:
        head_dim (int): head dim.
        max_seq_len (int): positions in the cache; also ``max_position_embeddings`` for LongRoPE's attention factor.
        base (float): RoPE theta.
        rotary_dim (Optional[int]): the leading dims of each head that rotate (None: all).
        rope_scaling (Optional[Dict[str, Any]]): LongRoPE settings in HF's keys (``short_factor``,
            ``long_factor``, ``original_max_position_embeddings``, optionally ``attention_factor``).
        rope_scaling_config (Optional[str]): or the ``config.json`` that holds them.
    """

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        base: float = 10_000.0,
        rotary_dim: Optional[int] = None,
        rope_scaling: Optional[Dict[str, Any]] = None,
        rope_scaling_config: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_seq_len = max_seq_len
        self.base = base
        self.rope_scaling_config = None if rope_scaling_config is None else str(rope_scaling_config)
        self._rope_scaling = rope_scaling
        self._longrope: Optional[Dict[str, Any]] = None
        self.register_buffer("cache", self._table(max_seq_len, long=False), persistent=False)

    def longrope(self) -> Optional[Dict[str, Any]]:
        """The LongRoPE settings (``short_factor``, ``long_factor``, ``original_max_seq_len``,
        ``attention_factor``), read from ``rope_scaling_config`` the first time; None for plain RoPE.

        Returns:
            Optional[Dict[str, Any]]: the settings.

        Raises:
            FileNotFoundError: if ``rope_scaling_config`` does not exist.
            ValueError: on factor lists whose length is not the rotated frequencies', or another RoPE scaling.
        """
        if self._longrope is None and (self._rope_scaling or self.rope_scaling_config):
            scaling = self._rope_scaling or read_rope_scaling(self.rope_scaling_config)
            self._longrope = _longrope_args(scaling, self.max_seq_len, self.rotary_dim) if scaling else {}
        return self._longrope or None

    def _table(self, rows: int, long: bool, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[rows, rotary_dim * 2]``: cos then sin of each position, scaled by LongRoPE's attention factor."""
        probe = torch.empty(0, device=device)
        if probe.is_meta or isinstance(probe, FakeTensor):  # shapes only (a meta build, the memory estimate)
            return torch.empty(rows, self.rotary_dim * 2, device=probe.device)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        inv_freq = 1.0 / (self.base**exponents)
        longrope = self.longrope()
        if longrope is not None:
            factor = longrope["long_factor" if long else "short_factor"]
            inv_freq = inv_freq / torch.tensor(factor, dtype=torch.float32, device=device)
        freqs = torch.outer(torch.arange(rows, dtype=torch.float32, device=device), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return table if longrope is None else table * longrope["attention_factor"]

    def build_rope_cache(self, max_seq_len: int) -> None:
        """(Re)builds the short-context cache for ``max_seq_len`` positions, on the device of a built cache.

        Args:
            max_seq_len (int): positions.
        """
        device = None if self.cache.is_meta else self.cache.device
        self.register_buffer("cache", self._table(max_seq_len, False, device), persistent=False)

    def rope_init(self) -> None:
        """Builds the cache on the default device (what our materialiser calls, under the target device)."""
        self.register_buffer("cache", self._table(self.max_seq_len, long=False), persistent=False)

    def forward(self, x: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): ``[b, s, n_h, h_d]``.
            input_pos (Optional[torch.Tensor]): positions ``[b, s]`` (None: ``0 .. s-1``).

        Returns:
            torch.Tensor: ``x`` with its first ``rotary_dim`` dims of each head rotated.
        """
        seq_len = x.size(1)
        positions = seq_len if input_pos is None else int(input_pos.max()) + 1
        cache, longrope = self.cache, self.longrope()
        if longrope is not None and positions > longrope["original_max_seq_len"]:
            # as transformers: the long factors for every position once a sequence passes the original context
            cache = self._table(positions, True, x.device)
        table = cache[:seq_len] if input_pos is None else cache[input_pos]
        table = table.view(-1, seq_len, 1, self.rotary_dim * 2)
        cos, sin = table[..., : self.rotary_dim], table[..., self.rotary_dim :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1).type_as(x)


def longrope_attention_factor(max_seq_len: int, original_max_seq_len: int) -> float:
    """LongRoPE's cos/sin scale for a context extended from ``original_max_seq_len`` to ``max_seq_len``
    (transformers' default when ``attention_factor`` is not given).

    Args:
        max_seq_len (int): ``max_position_embeddings``.
        original_max_seq_len (int): ``original_max_position_embeddings``.

    Returns:
        float: ``sqrt(1 + ln(factor) / ln(original))``, 1.0 for no extension.
    """
    factor = max_seq_len / original_max_seq_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_seq_len))


def lora_phi(
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
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    rope_base: float = 10_000.0,
    partial_rotary_factor: float = 1.0,
    rope_scaling: Optional[Dict[str, Any]] = None,
    rope_scaling_config: Optional[str] = None,
    tie_word_embeddings: bool = False,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """A Phi-3-family LoRA model (transformers' ``Phi3ForCausalLM``): torchtune's ``lora_phi3`` with
    :class:`PhiRotaryEmbeddings` and an optionally tied output.

    Args:
        lora_attn_modules (List[LORA_ATTN_MODULES]): attention projections that get LoRA.
        apply_lora_to_mlp (bool): LoRA on the MLP too.
        apply_lora_to_output (bool): LoRA on the output projection (not when tied).
        vocab_size (int): vocabulary size.
        num_layers (int): decoder layers.
        num_heads (int): query heads.
        num_kv_heads (int): key/value heads.
        embed_dim (int): model dim.
        intermediate_dim (int): MLP hidden dim.
        max_seq_len (int): ``max_position_embeddings`` (LongRoPE's attention factor depends on it).
        attn_dropout (float): attention dropout.
        norm_eps (float): RMSNorm epsilon.
        rope_base (float): RoPE theta.
        partial_rotary_factor (float): the fraction of each head's dims that rotate.
        rope_scaling (Optional[Dict[str, Any]]): LongRoPE: ``short_factor``, ``long_factor``,
            ``original_max_position_embeddings`` and optionally ``attention_factor`` (HF's keys); None: plain RoPE.
        rope_scaling_config (Optional[str]): or the checkpoint's ``config.json`` holding them (read when the model
            is materialised, see :class:`PhiRotaryEmbeddings`).
        tie_word_embeddings (bool): the output projection is the token embedding.
        lora_rank (int): LoRA rank.
        lora_alpha (float): LoRA alpha.
        lora_dropout (float): LoRA dropout.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): torchtune's NF4 base.

    Returns:
        TransformerDecoder: the model.

    Raises:
        ValueError: on LoRA on a tied output, or a ``rope_scaling`` that is not LongRoPE.
    """
    check_no_lora_on_tied_output(apply_lora_to_output, tie_word_embeddings, "this Phi model")
    model = lora_phi3(
        lora_attn_modules,
        apply_lora_to_mlp,
        apply_lora_to_output,
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        norm_eps=norm_eps,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )
    head_dim = embed_dim // num_heads
    rotary_dim = int(head_dim * partial_rotary_factor)
    rope = PhiRotaryEmbeddings(head_dim, max_seq_len, rope_base, rotary_dim, rope_scaling, rope_scaling_config)
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.pos_embeddings = rope
    return tie_output_(model) if tie_word_embeddings else model


def _longrope_args(rope_scaling: Dict[str, Any], max_seq_len: int, rotary_dim: int) -> Dict[str, Any]:
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in ("longrope", "su"):
        raise ValueError(f"rope_scaling of type {kind!r} is not supported for Phi; supported: 'longrope' (or None).")
    for name in ("short_factor", "long_factor"):
        if len(rope_scaling[name]) != rotary_dim // 2:
            raise ValueError(
                f"rope_scaling.{name} has {len(rope_scaling[name])} entries but the model rotates {rotary_dim} dims "
                f"per head ({rotary_dim // 2} frequencies): does model.rope_scaling_config name another model's "
                "config.json?"
            )
    original = int(rope_scaling["original_max_position_embeddings"])
    attention_factor = rope_scaling.get("attention_factor")
    return dict(
        short_factor=[float(f) for f in rope_scaling["short_factor"]],
        long_factor=[float(f) for f in rope_scaling["long_factor"]],
        original_max_seq_len=original,
        attention_factor=longrope_attention_factor(max_seq_len, original)
        if attention_factor is None
        else float(attention_factor),
    )


def read_rope_scaling(rope_scaling_config: str) -> Optional[Dict[str, Any]]:
    """The LongRoPE settings of the checkpoint whose ``config.json`` is at ``rope_scaling_config``.

    Args:
        rope_scaling_config (str): the path.

    Returns:
        Optional[Dict[str, Any]]: see :func:`torchtune_ext.modules.hf_rope_scaling`.

    Raises:
        FileNotFoundError: naming the config key and the fix.
    """
    path = Path(rope_scaling_config)
    if not path.is_file():
        raise FileNotFoundError(
            f"model.rope_scaling_config={str(path)!r} does not exist: it must be the Phi checkpoint's config.json "
            "(its LongRoPE factors), e.g. ${checkpointer.checkpoint_dir}/config.json after `tune download`. (A dry "
            "run before the download: model.rope_scaling_config=null gives the same memory estimate.)"
        )
    return hf_rope_scaling(json.loads(path.read_text()))


#: the architecture of each model, from its HF ``config.json`` (RMSNorm eps 1e-5, rope theta 10,000, LongRoPE with
#: an original context of 4096 positions extended to 131,072).
PHI_ARCHS: Dict[str, Dict[str, Any]] = {
    "3_5_mini": dict(
        vocab_size=32_064, num_layers=32, num_heads=32, num_kv_heads=32, embed_dim=3072, intermediate_dim=8192
    ),
    "4_mini": dict(
        vocab_size=200_064,
        num_layers=32,
        num_heads=24,
        num_kv_heads=8,
        embed_dim=3072,
        intermediate_dim=8192,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
    ),
}
_NAMES = {"3_5_mini": "Phi-3.5-mini-instruct", "4_mini": "Phi-4-mini-instruct"}


def _sized(size: str) -> Callable[..., TransformerDecoder]:
    return sized_builder(
        lora_phi,
        f"lora_phi{size}",
        f"{_NAMES[size]}: :func:`lora_phi` with {PHI_ARCHS[size]}, max_seq_len 131072 (the LongRoPE context), "
        "rope theta 10000, LongRoPE factors from ``rope_scaling_config`` (the checkpoint's config.json).",
        max_seq_len=131_072,
        norm_eps=1e-5,
        rope_base=10_000.0,
        **PHI_ARCHS[size],
    )


lora_phi3_5_mini = _sized("3_5_mini")
lora_phi4_mini = _sized("4_mini")

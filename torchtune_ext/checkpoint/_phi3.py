"""Phi-3 / Phi-3.5 / Phi-4 HF checkpoints: fused ``qkv_proj`` and ``gate_up_proj`` against torchtune's separate
``q_proj`` / ``k_proj`` / ``v_proj`` and ``w1`` / ``w3``.

Reading splits each fused HF tensor into torchtune's tensors (rows ``[q | k | v]`` by the attention geometry,
``[gate | up]`` in halves, as torchtune's ``phi3_hf_to_tune``); the merged export concatenates them back. Phi's
RoPE rotates halves (as HF does), so no row is permuted.

The PEFT adapter targets the fused modules transformers' ``Phi3ForCausalLM`` has. Our separate LoRAs on the members
of a fused module (q/k/v, or w1/w3) are written as one LoRA of rank ``n * r`` on it, ``n`` being the adapted members:
``lora_A`` stacks the members' ``A`` (``[n * r, in]``) and ``lora_B`` is block-diagonal (``[q+k+v rows, n * r]``,
zero where a member has no adapter), so ``B @ A`` is the members' ``B_i @ A_i`` stacked, zero rows for an unadapted
member; ``adapter_config.json`` gives those modules rank ``n * r`` and alpha ``n * alpha`` (``rank_pattern``,
``alpha_pattern``), so PEFT's scale ``alpha / r`` is ours. DoRA's magnitude is per output row, so the members'
magnitudes stack too, but only when every member of a fused module is adapted (an unadapted member's rows would need
the base weight's norms): other DoRA layouts are refused before any weight is read.

Reading an adapter back (generation's ``adapter_dir``, ``tune-ext merge``) inverts that for a model with the training
run's LoRA modules: block ``i`` of a rank ``n * r`` fused LoRA is the ``i``-th adapted member's; a fused LoRA of rank
``r`` (PEFT's own, shared by the members) gives each member ``lora_A`` and its rows of ``lora_B``. Both are exact;
a nonzero ``lora_B`` entry the model's LoRAs cannot hold fails the read.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torchtune.models.convert_weights import get_mapped_key
from torchtune.models.phi3._convert_weights import _PHI3_MINI

from torchtune_ext.checkpoint._hf import HFConverter
from torchtune_ext.modules import hf_rope_scaling

#: fused HF module -> its torchtune members, in row order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("w1", "w3")}
#: torchtune module name -> Phi-3 HF module name.
PEFT_MODULES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "output_proj": "o_proj",
    "w1": "gate_up_proj",
    "w3": "gate_up_proj",
    "w2": "down_proj",
    "output": "lm_head",
}
_MEMBER_RE = re.compile(r"^(layers\.\d+\.(?:attn|mlp))\.(q_proj|k_proj|v_proj|w1|w3)\.(.+)$")
_LORA_SUFFIXES = {"lora_a.weight": "lora_A.weight", "lora_b.weight": "lora_B.weight", "magnitude": None}
_TO_HF = {tune: hf for hf, tune in _PHI3_MINI.items()}


_FUSED_PEFT_RE = re.compile(
    r"^base_model\.model\.(model\.layers\.\d+\.(?:self_attn|mlp)\.(qkv_proj|gate_up_proj))"
    r"\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector(?:\.weight)?)$"
)


def _adapted_members(model: nn.Module) -> Dict[str, Tuple[str, ...]]:
    lora_a = (_MEMBER_RE.match(name) for name, _ in model.named_parameters() if name.endswith(".lora_a.weight"))
    names = {match.group(2) for match in lora_a if match}
    return {fused: tuple(m for m in members if m in names) for fused, members in FUSED.items()}


def _fused_of(member: str) -> str:
    return next(fused for fused, members in FUSED.items() if member in members)


class Phi3Converter(HFConverter):
    """:class:`HFConverter` for ``model_type`` PHI3_MINI: splits / fuses ``qkv_proj`` and ``gate_up_proj``.

    Args:
        model_type (str): "PHI3_MINI".
        num_heads (int): attention heads.
        num_kv_heads (int): key/value heads.
        embed_dim (int): model dim.
        head_dim (int): head dim.
        tie_word_embeddings (bool): whether the output projection is the token embedding (no ``lm_head``).
    """

    model_types = ("PHI3_MINI",)

    def __init__(self, model_type, num_heads, num_kv_heads, embed_dim, head_dim, tie_word_embeddings):
        super().__init__(model_type, num_heads, num_kv_heads, embed_dim, head_dim, tie_word_embeddings)
        self._splits = {
            "qkv_proj": [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            "gate_up_proj": None,  # two equal halves
        }
        self._adapted: Dict[str, Tuple[str, ...]] = {}  # fused HF module -> its members the model adapts
        self._rank = 0

    @classmethod
    def for_model(cls, model_type: str, model: nn.Module) -> Phi3Converter:
        """Reads the geometry off the model and refuses a DoRA layout the PEFT export cannot write.

        Raises:
            ValueError: if a fused module's members are only partly adapted with DoRA.
        """
        converter = super().for_model(model_type, model)
        names = {name for name, _ in model.named_parameters() if name.endswith(".magnitude")}
        for layer in {m.group(1) for m in map(_MEMBER_RE.match, names) if m}:
            for fused, members in FUSED.items():
                present = [m for m in members if f"{layer}.{m}.magnitude" in names]
                if present and len(present) != len(members):
                    raise ValueError(
                        f"model.use_dora=True adapts {present} of Phi's fused {fused} ({list(members)}): the PEFT "
                        f"adapter of a fused module needs DoRA on all of them. Add the others to "
                        "model.lora_attn_modules (or set model.apply_lora_to_mlp), or use LoRA (use_dora=False)."
                    )
        converter._adapted = _adapted_members(model)
        converter._rank = next((p.shape[0] for n, p in model.named_parameters() if n.endswith("lora_a.weight")), 0)
        return converter

    def to_tune_all(self, hf_key: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """Converts one HF tensor into the torchtune tensors it holds (three for ``qkv_proj``, two for
        ``gate_up_proj``; none for a tied ``lm_head`` or a rotary ``inv_freq``).

        Raises:
            Exception: torchtune's ``get_mapped_key`` on a key that is no Phi-3 weight.
        """
        if (self.tie_word_embeddings and hf_key == "lm_head.weight") or hf_key.endswith("rotary_emb.inv_freq"):
            return []
        key = get_mapped_key(hf_key, _PHI3_MINI)
        fused = next((f for f in FUSED if f".{f}." in hf_key), None)
        if fused is None:
            return [(key, tensor)]
        splits = self._splits[fused]
        parts = torch.split(tensor, splits, dim=0) if splits else torch.chunk(tensor, 2, dim=0)
        first = FUSED[fused][0]
        return [(key.replace(f".{first}.", f".{member}."), part) for member, part in zip(FUSED[fused], parts)]

    def to_tune(self, hf_key: str, tensor: torch.Tensor) -> Optional[Tuple[str, torch.Tensor]]:
        """One torchtune tensor: only for HF tensors that are not fused (see :meth:`to_tune_all`).

        Raises:
            ValueError: on a fused tensor.
        """
        converted = self.to_tune_all(hf_key, tensor)
        if len(converted) > 1:
            raise ValueError(f"{hf_key} holds {len(converted)} torchtune tensors; use to_tune_all.")
        return converted[0] if converted else None

    def to_hf(self, tune_key: str, tensor: torch.Tensor) -> Tuple[str, torch.Tensor]:
        """Converts one torchtune tensor that is not a fused member (those go through :meth:`group_to_hf`).

        Raises:
            ValueError: on a member of a fused HF tensor.
        """
        if _MEMBER_RE.match(tune_key):
            raise ValueError(f"{tune_key} is part of a fused Phi-3 tensor; convert its group with group_to_hf.")
        return get_mapped_key(tune_key, _TO_HF), tensor

    def hf_groups(self, shapes: Dict[str, torch.Size]) -> Dict[str, Tuple[List[str], torch.Size]]:
        """The HF tensors of the merged model: HF key -> (its torchtune keys in row order, its shape)."""
        groups = {}
        for key, shape in shapes.items():
            match = _MEMBER_RE.match(key)
            if match is None:
                groups[get_mapped_key(key, _TO_HF)] = ([key], torch.Size(shape))
                continue
            prefix, member, suffix = match.groups()
            members = FUSED[_fused_of(member)]
            if member != members[0]:
                continue
            keys = [f"{prefix}.{m}.{suffix}" for m in members]
            rows = sum(shapes[k][0] for k in keys)
            groups[get_mapped_key(key, _TO_HF)] = (keys, torch.Size((rows, *shape[1:])))
        return groups

    def group_to_hf(self, tensors: Dict[str, torch.Tensor]) -> Tuple[str, torch.Tensor]:
        """One HF tensor from its torchtune tensors (in :meth:`hf_groups` order): fused ones concatenated."""
        first = next(iter(tensors))
        return get_mapped_key(first, _TO_HF), torch.cat(list(tensors.values()), dim=0)

    def adapters_to_peft(self, adapters: Dict[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
        """The PEFT tensors of the adapter: plain modules one to one, fused ones as the stacked / block-diagonal
        LoRA described in the module docstring.

        Args:
            adapters (Dict[str, torch.Tensor]): torchtune adapter keys -> tensors (``lora_a``, ``lora_b``,
                ``magnitude``).

        Returns:
            List[Tuple[str, torch.Tensor]]: PEFT keys and tensors.
        """
        converted, groups = [], {}
        for key, tensor in adapters.items():
            match = _MEMBER_RE.match(key)
            if match is None:
                converted.append(self.to_peft(key, tensor))
                continue
            prefix, member, suffix = match.groups()
            groups.setdefault((prefix, _fused_of(member)), {}).setdefault(member, {})[suffix] = tensor
        for (prefix, fused), members in groups.items():
            converted += self._fused_adapter(prefix, fused, members)
        return converted

    def _fused_adapter(
        self, prefix: str, fused: str, members: Dict[str, Dict[str, torch.Tensor]]
    ) -> List[Tuple[str, torch.Tensor]]:
        order = [m for m in FUSED[fused] if m in members]
        a = torch.cat([members[m]["lora_a.weight"] for m in order], dim=0)
        rank = members[order[0]]["lora_a.weight"].shape[0]
        rows = self._member_rows(fused, members)
        b = a.new_zeros((sum(rows.values()), len(order) * rank))
        start = 0
        for member in FUSED[fused]:
            if member in members:
                block = order.index(member) * rank
                b[start : start + rows[member], block : block + rank] = members[member]["lora_b.weight"]
            start += rows[member]
        peft = "base_model.model." + get_mapped_key(f"{prefix}.{FUSED[fused][0]}.weight", _TO_HF)[: -len(".weight")]
        out = [(f"{peft}.lora_A.weight", a), (f"{peft}.lora_B.weight", b)]
        if all("magnitude" in members[m] for m in order):
            out.append((f"{peft}.lora_magnitude_vector", torch.cat([members[m]["magnitude"] for m in order])))
        return out

    def _member_rows(self, fused: str, members: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, int]:
        if fused == "qkv_proj":
            return dict(zip(FUSED[fused], self._splits[fused]))
        rows = next(t["lora_b.weight"].shape[0] for t in members.values())
        return dict.fromkeys(FUSED[fused], rows)

    def peft_config(self, config: Dict[str, Any], target_modules: List[str], rank: int, alpha: float) -> Dict:
        """``adapter_config.json`` for Phi-3: HF module names, and rank / alpha ``n`` times ours on a fused module
        with ``n`` adapted members.

        Args:
            config (Dict[str, Any]): the generic PEFT config (:func:`peft_adapter_config`).
            target_modules (List[str]): torchtune module names.
            rank (int): LoRA rank.
            alpha (float): LoRA alpha.

        Returns:
            Dict: the config.
        """
        targets = sorted({PEFT_MODULES[m] for m in target_modules})
        counts = {f: sum(m in target_modules for m in members) for f, members in FUSED.items()}
        multiples = {f: n for f, n in counts.items() if n > 1}
        return {
            **config,
            "target_modules": targets,
            "rank_pattern": {f: n * rank for f, n in multiples.items()},
            "alpha_pattern": {f: n * alpha for f, n in multiples.items()},
        }

    def from_peft_all(self, peft_key: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """Splits a fused module's PEFT tensor into the LoRAs of the members the model adapts (other keys: one to
        one, :meth:`HFConverter.from_peft`). A fused LoRA of rank ``n * r`` (``n``: the model's adapted members,
        ``r``: its ``lora_rank``) is our export's block layout: member ``i`` takes block ``i`` of ``lora_A``'s rows
        and of ``lora_B``'s columns. One of rank ``r`` is a LoRA the members share (PEFT's own on ``qkv_proj``): each
        takes ``lora_A`` whole and its rows of ``lora_B``. On real tensors, ``lora_B`` must be zero wherever the
        model has no LoRA to hold it (another member, another block).

        Args:
            peft_key (str): PEFT key.
            tensor (torch.Tensor): the adapter tensor (meta: shapes only).

        Returns:
            List[Tuple[str, torch.Tensor]]: torchtune keys and tensors.

        Raises:
            ValueError: on a fused LoRA the model's LoRAs cannot hold (rank, adapted members, nonzero rows).
        """
        match = _FUSED_PEFT_RE.match(peft_key)
        if match is None:
            return [self.from_peft(peft_key, tensor)]
        module, fused, kind = match.groups()
        members, adapted = FUSED[fused], self._adapted.get(fused, ())
        parent = get_mapped_key(f"{module}.weight", _PHI3_MINI).rsplit(".", 2)[0]  # layers.N.attn / layers.N.mlp
        keys = {m: f"{parent}.{m}" for m in members}
        if not adapted:
            raise ValueError(
                f"{peft_key!r} adapts {fused}, but the model has no LoRA on {list(members)}: use the training "
                "config's model.lora_attn_modules / model.apply_lora_to_mlp."
            )
        if kind.startswith("lora_magnitude_vector"):
            rows = self._rows(fused, tensor.shape[0])
            return [(f"{keys[m]}.magnitude", tensor[slice(*rows[m])]) for m in adapted]
        rank = tensor.shape[0] if kind == "lora_A.weight" else tensor.shape[1]
        blocks = self._blocks(peft_key, fused, rank)
        if kind == "lora_A.weight":
            return [(f"{keys[m]}.lora_a.weight", tensor[blocks[m]]) for m in adapted]
        rows = self._rows(fused, tensor.shape[0])
        if tensor.device.type != "meta":
            self._check_unheld(peft_key, tensor, rows, blocks)
        return [(f"{keys[m]}.lora_b.weight", tensor[slice(*rows[m]), blocks[m]]) for m in adapted]

    def _rows(self, fused: str, total: int) -> Dict[str, Tuple[int, int]]:
        sizes = self._splits[fused] or [total // 2] * 2
        ends = torch.tensor(sizes).cumsum(0).tolist()
        return {m: (end - size, end) for m, size, end in zip(FUSED[fused], sizes, ends)}

    def _blocks(self, peft_key: str, fused: str, rank: int) -> Dict[str, slice]:
        adapted, r = self._adapted[fused], self._rank
        if rank == len(adapted) * r:
            return {m: slice(i * r, (i + 1) * r) for i, m in enumerate(adapted)}
        if rank == r:
            return dict.fromkeys(adapted, slice(0, r))
        raise ValueError(
            f"{peft_key!r} has rank {rank}: neither {len(adapted)} x the model's lora_rank={r} (one block per adapted "
            f"member, {list(adapted)}) nor lora_rank (shared): use the training config's model.lora_rank and "
            "model.lora_attn_modules."
        )

    def _check_unheld(
        self, peft_key: str, b: torch.Tensor, rows: Dict[str, Tuple[int, int]], blocks: Dict[str, slice]
    ) -> None:
        rest = b.clone()
        for member, block in blocks.items():
            rest[slice(*rows[member]), block] = 0
        unheld = [m for m, (start, end) in rows.items() if rest[start:end].any()]
        if unheld:
            raise ValueError(
                f"{peft_key!r} has nonzero rows for {unheld} that the model's LoRAs on {list(blocks)} do not hold "
                "(the adapter trained with other LoRA modules): use the training config's model.lora_attn_modules."
            )


def phi_rope_problems(hf_config: Dict[str, Any], model: nn.Module) -> List[str]:
    """A Phi checkpoint's RoPE (theta, rotated dims, LongRoPE factors) against the model's, which no weight's shape
    shows (a Phi-3.5 checkpoint in torchtune's plain-RoPE ``lora_phi3_mini`` would load, and be wrong).

    Args:
        hf_config (Dict[str, Any]): the checkpoint's ``config.json``.
        model (nn.Module): the model (on meta).

    Returns:
        List[str]: the disagreements (none for a checkpoint that is not Phi's).
    """
    if hf_config.get("model_type") != "phi3":
        return []
    rope = model.layers[0].attn.pos_embeddings
    parameters = hf_config.get("rope_parameters") or {}
    theta = float(hf_config.get("rope_theta", parameters.get("rope_theta", 10_000.0)))
    fraction = hf_config.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 1.0))
    rotary_dim = int(model.layers[0].attn.head_dim * fraction)
    scaling = hf_rope_scaling(hf_config)
    longrope = rope.longrope() if hasattr(rope, "longrope") else None
    problems = []
    if float(rope.base) != theta:
        problems.append(f"config.json has rope_theta={theta:g} but the model has RoPE base {float(rope.base):g}")
    rotated = rope.rotary_dim if hasattr(rope, "rotary_dim") else rope.dim  # ours, torchtune's
    if rotated != rotary_dim:
        problems.append(
            f"config.json has partial_rotary_factor={fraction} ({rotary_dim} rotated dims per head) but the model "
            f"rotates {rotated}"
        )
    if scaling and longrope is None:
        problems.append(
            "config.json has rope_scaling of type 'longrope' (Phi-3.5 / Phi-4-mini) but the model has plain RoPE: use "
            "qlora_phi3_5_mini / qlora_phi4_mini with model.rope_scaling_config set to this config.json"
        )
    elif not scaling and longrope is not None:
        problems.append("config.json has no rope_scaling but the model has LongRoPE (model.rope_scaling_config)")
    elif scaling and any([float(f) for f in scaling[k]] != longrope[k] for k in ("short_factor", "long_factor")):
        problems.append(
            "config.json's rope_scaling short_factor / long_factor differ from the model's: model.rope_scaling_config "
            "names another checkpoint's config.json"
        )
    return problems

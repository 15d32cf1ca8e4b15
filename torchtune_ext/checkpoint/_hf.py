"""HF <-> torchtune conversion one tensor at a time, PEFT adapter files, and HF ``config.json`` for our models.

Conversion calls torchtune's own per-family converters (``convert_weights.hf_to_tune`` / ``tune_to_hf`` with the
q/k permutation for the Llama family, ``qwen2_hf_to_tune`` / ``qwen2_tune_to_hf`` for Qwen2) on one-entry state
dicts, so a checkpoint streams through them tensor by tensor.

The PEFT adapter conversion is ours because torchtune's ``tune_to_peft_adapter_weights`` (0.6.1) is wrong in two
cases: it permutes Qwen2's q/k ``lora_B`` although Qwen2 weights are never permuted, and it leaves DoRA's q/k
``magnitude`` unpermuted although its rows follow the permuted weight's rows. Here every adapter tensor goes
through the same converter as the base weight of its layer.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchtune.models import convert_weights
from torchtune.models.qwen2._convert_weights import _FROM_HF as _QWEN2_FROM_HF
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune, qwen2_tune_to_hf

from torchtune_ext.checkpoint import _gemma2, _qwen3, _safetensors
from torchtune_ext.checkpoint._writes import writing
from torchtune_ext.config import ConfigFileNotFoundError

#: the index of a sharded safetensors checkpoint.
SAFETENSORS_INDEX = "model.safetensors.index.json"

#: model_type -> True when the family stores q/k rows permuted relative to HF (torchtune's interleaved RoPE).
SUPPORTED_MODEL_TYPES: Dict[str, bool] = {
    "LLAMA2": True,
    "LLAMA3": True,
    "LLAMA3_2": True,
    "MISTRAL": True,
    "QWEN2": False,
    "QWEN3": False,
    "GEMMA2": True,
    "PHI3_MINI": False,  # fused qkv / gate_up: Phi3Converter
}

#: model_type -> (hf_to_tune, tune_to_hf, HF -> torchtune key map) of families with their own conversion.
_FAMILY_CONVERTERS: Dict[str, Tuple[Callable[..., Any], Callable[..., Any], Dict[str, Any]]] = {
    "QWEN3": (_qwen3.hf_to_tune, _qwen3.tune_to_hf, _qwen3.QWEN3_FROM_HF),
    "GEMMA2": (_gemma2.hf_to_tune, _gemma2.tune_to_hf, _gemma2.GEMMA2_FROM_HF),
}

#: model_type -> the HFConverter subclass of a family whose HF layout is its own (each registers itself, e.g.
#: ``checkpoint._phi3.Phi3Converter``; this package imports it).
_CONVERTERS: Dict[str, type] = {}

_ADAPTER_SUFFIXES = {
    ".lora_a.weight": ".lora_A.weight",
    ".lora_b.weight": ".lora_B.weight",
    ".magnitude": ".lora_magnitude_vector",
}


def is_adapter_key(key: str) -> bool:
    """
    Args:
        key (str): a torchtune state-dict key.

    Returns:
        bool: whether it names a LoRA/DoRA adapter param (torchtune's ``get_adapter_state_dict`` rule).
    """
    return "lora" in key or "magnitude" in key


class HFConverter:
    """Per-tensor conversion between HF and torchtune layouts for one model.

    Args:
        model_type (str): torchtune checkpointer model type: LLAMA2, LLAMA3, LLAMA3_2, MISTRAL, QWEN2, QWEN3 or GEMMA2.
        num_heads (int): attention heads.
        num_kv_heads (int): key/value heads.
        embed_dim (int): model dim.
        head_dim (int): head dim.
        tie_word_embeddings (bool): whether the output projection is the token embedding (no ``lm_head``).

    Raises:
        ValueError: on an unsupported ``model_type``.
    """

    #: the model types a subclass converts (its HF layout is its own); :meth:`for_model` hands them to it.
    model_types: Tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _CONVERTERS.update(dict.fromkeys(cls.model_types, cls))

    def __init__(
        self,
        model_type: str,
        num_heads: int,
        num_kv_heads: int,
        embed_dim: int,
        head_dim: int,
        tie_word_embeddings: bool,
    ):
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"checkpointer.model_type={model_type!r} is not supported; use one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3/3.1/3.2, Mistral: their own types; Qwen2/2.5: QWEN2; "
                "Qwen3: QWEN3)."
            )
        self.model_type = model_type
        self.permutes_qk = SUPPORTED_MODEL_TYPES[model_type]
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.embed_dim = embed_dim
        self.head_dim = head_dim
        self.tie_word_embeddings = tie_word_embeddings
        default = (
            (convert_weights.hf_to_tune, convert_weights.tune_to_hf, convert_weights._FROM_HF)
            if self.permutes_qk
            else (qwen2_hf_to_tune, qwen2_tune_to_hf, _QWEN2_FROM_HF)
        )
        self._to_tune, self._to_hf, from_hf = _FAMILY_CONVERTERS.get(model_type, default)
        self._tune_to_hf_keys = {tune: hf for hf, tune in from_hf.items() if tune is not None}
        self._hf_to_tune_keys = from_hf

    @classmethod
    def for_model(cls, model_type: str, model: nn.Module) -> HFConverter:
        """Reads the attention geometry off a torchtune ``TransformerDecoder`` (meta or materialised).

        Args:
            model_type (str): checkpointer model type.
            model (nn.Module): the model.

        Returns:
            HFConverter: the converter.
        """
        family = _CONVERTERS.get(model_type)
        if cls is HFConverter and family is not None:  # a layout of its own (fused HF tensors)
            return family.for_model(model_type, model)
        attn = model.layers[0].attn
        tied = not any(name == "output.weight" for name, _ in model.named_parameters())
        return cls(model_type, attn.num_heads, attn.num_kv_heads, attn.embed_dim, attn.head_dim, tied)

    def _kwargs(self, dim: Optional[int] = None) -> Dict[str, Any]:
        kwargs = dict(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            dim=self.embed_dim if dim is None else dim,
            head_dim=self.head_dim,
        )
        if not self.permutes_qk:
            kwargs["tie_word_embeddings"] = self.tie_word_embeddings
        return kwargs

    def to_tune(self, hf_key: str, tensor: torch.Tensor) -> Optional[Tuple[str, torch.Tensor]]:
        """Converts one HF tensor; None for tensors torchtune drops (rotary ``inv_freq``, a tied ``lm_head``).

        Args:
            hf_key (str): HF key.
            tensor (torch.Tensor): HF tensor.

        Returns:
            Optional[Tuple[str, torch.Tensor]]: torchtune key and tensor.
        """
        if self.tie_word_embeddings and hf_key == "lm_head.weight":
            return None
        converted = self._to_tune({hf_key: tensor}, **self._kwargs())
        return next(iter(converted.items()), None)

    def to_tune_all(self, hf_key: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """All torchtune tensors one HF tensor holds (several where HF fuses them, e.g. Phi-3's ``qkv_proj``).

        Args:
            hf_key (str): HF key.
            tensor (torch.Tensor): HF tensor.

        Returns:
            List[Tuple[str, torch.Tensor]]: torchtune keys and tensors (none for tensors torchtune drops).
        """
        converted = self.to_tune(hf_key, tensor)
        return [] if converted is None else [converted]

    def hf_groups(self, shapes: Dict[str, torch.Size]) -> Dict[str, Tuple[List[str], torch.Size]]:
        """The HF tensors of a model with these torchtune base tensors.

        Args:
            shapes (Dict[str, torch.Size]): torchtune key -> shape of every base tensor.

        Returns:
            Dict[str, Tuple[List[str], torch.Size]]: HF key -> (the torchtune keys it is made of, its shape).
        """
        groups = {}
        for key, shape in shapes.items():
            hf_key, meta = self.to_hf(key, torch.empty(shape, device="meta"))
            groups[hf_key] = ([key], meta.shape)
        return groups

    def group_to_hf(self, tensors: Dict[str, torch.Tensor]) -> Tuple[str, torch.Tensor]:
        """One HF tensor from the torchtune tensors :meth:`hf_groups` names for it.

        Args:
            tensors (Dict[str, torch.Tensor]): torchtune key -> tensor, in :meth:`hf_groups` order.

        Returns:
            Tuple[str, torch.Tensor]: HF key and tensor.
        """
        ((key, tensor),) = tensors.items()
        return self.to_hf(key, tensor)

    def adapters_to_peft(self, adapters: Dict[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
        """
        Args:
            adapters (Dict[str, torch.Tensor]): torchtune adapter keys -> tensors.

        Returns:
            List[Tuple[str, torch.Tensor]]: their PEFT keys and tensors (:meth:`to_peft` each).
        """
        return [self.to_peft(k, v) for k, v in adapters.items()]

    def peft_config(self, config: Dict[str, Any], target_modules: List[str], rank: int, alpha: float) -> Dict:
        """Family-specific changes to the PEFT ``adapter_config.json`` (none here; see ``Phi3Converter``).

        Args:
            config (Dict[str, Any]): the config of :func:`peft_adapter_config`.
            target_modules (List[str]): torchtune module names.
            rank (int): LoRA rank.
            alpha (float): LoRA alpha.

        Returns:
            Dict: the config.
        """
        return config

    def to_hf(self, tune_key: str, tensor: torch.Tensor) -> Tuple[str, torch.Tensor]:
        """Converts one torchtune tensor (works on meta tensors, to plan shapes).

        Args:
            tune_key (str): torchtune key of a base (non-adapter) param.
            tensor (torch.Tensor): the tensor.

        Returns:
            Tuple[str, torch.Tensor]: HF key and tensor.
        """
        return next(iter(self._to_hf({tune_key: tensor}, **self._kwargs()).items()))

    def to_peft(self, tune_key: str, tensor: torch.Tensor) -> Tuple[str, torch.Tensor]:
        """Converts one torchtune adapter tensor to its PEFT key and layout.

        ``lora_b`` and ``magnitude`` rows follow the base weight's output rows, so they take its permutation;
        ``lora_a`` works on the input dim, which is never permuted.

        Args:
            tune_key (str): e.g. ``layers.0.attn.q_proj.lora_b.weight``.
            tensor (torch.Tensor): the adapter tensor.

        Returns:
            Tuple[str, torch.Tensor]: e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight``.
        """
        suffix = next(s for s in _ADAPTER_SUFFIXES if tune_key.endswith(s))
        base_key = tune_key[: -len(suffix)] + ".weight"
        value = tensor
        if suffix != ".lora_a.weight" and self.permutes_qk:
            rows = tensor if suffix == ".lora_b.weight" else tensor.unsqueeze(-1)
            converted = convert_weights.tune_to_hf({base_key: rows}, **self._kwargs(dim=rows.shape[-1]))
            value = next(iter(converted.values()))
            value = value if suffix == ".lora_b.weight" else value.squeeze(-1)
        hf_key = convert_weights.get_mapped_key(base_key, self._tune_to_hf_keys)
        return "base_model.model." + hf_key[: -len(".weight")] + _ADAPTER_SUFFIXES[suffix], value

    def from_peft(self, peft_key: str, tensor: torch.Tensor) -> Tuple[str, torch.Tensor]:
        """Converts one PEFT adapter tensor to its torchtune key and layout: the inverse of :meth:`to_peft`
        (works on meta tensors, to check shapes from a file's header).

        Args:
            peft_key (str): e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight``.
            tensor (torch.Tensor): the adapter tensor.

        Returns:
            Tuple[str, torch.Tensor]: e.g. ``layers.0.attn.q_proj.lora_b.weight``.

        Raises:
            ValueError: on a key that is not a LoRA/DoRA tensor of a decoder weight.
        """
        key = peft_key.removeprefix("base_model.model.")
        key = key.removesuffix(".weight") if key.endswith(".lora_magnitude_vector.weight") else key
        match = next(((t, p) for t, p in _ADAPTER_SUFFIXES.items() if key.endswith(p)), None)
        if match is None:
            raise ValueError(f"{peft_key!r} is not a LoRA/DoRA tensor (lora_A, lora_B, lora_magnitude_vector).")
        tune_suffix, peft_suffix = match
        hf_base = key[: -len(peft_suffix)] + ".weight"
        try:
            base_key = convert_weights.get_mapped_key(hf_base, self._hf_to_tune_keys)
        except Exception as err:  # torchtune raises a bare Exception on an unknown key
            raise ValueError(f"{peft_key!r} adapts {hf_base!r}, which the torchtune model does not have.") from err
        value = tensor
        if tune_suffix != ".lora_a.weight" and self.permutes_qk and (".q_proj." in hf_base or ".k_proj." in hf_base):
            rows = tensor if tune_suffix == ".lora_b.weight" else tensor.unsqueeze(-1)
            converted = convert_weights.hf_to_tune({hf_base: rows}, **self._kwargs(dim=rows.shape[-1]))
            value = next(iter(converted.values()))
            value = value if tune_suffix == ".lora_b.weight" else value.squeeze(-1)
        return base_key[: -len(".weight")] + tune_suffix, value

    def from_peft_all(self, peft_key: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """All torchtune adapter tensors one PEFT tensor holds (several where HF fuses modules, e.g. Phi-3's
        ``qkv_proj``; one here: :meth:`from_peft`).

        Args:
            peft_key (str): PEFT key.
            tensor (torch.Tensor): the adapter tensor (meta: shapes only).

        Returns:
            List[Tuple[str, torch.Tensor]]: torchtune keys and tensors.

        Raises:
            ValueError: on a key that is not a LoRA/DoRA tensor of a decoder weight.
        """
        return [self.from_peft(peft_key, tensor)]


def peft_adapter_config(
    target_modules: List[str],
    rank: int,
    alpha: float,
    dropout: float,
    use_dora: bool,
    base_model_name_or_path: str,
    trainable_token_indices: Optional[Dict[str, List[int]]] = None,
) -> Dict[str, Any]:
    """A PEFT ``adapter_config.json`` that ``peft.PeftModel.from_pretrained`` loads.

    Args:
        target_modules (List[str]): torchtune module names (``q_proj``, ``output_proj``, ``w1``, ...).
        rank (int): LoRA rank.
        alpha (float): LoRA alpha.
        dropout (float): LoRA dropout.
        use_dora (bool): DoRA.
        base_model_name_or_path (str): the base model (hub id or local path).
        trainable_token_indices (Optional[Dict[str, List[int]]]): HF module name (``embed_tokens``, ``lm_head``)
            -> token ids whose rows the adapter replaces (PEFT's trainable tokens, e.g. vocab pruning's kept
            ids). None: LoRA only.

    Returns:
        Dict[str, Any]: the config.
    """
    converted = convert_weights.tune_to_peft_adapter_config(
        {"target_modules": list(target_modules), "r": rank, "lora_alpha": alpha},
        base_model_name_or_path=base_model_name_or_path,
    )
    config = {
        **converted,
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "lora_dropout": dropout,
        "use_dora": use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
    }
    if trainable_token_indices is not None:
        config["trainable_token_indices"] = {k: [int(i) for i in v] for k, v in trainable_token_indices.items()}
    return config


_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_dtype_fields(dtype: torch.dtype) -> Dict[str, str]:
    """The ``config.json`` entries that name the weights' dtype, for every transformers release we support.

    transformers 5 writes and reads ``dtype`` first; 4.x wrote ``torch_dtype`` (4.56+ read ``dtype`` too). A config
    that holds one of them from its base and the other from us loads in the wrong dtype on one release, so both are
    always written, equal.

    Args:
        dtype (torch.dtype): fp32, bf16 or fp16.

    Returns:
        Dict[str, str]: ``{"dtype": name, "torch_dtype": name}``.
    """
    name = _HF_DTYPE_NAMES[dtype]
    return {"dtype": name, "torch_dtype": name}


def write_json(path: Path, data: Dict[str, Any]) -> None:
    """Writes ``data`` as indented JSON (the layout HF tools write).

    Args:
        path (Path): the file.
        data (Dict[str, Any]): JSON-serialisable data.
    """
    with writing(path):
        path.write_text(json.dumps(data, indent=2) + "\n")


def write_hf_model_files(
    folder: Path,
    shards: Sequence[Sequence[_safetensors.TensorSpec]],
    tensors: Callable[[Sequence[_safetensors.TensorSpec]], Iterator[Tuple[str, torch.Tensor]]],
    hf_config: Dict[str, Any],
    dtype: torch.dtype,
    single_file: bool = False,
) -> None:
    """Writes an HF model folder's weights, one tensor at a time, and its metadata: the shards
    (``model-0000i-of-0000n.safetensors``) and their index, or one ``model.safetensors``; and ``config.json`` naming
    ``dtype``. The one writer of HF model folders (merged checkpoints, random bases).

    Args:
        folder (Path): the folder (callers write into a temporary one and rename it).
        shards (Sequence[Sequence[_safetensors.TensorSpec]]): the tensors of each file, in order.
        tensors (Callable[[Sequence[_safetensors.TensorSpec]], Iterator[Tuple[str, torch.Tensor]]]): a shard's
            ``(name, tensor)`` pairs, in its order.
        hf_config (Dict[str, Any]): the model's ``config.json`` (its dtype entries are replaced).
        dtype (torch.dtype): the weights' dtype.
        single_file (bool): one ``model.safetensors`` and no index (``shards`` must hold one shard).
    """
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = "model.safetensors" if single_file else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _safetensors.write_tensors(folder / name, shard, tensors(shard))
        weight_map.update({spec.name: name for spec in shard})
        total += sum(spec.nbytes for spec in shard)
    if not single_file:
        write_json(folder / SAFETENSORS_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(folder / "config.json", {**hf_config, **hf_dtype_fields(dtype)})


#: per ``decoder_hf_config`` family: HF architecture, model type, and torchtune's builder defaults.
_DECODER_FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": dict(architecture="LlamaForCausalLM", model_type="llama", rope_base=500_000, norm_eps=1e-5),
    "qwen2": dict(architecture="Qwen2ForCausalLM", model_type="qwen2", rope_base=1_000_000.0, norm_eps=1e-6),
}


def decoder_hf_config(
    family: str,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    rope_base: Optional[float] = None,
    norm_eps: Optional[float] = None,
    scale_factor: float = 32,
    tie_word_embeddings: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> Dict[str, Any]:
    """HF ``config.json`` of a decoder built with torchtune's ``llama3_2`` or ``qwen2`` builder arguments
    (:data:`llama3_2_hf_config`, :data:`qwen2_hf_config`).

    Args:
        family (str): "llama" (Llama 3.2-style: scaled RoPE) or "qwen2" (Qwen2-style: q/k/v biases).
        vocab_size (int): vocabulary size.
        num_layers (int): decoder layers.
        num_heads (int): attention heads.
        num_kv_heads (int): key/value heads.
        embed_dim (int): model dim.
        intermediate_dim (int): MLP hidden dim.
        max_seq_len (int): maximum sequence length.
        rope_base (Optional[float]): RoPE theta; None: the family's (500,000 / 1,000,000).
        norm_eps (Optional[float]): RMSNorm epsilon; None: the family's (1e-5 / 1e-6).
        scale_factor (float): llama only: Llama 3.1 RoPE scaling factor (low 1, high 4, original context 8192:
            torchtune's).
        tie_word_embeddings (bool): tied input/output embeddings.
        dtype (torch.dtype): the weights' dtype (``dtype`` / ``torch_dtype``).

    Returns:
        Dict[str, Any]: the config.

    Raises:
        ValueError: on an unknown family.
    """
    if family not in _DECODER_FAMILIES:
        raise ValueError(f"Unknown decoder family {family!r}; use one of {sorted(_DECODER_FAMILIES)}.")
    defaults = _DECODER_FAMILIES[family]
    config = {
        "architectures": [defaults["architecture"]],
        "model_type": defaults["model_type"],
        "vocab_size": vocab_size,
        "hidden_size": embed_dim,
        "intermediate_size": intermediate_dim,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": defaults["norm_eps"] if norm_eps is None else norm_eps,
        "rope_theta": float(defaults["rope_base"] if rope_base is None else rope_base),
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "use_cache": True,
        **hf_dtype_fields(dtype),
    }
    if family == "llama":
        config["head_dim"] = embed_dim // num_heads
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(scale_factor),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(max_window_layers=num_layers, sliding_window=max_seq_len, use_sliding_window=False)
    return config


#: ``decoder_hf_config("llama", ...)``: a Llama 3.2-style model with torchtune ``llama3_2`` builder arguments.
llama3_2_hf_config = partial(decoder_hf_config, "llama")
#: ``decoder_hf_config("qwen2", ...)``: a Qwen2-style model with torchtune ``qwen2`` builder arguments.
qwen2_hf_config = partial(decoder_hf_config, "qwen2")


def read_hf_config(checkpoint_dir: Path, key: str = "checkpointer.checkpoint_dir") -> Dict[str, Any]:
    """Reads ``config.json`` from an HF checkpoint folder.

    Args:
        checkpoint_dir (Path): the folder.
        key (str): the config key or command-line flag that gave the folder, named in errors.

    Returns:
        Dict[str, Any]: the config.

    Raises:
        ConfigFileNotFoundError: naming ``key`` if the folder or its ``config.json`` is missing.
    """
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        missing = "is not a folder" if not path.parent.is_dir() else "has no config.json"
        raise ConfigFileNotFoundError(
            f"{key}={str(checkpoint_dir)!r} {missing}; {key} must be an HF-format model folder (config.json + "
            "*.safetensors), e.g. from `tune download <repo> --output-dir <dir>`.",
            key,
        )
    return json.loads(path.read_text())


def hf_rope_parameters(hf_config: Dict[str, Any]) -> Dict[str, Any]:
    """An HF ``config.json``'s RoPE settings in transformers 5's ``rope_parameters`` form, from either layout:
    transformers 5 writes ``rope_parameters`` (``rope_theta``, ``rope_type`` and the scaling's own keys), 4.x a
    top-level ``rope_theta`` beside ``rope_scaling`` (``type`` instead of ``rope_type`` in older files).

    Args:
        hf_config (Dict[str, Any]): the config.

    Returns:
        Dict[str, Any]: ``rope_type`` ("default" for plain RoPE), ``rope_theta`` (transformers' 10,000 when the
        config has none) and the scaling's keys (``factor``, ``original_max_position_embeddings``, ...).

    Example:
        >>> hf_rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
        {'factor': 2.0, 'rope_type': 'linear', 'rope_theta': 500000.0}
        >>> hf_rope_parameters({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}})
        {'rope_type': 'default', 'rope_theta': 100000.0}
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10_000.0))
    return params

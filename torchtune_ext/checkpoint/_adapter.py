"""Reading PEFT LoRA adapter folders (ours, or written by PEFT / Unsloth for a supported model) and checking them
against a model from the files' headers only, so that a missing or mismatched adapter fails before any weight is
read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import torch
from torch import nn
from torchtune.models.convert_weights import _TO_PEFT_TARGET_MODULES
from torchtune.modules.peft import get_adapter_params

from torchtune_ext.checkpoint import _safetensors
from torchtune_ext.checkpoint._hf import HFConverter, peft_adapter_config
from torchtune_ext.checkpoint._phi3 import FUSED
from torchtune_ext.config import ConfigError, ConfigFileNotFoundError

PathLike = Union[str, Path]
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT module name -> torchtune module name.
PEFT_TO_TUNE_MODULES = {peft: tune for tune, peft in _TO_PEFT_TARGET_MODULES.items()}
#: PEFT module name -> the torchtune modules it holds (Phi's fused ``qkv_proj`` / ``gate_up_proj``: several).
_TUNE_MODULES = {**{peft: (tune,) for peft, tune in PEFT_TO_TUNE_MODULES.items()}, **FUSED}
_MLP = ("w1", "w2", "w3")
_ATTN = ("q_proj", "k_proj", "v_proj", "output_proj")
#: PEFT trainable-tokens tensor key -> (module name in ``trainable_token_indices``, torchtune weight key).
TRAINABLE_TOKEN_TENSORS = {
    "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": (
        "embed_tokens",
        "tok_embeddings.weight",
    ),
    "base_model.model.lm_head.token_adapter.trainable_tokens_delta": ("lm_head", "output.weight"),
}


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter folder, its config read and its weights' header checked (no tensor data read).

    Args:
        folder (Path): the folder.
        config (Dict[str, Any]): ``adapter_config.json``.
        header (Dict[str, Dict]): ``adapter_model.safetensors``'s header.
        key (str): the config key or command-line flag that gave the folder, named in errors.
    """

    folder: Path
    config: Dict[str, Any]
    header: Dict[str, Dict]
    key: str = "adapter_dir"

    @property
    def weights_path(self) -> Path:
        """Path: ``adapter_model.safetensors``."""
        return self.folder / ADAPTER_WEIGHTS

    @property
    def target_modules(self) -> Tuple[str, ...]:
        """Tuple[str, ...]: the torchtune modules the adapted ones hold (every member of a fused one), sorted."""
        return tuple(sorted(m for peft in self.config["target_modules"] for m in _TUNE_MODULES[peft]))

    def lora_settings(self) -> Dict[str, Any]:
        """
        Returns:
            Dict[str, Any]: the QLoRA builder arguments that make a model this adapter fits (``lora_attn_modules``,
            ``apply_lora_to_mlp``, ``apply_lora_to_output``, ``lora_rank``, ``lora_alpha``, ``use_dora``); a
            fused module (Phi's) adapts all its members.

        Raises:
            ValueError: on a fused module whose rank says some but not all of its members trained (which ones only
                the training config says).
        """
        rank = int(self.config["r"])
        for fused in sorted(set(FUSED) & set(self.config["target_modules"])):
            count = int((self.config.get("rank_pattern") or {}).get(fused, rank)) // rank
            if count not in (1, len(FUSED[fused])):
                raise ValueError(
                    f"{self.folder / ADAPTER_CONFIG}: {fused} has rank {count} x r: {count} of {list(FUSED[fused])} "
                    "trained, and which ones only the training config says; pass its model section (generation / "
                    "eval configs: model:, load_model_with_adapter: model=)."
                )
        modules = set(self.target_modules)
        return dict(
            lora_attn_modules=[m for m in _ATTN if m in modules],
            apply_lora_to_mlp=bool(modules & set(_MLP)),
            apply_lora_to_output="output" in modules,
            lora_rank=int(self.config["r"]),
            lora_alpha=float(self.config["lora_alpha"]),
            use_dora=bool(self.config.get("use_dora", False)),
        )

    def trainable_token_indices(self) -> Dict[str, List[int]]:
        """Dict[str, List[int]]: PEFT's trainable tokens (``embed_tokens`` / ``lm_head`` -> token ids), if any."""
        indices = self.config.get("trainable_token_indices") or {}
        if isinstance(indices, list):  # PEFT's short form: the embedding's ids
            indices = {"embed_tokens": indices}
        return {name: [int(i) for i in ids] for name, ids in indices.items()}


def read_peft_adapter(folder: PathLike, key: str = "adapter_dir") -> PeftAdapter:
    """Reads a PEFT LoRA adapter folder's config and weights header, rejecting what this loader cannot apply.

    Args:
        folder (PathLike): a folder with ``adapter_config.json`` and ``adapter_model.safetensors``.
        key (str): the config key or command-line flag that gave the folder (``adapter_dir``, ``--adapter``), named
            in errors.

    Returns:
        PeftAdapter: the adapter.

    Raises:
        ConfigFileNotFoundError: naming ``key``, the missing folder or file and the fix (a checkpoint's step folder:
            its ``adapter/`` folder).
        ConfigError: naming the file and the unsupported setting (not LoRA, rsLoRA, per-module ranks other than on
            Phi's fused modules at the others' scale, biases, ``modules_to_save``, regex ``target_modules``).
        ValueError: on a truncated file.
    """
    folder = Path(folder)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    where = "a training run writes them to <output_dir>/step_<N>/adapter"
    if not folder.is_dir():
        raise ConfigFileNotFoundError(
            f"{key}={str(folder)!r} is not a folder; set {key} to an adapter folder ({ADAPTER_CONFIG} + "
            f"{ADAPTER_WEIGHTS}: {where}).",
            key,
        )
    if not config_path.exists() and (folder / "adapter" / ADAPTER_CONFIG).is_file():
        raise ConfigFileNotFoundError(
            f"{key}={str(folder)!r} is a checkpoint folder, not its adapter; set {key}={str(folder / 'adapter')!r}.",
            key,
        )
    for path in (config_path, weights_path):
        if not path.exists():
            hint = (
                " (a .bin adapter: load it with peft and save it again with safe_serialization=True)"
                if (folder / "adapter_model.bin").is_file()
                else ""
            )
            raise ConfigFileNotFoundError(
                f"{key}={str(folder)!r}: {path} not found{hint}; the adapter folder must hold {ADAPTER_CONFIG} and "
                f"{ADAPTER_WEIGHTS} ({where}).",
                key,
            )
    config = json.loads(config_path.read_text())
    _check_supported(config, config_path, key)
    return PeftAdapter(folder, config, _safetensors.check_complete(weights_path), key)


def _check_supported(config: Dict[str, Any], path: Path, key: str) -> None:
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} (only LORA)")
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        problems.append(f"target_modules={targets!r} (a list of module names is needed)")
    else:
        unknown = sorted(set(targets) - set(_TUNE_MODULES))
        if unknown:
            problems.append(f"target_modules {unknown} (supported: {sorted(_TUNE_MODULES)})")
        mlp = {tune for m in targets for tune in _TUNE_MODULES.get(m, ())} & set(_MLP)
        if mlp and mlp != set(_MLP):
            problems.append("LoRA on part of the MLP (torchtune adapts gate_proj, up_proj and down_proj together)")
    for key, supported in (("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none"), ("lora_bias", False)):
        if config.get(key, supported) != supported:
            problems.append(f"{key}={config[key]!r}")
    for key in ("modules_to_save", "layers_to_transform"):
        if config.get(key):
            problems.append(f"{key}={config[key]!r}")
    problems += _pattern_problems(config)
    if problems:
        raise ConfigError(
            f"{key}: {path}: this adapter uses settings the loader does not support: " + "; ".join(problems), key
        )


def _pattern_problems(config: Dict[str, Any]) -> List[str]:
    """Per-module ranks are supported on Phi's fused modules with the scale ``alpha / r`` of the others (our
    export's ``n * r`` / ``n * alpha``)."""
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    others = sorted((set(ranks) | set(alphas)) - set(FUSED))
    if others:
        return [f"rank_pattern / alpha_pattern on {others} (supported on a fused qkv_proj / gate_up_proj only)"]
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    return [
        f"{fused}: rank_pattern {ranks.get(fused, r)} with alpha_pattern {alphas.get(fused, alpha)} (its scale "
        f"alpha / r must be lora_alpha / r = {alpha} / {r})"
        for fused in sorted(set(ranks) | set(alphas))
        if float(alphas.get(fused, alpha)) * r != float(alpha) * ranks.get(fused, r)
    ]


def check_adapter_fits(adapter: PeftAdapter, model: nn.Module, converter: HFConverter) -> None:
    """Checks an adapter against a (meta) model from its config and header: rank, alpha, DoRA, target modules and
    every tensor's shape (a different base model shows as different shapes or layer counts).

    Args:
        adapter (PeftAdapter): the adapter.
        model (nn.Module): the QLoRA model it is to be applied to.
        converter (HFConverter): the model's HF converter.

    Raises:
        ConfigError: naming the adapter's key (:attr:`PeftAdapter.key`) and folder, and every mismatch.
    """
    expected = {k: tuple(v.shape) for k, v in get_adapter_params(model).items()}
    model_targets = tuple(sorted({k.split(".")[-3] for k in expected if ".lora_" in k}))
    rank = next((v[0] for k, v in expected.items() if k.endswith("lora_a.weight")), None)
    lora = next((m for m in model.modules() if hasattr(m, "lora_a")), None)
    problems = []
    exported = converter.peft_config(
        peft_adapter_config(list(model_targets), rank or 8, 1.0, 0.0, False, ""), list(model_targets), rank or 8, 1.0
    )  # the target modules our export writes for this model
    if sorted(adapter.config["target_modules"]) != sorted(exported["target_modules"]):
        problems.append(f"target modules {list(adapter.target_modules)} but the model adapts {list(model_targets)}")
    if rank is not None and int(adapter.config["r"]) != rank:
        problems.append(f"rank r={adapter.config['r']} but the model has lora_rank={rank}")
    if lora is not None and float(adapter.config["lora_alpha"]) != float(lora.alpha):
        problems.append(f"lora_alpha={adapter.config['lora_alpha']} but the model has lora_alpha={lora.alpha}")
    dora = any(k.endswith(".magnitude") for k in expected)
    if bool(adapter.config.get("use_dora", False)) != dora:
        problems.append(f"use_dora={adapter.config.get('use_dora', False)} but the model has use_dora={dora}")
    if not problems:
        problems = _shape_problems(adapter, expected, converter)
    if problems:
        base = adapter.config.get("base_model_name_or_path")
        raise ConfigError(
            f"{adapter.key}={str(adapter.folder)!r}: the adapter does not fit the model ({ADAPTER_CONFIG} names base "
            f"model {base!r}): "
            + "; ".join(problems[:8])
            + ". Use the adapter with the base model and LoRA settings (model: lora_rank, lora_alpha, "
            "lora_attn_modules, apply_lora_to_mlp, use_dora) it was trained with.",
            adapter.key,
        )


def _shape_problems(adapter: PeftAdapter, expected: Dict[str, Tuple[int, ...]], converter: HFConverter) -> List[str]:
    found: Dict[str, Tuple[int, ...]] = {}
    problems = []
    for peft_key, info in adapter.header.items():
        if peft_key in TRAINABLE_TOKEN_TENSORS:
            continue
        try:
            converted = converter.from_peft_all(peft_key, torch.empty(info["shape"], device="meta"))
        except ValueError as err:
            problems.append(f"{ADAPTER_WEIGHTS}: {err}")
            continue
        found.update((key, tuple(meta.shape)) for key, meta in converted)
    for key in sorted(set(found) | set(expected)):
        if key not in expected:
            problems.append(f"{ADAPTER_WEIGHTS} has {key} {found[key]}, which the model does not have")
        elif key not in found:
            problems.append(f"{ADAPTER_WEIGHTS} lacks {key} {expected[key]}")
        elif found[key] != expected[key]:
            problems.append(
                f"{ADAPTER_WEIGHTS}: {key} has shape {found[key]} but the base model expects {expected[key]} (an "
                "adapter trained on another base model?)"
            )
    return problems


def read_adapter_state(
    adapter: PeftAdapter, converter: HFConverter, dtype: torch.dtype
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Tuple[List[int], torch.Tensor]]]:
    """Reads an adapter's tensors in torchtune's keys and layout.

    Args:
        adapter (PeftAdapter): the adapter (checked with :func:`check_adapter_fits`).
        converter (HFConverter): the model's HF converter.
        dtype (torch.dtype): dtype of the returned LoRA/DoRA tensors.

    Returns:
        Tuple[Dict[str, torch.Tensor], Dict[str, Tuple[List[int], torch.Tensor]]]: the LoRA/DoRA tensors; and
        PEFT's trainable tokens: torchtune weight key -> (token ids, their rows).
    """
    state, tokens = {}, {}
    indices = adapter.trainable_token_indices()
    for peft_key, tensor in _safetensors.iter_tensors(adapter.weights_path):
        if peft_key in TRAINABLE_TOKEN_TENSORS:
            name, tune_key = TRAINABLE_TOKEN_TENSORS[peft_key]
            tokens[tune_key] = (indices[name], tensor)
            continue
        for key, value in converter.from_peft_all(peft_key, tensor):
            state[key] = value.to(dtype)
    return state, tokens

"""Initialising QLoRA models built on the meta device, FSDP2-sharded or not, to the same values either way: every
tensor is drawn whole, in module order, and each rank keeps its own shard (``load_full_state_dict`` writes it,
quantizing NF4 shards exactly as the whole tensor would be).

- :func:`init_adapters_`: for training, once the base weights are loaded: LoRA ``A``/``B`` with torchtune's
  initialisation from the global RNG (the values torchtune's recipe draws, on every rank), DoRA magnitudes from the
  loaded base, RoPE caches; or the adapters of a resumed run.
- :func:`materialize_` / :func:`init_weights_`: random weights everywhere (tests, benchmarks).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import get_adapter_params

from torchtune_ext.distributed import load_full_state_dict, unwrap_key
from torchtune_ext.modules.peft import DoRALinear, LoRALinear, init_lora_weights_

DeviceLike = Union[str, torch.device, None]


def _lora_shapes(adapters: Mapping[str, torch.Tensor]) -> Dict[str, Tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in adapters.items() if ".lora_" in k or k.endswith(".magnitude")}


def check_adapter_state(model: nn.Module, adapter_state: Mapping[str, torch.Tensor]) -> None:
    """Checks a saved adapter state (a resumed run's) against the model's LoRA/DoRA params, keys and shapes; works on
    a meta-built model, so a resume with other LoRA settings fails before anything is loaded or written.
    Vocab-pruning rows are checked through the kept token ids instead (their shapes follow the data).

    Args:
        model (nn.Module): the QLoRA model (meta, materialized or sharded).
        adapter_state (Mapping[str, torch.Tensor]): adapter tensors under the model's unwrapped keys.

    Raises:
        ValueError: naming the first differing adapters and the settings that decide them.
    """
    expected = _lora_shapes({unwrap_key(model, k): v for k, v in get_adapter_params(model).items()})
    found = _lora_shapes(adapter_state)
    if found != expected:
        differ = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
        raise ValueError(
            "The recipe state's adapters do not match the model's (different lora_attn_modules, apply_lora_to_mlp, "
            "apply_lora_to_output, lora_rank or use_dora?): "
            + "; ".join(f"{k}: saved {found.get(k)}, model {expected.get(k)}" for k in differ[:4])
        )


@torch.no_grad()
def init_adapters_(
    model: nn.Module, device: DeviceLike, adapter_state: Optional[Mapping[str, torch.Tensor]] = None
) -> None:
    """Creates and initialises what a checkpoint does not hold: adapters, DoRA magnitudes and RoPE caches.

    Call it on every rank once the base weights are loaded (:func:`torchtune_ext.checkpoint.load_base_`). LoRA ``A``
    and ``B`` are drawn whole from the global RNG in module order (:func:`init_lora_weights_`), so every rank draws the
    same values as one device does, and as torchtune's recipe does with the same seed; each rank keeps its shard.

    Args:
        model (nn.Module): the QLoRA model, base loaded, adapters possibly still on the meta device.
        device (DeviceLike): the training device.
        adapter_state (Optional[Mapping[str, torch.Tensor]]): a resumed run's adapter params (every
            ``get_adapter_params`` entry, unwrapped keys) to load instead; the initial values are drawn all the
            same, so the RNG streams do not depend on resuming.

    Raises:
        ValueError: if ``adapter_state`` does not match the model's adapters.
    """
    device = torch.device(device)
    adapters: Dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        key = unwrap_key(model, name)
        a, b = (
            torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device=device)
            for linear in (module.lora_a, module.lora_b)
        )
        init_lora_weights_(a, b)
        adapters[f"{key}.lora_a.weight"], adapters[f"{key}.lora_b.weight"] = a, b
        if isinstance(module, DoRALinear):
            # Computed from the loaded base below, once every shard is in place.
            adapters[f"{key}.magnitude"] = torch.zeros(module.out_dim, dtype=module.magnitude.dtype, device=device)
    if adapter_state is not None:
        check_adapter_state(model, adapter_state)
        expected = {unwrap_key(model, k) for k in get_adapter_params(model)}
        if set(adapter_state) != expected:
            raise ValueError(
                "The recipe state's adapters do not match the model's (different vocab_pruning?): "
                f"{sorted(set(adapter_state) ^ expected)[:4]}"
            )
        adapters.update(adapter_state)
    load_full_state_dict(model, adapters, device=device, strict=False)
    _init_rope_(model, device)
    if adapter_state is None:
        for module in model.modules():
            if isinstance(module, DoRALinear):
                module.initialize_dora_magnitude()


def _init_rope_(model: nn.Module, device: torch.device) -> None:
    with torch.device(device):
        for module in model.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()


def _device_of(param: torch.Tensor) -> torch.device:
    return param._local_tensor.device if hasattr(param, "_local_tensor") else param.device


def _empty_like_full(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(param.shape, dtype=param.dtype, device=_device_of(param))


def _random_value(name: str, param: torch.Tensor, std: float, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Matrices ~ N(0, std), biases 0, other vectors (norm scales) 1; whole-size, in the param's dtype."""
    if param.dim() >= 2:
        return _empty_like_full(param).normal_(0, std, generator=generator)
    fill = 0.0 if name.endswith("bias") else 1.0
    return torch.full(param.shape, fill, dtype=param.dtype, device=_device_of(param))


@torch.no_grad()
def init_weights_(model: nn.Module, std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
    """Random-initialises a materialised model in place, one param at a time, in module order.

    Dense matrices and NF4 bases ~ N(0, std) (NF4 bases quantized from it), norm scales = 1, biases = 0; LoRA
    adapters get torchtune's init (Kaiming-uniform A, zero B) and DoRA magnitudes their initial norms; RoPE caches
    are rebuilt. Works on FSDP2-sharded models: every param is drawn whole and its shard written, so a sharded model
    gets the same values as the unsharded one.

    Args:
        model (nn.Module): the model, not on the meta device.
        std (float): standard deviation of the normal init. Default: 0.02.
        generator (Optional[torch.Generator]): RNG for reproducible weights.
    """
    for module_name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            values = {"weight": _random_value("weight", module.weight, std, generator)}
            if module.bias is not None:
                values["bias"] = _random_value("bias", module.bias, std, generator)
            a, b = (_empty_like_full(linear.weight) for linear in (module.lora_a, module.lora_b))
            init_lora_weights_(a, b, generator)
            values.update({"lora_a.weight": a, "lora_b.weight": b})
        elif not any(isinstance(parent, LoRALinear) for parent in _ancestors(model, module_name)):
            values = {
                name: _random_value(name, p, std, generator) for name, p in module.named_parameters(recurse=False)
            }
        else:
            continue
        for name, value in values.items():
            key = unwrap_key(model, f"{module_name}.{name}" if module_name else name)
            load_full_state_dict(model, {key: value}, strict=False)
        if isinstance(module, DoRALinear):
            module.initialize_dora_magnitude()
    _init_rope_(model, next((_device_of(p) for p in model.parameters()), torch.device("cpu")))


def _ancestors(model: nn.Module, module_name: str):
    parts = module_name.split(".") if module_name else []
    for i in range(len(parts)):
        yield model.get_submodule(".".join(parts[:i]))


def materialize_(
    model: TransformerDecoder, device: DeviceLike, seed: Optional[int] = 0, std: float = 0.02
) -> TransformerDecoder:
    """Materialises a meta-device model (plain or FSDP2-sharded) on ``device`` with random weights.

    ``to_empty`` allocates the params in their final formats (NF4 bases take 4 bits per value), then
    :func:`init_weights_` fills them one at a time, so no more than one dense weight exists in high precision.

    Args:
        model (TransformerDecoder): a model built on the meta device, optionally already ``fully_shard``-ed.
        device (DeviceLike): target device.
        seed (Optional[int]): seed for the init RNG; None uses torch's global RNG.
        std (float): init standard deviation.

    Returns:
        TransformerDecoder: the same model, materialised.
    """
    device = torch.device(device)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    model.to_empty(device=device)
    init_weights_(model, std=std, generator=generator)
    return model

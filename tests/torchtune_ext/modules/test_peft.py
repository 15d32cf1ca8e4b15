"""LoRA/DoRA layers against torchtune's merge, torchtune's own layers and torchtune's PEFT helpers."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules.peft import DoRALinear as TorchtuneDoRALinear
from torchtune.modules.peft import LoRALinear as TorchtuneLoRALinear
from torchtune.modules.peft import (
    disable_adapter,
    get_adapter_params,
    get_adapter_state_dict,
    get_merged_lora_ckpt,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)

from torchtune_ext.models import qlora_tiny_llama
from torchtune_ext.modules import DoRALinear, LoRALinear
from torchtune_ext.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

IN_DIM, OUT_DIM, RANK, ALPHA = 256, 512, 8, 16.0
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def _layer(cls, quantize_base, use_bias, dtype=torch.float32, adapter_dtype=None, seed=0):
    """A layer whose adapters are far from their init, so that they change the output."""
    torch.manual_seed(seed)
    layer = cls(
        IN_DIM,
        OUT_DIM,
        RANK,
        ALPHA,
        use_bias=use_bias,
        quantize_base=quantize_base,
        dtype=dtype,
        adapter_dtype=adapter_dtype,
    )
    with torch.no_grad():
        layer.lora_b.weight.normal_(0, 0.05)
        if use_bias:
            layer.bias.normal_(0, 0.5)
        if isinstance(layer, DoRALinear):
            layer.initialize_dora_magnitude()
            layer.magnitude.mul_(torch.empty_like(layer.magnitude).uniform_(0.5, 1.5))
    return layer


def _dense_state_dict(module: nn.Module, prefix: str = "") -> dict:
    return {
        prefix + k: (dequantize_nf4(v) if isinstance(v, NF4Tensor) else v).detach().clone().float()
        for k, v in module.state_dict().items()
    }


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("quantize_base", [False, True])
@pytest.mark.parametrize("cls", [LoRALinear, DoRALinear])
def test_merged_checkpoint_gives_the_adapter_layer_output(cls, quantize_base, use_bias):
    layer = _layer(cls, quantize_base, use_bias)
    merged = get_merged_lora_ckpt(_dense_state_dict(layer, "proj."), rank=RANK, alpha=ALPHA)
    assert set(merged) == {"proj.weight"} | ({"proj.bias"} if use_bias else set())
    x = torch.randn(4, 7, IN_DIM)
    expected = F.linear(x, merged["proj.weight"], merged.get("proj.bias"))
    out = layer(x)
    assert (out - layer._base_forward(x, torch.float32)).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize("cls, torchtune_cls", [(LoRALinear, TorchtuneLoRALinear), (DoRALinear, TorchtuneDoRALinear)])
def test_same_keys_and_output_as_torchtune_layer(cls, torchtune_cls):
    # torchtune's DoRA scales the bias by the magnitude (unlike its own merge), so compare without bias.
    use_bias = cls is LoRALinear
    layer = _layer(cls, quantize_base=True, use_bias=use_bias)
    reference = torchtune_cls(IN_DIM, OUT_DIM, RANK, ALPHA, use_bias=use_bias)
    reference.load_state_dict(_dense_state_dict(layer), strict=True)
    assert layer.adapter_params() == reference.adapter_params()
    x = torch.randn(4, 7, IN_DIM)
    torch.testing.assert_close(layer(x), reference(x), **FP32_TOL)


@pytest.mark.parametrize("cls", [LoRALinear, DoRALinear])
def test_fp32_adapters_with_fp16_compute(cls):
    layer = _layer(cls, quantize_base=True, use_bias=True, dtype=torch.float16, adapter_dtype=torch.float32)
    assert layer.weight.dtype == layer.bias.dtype == torch.float16
    assert all(getattr(layer, n.split(".")[0]).dtype == torch.float32 for n in ["magnitude"] if hasattr(layer, n))
    assert layer.lora_a.weight.dtype == layer.lora_b.weight.dtype == torch.float32
    x = torch.randn(4, 7, IN_DIM)
    out = layer(x.half())
    assert out.dtype == torch.float16
    out.float().square().mean().backward()
    # Reference: the same layer entirely in fp32 (dense dequantized base).
    reference = _layer(cls, quantize_base=False, use_bias=True, dtype=torch.float32)
    reference.load_state_dict(_dense_state_dict(layer))
    reference(x).square().mean().backward()
    for name in layer.adapter_params():
        ours, ref = layer.get_parameter(name), reference.get_parameter(name)
        assert ours.grad.dtype == torch.float32, name
        assert ref.grad.abs().max() > 0, name
        torch.testing.assert_close(ours.grad, ref.grad, rtol=2e-2, atol=2e-2 * ref.grad.abs().max().item())
    assert not layer.weight.requires_grad and layer.weight.grad is None


def test_quantization_kwargs_need_quantize_base():
    with pytest.raises(ValueError, match="quantize_base"):
        LoRALinear(IN_DIM, OUT_DIM, RANK, ALPHA, block_size=64)


@pytest.mark.parametrize("use_dora", [False, True])
def test_torchtune_peft_helpers(use_dora):
    lora_attn_modules, apply_to_mlp = ["q_proj", "v_proj"], True
    kwargs = dict(apply_lora_to_mlp=apply_to_mlp, use_dora=use_dora, dtype=torch.float32)
    model = qlora_tiny_llama(lora_attn_modules, device="cpu", seed=0, **kwargs)
    names = {n for n, _ in model.named_parameters()}
    expected_adapters = {n for n in names if ".lora_a." in n or ".lora_b." in n or n.endswith(".magnitude")}
    assert len(expected_adapters) == 2 * 5 * (3 if use_dora else 2)

    adapter_params = get_adapter_params(model)
    assert set(adapter_params) == expected_adapters
    set_trainable_params(model, adapter_params)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected_adapters
    full_sd = model.state_dict()
    assert set(get_adapter_state_dict(full_sd)) == expected_adapters

    # Load base and adapter weights into a fresh model as torchtune's recipes do, and validate with torchtune.
    fresh = qlora_tiny_llama(lora_attn_modules, device="cpu", seed=1, **kwargs)
    base_sd = {k: v for k, v in full_sd.items() if k not in expected_adapters}
    base = fresh.load_state_dict(base_sd, strict=False)
    adapters = fresh.load_state_dict(get_adapter_state_dict(full_sd), strict=False)
    validate_missing_and_unexpected_for_lora(
        lora_attn_modules,
        apply_to_mlp,
        False,
        base.missing_keys,
        base.unexpected_keys,
        adapters.missing_keys,
        adapters.unexpected_keys,
    )
    base_key = next(k for k in base_sd if k.endswith("q_proj.weight"))
    with pytest.raises(AssertionError, match="Missing non-LoRA key"):
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules, apply_to_mlp, False, base.missing_keys + [base_key], [], [], []
        )
    # state_dict() is dense (torchtune's contract), so the fresh model holds the dense weights re-quantized.
    for name, param in model.named_parameters():
        loaded = fresh.get_parameter(name)
        if isinstance(param, NF4Tensor):
            assert isinstance(loaded, NF4Tensor), name
            assert torch.equal(dequantize_nf4(loaded), dequantize_nf4(quantize_nf4(dequantize_nf4(param)))), name
        else:
            assert torch.equal(loaded, param), name


def test_state_dict_is_dense_in_the_compute_dtype_as_torchtunes():
    """torchtune's contract for quantize_base=True models: state_dict() gives dense CPU tensors (ours in the compute
    dtype), so torchtune's get_merged_lora_ckpt works on it; the live NF4 params stay in state_dict(keep_vars=True)."""
    for dtype in (torch.float32, torch.bfloat16):
        model = qlora_tiny_llama(["q_proj", "v_proj"], apply_lora_to_mlp=True, dtype=dtype, device="cpu")
        with torch.no_grad():
            for name, param in get_adapter_params(model).items():
                if ".lora_b." in name:
                    param.normal_(0, 0.1)
        state = model.state_dict()
        live = model.state_dict(keep_vars=True)
        q = "layers.0.attn.q_proj.weight"
        assert type(state[q]) is torch.Tensor and state[q].dtype == dtype and state[q].device.type == "cpu"
        assert isinstance(live[q], NF4Tensor) and torch.equal(state[q], dequantize_nf4(live[q]))
        merged = get_merged_lora_ckpt(dict(state), rank=8, alpha=16)
        layer = model.layers[0].attn.q_proj
        expected = dequantize_nf4(layer.weight) + 2.0 * (layer.lora_b.weight @ layer.lora_a.weight)
        torch.testing.assert_close(merged[q], expected.to(dtype), rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
        assert not any("lora" in k for k in merged)


def test_disable_adapter_gives_the_base_model():
    model = qlora_tiny_llama(["q_proj", "v_proj"], apply_lora_to_mlp=True, dtype=torch.float32, device="cpu")
    tokens = torch.randint(0, 512, (2, 9))
    base_out = model(tokens)
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if ".lora_b." in name:
                param.normal_(0, 0.1)
    with disable_adapter(model):
        disabled_out = model(tokens)
    assert (model(tokens) - base_out).abs().max() > 1e-3
    torch.testing.assert_close(disabled_out, base_out, rtol=0, atol=0)

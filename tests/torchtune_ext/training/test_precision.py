"""Compute dtypes: parsing, the bf16 support check, fp32 master adapters and fp16 dynamic loss scaling."""

import inspect

import pytest
import torch

from torchtune_ext import _dtype
from torchtune_ext.training import DistributedLossScaler, LossScaler, default_adapter_dtype, parse_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("BF16", torch.bfloat16),
        (None, None),
    ],
)
def test_parse_dtype(name, dtype):
    assert parse_dtype(name, CPU) == dtype


@pytest.mark.parametrize("name", ["fp8", "int8", "fp64", "nf4"])
def test_unknown_dtype_names_the_choices(name):
    with pytest.raises(ValueError, match="dtype=fp32, dtype=bf16 or dtype=fp16"):
        parse_dtype(name, CPU)


def test_bf16_without_support_suggests_fp32_or_fp16(monkeypatch):
    monkeypatch.setattr(_dtype, "is_bf16_supported", lambda device: False)
    with pytest.raises(RuntimeError, match=r"dtype=fp32.*dtype=fp16"):
        parse_dtype("bf16", torch.device("cuda"))
    assert parse_dtype("fp16", torch.device("cuda")) == torch.float16


def test_cpu_supports_bf16():
    assert _dtype.is_bf16_supported(CPU)


def test_one_initial_loss_scale_on_one_rank_and_many():
    """The two scalers once had 2**10 and 2**16: N-rank fp16 runs started differently from one device."""
    single, distributed = (
        inspect.signature(cls).parameters["init_scale"].default for cls in (LossScaler, DistributedLossScaler)
    )
    assert single == distributed == 2.0**10
    assert LossScaler(True, CPU).get_scale() == DistributedLossScaler(True, CPU).get_scale() == 2.0**10


def test_adapter_dtype_is_fp32_master_under_fp16():
    assert default_adapter_dtype(torch.float16) == torch.float32
    assert default_adapter_dtype(torch.bfloat16) == torch.bfloat16
    assert default_adapter_dtype(torch.bfloat16, "fp32") == torch.float32
    with pytest.raises(ValueError, match="adapter_dtype=fp32"):
        default_adapter_dtype(torch.float16, "fp16")


def _setup():
    param = torch.nn.Parameter(torch.ones(4))
    return param, torch.optim.SGD([param], lr=0.1)


def test_loss_scaler_skips_and_counts_overflowed_steps():
    param, optimizer = _setup()
    scaler = LossScaler(enabled=True, device=CPU, init_scale=2.0**16)
    # fp16 activations overflow under the scale: inf gradients, the step is skipped and the scale halves.
    scaler.scale((param.half() * 60000).float().sum() * 10).backward()
    scaler.unscale_(optimizer)
    assert not torch.isfinite(param.grad).all()
    assert scaler.step(optimizer) is False
    assert torch.equal(param.detach(), torch.ones(4)) and scaler.skipped_steps == 1
    assert scaler.get_scale() == 2.0**15
    optimizer.zero_grad()
    # A normal step: the unscaled gradient (1.0 each) is applied exactly.
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    torch.testing.assert_close(param.grad, torch.ones(4))
    assert scaler.step(optimizer) is True
    torch.testing.assert_close(param.detach(), torch.full((4,), 0.9))
    assert scaler.skipped_steps == 1

    restored = LossScaler(enabled=True, device=CPU, init_scale=4.0)
    restored.load_state_dict(scaler.state_dict())
    assert restored.get_scale() == scaler.get_scale() and restored.skipped_steps == 1


def test_disabled_loss_scaler_is_a_pass_through():
    param, optimizer = _setup()
    scaler = LossScaler(enabled=False, device=CPU)
    loss = param.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(optimizer)
    assert scaler.step(optimizer) is True and scaler.get_scale() == 1.0
    torch.testing.assert_close(param.detach(), torch.full((4,), 0.9))

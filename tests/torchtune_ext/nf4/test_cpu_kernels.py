"""The CPU kernels (``torchtune_ext.nf4._cpu_kernels``) against independent references, on each path a CPU can take:
AVX-512, AVX2 (forced on an AVX-512 CPU) and torch (the kernels off).

- Decoding: ``dequantize_nf4`` equal bit for bit to torchao's ``get_original_weight().to(dtype)``, for every weight and
  output dtype, whole weights and the column slabs the backward decodes.
- Products of 1-4 tokens: ``linear_nf4`` / ``frozen_linear`` against a float64 product of torchao's dequantized weight
  (fp32 compute), and against torch's own bf16 product (bf16 compute).
- Availability: a clear reason when the kernels cannot be built, and one build for processes asking at once.
"""

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torchtune_ext.nf4._cpu_kernels as cpu_kernels
from torchtune_ext.modules import frozen_linear, linear_nf4
from torchtune_ext.nf4 import (
    cpu_kernels_available,
    cpu_kernels_off,
    decode_nf4_,
    dequantize_nf4,
    dequantize_nf4_scalers,
    nf4_mv_supports,
    quantize_nf4,
)

pytestmark = pytest.mark.stack

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _level() -> int:
    return cpu_kernels._state.get("level", 0) if cpu_kernels_available() else 0


@pytest.fixture(params=["avx512", "avx2", "torch"])
def kernel_path(request, monkeypatch):
    """Runs a test on one path: the kernels' AVX-512 or AVX2 code, or torch's (the kernels reported unavailable)."""
    level = _level()
    if request.param == "avx512" and level != 1:
        pytest.skip("no AVX-512 kernels on this machine")
    if request.param == "avx2" and level == 0:
        pytest.skip("no CPU kernels on this machine")
    if request.param == "torch":
        with cpu_kernels_off():
            yield request.param
        return
    monkeypatch.setattr(cpu_kernels, "_state", {**cpu_kernels._state, "level": 2 if request.param == "avx2" else 1})
    yield request.param


def _weight(shape, dtype, block_size=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return quantize_nf4((torch.randn(shape, generator=generator) * 0.05).to(dtype), block_size)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_decoding_is_bit_identical_to_torchao(kernel_path, weight_dtype, block_size):
    for shape in [(96, 256), (64, 320), (40, 48)]:  # whole weights decode as one row of blocks, whatever their width
        weight = _weight(shape, weight_dtype, block_size)
        reference = weight.get_original_weight()
        for out_dtype in DTYPES:
            whole = torch.empty(weight.numel(), dtype=out_dtype)
            uses_kernel = cpu_kernels.nf4_decode_supports(weight, weight.quantized_data, whole)
            assert uses_kernel == (kernel_path != "torch")
            ours = dequantize_nf4(weight, out_dtype)
            assert ours.dtype == out_dtype
            assert torch.equal(_bits(ours), _bits(reference.to(out_dtype))), (shape, out_dtype)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
def test_decoding_column_slabs_is_bit_identical_to_torchao(kernel_path, weight_dtype):
    """The backward decodes column slabs (strided codes and scales) straight into the compute dtype."""
    weight = _weight((48, 512), weight_dtype)
    reference = weight.get_original_weight().float()
    packed = weight.quantized_data.view(torch.uint16).view(48, 128)
    scalers = dequantize_nf4_scalers(weight).view(48, 8)
    piece = torch.empty(48, 192, dtype=torch.float32)
    uses_kernel = cpu_kernels.nf4_decode_supports(weight, packed[:, 32:80].view(torch.uint8), piece)
    assert uses_kernel == (kernel_path != "torch")
    decode_nf4_(weight, packed[:, 32:80], scalers[:, 2:5], piece)
    assert torch.equal(piece, reference[:, 128:320])


@pytest.mark.parametrize("tokens", [1, 2, 4, 5])
@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_few_token_products_match_a_float64_reference(kernel_path, weight_dtype, tokens):
    weight = _weight((160, 512), weight_dtype)
    x = torch.randn(1, tokens, 512, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = linear_nf4(x, weight, torch.float32)
    reference = F.linear(x.double(), weight.get_original_weight().double())
    assert ours.shape == (1, tokens, 160) and ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-5)
    assert nf4_mv_supports(x, weight, torch.float32) == (kernel_path != "torch" and tokens <= cpu_kernels.MAX_TOKENS)


def test_bf16_compute_rounds_like_torchs_bf16_product(kernel_path):
    weight = _weight((256, 512), torch.bfloat16)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert nf4_mv_supports(x, weight, torch.bfloat16) == (kernel_path != "torch")
    with torch.no_grad():
        ours = linear_nf4(x, weight, torch.bfloat16)
    reference = F.linear(x, weight.get_original_weight())  # torch's bf16 product: fp32 sums, one rounding
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), reference.float(), rtol=8e-3, atol=1e-3)  # one bf16 ulp apart at most


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_dim", [576, 520])  # 520: a tail past the last 16 values
def test_16_bit_weight_products_match_a_float64_reference(kernel_path, storage, in_dim):
    weight = (torch.randn(1000, in_dim, generator=torch.Generator().manual_seed(3)) * 0.05).to(storage)
    x = torch.randn(3, in_dim, generator=torch.Generator().manual_seed(4))
    assert cpu_kernels.dense16_mv_supports(x, weight) == (kernel_path != "torch")
    ours = frozen_linear(x, weight, torch.float32)
    reference = x.double() @ weight.double().t()
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-5)


def test_fake_tensors_take_the_torch_path():
    """The memory estimate runs the model on fake tensors: the kernels, which read memory, must not see them."""
    weight = _weight((64, 256), torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(1, 256))
        assert not nf4_mv_supports(x, weight, torch.float32)
        assert linear_nf4(x, weight, torch.float32).shape == (1, 64)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the kernels are for x86-64")
def test_unavailable_kernels_say_why(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("TORCHTUNE_EXT_NATIVE", raising=False)
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("TORCHTUNE_EXT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level("INFO", logger=cpu_kernels.__name__):
        assert not cpu_kernels.cpu_kernels_available()
    assert "no-such-compiler" in cpu_kernels.cpu_kernels_unavailable_reason()
    (warning,) = caplog.records
    assert warning.levelname == "WARNING" and "set CC" in warning.getMessage()
    assert not list(tmp_path.rglob("*.so"))
    # turned off on purpose: said at INFO only
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("TORCHTUNE_EXT_NATIVE", "0")
    caplog.clear()
    with caplog.at_level("INFO", logger=cpu_kernels.__name__):
        assert not cpu_kernels.cpu_kernels_available()
    assert cpu_kernels.cpu_kernels_unavailable_reason() == "TORCHTUNE_EXT_NATIVE=0"
    assert [record.levelname for record in caplog.records] == ["INFO"]


@pytest.mark.skipif(_level() == 0, reason="no CPU kernels on this machine")
def test_processes_asking_at_once_build_the_kernels_once(tmp_path):
    code = (
        "import torchtune_ext.nf4._cpu_kernels as k; "
        "print(k.cpu_kernels_available(), k.cpu_kernels_unavailable_reason())"
    )
    env = {**os.environ, "TORCHTUNE_EXT_CACHE": str(tmp_path)}
    env.pop("TORCHTUNE_EXT_NATIVE", None)
    processes = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outputs = [process.communicate(timeout=300)[0].strip() for process in processes]
    assert outputs == ["True None"] * 3
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


def test_torch_compile_traces_the_torch_path_in_one_graph():
    """Compiled decoding cannot call the kernels (opaque to dynamo): the checks must send it to the torch path before
    anything dynamo cannot trace (``fullgraph=True`` fails on a graph break). The training step's compiled graphs
    (the autograd.Function) are checked in ``tests/torchtune_ext/memory/test_compiled.py``."""
    torch._dynamo.reset()
    weight = _weight((64, 256), torch.bfloat16)
    x = torch.randn(1, 256)
    compiled = torch.compile(lambda x: linear_nf4(x, weight, torch.float32), backend="eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
    expected = F.linear(x.double(), weight.get_original_weight().double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)

"""Forked NF4 linear vs dense references and torchao's own dequantization."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torchtune_ext.modules.low_precision as low_precision
from torchtune_ext.modules import (
    FrozenEmbedding,
    FrozenNF4Linear,
    FrozenTiedLinear,
    LinearNF4,
    LoRALinear,
    frozen_linear,
    linear_nf4,
)
from torchtune_ext.nf4 import NF4Tensor, cache_nf4_decoding_tables, dequantize_nf4, quantize_nf4, to_nf4

pytestmark = pytest.mark.stack

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Tolerances of a compute-dtype result against the same computation done by F.linear in that dtype.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}
IN_DIM, OUT_DIM = 256, 512


@pytest.fixture(params=["whole", "slabs"])
def path(request, monkeypatch):
    """Runs a test on both CPU paths of LinearNF4: the whole dequantized weight, and slab by slab.

    The slab sizes are shrunk so that the test weights (512x256) take 3 uneven row slabs and 2 column slabs.
    """
    if request.param == "slabs":
        monkeypatch.setattr(low_precision, "_CPU_SLAB_NUMEL", 1024)
        monkeypatch.setattr(low_precision, "_MIN_SLAB_DIM", 192)
        assert low_precision._slab_plan(_nf4_weight()) == (192, 192)
    else:
        assert low_precision._slab_plan(_nf4_weight()) is None
    return request.param


def _nf4_weight(dtype=torch.bfloat16, shape=(OUT_DIM, IN_DIM), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return quantize_nf4((torch.randn(shape, generator=gen) * 0.05).to(dtype))


def _input(dtype, seed=1, shape=(3, 5, IN_DIM)):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).requires_grad_()


def _dense_reference(x, weight, dtype, grad_out):
    """Output and grad_input of F.linear in ``dtype`` on torchao's dequantized weight."""
    x_ref = x.detach().clone().requires_grad_()
    out = F.linear(x_ref.to(dtype), weight.get_original_weight().to(dtype))
    out.backward(grad_out)
    return out.detach(), x_ref.grad


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("nf4_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_nf4_matches_dense_reference(dtype, nf4_dtype, path):
    weight = _nf4_weight(nf4_dtype)
    x = _input(dtype)
    out = linear_nf4(x, weight, dtype=dtype)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out.backward(grad_out)
    ref_out, ref_grad = _dense_reference(x, weight, dtype, grad_out)
    assert out.dtype == dtype and x.grad.dtype == dtype
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(x.grad, ref_grad, **TOL[dtype])


def test_linear_nf4_mixed_input_and_compute_dtypes(path):
    weight = _nf4_weight(torch.bfloat16)
    # fp32 activations computed in bf16: bf16 output, fp32 grad (autograd casts it back to the input's dtype).
    x = _input(torch.float32)
    out = linear_nf4(x, weight, dtype=torch.bfloat16)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out.backward(grad_out)
    ref_out, ref_grad = _dense_reference(x, weight, torch.bfloat16, grad_out)
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **TOL[torch.bfloat16])
    torch.testing.assert_close(x.grad, ref_grad, **TOL[torch.bfloat16])


def test_linear_nf4_computes_in_fp32_when_asked(path):
    # bf16 weight and bf16 activations, dtype=fp32: the result must be the fp32 computation, far more accurate
    # than the bf16 one, so a silent fallback to the activation dtype fails this test.
    weight = _nf4_weight(torch.bfloat16)
    x = _input(torch.bfloat16)
    out = linear_nf4(x, weight, dtype=torch.float32)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (grad_input,) = torch.autograd.grad(out, x, grad_out)
    exact_out, exact_grad = _dense_reference(x.double(), weight, torch.float64, grad_out.double())
    bf16_out, _ = _dense_reference(x, weight, torch.bfloat16, grad_out.bfloat16())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact_out, rtol=1e-5, atol=1e-5)
    assert (bf16_out.double() - exact_out).abs().max() > 100 * (out.double() - exact_out).abs().max()
    # The grad is computed in fp32 and cast once to the input's dtype.
    assert grad_input.dtype == torch.bfloat16
    torch.testing.assert_close(grad_input, exact_grad.bfloat16(), rtol=0, atol=0)


def test_linear_nf4_function_returns_grad_in_compute_dtype(path):
    weight = _nf4_weight(torch.bfloat16)
    x = _input(torch.float16)
    out = LinearNF4.apply(x, weight, torch.float32)
    # grad_fn.apply runs LinearNF4.backward itself, before autograd casts the grad to the input's dtype.
    grad_input, grad_weight, grad_dtype = out.grad_fn.apply(torch.ones_like(out))
    assert out.dtype == torch.float32 and grad_input.dtype == torch.float32
    assert grad_weight is None and grad_dtype is None
    out.sum().backward()
    assert x.grad.dtype == torch.float16
    torch.testing.assert_close(x.grad, grad_input.half(), rtol=0, atol=0)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_linear_nf4_under_autocast(autocast_dtype, path):
    weight = _nf4_weight(torch.float32)
    x = _input(torch.float32)
    with torch.autocast("cpu", dtype=autocast_dtype):
        out = linear_nf4(x, weight)
        explicit = linear_nf4(x, weight, dtype=torch.float32)
        ref = F.linear(x, weight.get_original_weight())
    assert out.dtype == ref.dtype == autocast_dtype
    torch.testing.assert_close(out, ref, **TOL[autocast_dtype])
    assert explicit.dtype == torch.float32
    torch.testing.assert_close(explicit, F.linear(x, weight.get_original_weight()), **TOL[torch.float32])


def test_linear_nf4_compiles_in_one_graph_on_the_cpu_paths(path):
    """``compile=True`` on a CPU run: the NF4 linear traces into one graph (``fullgraph=True`` fails on a graph
    break; the huge-page buffer's address made every compiled layer fall back to eager, and dynamo cannot write a
    slab's strided ``out=``, so compiled code dequantizes whole weights), forward and backward equal to eager (torch's
    matmul against oneDNN's: summation order)."""
    torch._dynamo.reset()
    weight, grad_out = _nf4_weight(), torch.randn(3, 5, OUT_DIM, generator=torch.Generator().manual_seed(2))
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight, requires_grad=False)
    cache_nf4_decoding_tables(holder, torch.device("cpu"))  # as the recipes do before a compiled forward
    compiled = torch.compile(lambda x: linear_nf4(x, weight, torch.float32), backend="eager", fullgraph=True)
    results = []
    for run in (compiled, lambda x: linear_nf4(x, weight, torch.float32)):
        x = _input(torch.float32)
        out = run(x)
        out.backward(grad_out)
        results.append((out.detach(), x.grad))
    for actual, expected in zip(*results):
        torch.testing.assert_close(actual, expected, **TOL[torch.float32])


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_linear_nf4_activation_checkpointing(use_reentrant, path):
    weight = _nf4_weight(torch.bfloat16)

    def block(x):
        return F.gelu(linear_nf4(x, weight, dtype=torch.float32)).square()

    x = _input(torch.float32)
    block(x).sum().backward()
    x_ckpt = x.detach().clone().requires_grad_()
    checkpoint(block, x_ckpt, use_reentrant=use_reentrant).sum().backward()
    torch.testing.assert_close(x_ckpt.grad, x.grad, rtol=0, atol=0)


def _saved_tensors(fn):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _nbytes(t: torch.Tensor) -> int:
    if isinstance(t, NF4Tensor):
        return sum(getattr(t, name).nbytes for name in t.__tensor_flatten__()[0])
    return t.nbytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_nf4_saves_only_the_nf4_weight(dtype, path):
    weight = _nf4_weight(torch.bfloat16)
    x = _input(torch.float32)
    out, saved = _saved_tensors(lambda: linear_nf4(x, weight, dtype=dtype))
    assert len(saved) == 1 and saved[0] is weight
    # The dense reference keeps the input and the dense weight for the same op.
    _, dense_saved = _saved_tensors(
        lambda: F.linear(x.to(dtype), weight.get_original_weight().to(dtype).requires_grad_())
    )
    nf4_bytes = _nbytes(weight)
    assert nf4_bytes * 3.5 < weight.numel() * 2 <= sum(_nbytes(t) for t in dense_saved)
    out.sum().backward()


def test_frozen_nf4_linear_and_lora_base_save_no_dense_weight(path):
    layer = FrozenNF4Linear(IN_DIM, OUT_DIM, bias=True, dtype=torch.bfloat16)
    x = _input(torch.bfloat16)
    _, saved = _saved_tensors(lambda: layer(x))
    assert all(isinstance(t, NF4Tensor) or t.numel() < IN_DIM * OUT_DIM for t in saved)
    lora = LoRALinear(IN_DIM, OUT_DIM, rank=8, alpha=16, quantize_base=True, dtype=torch.bfloat16)
    _, saved = _saved_tensors(lambda: lora(x))
    assert all(isinstance(t, NF4Tensor) or t.numel() < IN_DIM * OUT_DIM for t in saved)


def _adversarial_weights(dtype):
    """Shapes 256x64 (one scaler block of 256 NF4 blocks); values chosen to stress the scale path.

    Zeros dequantize to -0.0 and overflowing scales to NaN in torchao; comparing bits checks signs and NaNs too.
    """
    finfo = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(3)
    shape = (256, 64)
    randn = torch.randn(shape, generator=gen, dtype=torch.float32)
    mixed = randn * torch.logspace(-4, 4, 256).view(256, 1)  # one scale per NF4 block (row of 64)
    sparse = torch.zeros(shape)
    sparse[::3, 7] = 1.0
    cases = {
        "random": randn,
        "zeros": torch.zeros(shape),
        "huge": randn.sign() * finfo.max * torch.rand(shape, generator=gen).clamp_min(0.5),
        "constant_huge": torch.full(shape, finfo.max),  # the scale mean overflows: torchao gives NaN everywhere
        "tiny": randn * finfo.tiny,
        "subnormal": randn.sign() * finfo.smallest_normal / 8,
        "mixed_scale_blocks": mixed.clamp(-finfo.max, finfo.max),
        "constant": torch.full(shape, -3.0),
        "sparse": sparse,
        "nf4_levels": torch.linspace(-1, 1, 16).repeat(1024).view(shape),
    }
    return {name: w.to(dtype) for name, w in cases.items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_nf4_is_bit_identical_to_torchao(dtype):
    gen = torch.Generator().manual_seed(4)
    weights = _adversarial_weights(dtype)
    weights["large_random"] = (torch.randn(1024, 768, generator=gen) * 0.02).to(dtype)
    for name, dense in weights.items():
        nf4 = to_nf4(dense)
        ref = nf4.get_original_weight()
        ours = dequantize_nf4(nf4)
        assert ours.dtype == ref.dtype == dtype and ours.shape == ref.shape
        assert torch.equal(_bits(ours), _bits(ref)), name
        for out_dtype in DTYPES:
            assert torch.equal(_bits(dequantize_nf4(nf4, out_dtype)), _bits(ref.to(out_dtype))), (name, out_dtype)
        assert torch.equal(_bits(dequantize_nf4(nf4.t())), _bits(ref.t())), name


def _assert_same_nf4(ours: NF4Tensor, ref: NF4Tensor, what: str) -> None:
    assert (ours.shape, ours.stride(), ours.dtype, ours.block_size, ours.n_blocks, ours.scaler_block_size) == (
        ref.shape,
        ref.stride(),
        ref.dtype,
        ref.block_size,
        ref.n_blocks,
        ref.scaler_block_size,
    ), what
    for name in ref.__tensor_flatten__()[0]:
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name)
        assert torch.equal(_bits(a) if a.is_floating_point() else a, _bits(b) if b.is_floating_point() else b), (
            what,
            name,
        )


def _blocks_with_unit_absmax(values: torch.Tensor) -> torch.Tensor:
    """``values`` (within [-1, 1]) laid out 63 per NF4 block plus a 1.0, so that they are their own scaled values."""
    values = torch.cat([values, values.new_zeros((-values.numel()) % 63)]).view(-1, 63)
    blocks = torch.cat([values, values.new_ones(values.shape[0], 1)], dim=1).flatten()
    return torch.cat([blocks, blocks.new_zeros((-blocks.numel()) % (64 * 256))]).view(-1, 256)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_nf4_is_bit_identical_to_torchao(dtype):
    weights = _adversarial_weights(dtype)
    weights["large_random"] = (torch.randn(1024, 768, generator=torch.Generator().manual_seed(5)) * 0.02).to(dtype)
    if dtype == torch.float32:
        # The midpoints between NF4 levels (where the codes change) and their neighbours up to 16 ulps away.
        levels = to_nf4(torch.ones(256, 64)).nf4
        mids = ((levels[1:] + levels[:-1]) / 2).repeat_interleave(33)
        near = (mids.view(torch.int32) + torch.arange(-16, 17, dtype=torch.int32).repeat(15)).view(torch.float32)
        weights["near_thresholds"] = _blocks_with_unit_absmax(near)
    else:
        # Every value of the dtype in [-1, 1].
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        weights["every_value"] = _blocks_with_unit_absmax(every[every.abs() <= 1])
    for name, dense in weights.items():
        _assert_same_nf4(quantize_nf4(dense, scaler_block_size=256), to_nf4(dense), name)


def test_quantize_nf4_has_no_autograd_history():
    dense = torch.randn(OUT_DIM, IN_DIM, requires_grad=True)
    nf4 = quantize_nf4(dense * 2)
    assert isinstance(nf4, NF4Tensor) and not nf4.requires_grad and nf4.grad_fn is None
    for name in nf4.__tensor_flatten__()[0]:
        inner = getattr(nf4, name)
        assert not inner.requires_grad and inner.grad_fn is None
    assert torch.equal(dequantize_nf4(nf4), to_nf4(dense.detach() * 2).get_original_weight())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_nf4_on_meta_matches_torchao_layout(dtype):
    shape = (1024, 512)
    ours = quantize_nf4(torch.empty(shape, dtype=dtype, device="meta"))
    ref = to_nf4(torch.empty(shape, dtype=dtype, device="meta"))
    assert (ours.shape, ours.stride(), ours.dtype, ours.device) == (ref.shape, ref.stride(), ref.dtype, ref.device)
    assert ours.__tensor_flatten__()[1]["n_blocks"] == ref.__tensor_flatten__()[1]["n_blocks"]
    for name in ref.__tensor_flatten__()[0]:
        a, b = getattr(ours, name), getattr(ref, name)
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), name
    assert dequantize_nf4(ours, torch.float16).shape == shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_frozen_nf4_linear_forward_and_state_dict(dtype):
    torch.manual_seed(0)
    layer = FrozenNF4Linear(IN_DIM, OUT_DIM, bias=True, dtype=dtype)
    with torch.no_grad():
        layer.bias.normal_()
    assert isinstance(layer.weight, NF4Tensor) and layer.weight.dtype == dtype
    assert not any(p.requires_grad for p in layer.parameters())
    x = _input(torch.float32)
    ref = F.linear(x.to(dtype), layer.weight.get_original_weight(), layer.bias)
    torch.testing.assert_close(layer(x), ref, **TOL[dtype])
    # A dense incoming weight in another dtype is quantized in the layer's dtype.
    incoming = torch.randn(OUT_DIM, IN_DIM, dtype=torch.bfloat16 if dtype != torch.bfloat16 else torch.float32)
    layer.load_state_dict({"weight": incoming, "bias": torch.zeros(OUT_DIM)})
    expected = to_nf4(incoming.to(dtype)).get_original_weight()
    assert isinstance(layer.weight, NF4Tensor) and torch.equal(dequantize_nf4(layer.weight), expected)


def test_nf4_incompatible_shape_raises_clear_error():
    # Any 2-D shape quantizes with the per-shape scaler block size; an explicit one must divide the block count.
    with pytest.raises(ValueError, match=r"\(100, 300\).*469 blocks.*scaler_block_size=256.*scaler_block_size=None"):
        FrozenNF4Linear(300, 100, scaler_block_size=256)
    with pytest.raises(ValueError, match=r"\(128, 256\).*256 blocks of block_size=128.*scaler_block_size=512"):
        FrozenNF4Linear(256, 128, block_size=128, scaler_block_size=512)
    with pytest.raises(ValueError, match=r"\(100, 64\).*scaler_block_size=256"):
        LoRALinear(64, 100, rank=4, alpha=8, quantize_base=True, scaler_block_size=256)
    with pytest.raises(ValueError, match=r"\(16384,\).*2-D"):
        quantize_nf4(torch.zeros(16384))


def test_non_float_dtype_raises_clear_error():
    with pytest.raises(ValueError, match=r"dtype=torch.int32 is not a floating-point dtype"):
        FrozenNF4Linear(IN_DIM, OUT_DIM, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"adapter_dtype=torch.int8"):
        LoRALinear(IN_DIM, OUT_DIM, rank=4, alpha=8, adapter_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"torch.int64 is not a floating-point dtype"):
        quantize_nf4(torch.zeros(OUT_DIM, IN_DIM, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"dtype=torch.int32 is not a floating-point dtype"):
        linear_nf4(torch.randn(2, IN_DIM), _nf4_weight(), dtype=torch.int32)


# ------------------------------------------------------------------------------------------ frozen 16-bit storage


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
def test_frozen_linear_computes_in_fp32_from_16_bit_storage(storage, monkeypatch):
    """An fp32 run's bf16-stored frozen weight: the values of F.linear on the upcast weight (the upcast is exact),
    with only the stored weight saved for backward and the upcast done a block of rows at a time."""
    from torchtune_ext.modules import low_precision

    monkeypatch.setattr(low_precision, "_FROZEN_BLOCK_NUMEL", 256 * 100)  # 3 blocks of 100 rows (+ 12)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(312, 256, generator=gen) * 0.05).to(storage)
    x = torch.randn(3, 5, 256, generator=gen, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = frozen_linear(x, weight, torch.float32)
    assert out.dtype == torch.float32 and [t.data_ptr() for t in saved] == [weight.data_ptr()]
    grad_out = torch.randn(out.shape, generator=gen)
    out.backward(grad_out)
    reference_x = x.detach().clone().requires_grad_()
    reference = F.linear(reference_x, weight.float())
    reference.backward(grad_out)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-6, atol=1e-6)


def test_frozen_embedding_and_tied_output_keep_bf16_storage_and_fp32_results():
    from torchtune_ext.models import qlora_tiny_llama

    full = qlora_tiny_llama(["q_proj", "v_proj"], dtype=torch.float32, device="cpu", seed=0)
    half = qlora_tiny_llama(
        ["q_proj", "v_proj"], dtype=torch.float32, frozen_dtype=torch.bfloat16, device="cpu", seed=0
    )
    assert isinstance(half.tok_embeddings, FrozenEmbedding) and isinstance(half.output, FrozenTiedLinear)
    assert half.tok_embeddings.weight.dtype == torch.bfloat16 and not half.tok_embeddings.weight.requires_grad
    # The same model once its table holds bf16 values: fp32 storage of them gives the same results.
    with torch.no_grad():
        full.tok_embeddings.weight.copy_(half.tok_embeddings.weight.float())
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, reference = half(tokens), full(tokens)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)

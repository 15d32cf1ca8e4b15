"""NF4 of any shape: the per-shape scaler block size, the padded last block, and the values of a dense reference
implementation of the algorithm (written here, independent of ``torchtune_ext.nf4``)."""

import pytest
import torch
import torch.nn.functional as F

from torchtune_ext.modules import FrozenNF4Linear
from torchtune_ext.nf4 import (
    dequantize_nf4,
    nf4_even_world_sizes,
    nf4_scaler_block_size,
    quantize_nf4,
    to_nf4,
)

# QLoRA's NF4 levels (Dettmers et al., 2023, appendix E), as torchao rounds them.
LEVELS = [
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
]  # fmt: skip

# Every NF4 weight shape of SmolLM2-135M (hidden 576, 9 heads, 3 KV heads, MLP 1536) and SmolLM2-360M (hidden 960,
# 15 heads, 5 KV heads, MLP 2560): q/o, k/v, gate/up, down.
SMOLLM2_135M = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
SMOLLM2_360M = [(960, 960), (320, 960), (2560, 960), (960, 2560)]
# numel not a multiple of 64: the last block is padded.
PADDED = [(100, 300), (3, 7), (2, 65), (129, 3)]


def reference_nf4(dense: torch.Tensor, scaler_block_size: int, block_size: int = 64) -> torch.Tensor:
    """Dequantized NF4 values, computed densely: zero-pad to whole blocks of ``block_size``; per block, absmax
    scale and nearest NF4 level of each scaled value; the block scales double-quantized to int8 in groups of
    ``scaler_block_size`` around their mean (each group scaled by 256 / (2 * its max |scale - mean|)); value =
    level * dequantized scale; padding dropped. Every step in ``dense.dtype``."""
    dtype = dense.dtype
    flat = dense.flatten()
    blocks = torch.cat([flat, flat.new_zeros(-flat.numel() % block_size)]).view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    levels = torch.tensor(LEVELS, dtype=dtype)
    codes = ((blocks / absmax[:, None]).unsqueeze(-1) - levels).abs().argmin(dim=-1)
    mean = absmax.mean()
    centered = (absmax - mean).view(-1, scaler_block_size)
    factor = 256 / (2 * centered.abs().amax(dim=1, keepdim=True))
    quantized = (centered * factor).round().clamp(-128, 127).to(torch.int8)
    scales = (quantized / factor).flatten().to(dtype) + mean
    values = levels[codes] * scales[:, None]
    return values.flatten()[: flat.numel()].view(dense.shape)


def _weight(shape, dtype, seed=0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def test_scaler_block_size_keeps_torchao_layout_where_it_splits_over_8_ranks():
    assert nf4_scaler_block_size((4096, 4096)) == 256  # 262,144 blocks: 1,024 groups of 256
    assert nf4_scaler_block_size((576, 576)) == 216  # 5,184 blocks: 24 groups (256 does not divide)
    assert nf4_scaler_block_size((896, 896)) == 224  # 12,544 blocks: 49 groups of 256 -> 56 of 224
    assert nf4_scaler_block_size((128, 896)) == 224  # 1,792 blocks: 7 groups of 256 -> 8 of 224
    assert nf4_scaler_block_size((960, 960)) == 225  # 14,400 blocks: 64 groups
    assert nf4_scaler_block_size((100, 300)) == 67  # 469 blocks (last padded) = 7 x 67
    assert nf4_even_world_sizes((896, 896)) == (1, 2, 4, 7, 8)
    assert nf4_even_world_sizes((896, 896), scaler_block_size=256) == (1, 7)  # torchao's: 49 groups
    assert nf4_even_world_sizes((576, 576)) == (1, 2, 3, 4, 6, 8)
    assert nf4_even_world_sizes((100, 300)) == (1,)  # a padded last block is never split
    # Where 256 is kept, the NF4Tensor is torchao's to_nf4, inner tensor for inner tensor.
    dense = _weight((512, 2048), torch.bfloat16)
    ours, theirs = quantize_nf4(dense), to_nf4(dense)
    assert ours.scaler_block_size == theirs.scaler_block_size == 256
    for name in theirs.__tensor_flatten__()[0]:
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SMOLLM2_135M + SMOLLM2_360M + PADDED, ids=str)
def test_any_shape_equals_dense_reference(shape, dtype):
    dense = _weight(shape, dtype)
    nf4 = quantize_nf4(dense)
    assert nf4.shape == shape and nf4.scaler_block_size == nf4_scaler_block_size(shape)
    expected = reference_nf4(dense, nf4.scaler_block_size)
    assert torch.equal(dequantize_nf4(nf4), expected)
    assert torch.equal(dequantize_nf4(nf4, torch.float32), expected.float())
    assert torch.equal(dequantize_nf4(nf4.t()), expected.t())
    # On the meta device: the same layout, no memory.
    meta = quantize_nf4(dense.to("meta"))
    for name in nf4.__tensor_flatten__()[0]:
        assert getattr(meta, name).shape == getattr(nf4, name).shape, name


@pytest.mark.parametrize("shape", PADDED, ids=str)
def test_padding_never_changes_an_unpadded_block(shape):
    dense = _weight(shape, torch.float32, seed=1)
    numel, full = dense.numel(), dense.numel() // 64 * 64
    values = dequantize_nf4(quantize_nf4(dense)).flatten()
    # The same values with the padded tail written out as zeros: a weight of whole blocks.
    explicit = torch.cat([dense.flatten(), dense.new_zeros(-numel % 64)]).view(1, -1)
    unpadded = dequantize_nf4(quantize_nf4(explicit, scaler_block_size=nf4_scaler_block_size(shape))).flatten()
    assert torch.equal(values[:full], unpadded[:full])
    assert torch.equal(values, reference_nf4(dense, nf4_scaler_block_size(shape)).flatten())


@pytest.mark.parametrize("shape", [SMOLLM2_135M[0], SMOLLM2_135M[1], SMOLLM2_360M[3], (100, 300)], ids=str)
def test_frozen_nf4_linear_at_any_shape(shape):
    out_dim, in_dim = shape
    layer = FrozenNF4Linear(in_dim, out_dim, dtype=torch.bfloat16)
    dense = _weight(shape, torch.float32, seed=2)
    layer.load_state_dict({"weight": dense})
    reference = reference_nf4(dense.to(torch.bfloat16), nf4_scaler_block_size(shape))
    x = torch.randn(3, in_dim, generator=torch.Generator().manual_seed(3))
    assert torch.equal(layer(x), F.linear(x.to(torch.bfloat16), reference))
    assert torch.equal(dequantize_nf4(layer.weight), reference)

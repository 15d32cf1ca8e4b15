"""``linear_nf4`` under ``no_grad`` (decoding) skips the autograd.Function: its output equals the recorded forward's bit
for bit, for every CPU path (1-token slabs, large-weight slabs, the whole dequantized weight), and autocast still
cannot change its compute dtype."""

import pytest
import torch
import torch.nn.functional as F

from torchtune_ext.modules.low_precision import linear_nf4
from torchtune_ext.nf4 import quantize_nf4

SHAPES = [(576, 576), (2048, 1024), (96, 64)]  # small-batch slabs, slab plan, whole weight (48 tokens)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 48])
def test_no_grad_output_equals_the_recorded_forward(shape, tokens):
    generator = torch.Generator().manual_seed(0)
    weight = quantize_nf4(torch.randn(shape, generator=generator))
    x = torch.randn(1, tokens, shape[1], generator=generator)
    recorded = linear_nf4(x.clone().requires_grad_(True), weight, torch.float32)
    assert recorded.grad_fn is not None
    with torch.no_grad():
        direct = linear_nf4(x, weight, torch.float32)
    assert direct.grad_fn is None
    assert torch.equal(direct, recorded.detach())
    reference = F.linear(x.double(), weight.get_original_weight().double())  # torchao's dequantization
    torch.testing.assert_close(direct.double(), reference, rtol=1e-5, atol=1e-4)


def test_no_grad_under_autocast_still_computes_in_the_given_dtype():
    generator = torch.Generator().manual_seed(1)
    weight = quantize_nf4(torch.randn(576, 576, generator=generator))
    x = torch.randn(1, 1, 576, generator=generator)
    with torch.no_grad():
        plain = linear_nf4(x, weight, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = linear_nf4(x, weight, torch.float32)
    assert autocast.dtype == torch.float32
    assert torch.equal(autocast, plain)

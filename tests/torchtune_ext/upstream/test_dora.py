"""Port of torchtune's ``tests/torchtune/modules/peft/test_dora.py``.

Upstream: pytorch/torchtune, tag v0.6.1, commit a6290a5b40758f13bca61c386bc8756a49ef417e.

Adapted:
- ``torchtune.modules.peft.DoRALinear`` -> ``torchtune_ext.modules.DoRALinear``.
- dtype: upstream builds the layer under ``training.set_default_dtype(dtype)`` and the layer computes in the input's
  dtype. Ours also takes an explicit compute ``dtype`` (and ``adapter_dtype``); the fixtures keep upstream's
  ``set_default_dtype`` context and pass ``dtype=dtype`` too (base, bias, adapters and magnitude in ``dtype``; the
  NF4 path dequantizes to / computes in ``dtype``). ``test_quantized_state_dict`` and the meta-device test build
  their layers exactly as upstream (no explicit dtype).
- ``tests.test_utils.fixed_init_model`` is copied into ``_upstream_utils``.
- ``TestDistributedDoRALinear`` (an ``FSDPTest`` on 2 GPUs with NCCL) runs on 2 CPU processes over gloo through the
  project's ``run_distributed``: ``cuda:{rank}`` -> ``cpu``; each rank seeds ``torch.manual_seed(0)`` first, as
  ``FSDPTest`` does, so the random state dicts agree across ranks; upstream's ``run_subtests`` over
  ``load_dora_weights`` becomes one pytest case per subtest, run in the one 2-process job shared by all ported
  files (``_upstream_utils.register_distributed_cases``: one spawn keeps the suite fast); the checks upstream makes
  on rank 0 only are made on every rank (the values are the same on both), so that a failing check stops both ranks
  at the same point instead of leaving the other rank blocked in the next collective.
  ``torch.distributed._composable.fsdp.fully_shard`` -> its public path ``torch.distributed.fsdp``.
  Each subtest also runs with our ``load_full_state_dict`` (``torchtune_ext.distributed``) in place of torchtune's
  ``training.load_from_full_model_state_dict`` (``strict=False``, as torchtune's default).
- ``NF4Tensor`` / ``to_nf4`` are imported from ``torchtune_ext.nf4`` (torchao's, re-exported from wherever the
  installed torchao keeps them) instead of ``torchao.dtypes.nf4tensor``.
- Not upstream, added: ``TestDoRALinearVsTorchtune`` compares our forward with torchtune's DoRALinear on the same
  weights (equal without a bias; with a bias a strict xfail, a documented difference: torchtune rescales the bias
  too, ours does not, as PEFT's DoRA) and with the linear ``get_merged_lora_ckpt`` makes from ours (equal with and
  without a bias).
All assertions and tolerances are upstream's.
"""

from copy import deepcopy
from functools import partial

import pytest
import torch
import torch.distributed
from _upstream_utils import (
    check_distributed_case,
    expect_gap,
    fixed_init_model,
    register_distributed_cases,
    xfail_gap,
)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torchtune import training
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.feed_forward import FeedForward
from torchtune.modules.peft import DoRALinear as TorchtuneDoRALinear
from torchtune.modules.peft import get_merged_lora_ckpt
from torchtune.training.seed import set_seed

from torchtune_ext.distributed import load_full_state_dict
from torchtune_ext.modules import DoRALinear
from torchtune_ext.nf4 import NF4Tensor, to_nf4

RANK = 4
ALPHA = 1.0
BSZ = 2
SEQ_LEN = 32
EXPECTED_VAL = 0.05201


@pytest.fixture(autouse=True)
def random():
    set_seed(16)


class TestDoRALinear:
    """
    Class for testing our DoRALinear implementation. Expected values are computed
    from the reference implementation and calculated in scripts/compare_lora.py.
    """

    @pytest.fixture
    def in_dim(self) -> int:
        return 64

    @pytest.fixture
    def out_dim(self) -> int:
        return 128

    @pytest.fixture
    def inputs(self, in_dim) -> torch.Tensor:
        inputs = torch.randn(BSZ, SEQ_LEN, in_dim)
        return inputs

    @pytest.fixture
    def dora_linear(self, in_dim, out_dim):
        def create_dora_linear(
            use_bias,
            dtype,
            should_init=True,
            in_dim=in_dim,
            out_dim=out_dim,
        ):
            with training.set_default_dtype(dtype):
                dora_linear = DoRALinear(
                    in_dim=in_dim,
                    out_dim=out_dim,
                    rank=RANK,
                    alpha=ALPHA,
                    use_bias=use_bias,
                    dtype=dtype,
                )
                if should_init:
                    fixed_init_model(dora_linear)
            return dora_linear

        return create_dora_linear

    @pytest.fixture
    def qdora_linear(self):
        def create_qdora_linear(
            use_bias=False,
            dtype=torch.bfloat16,
            in_dim=512,
            out_dim=512,
            quantize_base=True,
            **quantization_kwargs,
        ):
            with training.set_default_dtype(dtype):
                qdora_linear = DoRALinear(
                    in_dim=in_dim,
                    out_dim=out_dim,
                    rank=RANK,
                    alpha=ALPHA,
                    use_bias=use_bias,
                    quantize_base=quantize_base,
                    dtype=dtype,
                    **quantization_kwargs,
                )
                fixed_init_model(qdora_linear)
            return qdora_linear

        return create_qdora_linear

    def test_forward(self, inputs, dora_linear, out_dim) -> None:
        dora_linear = dora_linear(use_bias=False, dtype=torch.float32)
        expected = torch.tensor(EXPECTED_VAL)
        actual = dora_linear(inputs)
        assert actual.shape == (BSZ, SEQ_LEN, out_dim)
        torch.testing.assert_close(actual.mean(), expected, atol=1e-4, rtol=1e-6)

    @pytest.mark.parametrize("use_bias", [True, False])
    def test_dora_weight_nf4_when_quantized(self, use_bias, qdora_linear):
        qdora_linear = qdora_linear(use_bias=use_bias, dtype=torch.bfloat16)
        assert isinstance(qdora_linear.weight, NF4Tensor)
        if use_bias:
            assert not isinstance(qdora_linear.bias, NF4Tensor)
            assert qdora_linear.bias.dtype == torch.bfloat16

    def test_dora_weight_nf4_when_quantized_with_quantization_kwargs(self, qdora_linear):
        qdora_linear = qdora_linear(use_bias=True, dtype=torch.bfloat16, block_size=8, scaler_block_size=4)
        assert isinstance(qdora_linear.weight, NF4Tensor)
        assert qdora_linear.weight.block_size == 8
        assert qdora_linear.weight.scaler_block_size == 4
        assert not isinstance(qdora_linear.bias, NF4Tensor)

    def test_dora_weight_nf4_when_quantized_raises_value_error_with_bad_args(self, qdora_linear):
        """Ensure that if quantize_base is False, but we pass in quantization kwargs,
        we raise a ValueError."""
        with pytest.raises(
            ValueError,
            match="``quantize_base`` is False, but received the following quantization arguments",
        ):
            qdora_linear(
                use_bias=True,
                dtype=torch.bfloat16,
                block_size=8,
                scaler_block_size=4,
                quantize_base=False,
            )

    # Note: with bfloat16 F.linear(x, weight, bias) != F.linear(x, weight) + bias.
    # This means we would get different results (irrespective of QDoRA).
    # So we leave that test case out
    @pytest.mark.parametrize(
        "use_bias, dtype",
        [(False, torch.bfloat16), (True, torch.float32), (False, torch.float32)],
    )
    def test_qdora_parity(self, use_bias, dtype, dora_linear, qdora_linear):
        with training.set_default_dtype(dtype):
            qdora_linear = qdora_linear(use_bias=use_bias, dtype=dtype, in_dim=512, out_dim=512)
            dora_linear = dora_linear(use_bias=use_bias, dtype=dtype, in_dim=512, out_dim=512)

        # set weight of dora_linear to unquantized weight of qdora_linear and check
        # parity.
        dora_linear.weight.data = qdora_linear.weight.to(dtype)
        if use_bias:
            dora_linear.bias.data = qdora_linear.bias.detach().clone()
        qdora_linear.initialize_dora_magnitude()
        dora_linear.initialize_dora_magnitude()

        # Ensure forward passes are the same. This is because DoRALinear should use a special
        # quantized linear operator that runs compute in higher prec (but only saves the 4 bit quantized tensor)
        # for autograd.
        inputs = torch.randn(BSZ, SEQ_LEN, 512, dtype=dtype)
        torch.manual_seed(0)
        dora_linear_out = dora_linear(inputs)
        torch.manual_seed(0)
        qdora_linear_out = qdora_linear(inputs)
        torch.testing.assert_close(dora_linear_out, qdora_linear_out)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_quantized_state_dict(self, dtype):
        with training.set_default_dtype(dtype):
            dora_linear = DoRALinear(
                in_dim=512,
                out_dim=512,
                rank=RANK,
                alpha=ALPHA,
                use_bias=False,
                quantize_base=True,
            )

        dora_linear._register_state_dict_hook(
            partial(
                reparametrize_as_dtype_state_dict_post_hook,
                dtype=dtype,
                offload_to_cpu=False,
            )
        )
        sd = dora_linear.state_dict()
        # No nf4 tensors, all have type dtype
        for v in sd.values():
            assert v.dtype == dtype
            assert not isinstance(v, NF4Tensor)

        # Load back in results in re-quant and creates the same nf4 tensor.
        # This also ensures that DoRALinear can load a bf16 state_dict.
        dora_linear_reload = DoRALinear(
            in_dim=512,
            out_dim=512,
            rank=RANK,
            alpha=ALPHA,
            use_bias=False,
            quantize_base=True,
        )
        # Zero out weight to verify reloading works
        dora_linear_reload.weight = nn.Parameter(
            to_nf4(
                torch.zeros_like(
                    dora_linear.weight.get_original_weight(),
                    dtype=dtype,
                    device=dora_linear.weight.device,
                )
            )
        )
        # nf4 tensors should be different
        assert not torch.allclose(dora_linear.weight.quantized_data, dora_linear_reload.weight.quantized_data)
        # but should be the same after loading
        dora_linear_reload.load_state_dict(sd)
        assert torch.allclose(dora_linear.weight.quantized_data, dora_linear_reload.weight.quantized_data)

    def test_dora_single_device_init(self, dora_linear):
        dora_linear = dora_linear(use_bias=False, dtype=torch.float32, should_init=False)

        # Randomly initialize LoRA A and B weights to some nonzero value
        dora_linear.lora_a.weight = nn.Parameter(torch.randn_like(dora_linear.lora_a.weight))
        dora_linear.lora_b.weight = nn.Parameter(torch.randn_like(dora_linear.lora_b.weight))

        expected_magnitude = torch.linalg.norm(
            dora_linear.weight + dora_linear.scaling * dora_linear.lora_b.weight @ dora_linear.lora_a.weight,
            dim=1,
        )
        assert not torch.allclose(dora_linear.magnitude, expected_magnitude)
        dora_linear.initialize_dora_magnitude()
        assert torch.allclose(dora_linear.magnitude, expected_magnitude)

    def test_dora_meta_device_init_error(self):
        with torch.device("meta"):
            dora_linear = DoRALinear(
                in_dim=512,
                out_dim=512,
                rank=RANK,
                alpha=ALPHA,
                use_bias=False,
                quantize_base=False,
            )
        with pytest.raises(RuntimeError, match="Cannot initialize DoRA magnitude"):
            dora_linear.initialize_dora_magnitude()


# ---- not upstream: our DoRALinear against torchtune's, with a bias ---------------------------------------------------

DORA_BIAS_GAP = (
    "contract difference: with use_bias=True torchtune's DoRALinear rescales the base output *including* the bias, "
    "(m / ||W + s BA|| - 1) * (W x + b), while ours rescales W x only (as PEFT's DoRA does); so ours equals the "
    "linear that get_merged_lora_ckpt produces (W' = m / ||W + s BA|| * (W + s BA), b unchanged) and torchtune's "
    "does not"
)


def _ours_and_torchtunes_dora(use_bias: bool):
    torch.manual_seed(0)
    theirs = TorchtuneDoRALinear(64, 128, rank=RANK, alpha=8.0, use_bias=use_bias)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_()  # non-zero lora_b, a magnitude away from the norms, a non-zero bias
    ours = DoRALinear(64, 128, rank=RANK, alpha=8.0, use_bias=use_bias)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


class TestDoRALinearVsTorchtune:
    @pytest.mark.parametrize(
        "use_bias", [False, pytest.param(True, marks=xfail_gap(DORA_BIAS_GAP))], ids=["no_bias", "bias"]
    )
    def test_forward_matches_torchtune(self, use_bias):
        ours, theirs = _ours_and_torchtunes_dora(use_bias)
        inputs = torch.randn(BSZ, SEQ_LEN, 64)
        with expect_gap(r"Tensor-likes are not close"):
            torch.testing.assert_close(ours(inputs), theirs(inputs))

    @pytest.mark.parametrize("use_bias", [False, True])
    def test_forward_matches_merged_checkpoint(self, use_bias):
        ours, _ = _ours_and_torchtunes_dora(use_bias)
        model = nn.Sequential(ours)
        merged = get_merged_lora_ckpt(deepcopy(model.state_dict()), rank=RANK, alpha=8.0)
        merged_model = nn.Sequential(nn.Linear(64, 128, bias=use_bias))
        merged_model.load_state_dict(merged, strict=True)
        inputs = torch.randn(BSZ, SEQ_LEN, 64)
        torch.testing.assert_close(model(inputs), merged_model(inputs), atol=1e-4, rtol=1e-4)


# ---- TestDistributedDoRALinear (upstream: FSDPTest, 2 GPUs) on 2 gloo CPU processes ---------------------------------

EMBED_DIM = 128
# Upstream checks these on rank 0 only; every rank checks here (see the module docstring).
CHECK_ON_EVERY_RANK = True
LOADERS = {
    "torchtune": lambda model, sd, device: training.load_from_full_model_state_dict(model, sd, device),
    "ours": lambda model, sd, device: load_full_state_dict(model, sd, device=device, strict=False),
}
SUBTESTS = [(loader, load_dora_weights) for loader in LOADERS for load_dora_weights in (True, False)]


def _test_dora_distributed_init(rank: int, load_dora_weights: bool, loader: str) -> None:
    load_from_full_model_state_dict = LOADERS[loader]
    is_rank_zero = rank == 0
    device = "cpu"
    embed_dim = EMBED_DIM
    base_model_state_dict = {
        "w1.weight": torch.randn(embed_dim, embed_dim),
        "w2.weight": torch.randn(embed_dim, embed_dim),
        "w3.weight": torch.randn(embed_dim, embed_dim),
    }

    adapter_state_dict = {
        "w1.lora_a.weight": torch.randn(RANK, embed_dim),
        "w1.lora_b.weight": torch.randn(embed_dim, RANK),
        "w1.magnitude": torch.randn(embed_dim),
        "w2.lora_a.weight": torch.randn(RANK, embed_dim),
        "w2.lora_b.weight": torch.randn(embed_dim, RANK),
        "w2.magnitude": torch.randn(embed_dim),
        "w3.lora_a.weight": torch.randn(RANK, embed_dim),
        "w3.lora_b.weight": torch.randn(embed_dim, RANK),
        "w3.magnitude": torch.randn(embed_dim),
    }

    # Define an FFN containing 3 DoRALinear layers and instantiate on meta device
    with torch.device("meta"):
        linears = [
            DoRALinear(
                in_dim=embed_dim,
                out_dim=embed_dim,
                rank=RANK,
                alpha=ALPHA,
                use_bias=False,
                quantize_base=False,
            )
            for _ in range(3)
        ]
        ffn = FeedForward(
            gate_proj=linears[0],
            down_proj=linears[1],
            up_proj=linears[2],
        )

    # Shard the FFN
    fully_shard(ffn)

    # Assert that everything is on meta device to start
    if is_rank_zero or CHECK_ON_EVERY_RANK:
        for dora_linear in [ffn.w1, ffn.w2, ffn.w3]:
            assert dora_linear.weight.is_meta
            assert dora_linear.lora_a.weight.is_meta
            assert dora_linear.lora_b.weight.is_meta
            assert dora_linear.magnitude.is_meta

    # Optionally load adapter weights (as though we are resuming from checkpoint)
    # Now lora_a, lora_b, and magnitude should not be on meta device, but base weight should be.
    if load_dora_weights:
        load_from_full_model_state_dict(
            ffn,
            adapter_state_dict,
            device,
        )
        if is_rank_zero or CHECK_ON_EVERY_RANK:
            for dora_linear in [ffn.w1, ffn.w2, ffn.w3]:
                assert dora_linear.weight.is_meta
                assert not dora_linear.lora_a.weight.is_meta
                assert not dora_linear.lora_b.weight.is_meta
                assert not dora_linear.magnitude.is_meta

    # If not loading adapter weights, initialize LoRA params as usual
    if not load_dora_weights:
        for m in ffn.modules():
            if isinstance(m, DoRALinear):
                m.to_empty(device=device)
                m.initialize_parameters()

    # At this point (assuming load_dora_weights=False) we should have
    # zero-initialized LoRA B, Kaiming-uniform initialized LoRA A, and magnitude off meta device
    if is_rank_zero or CHECK_ON_EVERY_RANK:
        for dora_linear in [ffn.w1, ffn.w2, ffn.w3]:
            assert dora_linear.weight.is_meta
            assert not dora_linear.lora_a.weight.is_meta
            assert not dora_linear.lora_b.weight.is_meta
            assert not dora_linear.magnitude.is_meta

    # Load base model weights
    load_from_full_model_state_dict(
        ffn,
        base_model_state_dict,
        device,
    )

    # After this, everything should be off meta device
    if is_rank_zero or CHECK_ON_EVERY_RANK:
        for dora_linear in [ffn.w1, ffn.w2, ffn.w3]:
            assert not dora_linear.weight.is_meta
            assert not dora_linear.lora_a.weight.is_meta
            assert not dora_linear.lora_b.weight.is_meta
            assert not dora_linear.magnitude.is_meta

    # Finally, initialize the magnitudes
    for m in ffn.modules():
        if hasattr(m, "initialize_dora_magnitude"):
            m.initialize_dora_magnitude()

    # Explicitly check that the magnitudes match their expected value
    for layer in ["w1", "w2", "w3"]:
        weight = base_model_state_dict[f"{layer}.weight"]
        if load_dora_weights:
            weight += (
                (ALPHA / RANK)
                * adapter_state_dict[f"{layer}.lora_b.weight"]
                @ adapter_state_dict[f"{layer}.lora_a.weight"]
            )
        expected_magnitude = torch.linalg.norm(weight, axis=1).to(device=device)
        actual_magnitude = getattr(ffn, layer).magnitude.full_tensor()
        # to explicit replicate the tensor before comparing with DTensor
        if isinstance(expected_magnitude, DTensor):
            device_mesh = torch.distributed.init_device_mesh("cpu", (2,))
            actual_magnitude = DTensor.from_local(actual_magnitude, device_mesh=device_mesh, placements=[Replicate()])
        torch.testing.assert_close(expected_magnitude, actual_magnitude)


def _dora_distributed_init_case(rank: int, loader: str, load_dora_weights: bool) -> None:
    torch.manual_seed(0)  # FSDPTest seeds every rank alike; the random state dicts must agree
    _test_dora_distributed_init(rank, load_dora_weights, loader)


register_distributed_cases(
    {
        f"test_dora-{loader}-{load_dora_weights}": (_dora_distributed_init_case, (loader, load_dora_weights))
        for loader, load_dora_weights in SUBTESTS
    }
)


@pytest.mark.distributed
class TestDistributedDoRALinear:
    @pytest.mark.parametrize("loader", list(LOADERS))
    def test_dora_distributed_init_load_dora_weights(self, tmp_path_factory, loader):
        check_distributed_case(f"test_dora-{loader}-True", tmp_path_factory)

    @pytest.mark.parametrize("loader", list(LOADERS))
    def test_dora_distributed_init_no_dora_weights(self, tmp_path_factory, loader):
        check_distributed_case(f"test_dora-{loader}-False", tmp_path_factory)

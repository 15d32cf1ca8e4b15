"""The dry run's device profiles, host RAM and headroom.

References: the byte arithmetic of the shapes (layer inputs offloaded, power-of-two blocks), the estimator's own
estimates at the lengths the search returns (each limit checked at L and L + 1), and the recipe's refusal of bf16.
"""

import pytest
import torch
from test_estimator import KIB, _cfg, _estimator

from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipe
from torchtune_ext.config import ConfigError
from torchtune_ext.memory import (
    GIB,
    PROFILES,
    DryRunTarget,
    HostMemory,
    device_profile,
    dry_run_target,
    fits_line,
    longest_fitting_seq_len,
    pinned_block_bytes,
    pinned_bytes,
)
from torchtune_ext.models import TINY_LLAMA_ARGS


def test_t4_profile_refuses_bf16_before_any_estimate(monkeypatch):
    """The recipe's settings refuse it (a dry run and a real run alike), before any estimate."""
    monkeypatch.setattr(
        QLoRAFinetuneRecipe, "memory_estimator", lambda *a: pytest.fail("estimated before refusing bf16")
    )
    for dry_run in (True, False):
        with pytest.raises(ConfigError, match="bf16.*t4"):
            QLoRAFinetuneRecipe(_cfg("dtype=bf16", "device_profile=t4", f"dry_run={dry_run}"))


@pytest.mark.parametrize(
    "name, dtype, backend",
    [
        ("t4", torch.float16, "efficient"),  # sm75: no FlashAttention-2
        ("t4", torch.float32, "efficient"),
        ("l4", torch.bfloat16, "flash"),
        ("a100_40gb", torch.float16, "flash"),
        ("h100", torch.float32, "efficient"),  # FlashAttention-2 takes 16-bit inputs only
    ],
)
def test_sdpa_backend_follows_capability_and_dtype(name, dtype, backend):
    assert PROFILES[name].sdpa_backend(dtype) == backend


def test_profile_from_memory_and_capability_and_bad_names():
    custom = device_profile(None, 15.0, "7.5")
    assert (custom.total_memory_gib, custom.capability, custom.bf16) == (15.0, (7, 5), False)
    assert device_profile("t4", 14.0).total_memory_gib == 14.0  # device_memory_gb overrides the profile's
    assert PROFILES["t4"].total_memory_gib < 15360 / 1024  # less than nvidia-smi's 15360 MiB
    with pytest.raises(ConfigError, match="device_profile='v100'"):
        device_profile("v100")
    with pytest.raises(ConfigError, match="compute_capability"):
        device_profile(None, 15.0, "sm75")
    with pytest.raises(ConfigError, match="memory_headroom"):
        dry_run_target(_cfg("memory_headroom=1.5"), torch.device("cpu"), torch.float32)


def test_every_fits_answer_states_its_headroom():
    usable = 16 * 0.95 * GIB
    assert fits_line("device", int(usable), 16, 0.05).endswith(": fits")
    assert "5% headroom" in fits_line("device", int(usable), 16, 0.05)
    assert fits_line("device", int(usable) + 1, 16, 0.05).endswith("does NOT fit")


def test_pinned_offload_buffers_are_power_of_two_blocks_of_the_layer_inputs():
    """Offloaded gradient checkpointing puts each layer's input (``seq x dim``, bf16: 125,000 bytes at 1000 tokens)
    on the host; torch's caching host allocator reserves a power of two for each: 131,072 bytes."""
    num_layers, dim, seq_len = 8, TINY_LLAMA_ARGS["embed_dim"], 1000
    settings = [f"model.num_layers={num_layers}", "model.lora_rank=4", "model.max_seq_len=1024", "dtype=bf16"]
    cfg = _cfg(*settings, "enable_activation_checkpointing=True", "enable_activation_offloading=True")
    estimate = _estimator(cfg).estimate(1, seq_len)
    layer_input = seq_len * dim * torch.bfloat16.itemsize
    block = pinned_block_bytes(layer_input)
    assert block == 1 << (layer_input - 1).bit_length() and block > layer_input
    assert (
        num_layers * block
        <= estimate.pinned_host_bytes
        <= num_layers * block + 4 * pinned_block_bytes(seq_len * dim * 4) + 8 * KIB
    )
    assert estimate.pinned_host_bytes > estimate.host_bytes  # the rounding costs host memory


def test_longest_sequence_respects_device_host_and_headroom():
    """The search's answer L fits both limits (with the headroom) and L + 1 does not, by the estimates themselves;
    with a small host the host is what bounds it, and two ranks on that host (each its own process, loading and
    pinned buffers) fit a shorter one; with the offload buffers at their own size (no power-of-two blocks) a longer
    one."""
    settings = ["model.num_layers=4", "model.lora_rank=4", "model.max_seq_len=4096", "dtype=fp16"]
    cfg = _cfg(*settings, "enable_activation_checkpointing=True", "enable_activation_offloading=True")
    estimator = _estimator(cfg)
    process, loading = 256 * KIB, 2 * 1024 * KIB
    answers = {}
    for host_gib, device_gib, ranks, exact in (
        (0.006, 2.0, 1, False),
        (0.006, 2.0, 2, False),
        (0.006, 2.0, 1, True),
        (64.0, 0.57, 1, False),
    ):
        target = DryRunTarget(device_profile(None, device_gib, "7.5"), host_gib, 0.05, ranks)

        def fits(seq_len: int, host_gib=host_gib, device_gib=device_gib, ranks=ranks, exact=exact) -> bool:
            estimate = estimator.estimate(1, seq_len)
            pinned = estimate.host_bytes if exact else estimate.pinned_host_bytes
            host = process + max(loading, pinned)  # loading comes before the pinned buffers
            return ranks * host <= host_gib * 0.95 * GIB and estimate.device_bytes <= device_gib * 0.95 * GIB

        longest = longest_fitting_seq_len(estimator, target, 1, HostMemory(process, loading, 0), exact_pinned=exact)
        assert 0 < longest < 4096
        assert fits(longest) and not fits(longest + 1)
        answers[host_gib, ranks, exact] = longest
    assert answers[0.006, 2, False] < answers[0.006, 1, False] < answers[0.006, 1, True]


def test_exact_pinned_bytes_are_the_offloaded_tensors():
    """Without the power-of-two blocks the offload buffers are the tensors themselves: each layer's input (``seq x
    dim`` in fp16) and what the final norm saves outside the checkpointed layers (its fp32 input, twice, and the fp32
    row scales), each counted in 512-byte units as device storages are."""
    num_layers, dim, seq_len = 4, TINY_LLAMA_ARGS["embed_dim"], 1000
    settings = [f"model.num_layers={num_layers}", "model.lora_rank=4", "model.max_seq_len=1024", "dtype=fp16"]
    cfg = _cfg(*settings, "enable_activation_checkpointing=True", "enable_activation_offloading=True")
    estimate = _estimator(cfg).estimate(1, seq_len)
    layer_input = seq_len * dim * torch.float16.itemsize
    tensors = [layer_input] * num_layers + [seq_len * dim * 4] * 2 + [seq_len * 4] * 2
    assert pinned_bytes(estimate, exact=True) == sum(-(-n // 512) * 512 for n in tensors)  # as the device counts
    assert pinned_bytes(estimate) == estimate.pinned_host_bytes >= num_layers * pinned_block_bytes(layer_input)

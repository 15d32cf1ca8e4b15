"""``bench/memory.py --torchtune-config``: torchtune's own ``lora_finetune_single_device`` step for one of
its shipped configs, eager or compiled (``compile=True``), with its activation offloading and packed batches
(``TorchtuneStep``, tested in test_torchtune_step.py); what its recipe refuses is refused before any estimate.

Reference: arithmetic over the config's shapes: the LoRA params of ``llama3_2/1B_qlora_single_device`` (rank 64 on
q/v/output_proj and the MLP of 16 layers of dim 2048, kv dim 512, MLP 8192), their gradients (kept through the
step by its gradient accumulation of 8) and AdamW's two moments plus a step count per param.
"""

import pytest
import torch

# bench/ is in a clone, not in the wheel (CI runs the installed wheel with `pytest`: no clone on sys.path).
bench_memory = pytest.importorskip("bench.memory", reason="bench/ is not installed with the wheel: run from a clone")
torchtune_config, torchtune_config_estimate = bench_memory.torchtune_config, bench_memory.torchtune_config_estimate

CONFIG = "llama3_2/1B_qlora_single_device"


@pytest.mark.parametrize(
    "override, reason",
    [
        ("enable_activation_offloading=True", "without enable_activation_checkpointing: torchtune's recipe refuses"),
        ("tokenizer.max_seq_len=null dataset.packed=True", "dataset.packed=True needs tokenizer.max_seq_len"),
        ("dtype=fp16", "torchtune's recipe refuses it"),
    ],
)
def test_what_is_not_modelled_is_refused_before_any_estimate(override, reason):
    with pytest.raises(SystemExit, match=reason):
        torchtune_config(CONFIG, override.split())
    with pytest.raises(SystemExit, match="not a config of torchtune's lora_finetune_single_device"):
        torchtune_config("llama3_2/1B_full", [])


@pytest.mark.parametrize("compile", [False, True])
def test_the_config_sets_the_model_the_optimizer_and_the_accumulation(compile):
    overrides = ["tokenizer.max_seq_len=64", "batch_size=1", f"compile={compile}"]
    estimate, cfg = torchtune_config_estimate(CONFIG, overrides, seq_len=2048)
    dim, kv_dim, hidden, rank, layers = 2048, 512, 8192, 64, 16
    per_layer = [(dim, dim), (dim, kv_dim), (dim, dim), (dim, hidden), (hidden, dim), (dim, hidden)]
    lora_params = layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in per_layer)
    adapters = lora_params * torch.bfloat16.itemsize
    assert (estimate.batch_size, estimate.seq_len, estimate.dtype) == (1, 64, torch.bfloat16)
    assert estimate.breakdown["adapters"] == adapters
    assert estimate.breakdown["grads"] == adapters  # gradient accumulation 8: kept through the step
    steps = 2 * len(per_layer) * layers * 512  # fused AdamW's fp32 step count per param, one 512-byte block each
    assert estimate.breakdown["optimizer_state"] == 2 * adapters + steps


@pytest.mark.slow
def test_the_config_sets_packing_and_activation_offloading():
    """The config's ``dataset.packed`` and ``enable_activation_offloading`` reach torchtune's step: the host holds
    each checkpointed layer's bf16 input and the final norm's two fp32 input saves (its fp32 rsqrt rows, 256 bytes,
    are under torchtune's 1 KiB offloading minimum); packing adds ``input_pos`` to the batch (``TorchtuneStep``'s
    own tests count the rest)."""
    overrides = ["tokenizer.max_seq_len=64", "batch_size=1", "enable_activation_checkpointing=True"]
    plain, _ = torchtune_config_estimate(CONFIG, overrides, seq_len=2048)
    offloaded, _ = torchtune_config_estimate(CONFIG, [*overrides, "enable_activation_offloading=True"], seq_len=2048)
    packed, cfg = torchtune_config_estimate(CONFIG, [*overrides, "dataset.packed=True"], seq_len=2048)
    dim, layers, tokens = 2048, 16, 64
    assert plain.host_bytes == 0
    assert offloaded.host_bytes == layers * tokens * dim * 2 + 2 * tokens * dim * 4
    assert bench_memory.packed(cfg) and packed.peak_bytes > plain.peak_bytes

"""[issue 19] ``bench/memory.py --torchtune-config``: torchtune's own ``lora_finetune_single_device`` step for one of
its shipped configs, eager or compiled (``compile=True``); what is not modelled (packing, activation offloading) is
refused.

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
        ("dataset.packed=True", "packed=True is not modelled"),
        ("enable_activation_offloading=True", "not modelled for torchtune's recipe"),
        ("dtype=fp16", "torchtune's recipe refuses it"),
    ],
)
def test_what_is_not_modelled_is_refused_before_any_estimate(override, reason):
    with pytest.raises(SystemExit, match=reason):
        torchtune_config(CONFIG, [override])
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

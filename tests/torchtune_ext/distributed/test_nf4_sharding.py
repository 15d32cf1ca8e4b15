"""NF4 weights on any number of ranks: every shipped builder's real shapes split (or are kept whole) on 2, 3, 4 and 8
ranks, checked on the meta device under a fake process group; real gloo groups of 2 and 3 ranks gather and train
like one device."""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import run_distributed
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from torchtune_ext import models
from torchtune_ext.distributed import check_nf4_sharding, get_full_state_dict, shard_model
from torchtune_ext.models import materialize_
from torchtune_ext.nf4 import NF4Tensor, UnevenNF4Tensor, nf4_from_inner, quantize_nf4

ROOT = Path(__file__).resolve().parents[3]
SHARDED_INNER = ("quantized_scalers", "quantization_factor", "quantized_data")
BUILDERS = [b for b in models.QLORA_BUILDERS]


def _build(builder, device="meta"):
    return builder(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, dtype=torch.bfloat16,
                   device=device)  # fmt: skip


def _nf4_params(model):
    return {n: p for n, p in model.named_parameters() if isinstance(getattr(p, "_local_tensor", p), NF4Tensor)}


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("builder", BUILDERS, ids=lambda b: b.__name__)
def test_every_builder_splits_or_keeps_whole(builder, world_size):
    model = _build(builder)
    full = {name: (tuple(p.shape), p.scaler_block_size) for name, p in _nf4_params(model).items()}
    plan = check_nf4_sharding(model, world_size)
    if world_size in (2, 4, 8):
        assert plan.whole == () and plan.whole_bytes == 0  # the per-shape scale groups split over 2, 4 and 8
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        shard_model(model, dtype=torch.bfloat16)
    finally:
        dist.destroy_process_group()
    params = _nf4_params(model)
    assert params.keys() == full.keys()
    for name, param in params.items():
        shape, scaler_block_size = full[name]
        whole = quantize_nf4(torch.empty(shape, dtype=torch.bfloat16, device="meta"))
        if name in plan.whole:
            assert type(param) is NF4Tensor and param.shape == shape, name  # whole on every rank
            continue
        assert isinstance(param, DTensor), name
        local = param._local_tensor
        assert local.shape == (shape[0] // world_size, shape[1]) and local.scaler_block_size == scaler_block_size
        # The gather: the inner tensors of the shards, concatenated, are the whole weight's.
        gathered = nf4_from_inner(
            local,
            shape,
            **{n: torch.cat([getattr(local, n)] * world_size) for n in SHARDED_INNER},
            scaler_mean=local.scaler_mean,
            nf4=local.nf4,
        )
        for inner in SHARDED_INNER:
            assert getattr(gathered, inner).shape == getattr(whole, inner).shape, (name, inner)
    assert len(plan.whole) + sum(isinstance(p, DTensor) for p in params.values()) == len(full)


def test_refused_layout_names_weight_shape_and_world_sizes():
    model = _build(models.qlora_qwen2_5_0_5b)
    assert check_nf4_sharding(model, 2, allow_whole=False).whole == ()
    with pytest.raises(
        ValueError, match=r"layers\.0\.attn\.q_proj\.weight of shape \(896, 896\).*3 ranks.*\[1, 2, 4, 7, 8\]"
    ):
        check_nf4_sharding(model, 3, allow_whole=False)
    plan = check_nf4_sharding(model, 3)
    assert len(plan.whole) == 24 * 7 and "MiB per rank" in plan.summary()
    with pytest.raises(ValueError, match="world_size=0"):
        check_nf4_sharding(model, 0)


def _loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())


def _gloo_worker(rank: int, world_size: int) -> None:
    def build(device):
        model = models.qlora_tiny_qwen(["q_proj", "v_proj"], apply_lora_to_mlp=True, dtype=torch.float32,
                                       device=device, seed=0)  # fmt: skip
        set_trainable_params(model, get_adapter_params(model))
        return model

    reference, model = build("cpu"), build("meta")
    plan = check_nf4_sharding(model, world_size)
    assert plan.whole == () and bool(plan.uneven) == (world_size == 3)  # tiny Qwen's 256/128/512 rows and 3
    shard_model(model, dtype=torch.float32)
    materialize_(model, "cpu", seed=0)
    expected = dict(reference.named_parameters())
    for name, param in _nf4_params(model).items():
        assert isinstance(param, DTensor), name
        assert isinstance(param._local_tensor, UnevenNF4Tensor) == (name in plan.uneven), name
    gathered = get_full_state_dict(model, is_rank_zero=rank == 0, keep_nf4=True, include_keys="*.weight")
    for name in _nf4_params(model) if rank == 0 else ():
        full = gathered[name]
        assert isinstance(full, NF4Tensor), name
        for inner in ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean"):  # bit for bit
            assert torch.equal(getattr(full, inner), getattr(expected[name], inner)), (name, inner)
    gen = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 512, (2, 12), generator=gen), torch.randint(0, 512, (2, 12), generator=gen)
    loss, ref_loss = _loss(model, tokens, labels), _loss(reference, tokens, labels)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    # shard_model sums gradients over ranks (the recipe normalises by the global token count); every rank ran the
    # whole batch here.
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.full_tensor()
            torch.testing.assert_close(grad, expected[name].grad * world_size, rtol=1e-4, atol=1e-6)
    state = get_full_state_dict(model, is_rank_zero=rank == 0)
    if rank == 0:
        ref_state = reference.state_dict()
        assert state.keys() == ref_state.keys()
        for key, value in state.items():
            assert torch.equal(value, ref_state[key]), key


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_nf4_fsdp2_gather_and_train(world_size):
    run_distributed(_gloo_worker, world_size)


def _tune_run(recipe: str, config: str, out: Path, base: Path, batch_size: int, nproc: int = 0) -> List[float]:
    """Runs a recipe as users do and returns its per-step losses."""
    cmd = [str(Path(sys.executable).parent / "tune"), "run"] + (["--nproc_per_node", str(nproc)] if nproc else [])
    cmd += [
        f"recipes/{recipe}.py", "--config", f"configs/tiny/{config}.yaml", f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}", "max_steps_per_epoch=3", "dataset.num_samples=96",
        "dataset_val.num_samples=12", "run_val_every_n_steps=null", "tokenizer.max_seq_len=48",
        f"batch_size={batch_size}", "gradient_accumulation_steps=1", "save_adapter_weights_only=True",
        "optimizer.lr=1e-2", "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    lines = "\n".join(p.read_text() for p in sorted((out / "logs").glob("log_*.txt")))
    return [float(v) for v in re.findall(r"Step \d+ \| .*\bloss:(\S+)", lines)]


@pytest.mark.integration_test
@pytest.mark.distributed
def test_recipe_on_3_ranks_keeps_nf4_whole_and_matches_one_device(tmp_path):
    """The tiny model's NF4 rows (256, 128, 512) do not divide 3: kept whole, loaded by the recipe's streaming
    loader on every rank; the losses and the adapter equal the single-device recipe's on the same global batch."""
    base = tmp_path / "base"
    single = _tune_run("qlora_finetune_single_device", "qlora_single_device", tmp_path / "single", base, 12)
    three = _tune_run("qlora_finetune_distributed", "qlora_distributed", tmp_path / "three", base, 4, nproc=3)
    assert len(single) == len(three) == 3 and len(set(single)) == 3
    assert max(abs(a - b) for a, b in zip(single, three)) < 1e-4, (single, three)
    ours, reference = (
        load_file(tmp_path / run / "step_3/adapter/adapter_model.safetensors") for run in ("three", "single")
    )
    assert ours.keys() == reference.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], atol=2e-5, rtol=0)

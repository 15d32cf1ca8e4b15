"""NF4 weights on any number of ranks: every shipped builder's real shapes are sharded on 2, 3, 4 and 8 ranks (evenly,
or unevenly by whole scale groups with padded shards), checked on the meta device under a fake process group (one
builder per family in the fast lane, the others in the slow lane); real
gloo groups of 2 and 3 ranks gather and train like one device, and their full state dicts equal its, bit for bit."""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import family_marks, run_distributed, run_recipe_in_process
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtune import training
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from torchtune_ext import models
from torchtune_ext.distributed import check_nf4_sharding, get_full_state_dict, get_model_state_dict, shard_model
from torchtune_ext.models import materialize_
from torchtune_ext.nf4 import (
    NF4Tensor,
    UnevenNF4Tensor,
    dequantize_nf4,
    nf4_shard_groups,
    quantize_nf4,
    quantize_nf4_shard,
)

ROOT = Path(__file__).resolve().parents[3]
SHARDED_INNER = ("quantized_scalers", "quantization_factor", "quantized_data")
BUILDERS = [pytest.param(b, id=b.__name__, marks=family_marks(b)) for b in models.QLORA_BUILDERS]


def _build(builder, device="meta"):
    return builder(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, dtype=torch.bfloat16,
                   device=device)  # fmt: skip


def _nf4_params(model):
    return {n: p for n, p in model.named_parameters() if isinstance(getattr(p, "_local_tensor", p), NF4Tensor)}


def _fsdp_rows(rows: int, world_size: int, rank: int) -> int:
    """The rows of FSDP2's shard on ``rank`` (torch.chunk, then empty shards)."""
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk))


def _shard_alone(weight: NF4Tensor, world_size: int, rank: int) -> NF4Tensor:
    """``weight`` in a module of its own, sharded by plain ``fully_shard`` (nothing prepared), on ``rank`` of a fake
    group."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        fully_shard(module)
    finally:
        dist.destroy_process_group()
    return module.weight._local_tensor


def _loaded_by_torchtune_alone(full: torch.Tensor, world_size: int, rank: int) -> NF4Tensor:
    """``full`` loaded by torchtune's ``training.load_from_full_model_state_dict`` into a module of its own, whose NF4
    weight on the meta device plain ``fully_shard`` sharded, on ``rank`` of a fake group: the loader quantizes,
    chunks and copies each rank's rows itself, then FSDP2's post-load hook pads the shard."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(quantize_nf4(full.to("meta")), requires_grad=False)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        fully_shard(module)
        training.load_from_full_model_state_dict(module, {"weight": full}, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    return module.weight._local_tensor


def _check_layout(whole: NF4Tensor, world_size: int, ranks=None) -> List[NF4Tensor]:
    """Every rank's shard (of ``ranks``; default the first and last) has FSDP2's rows and all-gather inputs of one
    size; gathered and cut, they are the whole weight's inner tensors; an even split is torchao's own (rows and
    groups over the world size). Returns the shards."""
    rows, groups = whole.shape[0], whole.quantization_factor.numel()
    even = rows % world_size == 0 and groups % world_size == 0 and whole.numel() % whole.block_size == 0
    sizes, shards = set(), []
    for rank in sorted({0, world_size - 1}) if ranks is None else ranks:
        local = _shard_alone(whole, world_size, rank)
        shards.append(local)
        assert local.shape == (_fsdp_rows(rows, world_size, rank), whole.shape[1])
        assert type(local) is (NF4Tensor if even else UnevenNF4Tensor)
        inputs, metadata = local.fsdp_pre_all_gather(None) if not even else (None, None)
        if even:
            for name in SHARDED_INNER:
                assert getattr(local, name).numel() * world_size == getattr(whole, name).numel(), name
            continue
        sizes.add(tuple(t.numel() for t in inputs))
        outputs = tuple(t.new_empty(t.numel() * world_size) for t in inputs)
        gathered, _ = local.fsdp_post_all_gather(outputs, metadata, whole.dtype)
        assert type(gathered) is NF4Tensor and gathered.shape == whole.shape
        for name in SHARDED_INNER:
            assert getattr(gathered, name).shape == getattr(whole, name).shape, name
    assert len(sizes) <= 1  # one all-gather input size on every rank
    return shards


@pytest.mark.parametrize(
    "shape, world_size",
    [
        ((896, 896), 3),  # Qwen2.5-0.5B's q/o: 56 scale groups, 19 + 19 + 18 (+1 padding)
        ((128, 896), 5),  # its k/v: 8 groups over 5 ranks, the last one padding only
        ((10, 100), 3),  # the last block padded: never splits evenly
        ((2, 1024), 3),  # fewer rows than ranks: FSDP2's empty third shard (new_empty)
    ],
)
def test_uneven_shards_gather_to_the_whole_quantization_bit_for_bit(shape, world_size):
    """Each rank quantizes its own scale groups (the loader's ``quantize_nf4_shard``); the FSDP2 hooks gather them
    into the whole tensor's ``quantize_nf4``, inner tensor by inner tensor."""
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = quantize_nf4(full)
    layout = _check_layout(quantize_nf4(full.to("meta")), world_size, ranks=range(world_size))
    shards = [quantize_nf4_shard(full, template, rank) for rank, template in enumerate(layout)]
    inputs = [shard.fsdp_pre_all_gather(None) for shard in shards]
    outputs = tuple(torch.cat(parts) for parts in zip(*(inner for inner, _ in inputs)))
    gathered, _ = shards[0].fsdp_post_all_gather(outputs, inputs[0][1], torch.bfloat16)
    for name in (*SHARDED_INNER, "scaler_mean"):
        assert torch.equal(getattr(gathered, name), getattr(whole, name)), name
    assert torch.equal(dequantize_nf4(gathered), dequantize_nf4(whole))


@pytest.mark.stack
@pytest.mark.parametrize(
    "shape, world_size, grows",
    [
        ((896, 896), 3, True),  # Qwen2.5-0.5B's q/o: 56 groups, 19 + 19 + 18; 298 rows are 4 chunks' rows, 14 each
        ((97, 896), 2, True),  # 14 groups, 7 + 7; the last chunk's 48 rows are 3 chunks' rows, 5 groups each
        ((192, 256), 3, False),  # 8 groups, 3 + 3 + 2, in chunks of equal rows
        ((97, 256), 3, False),  # the last rank holds padding only
    ],
)
def test_torchtunes_loader_gives_each_rank_the_shard_fully_shard_makes(shape, world_size, grows):
    """A torchtune user's distributed recipe shards on the meta device and loads with torchtune's own
    ``load_from_full_model_state_dict``, which makes each rank's shard from that rank's chunk rows: every rank gets
    the inner tensors plain ``fully_shard`` of the whole NF4 weight gives it, bit for bit (one all-gather size). Where
    ``grows``, the last chunk holds more scale groups than a shard of its rows is made with (the copy grows it)."""
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = quantize_nf4(full)
    last = torch.chunk(whole, world_size)[-1]
    made = whole.new_zeros(last.shape).quantization_factor.numel()
    assert (made < last.quantization_factor.numel()) == grows
    for rank in range(world_size):
        loaded = _loaded_by_torchtune_alone(full, world_size, rank)
        expected = _shard_alone(whole, world_size, rank)
        assert type(loaded) is type(expected) and loaded.shape == expected.shape, rank
        for name in (*SHARDED_INNER, "scaler_mean"):
            assert torch.equal(getattr(loaded, name), getattr(expected, name)), (rank, name)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("builder", BUILDERS)
def test_every_builder_shards_on_2_3_4_and_8_ranks(builder, world_size):
    """Real shapes on the meta device: every NF4 weight is sharded (none kept whole), evenly on 2, 4 and 8 ranks
    (the per-shape scale groups split so), each distinct shape checked alone on the first and last rank, and the
    whole model through ``shard_model`` on rank 0."""
    model = _build(builder)
    weights = _nf4_params(model)
    plan = check_nf4_sharding(model, world_size, allow_whole=False)
    assert plan.whole == () and plan.whole_bytes == 0
    if world_size in (2, 4, 8):
        assert plan.uneven == ()
    for whole in {(tuple(w.shape), w.scaler_block_size): w for w in weights.values()}.values():
        _check_layout(whole, world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        shard_model(model, dtype=torch.bfloat16)
    finally:
        dist.destroy_process_group()
    params = _nf4_params(model)
    assert params.keys() == weights.keys() and all(isinstance(p, DTensor) for p in params.values())
    uneven = {name for name, p in params.items() if isinstance(p._local_tensor, UnevenNF4Tensor)}
    assert uneven == set(plan.uneven)


def test_uneven_shards_of_qwen2_5_0_5b_on_3_ranks_are_logged():
    model = _build(models.qlora_qwen2_5_0_5b)
    assert check_nf4_sharding(model, 2, allow_whole=False).uneven == ()
    plan = check_nf4_sharding(model, 3, allow_whole=False)
    assert len(plan.uneven) == 24 * 7 and plan.whole == ()
    q_proj = _nf4_params(model)["layers.0.attn.q_proj.weight"]  # 896x896: 56 scale groups of 224 blocks
    assert q_proj.quantization_factor.numel() == 56 and nf4_shard_groups(q_proj, 3) == 19  # 19, 19, 18 + 1 padding
    assert "0 weight(s) kept whole on every rank (0.0 MiB per rank" in plan.summary()
    assert "168 split unevenly" in plan.summary()


def test_single_scale_group_is_kept_whole_or_refused_naming_weight_shape_and_world_sizes():
    """13 blocks of 64: one scale group, so a padded shard is the whole weight: kept whole, or refused."""
    model = torch.nn.Module()
    model.proj = torch.nn.Module()
    model.proj.weight = torch.nn.Parameter(quantize_nf4(torch.randn(13, 64)), requires_grad=False)
    plan = check_nf4_sharding(model, 3)
    assert plan.whole == ("proj.weight",) and plan.whole_bytes > 0 and "1 weight(s) kept whole" in plan.summary()
    with pytest.raises(ValueError, match=r"proj\.weight of shape \(13, 64\).*3 ranks.*single scale group.*\[1\]"):
        check_nf4_sharding(model, 3, allow_whole=False)
    with pytest.raises(ValueError, match="world_size=0"):
        check_nf4_sharding(model, 0)


def _loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())


def _gloo_worker(rank: int, world_size: int, tmp: str) -> None:
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
    assert not [name for name, param in model.named_parameters() if param.is_meta]
    for name, param in _nf4_params(model).items():
        assert isinstance(param, DTensor), name
        assert isinstance(param._local_tensor, UnevenNF4Tensor) == (name in plan.uneven), name
    if plan.uneven:  # a shard of scale groups has no dense rows of its own
        with pytest.raises(ValueError, match="keep_nf4=True"):
            get_model_state_dict(model, sharded_state_dict=True)
        shards = get_model_state_dict(model, sharded_state_dict=True, keep_nf4=True, include_keys="*.weight")
        assert all(isinstance(shards[name]._local_tensor, UnevenNF4Tensor) for name in plan.uneven)
        # DTensor's own row gather is refused on every rank (none is left waiting in the collective)
        with pytest.raises(NotImplementedError, match="get_full_state_dict"):
            model.get_parameter(plan.uneven[0]).full_tensor()
        dist.barrier()
        _check_dcp_round_trip(model, build, tmp, rank)
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


def _check_dcp_round_trip(model, build, tmp: str, rank: int) -> None:
    """The sharded state dict (NF4 kept packed) saved by ``torch.distributed.checkpoint`` and loaded into a model
    with other weights gives the saved model's NF4 weights, bit for bit."""
    dcp.save(get_model_state_dict(model, sharded_state_dict=True, keep_nf4=True), checkpoint_id=tmp)
    other = build("meta")
    shard_model(other, dtype=torch.float32)
    materialize_(other, "cpu", seed=7)
    dcp.load(get_model_state_dict(other, sharded_state_dict=True, keep_nf4=True), checkpoint_id=tmp)
    loaded = get_full_state_dict(other, is_rank_zero=rank == 0, keep_nf4=True, include_keys="*.weight")
    saved = get_full_state_dict(model, is_rank_zero=rank == 0, keep_nf4=True, include_keys="*.weight")
    for name in _nf4_params(model) if rank == 0 else ():
        for inner in ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean"):
            assert torch.equal(getattr(loaded[name], inner), getattr(saved[name], inner)), (name, inner)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_nf4_fsdp2_gather_and_train(world_size, tmp_path):
    run_distributed(_gloo_worker, world_size, str(tmp_path))


def _tune_run(recipe: str, config: str, out: Path, base: Path, batch_size: int, nproc: int = 0) -> List[float]:
    """Runs a recipe as ``tune run`` does (on ``nproc`` launched ranks; 0: in this process) and returns its per-step
    losses."""
    args = [
        "--config", f"configs/tiny/{config}.yaml", f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}", "max_steps_per_epoch=3", "dataset.num_samples=96",
        "dataset_val.num_samples=12", "run_val_every_n_steps=null", "tokenizer.max_seq_len=48",
        f"batch_size={batch_size}", "gradient_accumulation_steps=1", "save_adapter_weights_only=True",
        "optimizer.lr=1e-2", "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs",
    ]  # fmt: skip
    if nproc:
        cmd = [str(Path(sys.executable).parent / "tune"), "run", "--nproc_per_node", str(nproc), f"recipes/{recipe}.py"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    else:
        run_recipe_in_process(ROOT / "recipes" / f"{recipe}.py", args, cwd=ROOT)
    lines = "\n".join(p.read_text() for p in sorted((out / "logs").glob("log_*.txt")))
    return [float(v) for v in re.findall(r"Step \d+ \| .*\bloss:(\S+)", lines)]


@pytest.mark.integration_test
@pytest.mark.distributed
def test_recipe_on_3_ranks_shards_nf4_unevenly_and_matches_one_device(tmp_path):
    """The tiny model's NF4 rows (256, 128, 512) do not divide 3: sharded unevenly, loaded by the recipe's streaming
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

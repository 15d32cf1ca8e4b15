"""State-dict tooling on real 2-, 3- and 4-process gloo groups (FSDP2 and HSDP meshes).

References are independent of the code under test: each model's unsharded single-process state dict (NF4 weights
dequantized with the foundation's ``dequantize_nf4``, equal to torchao's), torchtune's ``gather_cpu_state_dict`` /
``load_from_full_model_state_dict`` on NF4 models, torch DCP's ``get_model_state_dict(full_state_dict=True)`` on plain
models, and torchao's ``to_nf4`` on one device for quantization.

Spawning a group costs seconds, so each group runs every case once (module-scoped fixture) and records each case's
outcome per rank; one pytest test per case reads its outcome.
"""

from __future__ import annotations

import fnmatch
import json
import os
import traceback
from typing import Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchtune_ext.distributed import get_full_state_dict, get_model_state_dict, load_full_state_dict
from torchtune_ext.models import qlora_tiny_llama, qlora_tiny_qwen
from torchtune_ext.modules import FrozenNF4Linear
from torchtune_ext.nf4 import NF4Tensor, dequantize_nf4, to_nf4

ATTN = ["q_proj", "v_proj"]


# ----------------------------------------------------------------------------------------------------------------------
# Helpers


def _dense(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A single-process state dict with NF4 weights dequantized in their own dtype (the reference)."""
    return {k: dequantize_nf4(v) if isinstance(v, NF4Tensor) else v.detach().clone() for k, v in sd.items()}


def _assert_same(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected), sorted(set(actual) ^ set(expected))
    for key, value in expected.items():
        got = actual[key]
        assert type(got) is torch.Tensor, (key, type(got))
        assert got.device.type == "cpu", key
        assert got.dtype == value.dtype, (key, got.dtype, value.dtype)
        assert torch.equal(got, value), key


def _requantized(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """What loading ``value`` into an NF4 weight like ``like`` must give back: torchao's quantization on one device."""
    return dequantize_nf4(to_nf4(value.to(like.dtype), like.block_size, like.scaler_block_size))


def _loaded_qlora_state(incoming: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """What a tiny QLoRA model of ``dtype`` must give back after loading ``incoming``: its NF4 weights requantized."""
    params = dict(_qlora(dtype=dtype, device="meta").named_parameters())
    return {k: _requantized(v, params[k]) if isinstance(params[k], NF4Tensor) else v for k, v in incoming.items()}


def _qlora(builder=qlora_tiny_llama, dtype=torch.bfloat16, device="cpu", **kwargs) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, whatever the builder draws from the global RNG
    return builder(ATTN, apply_lora_to_mlp=True, dtype=dtype, device=device, **kwargs)


def _shard(model: nn.Module) -> nn.Module:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _random_like(sd: Dict[str, torch.Tensor], seed: int) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=gen) * 0.05).to(v.dtype) for k, v in sd.items()}


def _run_cases(rank: int, world_size: int, cases: List[Callable], out_dir: str) -> None:
    outcomes = {}
    for case in cases:
        try:
            case(rank, world_size)
            outcomes[case.__name__] = None
        except Exception:
            outcomes[case.__name__] = traceback.format_exc()
        dist.barrier()  # a failed case must not leave collectives behind for the next one
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcomes, f)


def _outcomes(tmp_path_factory, cases: List[Callable], world_size: int) -> Dict[str, List]:
    out_dir = str(tmp_path_factory.mktemp(f"state_dict_{world_size}ranks"))
    run_distributed(_run_cases, world_size, cases, out_dir)
    per_rank = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            per_rank.append(json.load(f))
    return {case.__name__: [outcomes[case.__name__] for outcomes in per_rank] for case in cases}


def _check(outcomes: Dict[str, List], case: Callable) -> None:
    failures = [f"--- rank {r} ---\n{tb}" for r, tb in enumerate(outcomes[case.__name__]) if tb is not None]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------------------------------
# 2 ranks: FSDP2-sharded QLoRA models


def case_nf4_dtensor_gather_equals_torchtune(rank, world_size):
    from torchtune.training import gather_cpu_state_dict

    for builder, dtype in ((qlora_tiny_llama, torch.bfloat16), (qlora_tiny_qwen, torch.float32)):
        model = _qlora(builder, dtype)
        reference = _dense(model.state_dict())
        _shard(model)
        assert any(isinstance(p, DTensor) and isinstance(p._local_tensor, NF4Tensor) for p in model.parameters())
        ours = get_full_state_dict(model)
        theirs = gather_cpu_state_dict(model, rank == 0)
        if rank == 0:
            _assert_same(ours, reference)
            _assert_same(ours, {k: theirs[k] for k in ours})
        else:
            assert ours == {}


def case_dtype_and_keep_dtype(rank, world_size):
    model = _qlora()
    reference = _dense(model.state_dict())
    _shard(model)
    keep = ["*.lora_a.*", "*.lora_b.*"]
    ours = get_full_state_dict(model, dtype=torch.float32, keep_dtype=keep)
    as_str = get_full_state_dict(model, dtype="fp32", keep_dtype=keep)
    if rank == 0:
        kept = {k for k in reference if any(fnmatch.fnmatchcase(k, p) for p in keep)}
        assert kept and len(kept) < len(reference)
        _assert_same(ours, {k: v if k in kept else v.float() for k, v in reference.items()})
        _assert_same(as_str, ours)
    with pytest.raises(ValueError, match="keep_dtype pattern '\\*.magnitude' matches no"):
        get_full_state_dict(model, dtype=torch.float32, keep_dtype="*.magnitude")


def case_globs_and_unmatched_patterns(rank, world_size):
    model = _qlora()
    reference = _dense(model.state_dict())
    _shard(model)
    included = get_full_state_dict(model, include_keys="layers.0.*")
    ignored = get_full_state_dict(model, ignore_keys=["*.lora_*", "tok_embeddings.*"])
    if rank == 0:
        _assert_same(included, {k: v for k, v in reference.items() if k.startswith("layers.0.")})
        expected = {k: v for k, v in reference.items() if "lora_" not in k and not k.startswith("tok_embeddings.")}
        _assert_same(ignored, expected)
    # Every rank raises (the plan is global), naming the pattern and the nearest keys.
    with pytest.raises(ValueError, match=r"include_keys pattern 'layers\.9\.\*' matches no .*Nearest keys: \['layers"):
        get_full_state_dict(model, include_keys=["layers.0.*", "layers.9.*"])
    with pytest.raises(ValueError, match="ignore_keys pattern 'tok_embedding.weight'"):
        get_full_state_dict(model, ignore_keys="tok_embedding.weight")
    with pytest.raises(ValueError, match="mutually exclusive"):
        get_full_state_dict(model, include_keys="layers.*", ignore_keys="norm.*")


def case_adapter_weights_only(rank, world_size):
    from torchtune.modules.peft import get_adapter_params

    model = _qlora()
    reference = _dense(model.state_dict())
    adapter_keys = list(get_adapter_params(model))
    _shard(model)
    real_gather = dist.gather
    gathered_numels = []

    def counting_gather(tensor, *args, **kwargs):  # a spy: the real collective runs
        gathered_numels.append(tensor.numel())
        return real_gather(tensor, *args, **kwargs)

    dist.gather = counting_gather
    try:
        ours = get_full_state_dict(model, adapter_weights_only=True)
    finally:
        dist.gather = real_gather
    # One gather per adapter tensor and nothing else: the NF4 base is never gathered.
    assert len(gathered_numels) == len(adapter_keys), (len(gathered_numels), len(adapter_keys))
    assert sum(gathered_numels) * world_size == sum(reference[k].numel() for k in adapter_keys)
    if rank == 0:
        _assert_same(ours, {k: reference[k] for k in reference if k in adapter_keys})


def case_sharded_mode(rank, world_size):
    model = _qlora()
    reference = _dense(model.state_dict())
    _shard(model)
    shards = get_model_state_dict(model, sharded_state_dict=True, precision="fp32")
    assert list(shards) == list(reference)
    params = dict(model.named_parameters())
    for key, value in shards.items():
        param = params[key]
        assert isinstance(value, DTensor) and type(value._local_tensor) is torch.Tensor, key
        assert value.placements == param.placements and value.device_mesh == param.device_mesh, key
        assert value.shape == reference[key].shape and value.dtype == torch.float32, key
        rows = reference[key].shape[0] // world_size
        expected = reference[key][rank * rows : (rank + 1) * rows].float()
        assert torch.equal(value._local_tensor, expected), key  # NF4 shards dequantized locally
    packed = get_model_state_dict(model, sharded_state_dict=True, keep_nf4=True, include_keys="layers.0.mlp.*")
    assert all(k.startswith("layers.0.mlp.") for k in packed) and packed
    assert isinstance(packed["layers.0.mlp.w1.weight"]._local_tensor, NF4Tensor)
    full = get_model_state_dict(model, precision=torch.float32)
    if rank == 0:
        _assert_same(full, {k: v.float() for k, v in reference.items()})
    # A full state dict keeps NF4 weights whole and packed: the gathered shards are the whole tensor's NF4.
    packed_full = get_model_state_dict(model, keep_nf4=True, include_keys="layers.0.mlp.*")
    if rank == 0:
        w1 = packed_full["layers.0.mlp.w1.weight"]
        assert isinstance(w1, NF4Tensor) and w1.device.type == "cpu"
        assert torch.equal(dequantize_nf4(w1, torch.float32), reference["layers.0.mlp.w1.weight"].float())


def case_load_equals_torchtune_and_round_trips(rank, world_size):
    from torchtune.training import load_from_full_model_state_dict

    for dtype in (torch.bfloat16, torch.float32):
        template = _dense(_qlora(dtype=dtype).state_dict())
        incoming = _random_like(template, seed=1)  # the same on every rank
        ours = _shard(_qlora(dtype=dtype, device="meta"))
        theirs = _shard(_qlora(dtype=dtype, device="meta"))
        load_full_state_dict(ours, incoming)
        load_from_full_model_state_dict(theirs, dict(incoming), torch.device("cpu"), strict=True)
        mine, tt = dict(ours.named_parameters()), dict(theirs.named_parameters())
        for key, param in mine.items():  # each rank's NF4 shard equals torchtune's (which quantizes the whole)
            local, other = param._local_tensor, tt[key]._local_tensor
            assert type(local) is type(other) and local.dtype == other.dtype == template[key].dtype, key
            if isinstance(local, NF4Tensor):
                for name in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
                    assert torch.equal(getattr(local, name), getattr(other, name)), (key, name)
            else:
                assert torch.equal(local, other), key
        back = get_full_state_dict(ours)
        if rank == 0:
            _assert_same(back, _loaded_qlora_state(incoming, dtype))


def _shard_hsdp(model: nn.Module) -> nn.Module:
    """HSDP: placements (Replicate, Shard(0)) on a 2-D (replicate=world/2, shard=2) mesh."""
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def case_hsdp_mesh_gather_and_load(rank, world_size):
    for dtype in (torch.bfloat16, torch.float32):
        model = _qlora(dtype=dtype)
        reference = _dense(model.state_dict())
        _shard_hsdp(model)
        weight = model.layers[0].attn.q_proj.weight
        assert weight.device_mesh.ndim == 2 and isinstance(weight._local_tensor, NF4Tensor), weight.placements
        ours = get_full_state_dict(model)
        if rank == 0:
            _assert_same(ours, reference)
        else:
            assert ours == {}
        incoming = _random_like(reference, seed=5)
        loaded = _shard_hsdp(_qlora(dtype=dtype, device="meta"))
        load_full_state_dict(loaded, incoming if rank == 0 else None, broadcast_from_rank0=True)
        back = get_full_state_dict(loaded)
        if rank == 0:
            _assert_same(back, _loaded_qlora_state(incoming, dtype))


def case_load_in_place_broadcast_and_strict(rank, world_size):
    model = _shard(_qlora())
    incoming = _random_like(_dense(_qlora().state_dict()), seed=2)
    weight = model.layers[0].attn.q_proj.weight
    local_before = weight._local_tensor.quantized_data
    load_full_state_dict(model, incoming if rank == 0 else None, broadcast_from_rank0=True)
    assert model.layers[0].attn.q_proj.weight is weight  # written in place
    assert weight._local_tensor.quantized_data.data_ptr() == local_before.data_ptr()
    back = get_full_state_dict(model)
    fresh = _shard(_qlora(device="meta"))
    load_full_state_dict(fresh, incoming)
    if rank == 0:
        _assert_same(back, get_full_state_dict(fresh))
    else:
        get_full_state_dict(fresh)
    partial = {k: v for k, v in incoming.items() if k != "norm.scale"}
    partial["extra.weight"] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"missing keys: \['norm.scale'\]; unexpected keys: \['extra.weight'\]"):
        load_full_state_dict(model, partial)
    result = load_full_state_dict(model, partial, strict=False)
    assert result.missing_keys == ["norm.scale"] and result.unexpected_keys == ["extra.weight"]
    wrong = dict(incoming, **{"norm.scale": torch.zeros(7)})
    with pytest.raises(RuntimeError, match=r"norm.scale: checkpoint \[7\] vs model \[256\]"):
        load_full_state_dict(model, wrong, strict=False)


def case_unwrap_after_compile_and_activation_checkpointing(rank, world_size):
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.modules.peft import get_adapter_params
    from torchtune.training import set_activation_checkpointing

    model = _qlora()
    reference = _dense(model.state_dict())
    adapter_keys = set(get_adapter_params(model))
    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    assert any("_checkpoint_wrapped_module" in k for k, _ in model.named_parameters())
    compiled = torch.compile(_shard(model))  # wrapping only: no compiled forward runs
    unwrapped = get_full_state_dict(compiled)
    raw = get_full_state_dict(compiled, unwrap=False)
    adapters = get_full_state_dict(compiled, adapter_weights_only=True)
    if rank == 0:
        _assert_same(unwrapped, reference)
        assert all(k.startswith("_orig_mod.") for k in raw), list(raw)[:3]
        assert set(adapters) == adapter_keys
    incoming = _random_like(reference, seed=3)
    load_full_state_dict(compiled, incoming)  # unwrapped keys load into the wrapped model
    plain = _shard(_qlora(device="meta"))
    load_full_state_dict(plain, incoming)
    back, expected = get_full_state_dict(compiled), get_full_state_dict(plain)
    if rank == 0:
        _assert_same(back, expected)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4)))
    ddp_sd = get_full_state_dict(ddp)
    if rank == 0:
        assert list(ddp_sd) == ["0.weight", "0.bias"]


TWO_RANK_CASES = [
    case_nf4_dtensor_gather_equals_torchtune,
    case_dtype_and_keep_dtype,
    case_globs_and_unmatched_patterns,
    case_adapter_weights_only,
    case_sharded_mode,
    case_load_equals_torchtune_and_round_trips,
    case_load_in_place_broadcast_and_strict,
    case_unwrap_after_compile_and_activation_checkpointing,
    case_hsdp_mesh_gather_and_load,
]


# ----------------------------------------------------------------------------------------------------------------------
# 3 ranks: separate meshes, a sub-mesh without rank 0, keys on some ranks, bare NF4, ties


class TiedPair(nn.Module):
    """An embedding and a head sharing one weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(48, 64, dtype=torch.bfloat16)
        self.head = nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class MeshModel(nn.Module):
    """bf16 body on the world mesh (uneven rows), an fp32 module on its own mesh, an fp32 NF4 module on ranks 1-2
    only, tied embedding/head, a bare NF4 linear, a plain norm, and a buffer only rank 1 has."""

    def __init__(self, rank: int, device: str = "cpu", with_sub: bool = True):
        super().__init__()
        with torch.device(device):
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(64, 10), nn.Linear(10, 64)).to(torch.bfloat16)
            self.pruning = nn.Linear(64, 30)  # kept in fp32, sharded on a separate mesh
            self.tied = TiedPair()
            self.frozen = FrozenNF4Linear(256, 256, dtype=torch.bfloat16, device=device)
            self.norm = nn.LayerNorm(64, dtype=torch.bfloat16)
            torch.manual_seed(1)
            if with_sub:
                self.sub = FrozenNF4Linear(256, 512, dtype=torch.float32, device=device)
            if rank == 1:
                self.register_buffer("only_on_1", torch.arange(5.0))


def _shard_mesh_model(model: MeshModel, rank: int) -> MeshModel:
    world = init_device_mesh("cpu", (3,))
    fully_shard(model.body, mesh=world)
    fully_shard(model.pruning, mesh=init_device_mesh("cpu", (3,)))
    fully_shard(model.tied, mesh=world)
    sub_mesh = DeviceMesh("cpu", [1, 2])  # created on every rank; rank 0 is not in it
    if rank != 0:
        fully_shard(model.sub, mesh=sub_mesh)
    return model


def _mesh_reference() -> Dict[str, torch.Tensor]:
    return _dense(MeshModel(rank=1).state_dict())


def case_meshes_subsets_and_ties(rank, world_size):
    model = _shard_mesh_model(MeshModel(rank, with_sub=rank != 0), rank)
    pruning_mesh = model.pruning.weight.device_mesh
    assert isinstance(model.pruning.weight, DTensor) and pruning_mesh is not model.body[0].weight.device_mesh
    assert not hasattr(model, "sub") or isinstance(model.sub.weight._local_tensor, NF4Tensor)
    assert isinstance(model.frozen.weight, NF4Tensor) and not isinstance(model.frozen.weight, DTensor)
    ours = get_full_state_dict(model)
    if rank == 0:
        reference = _mesh_reference()
        assert ours["pruning.weight"].dtype == torch.float32 and ours["sub.weight"].dtype == torch.float32
        assert ours["tied.head.weight"] is ours["tied.embed.weight"]
        _assert_same(dict(sorted(ours.items())), dict(sorted(reference.items())))
    else:
        assert ours == {}
    # The same on another receiving rank, in bf16 except the fp32 module.
    on_two = get_full_state_dict(model, is_rank_zero=rank == 2, dtype=torch.bfloat16, keep_dtype="pruning.*")
    if rank == 2:
        reference = _mesh_reference()
        expected = {k: v if k.startswith("pruning.") else v.to(torch.bfloat16) for k, v in reference.items()}
        _assert_same(dict(sorted(on_two.items())), dict(sorted(expected.items())))
    else:
        assert on_two == {}
    with pytest.raises(ValueError, match="exactly one rank with is_rank_zero=True"):
        get_full_state_dict(model, is_rank_zero=True)


def case_load_meshes_subsets_and_ties(rank, world_size):
    reference = _mesh_reference()
    incoming = _random_like({k: v for k, v in reference.items() if k != "tied.head.weight"}, seed=4)
    nf4_like = {k: p for k, p in MeshModel(1).named_parameters() if isinstance(p, NF4Tensor)}
    expected = {k: _requantized(v, nf4_like[k]) if k in nf4_like else v for k, v in incoming.items()}
    expected["tied.head.weight"] = expected["tied.embed.weight"]
    for broadcast in (False, True):
        model = _shard_mesh_model(MeshModel(rank, device="meta", with_sub=rank != 0), rank)
        # The checkpoint omits the tied head (as HF does); rank 0 loads keys its model lacks for no one.
        sd = incoming if rank == 0 or not broadcast else None
        result = load_full_state_dict(model, sd, broadcast_from_rank0=broadcast)
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert model.tied.head.weight is model.tied.embed.weight  # re-tied after assigning new params
        assert model.pruning.weight.dtype == torch.float32 and model.body[0].weight.dtype == torch.bfloat16
        back = get_full_state_dict(model)
        if rank == 0:
            _assert_same(dict(sorted(back.items())), dict(sorted(expected.items())))


def case_plain_model_equals_dcp(rank, world_size):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.state_dict import get_model_state_dict as dcp_get_model_state_dict

    model = MeshModel(rank, with_sub=False)
    del model.frozen
    if rank == 1:
        del model.only_on_1
    reference = _dense(model.state_dict())
    _shard_mesh_model(model, rank=0)
    ours = get_full_state_dict(model)
    dcp = dcp_get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        _assert_same(ours, reference)
        _assert_same(ours, {k: dcp[k] for k in ours})
        assert set(dcp) == set(ours)


THREE_RANK_CASES = [case_meshes_subsets_and_ties, case_load_meshes_subsets_and_ties, case_plain_model_equals_dcp]
# 4 ranks: HSDP with two replicas of a 2-way shard (on 2 ranks the same case runs on a (1, 2) mesh).
FOUR_RANK_CASES = [case_hsdp_mesh_gather_and_load]


@pytest.fixture(scope="module")
def two_rank_outcomes(tmp_path_factory):
    return _outcomes(tmp_path_factory, TWO_RANK_CASES, 2)


@pytest.fixture(scope="module")
def three_rank_outcomes(tmp_path_factory):
    return _outcomes(tmp_path_factory, THREE_RANK_CASES, 3)


@pytest.mark.distributed
@pytest.mark.parametrize("case", TWO_RANK_CASES, ids=lambda c: c.__name__[5:])
def test_two_ranks(case, two_rank_outcomes):
    _check(two_rank_outcomes, case)


@pytest.mark.distributed
@pytest.mark.parametrize("case", THREE_RANK_CASES, ids=lambda c: c.__name__[5:])
def test_three_ranks(case, three_rank_outcomes):
    _check(three_rank_outcomes, case)


@pytest.mark.distributed
@pytest.mark.parametrize("case", FOUR_RANK_CASES, ids=lambda c: c.__name__[5:])
def test_four_ranks(case, tmp_path_factory):
    _check(_outcomes(tmp_path_factory, FOUR_RANK_CASES, 4), case)


# ----------------------------------------------------------------------------------------------------------------------
# One process


def test_no_process_group_gather_and_load():
    model = MeshModel(rank=1)
    reference = _dense(model.state_dict())
    ours = get_full_state_dict(model)
    _assert_same(ours, reference)
    assert ours["tied.head.weight"] is ours["tied.embed.weight"]
    incoming = _random_like(reference, seed=5)
    load_full_state_dict(model, incoming)
    back = get_full_state_dict(model)
    params = dict(MeshModel(1).named_parameters())
    for key in back:
        param = params.get(key)
        expected = _requantized(incoming[key], param) if isinstance(param, NF4Tensor) else incoming[key]
        if key == "tied.head.weight":  # the tie loads from its first key
            expected = incoming["tied.embed.weight"]
        assert back[key].dtype == expected.dtype and torch.equal(back[key], expected), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shard_quantization_equals_torchao(dtype):
    from torchtune_ext.nf4 import nf4_scaler_mean, quantize_nf4

    gen = torch.Generator().manual_seed(0)
    full = torch.randn(512, 256, generator=gen, dtype=torch.float32) * 3
    full[0, :64] = 0  # an all-zero block
    full[1, :64] = 0.5  # a constant block
    whole = to_nf4(full.to(dtype))
    mean = nf4_scaler_mean(full, dtype, whole.block_size)
    for index, shard in enumerate(torch.split(whole, 256)):  # torchao's own row split of the whole quantization
        piece = full[index * 256 : (index + 1) * 256].to(dtype)
        ours = quantize_nf4(piece, whole.block_size, whole.scaler_block_size, scaler_mean=mean)
        for name in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"):
            expected, got = getattr(shard, name), getattr(ours, name)
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
    alone = quantize_nf4(full.to(dtype))
    assert torch.equal(dequantize_nf4(alone), dequantize_nf4(whole))


def test_bad_arguments_fail_before_any_work():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="mutually exclusive"):
        get_full_state_dict(model, include_keys="weight", ignore_keys="bias")
    with pytest.raises(ValueError, match="dtype=torch.int8 is not supported; use dtype=fp32"):
        get_full_state_dict(model, dtype=torch.int8)
    with pytest.raises(ValueError, match="precision='fp8' is not supported"):
        get_model_state_dict(model, sharded_state_dict=True, precision="fp8")
    with pytest.raises(TypeError, match="glob string or a list of glob strings"):
        get_full_state_dict(model, include_keys=[1])
    with pytest.raises(ValueError, match="adapter_weights_only=True, but the model has no adapter params"):
        get_full_state_dict(model, adapter_weights_only=True)
    with pytest.raises(ValueError, match="full_sd is None"):
        load_full_state_dict(model, None)
    with pytest.raises(ValueError, match="takes plain tensors"):
        load_full_state_dict(model, {"weight": "not a tensor", "bias": torch.zeros(4)})


def test_unwrap_drops_only_wrapper_atoms():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = nn.Module()
    inner.module = nn.Linear(2, 2)  # a user submodule named like DDP's wrapper atom
    compiled = torch.compile(nn.Sequential(checkpoint_wrapper(inner)))
    assert set(compiled.state_dict()) == {"_orig_mod.0.module.weight", "_orig_mod.0.module.bias"}
    assert list(get_full_state_dict(compiled)) == ["0.module.weight", "0.module.bias"]
    assert list(get_model_state_dict(compiled, sharded_state_dict=True)) == ["0.module.weight", "0.module.bias"]

"""Port of the FSDP2 state-dict tests of torchtune's ``tests/torchtune/training/test_distributed.py``
(``TestFullyShardState.test_lora_state_dict`` and ``test_qlora_state_dict``).

Upstream: pytorch/torchtune, tag v0.6.1, commit a6290a5b40758f13bca61c386bc8756a49ef417e.

Not ported (nothing of ours is involved): ``TestDistributed`` (process-group init, ``get_distributed_backend``,
``validate_no_params_on_meta_device``) and ``TestTensorParalell`` (``prepare_mha_for_tp``).

Adapted:
- Upstream's ``FSDPTest`` on 2 GPUs with NCCL -> 2 CPU processes on gloo, started by the project's
  ``run_distributed`` (``tests/conftest.py``); ``torch.device("cuda")`` -> ``"cpu"``. All cases run in the one
  2-process job shared by the ported files (``_upstream_utils.register_distributed_cases``: one spawn keeps the
  suite fast) and each becomes one pytest test; ``run_subtests`` over ``enable_activation_checkpointing`` becomes a
  parameter.
- ``unittest``'s ``self.assertEqual`` -> ``_upstream_utils.assert_equal`` (same default tolerances).
- Upstream checks the gathered state dicts on rank 0 while the other rank goes on to the next collective; here every
  check block runs on every rank and the ranks exchange the outcome before going on (``_checked_on_all_ranks``), so
  that a failed check fails the case on all ranks instead of leaving one rank blocked in a collective.
- ``test_lora_state_dict``: the single-process reference model is trained as upstream's DDP emulation, but gloo has
  no ``ReduceOp.AVG``: gradients are all-reduced with ``SUM`` and divided by the world size (the same average).
  ``MLP`` is copied from ``torch.testing._internal.common_fsdp`` into ``_upstream_utils``.
- ``test_qlora_state_dict``: ``lora_llama2(**kwargs, quantize_base=True)`` -> our QLoRA builder
  ``torchtune_ext.models.build_qlora(lora_llama2, dtype=torch.float32, device=...)`` (fp32: the dtype upstream's
  model has by default), on the CPU for the reference model and on meta for the model to load, as upstream. The
  reference model's NF4 base weights are then redrawn as torchtune's builder draws them (``nn.Linear``'s
  kaiming-uniform init, then NF4; ours draw N(0, 0.02)): the test re-quantizes dequantized NF4 weights (its
  ``copy.deepcopy(base_model)``: torchao's NF4 ``clone`` is ``to_nf4(get_original_weight())``; and its dense save
  and load) and compares with fp32 tolerance, which holds for torchtune's init (max abs difference ~3e-7) but not
  for ours (~3e-4: the double-quantized block scales come out different).
  ``embed_dim`` shrunk 1024 -> 256 (still NF4-compatible: every quantized numel a multiple of 64 * 256) to fit two
  single-threaded CPU ranks; the other arguments are upstream's.
  Our builders register a state-dict hook (``torchtune_ext.modules.dense_state_dict_post_hook``) as torchtune's
  ``lora_llama2`` registers its reparametrize hook, so ``base_model.state_dict()`` (upstream's expected full state
  dict) holds the NF4 bases dense, in the compute dtype, as upstream expects.
- Every case also runs with our ``get_full_state_dict`` / ``load_full_state_dict`` (``torchtune_ext.distributed``)
  in place of torchtune's ``training.gather_cpu_state_dict`` / ``load_from_full_model_state_dict``
  (``strict=False``, as torchtune's default); the optimizer helpers stay torchtune's (we do not replace them).
- ``NF4Tensor`` / ``to_nf4`` from ``torchtune_ext.nf4`` (torchao's, re-exported) instead of
  ``torchao.dtypes.nf4tensor``.
"""

import copy
import math
import traceback
from typing import Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _upstream_utils import MLP, assert_equal, check_distributed_case, register_distributed_cases
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import fully_shard
from torchtune import modules, training
from torchtune.models.llama2._component_builders import lora_llama2
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from torchtune_ext.distributed import get_full_state_dict, load_full_state_dict
from torchtune_ext.models import build_qlora
from torchtune_ext.nf4 import NF4Tensor, to_nf4

DEVICE = "cpu"

# torchtune's state-dict functions, or ours with the same call shape.
GATHERS: Dict[str, Callable] = {
    "torchtune": lambda model, is_rank_zero: training.gather_cpu_state_dict(model, is_rank_zero),
    "ours": lambda model, is_rank_zero: get_full_state_dict(model, is_rank_zero=is_rank_zero),
}
LOADS: Dict[str, Callable] = {
    "torchtune": lambda model, sd, device: training.load_from_full_model_state_dict(model, sd, device),
    "ours": lambda model, sd, device: load_full_state_dict(model, sd, device=device, strict=False),
}


def _checked_on_all_ranks(check: Callable[[], None]) -> None:
    """Runs ``check`` on every rank; if it fails on any rank, raises on every rank (no rank left in a collective)."""
    error = None
    try:
        check()
    except Exception:
        error = traceback.format_exc()
    errors: List = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [f"--- check failed on rank {rank} ---\n{tb}" for rank, tb in enumerate(errors) if tb is not None]
    if failed:
        raise AssertionError("\n".join(failed))


def _broadcast_full_state_dict(full_sd):
    result = []
    if torch.distributed.get_rank() == 0:
        result.append(full_sd)
    else:
        result.append(None)
    torch.distributed.broadcast_object_list(result, src=0)
    return result[0]


# ---- test_lora_state_dict -------------------------------------------------------------------------------------------


def _test_lora_state_dict(rank: int, funcs: str) -> None:
    gather_cpu_state_dict, load_from_full_model_state_dict = GATHERS[funcs], LOADS[funcs]
    is_rank_zero = rank == 0
    mlp_dim = 4
    epochs = 5
    torch.manual_seed(42)
    # base_model is simple DDP
    with torch.device(DEVICE):
        base_model = nn.Sequential(
            MLP(mlp_dim),
            nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)),
            MLP(mlp_dim),
        )
        base_optim = torch.optim.Adam(base_model.parameters(), weight_decay=0.01, lr=0.01)

    fsdp_model_to_save = copy.deepcopy(base_model)
    for module in fsdp_model_to_save:
        fully_shard(module)
    fully_shard(fsdp_model_to_save)
    fsdp_optim_to_save = torch.optim.Adam(fsdp_model_to_save.parameters(), weight_decay=0.01, lr=0.01)

    # inp is different for each rank
    torch.manual_seed(42 + rank)

    # test get full state dict
    for _ in range(epochs):
        inp = torch.randn((2, mlp_dim), device=DEVICE)
        base_model(inp).sum().backward()
        for param in base_model.parameters():
            # upstream: all_reduce(param.grad, op=ReduceOp.AVG); gloo has no AVG
            torch.distributed.all_reduce(param.grad, op=torch.distributed.ReduceOp.SUM)
            param.grad.div_(torch.distributed.get_world_size())
        base_optim.step()
        base_optim.zero_grad()
        fsdp_model_to_save(inp).sum().backward()
        fsdp_optim_to_save.step()
        fsdp_optim_to_save.zero_grad()
    expected_model_sd = base_model.state_dict()
    expected_optim_sd = base_optim.state_dict()
    model_full_sd = gather_cpu_state_dict(fsdp_model_to_save, is_rank_zero)
    optim_full_sd = training.get_full_optimizer_state_dict(
        fsdp_model_to_save,
        fsdp_optim_to_save,
        is_rank_zero,
    )

    def check_full_state_dicts():
        if is_rank_zero:
            assert_equal(set(model_full_sd.keys()), set(expected_model_sd.keys()))
            for key, value in model_full_sd.items():
                assert_equal(value, expected_model_sd[key])
            assert_equal(len(optim_full_sd["param_groups"]), 1)
            assert_equal(
                len(optim_full_sd["param_groups"]),
                len(expected_optim_sd["param_groups"]),
            )
            assert_equal(
                len(optim_full_sd["param_groups"][0].keys()),
                len(expected_optim_sd["param_groups"][0].keys()),
            )
            for key, value in optim_full_sd["param_groups"][0].items():
                if key == "params":
                    assert_equal(len(value), len(expected_optim_sd["param_groups"][0][key]))
                else:
                    assert_equal(value, expected_optim_sd["param_groups"][0][key])
            assert_equal(
                len(optim_full_sd["state"].keys()),
                len(expected_optim_sd["state"].keys()),
            )
            for actual, expected in zip(optim_full_sd["state"].values(), expected_optim_sd["state"].values()):
                assert_equal(actual, expected)
        else:
            assert_equal(len(model_full_sd), 0)
            assert_equal(len(optim_full_sd), 0)

    _checked_on_all_ranks(check_full_state_dicts)

    # test set full state dict
    with torch.device("meta"):
        fsdp_model_to_load = nn.Sequential(
            MLP(mlp_dim),
            nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)),
            MLP(mlp_dim),
        )
    for module in fsdp_model_to_load:
        fully_shard(module)
    fully_shard(fsdp_model_to_load)
    load_from_full_model_state_dict(
        fsdp_model_to_load,
        copy.deepcopy(base_model.state_dict()),
        torch.device(DEVICE),
    )
    fsdp_optim_to_load = torch.optim.Adam(fsdp_model_to_load.parameters(), weight_decay=0.01, lr=0.01)
    training.load_from_full_optimizer_state_dict(
        fsdp_model_to_load,
        fsdp_optim_to_load,
        # mimic mmap=True where every rank see full SD
        copy.deepcopy(_broadcast_full_state_dict(optim_full_sd)),
        torch.device(DEVICE),
    )
    for _ in range(epochs):
        inp = torch.randn((2, mlp_dim), device=DEVICE)
        fsdp_model_to_load(inp).sum().backward()
        fsdp_model_to_save(inp).sum().backward()
        fsdp_optim_to_load.step()
        fsdp_optim_to_save.step()
        fsdp_optim_to_load.zero_grad()
        fsdp_optim_to_save.zero_grad()
    sharded_optim_sd = fsdp_optim_to_load.state_dict()
    expected_sharded_optim_sd = fsdp_optim_to_save.state_dict()
    assert_equal(
        sharded_optim_sd["param_groups"],
        expected_sharded_optim_sd["param_groups"],
    )
    assert_equal(
        set(sharded_optim_sd["state"].keys()),
        set(expected_sharded_optim_sd["state"].keys()),
    )
    for key, value in sharded_optim_sd["state"].items():
        assert_equal(value, expected_sharded_optim_sd["state"][key])

    sharded_model_sd = fsdp_model_to_load.state_dict()
    expected_sharded_model_sd = fsdp_model_to_save.state_dict()
    assert_equal(set(sharded_model_sd.keys()), set(expected_sharded_model_sd.keys()))
    for key, value in sharded_model_sd.items():
        assert_equal(value, expected_sharded_model_sd[key])


# ---- test_qlora_state_dict ------------------------------------------------------------------------------------------

QLORA_KWARGS = {
    "lora_attn_modules": ["q_proj", "v_proj", "k_proj", "output_proj"],
    "apply_lora_to_mlp": True,
    "apply_lora_to_output": False,
    "vocab_size": 1024,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 256,  # upstream: 1024
    "max_seq_len": 64,
    "lora_rank": 4,
    "lora_alpha": 1.0,
    # upstream: "quantize_base": True (our builders always quantize)
}


def _torchtune_base_init_(model: nn.Module) -> None:
    """Redraws every NF4 base weight as torchtune's ``lora_llama2(quantize_base=True)`` draws it: ``nn.Linear``'s
    kaiming-uniform init, then NF4 in the layer's own scale groups. (Our builders draw N(0, 0.02); re-quantizing a
    dequantized NF4 weight, which the test's deepcopy and save/load round trip do, gives back the same values
    within fp32 tolerance for the former only.)"""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, NF4Tensor):
            dense = torch.empty(weight.shape, dtype=weight.dtype)
            nn.init.kaiming_uniform_(dense, a=math.sqrt(5))
            module.weight = nn.Parameter(to_nf4(dense, 64, weight.scaler_block_size), requires_grad=False)


def _qlora_model(device: str) -> nn.Module:
    # fp32: upstream builds under torch's default dtype
    model = build_qlora(lora_llama2, dtype=torch.float32, device=device, **QLORA_KWARGS)
    if device != "meta":
        _torchtune_base_init_(model)
    return model


def _test_qlora_state_dict(rank: int, funcs: str, enable_activation_checkpointing: bool) -> None:
    gather_cpu_state_dict, load_from_full_model_state_dict = GATHERS[funcs], LOADS[funcs]
    is_rank_zero = rank == 0
    torch.manual_seed(42)
    kwargs = QLORA_KWARGS
    # single-device model as groundtruth
    base_model = _qlora_model(DEVICE)
    set_trainable_params(base_model, get_adapter_params(base_model))
    if enable_activation_checkpointing:
        training.set_activation_checkpointing(base_model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})

    # fsdp model for saving state dict
    fsdp_model_to_save = copy.deepcopy(base_model)
    for m in fsdp_model_to_save.modules():
        if enable_activation_checkpointing:
            if isinstance(m, CheckpointWrapper):
                fully_shard(m)
        else:
            if isinstance(m, modules.TransformerSelfAttentionLayer):
                fully_shard(m)
    fully_shard(fsdp_model_to_save)

    # one forward pass for lazy init
    torch.manual_seed(42 + rank)
    inp = torch.randint(
        low=0,
        high=kwargs["vocab_size"],
        size=(2, kwargs["max_seq_len"]),
        device=DEVICE,
    )
    base_model(inp)
    fsdp_model_to_save(inp)

    expected_model_sd = {k: v.cpu() for k, v in base_model.state_dict().items()}
    model_full_sd = gather_cpu_state_dict(fsdp_model_to_save, is_rank_zero)

    def check_full_state_dict():
        if is_rank_zero:
            assert_equal(set(model_full_sd.keys()), set(expected_model_sd.keys()))
            for key, value in model_full_sd.items():
                assert_equal(value, expected_model_sd[key])

    _checked_on_all_ranks(check_full_state_dict)

    # fsdp model for loading tate dict
    torch.manual_seed(42)
    fsdp_model_to_load = _qlora_model("meta")
    set_trainable_params(fsdp_model_to_load, get_adapter_params(fsdp_model_to_load))
    if enable_activation_checkpointing:
        training.set_activation_checkpointing(
            fsdp_model_to_load,
            auto_wrap_policy={modules.TransformerSelfAttentionLayer},
        )
    # init rope since it's not covered in state dict
    for m in fsdp_model_to_load.modules():
        if isinstance(m, modules.RotaryPositionalEmbeddings) or isinstance(m, modules.VisionRotaryPositionalEmbeddings):
            m.rope_init()
    for m in fsdp_model_to_load.modules():
        if enable_activation_checkpointing:
            if isinstance(m, CheckpointWrapper):
                fully_shard(m)
        else:
            if isinstance(m, modules.TransformerSelfAttentionLayer):
                fully_shard(m)
    fully_shard(fsdp_model_to_load)
    load_from_full_model_state_dict(fsdp_model_to_load, expected_model_sd, torch.device(DEVICE))
    fsdp_model_to_load(inp)
    sharded_model_sd = fsdp_model_to_load.state_dict()
    expected_sharded_model_sd = fsdp_model_to_save.state_dict()
    assert_equal(set(sharded_model_sd.keys()), set(expected_sharded_model_sd.keys()))
    for key, value in sharded_model_sd.items():
        if isinstance(value._local_tensor, NF4Tensor):
            assert_equal(
                value._local_tensor.get_original_weight(),
                expected_sharded_model_sd[key]._local_tensor.get_original_weight(),
            )
        else:
            assert_equal(value, expected_sharded_model_sd[key])


# ---- the pytest cases (all run in the one 2-process job of _upstream_utils) ------------------------------------------

register_distributed_cases(
    {
        **{f"test_distributed-lora_state_dict-{funcs}": (_test_lora_state_dict, (funcs,)) for funcs in GATHERS},
        **{
            f"test_distributed-qlora_state_dict-{funcs}-ac{ac}": (_test_qlora_state_dict, (funcs, ac))
            for funcs in GATHERS
            for ac in (False, True)
        },
    }
)


@pytest.mark.distributed
class TestFullyShardState:
    @pytest.mark.parametrize("funcs", list(GATHERS))
    def test_lora_state_dict(self, tmp_path_factory, funcs):
        check_distributed_case(f"test_distributed-lora_state_dict-{funcs}", tmp_path_factory)

    @pytest.mark.parametrize("funcs", list(GATHERS))
    @pytest.mark.parametrize("enable_activation_checkpointing", [False, True])
    def test_qlora_state_dict(self, tmp_path_factory, funcs, enable_activation_checkpointing):
        check_distributed_case(
            f"test_distributed-qlora_state_dict-{funcs}-ac{enable_activation_checkpointing}", tmp_path_factory
        )

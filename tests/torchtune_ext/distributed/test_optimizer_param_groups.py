"""Param groups that torch's fused and foreach AdamW accept (sharded DTensor adapters beside plain pruned rows), and
the full optimizer state across groupings: a state of one group (what every run saved before the groups were split)
resumes into split groups, and back. References: torch's own single-tensor (for-loop) AdamW over plain tensors."""

from types import SimpleNamespace
from typing import List

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtune_ext.checkpoint import RecipeState
from torchtune_ext.distributed import get_full_optimizer_state, load_full_optimizer_state, optimizer_param_groups

FAST = [{"fused": True}, {"foreach": True}]


@pytest.fixture
def mesh():
    """A one-rank gloo group in this process (DTensors need one), destroyed after the test."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _values(seed: int) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(4, 3, generator=generator),
        torch.randn(6, generator=generator),
        torch.randn(2, 2, generator=generator),
    ]


def _grads(step: int, params: List[torch.Tensor]) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]


def _sharded_and_plain(values: List[torch.Tensor], mesh) -> List[nn.Parameter]:
    """Sharded adapters (DTensor) and a plain pruned-rows param, as a replicated vocab-pruning run holds them."""
    sharded = [nn.Parameter(distribute_tensor(v.clone(), mesh, [Shard(0)])) for v in values[:2]]
    return sharded + [nn.Parameter(values[2].clone())]


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def _train(optimizer: torch.optim.Optimizer, params: List[nn.Parameter], steps: range, mesh=None) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step, [_full(p) for p in params])):
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if isinstance(p, DTensor) else g
        optimizer.step()


def test_groups_by_kind_device_and_dtype_keeping_order():
    a, b, c, d = (nn.Parameter(torch.zeros(2, dtype=dtype)) for dtype in (torch.bfloat16, torch.float32) * 2)
    groups = optimizer_param_groups([a, b, c, d])
    assert [g["params"] for g in groups] == [[a, c], [b, d]]
    assert all(set(g) == {"params"} for g in groups)  # the optimizer's own arguments apply to every group


@pytest.mark.parametrize("fast", FAST, ids=lambda kw: next(iter(kw)))
def test_fused_and_foreach_take_sharded_and_plain_params_in_split_groups(mesh, fast):
    values = _values(0)
    ours = _sharded_and_plain(values, mesh)
    reference = [nn.Parameter(v.clone()) for v in values]
    kwargs = dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9))

    with pytest.raises(Exception, match="mixed torch.Tensor and DTensor"):  # one group: the failure this fixes
        _train(torch.optim.AdamW(ours, **kwargs, **fast), ours, range(1), mesh)

    ours = _sharded_and_plain(values, mesh)
    optimizer = torch.optim.AdamW(optimizer_param_groups(ours), **kwargs, **fast)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1]
    _train(optimizer, ours, range(3), mesh)
    _train(torch.optim.AdamW(reference, **kwargs, foreach=False), reference, range(3))
    for p, r in zip(ours, reference):
        torch.testing.assert_close(_full(p), r.detach(), rtol=0, atol=1e-6)


def _state_by_param(optimizer: torch.optim.Optimizer, params: List[nn.Parameter]):
    return [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]


@pytest.mark.parametrize("fast", FAST, ids=lambda kw: next(iter(kw)))
def test_a_one_group_state_resumes_into_split_groups_and_back(fast):
    # Two dtypes: one param group before the split, two after. The params' own order interleaves them.
    dtypes = (torch.float32, torch.float64, torch.float32)
    values = [v.to(dtype) for v, dtype in zip(_values(1), dtypes)]
    straight = [nn.Parameter(v.clone()) for v in values]
    one_group = torch.optim.AdamW(straight, lr=1e-2, foreach=False)
    _train(one_group, straight, range(2))
    saved = get_full_optimizer_state(one_group)  # the layout every run saved so far
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1, 2]]

    resumed = [nn.Parameter(p.detach().clone()) for p in straight]
    split = torch.optim.AdamW(optimizer_param_groups(resumed), lr=1e-3, **fast)
    load_full_optimizer_state(split, saved, params=resumed)
    assert [len(g["params"]) for g in split.param_groups] == [2, 1]
    for ours, theirs in zip(_state_by_param(split, resumed), _state_by_param(one_group, straight)):
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name].to(theirs[name].dtype).cpu(), theirs[name]), name
    assert [g["lr"] for g in split.param_groups] == [1e-2, 1e-2]  # the saved group's hyperparameters

    # Saved again, numbered in the params' own order (not the groups'): the one-group layout's numbers.
    again = get_full_optimizer_state(split, resumed)
    assert sorted(again["state"]) == [0, 1, 2]
    assert sorted(i for g in again["param_groups"] for i in g["params"]) == [0, 1, 2]
    for index, param in enumerate(straight):
        assert torch.equal(again["state"][index]["exp_avg_sq"], one_group.state[param]["exp_avg_sq"])

    _train(split, resumed, range(2, 4))
    _train(one_group, straight, range(2, 4))
    for ours, theirs in zip(resumed, straight):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-6)

    # And back into one group, from the split layout.
    back = [nn.Parameter(p.detach().clone()) for p in resumed]
    merged = torch.optim.AdamW(back, lr=1e-2, foreach=False)
    load_full_optimizer_state(merged, get_full_optimizer_state(split, resumed), params=back)
    for ours, theirs in zip(_state_by_param(merged, back), _state_by_param(split, resumed)):
        for name in ours:
            assert torch.equal(ours[name].cpu(), theirs[name].to(ours[name].dtype).cpu()), name


def test_another_number_of_params_is_refused():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    saved = get_full_optimizer_state(torch.optim.AdamW(params[:1]))
    with pytest.raises(ValueError, match="has 1 params, this model 2"):
        load_full_optimizer_state(torch.optim.AdamW(optimizer_param_groups(params)), saved, params=params)


def test_lr_schedule_of_one_group_resumes_into_split_groups():
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    def schedule(optimizer):
        return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)

    one = schedule(
        torch.optim.AdamW([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=1e-2)
    )
    for _ in range(4):
        one.optimizer.step()
        one.step()
    split = torch.optim.AdamW(
        optimizer_param_groups([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]),
        lr=1e-2,
    )
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in split.param_groups]  # as the recipe takes them
    two = schedule(split)
    RecipeState.restore_lr_scheduler_(SimpleNamespace(lr_scheduler=one.state_dict()), two, fresh)
    for _ in range(3):
        for scheduler in (one, two):
            scheduler.optimizer.step()
            scheduler.step()
        expected = one.optimizer.param_groups[0]["lr"]
        assert 0 < expected < 1e-2
        assert [g["lr"] for g in split.param_groups] == [expected, expected]
        assert two.get_last_lr() == [expected, expected]

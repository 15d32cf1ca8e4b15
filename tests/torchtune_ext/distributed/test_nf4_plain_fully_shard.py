"""A QLoRA model whose NF4 weights do not split evenly, sharded by plain ``fully_shard`` and by torchtune's own
``training.shard_model`` (nothing prepared), on 2, 3 and 4 real gloo ranks: the full state dict (NF4 bit for bit)
and three SGD steps equal a single process and the project's ``shard_model``. So does a torchtune user's own
distributed recipe: sharded on the meta device, loaded by torchtune's ``load_from_full_model_state_dict`` (which
quantizes the dense weights again) and saved by its ``gather_cpu_state_dict``, against one process loaded from the
same dense state dict.

The model is a tiny Qwen3 (head_dim 48, MLP 97) whose NF4 weights are 192x256 (the 256 -> 192 q/k/v projections,
8 scale groups), 256x192 (8), 97x256 (4) and 256x97 (4): at 3 ranks none splits evenly (torchao refused them all:
"quantization_factor.numel() not divisible by 3"); at 2 and 4 ranks the 97-row MLP weights do not, the others do
(torchao's own layout).
"""

from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import run_distributed
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtune import training
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from torchtune_ext import models
from torchtune_ext.distributed import get_full_state_dict, shard_model
from torchtune_ext.models import materialize_
from torchtune_ext.nf4 import NF4Tensor, UnevenNF4Tensor

ARCH = dict(
    vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=48, embed_dim=256, intermediate_dim=97,
    max_seq_len=64, tie_word_embeddings=True, lora_rank=4, lora_alpha=8,
)  # fmt: skip
INNER = ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean")
# SGD: a sharded step differs from one process's by float rounding only (Adam's first steps are lr * sign(grad),
# which turns rounding of a near-zero gradient into a difference of lr).
STEPS, ROWS_PER_RANK, SEQ, LR = 3, 2, 10, 1.0


def _build(device: str) -> nn.Module:
    model = models.qlora_qwen3(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                               dtype=torch.float32, device=device, seed=0, **ARCH)  # fmt: skip
    set_trainable_params(model, get_adapter_params(model))
    return model


def _plain(model: nn.Module) -> None:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


def _torchtune(model: nn.Module) -> None:
    training.shard_model(model, [training.get_shard_conditions], cpu_offload=False)


def _ours(model: nn.Module) -> None:
    shard_model(model, dtype=torch.float32)


def _load_as_torchtune(model: nn.Module, full_state_dict: Dict[str, torch.Tensor]) -> None:
    """What torchtune's ``lora_finetune_distributed`` does after sharding on the meta device: its loader, then the
    RoPE buffers, which no state dict holds."""
    training.load_from_full_model_state_dict(model, dict(full_state_dict), torch.device("cpu"))
    with torch.device("cpu"):
        for module in model.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()


def _batch(world_size: int, step: int):
    gen = torch.Generator().manual_seed(step)
    shape = (world_size * ROWS_PER_RANK, SEQ)
    vocab = ARCH["vocab_size"]
    return torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen)


def _token_losses(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="none")


def _train(model: nn.Module, world_size: int, rank: Optional[int], summed: bool = False) -> List[float]:
    """SGD steps on the global batch's rows of ``rank`` (None: all rows, one process); returns the global mean
    losses. ``summed``: gradients are summed over ranks (the project's ``shard_model``), so each rank divides its loss
    by the global token count; else FSDP2 averages them, so each rank takes its own mean."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        tokens, labels = _batch(world_size, step)
        rows = slice(None) if rank is None else slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        token_losses = _token_losses(model, tokens[rows], labels[rows])
        loss = token_losses.sum() / labels.numel() if summed else token_losses.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM if summed else dist.ReduceOp.AVG)
        losses.append(total.item())
    return losses


def _check_state(model: nn.Module, reference: nn.Module, rank: int, what: str) -> None:
    """The full state dict equals the single process's, the NF4 weights' inner tensors bit for bit."""
    nf4 = get_full_state_dict(model, is_rank_zero=rank == 0, keep_nf4=True, include_keys="*.weight")
    dense = get_full_state_dict(model, is_rank_zero=rank == 0)
    if rank != 0:
        return
    expected = reference.state_dict()  # NF4 weights dequantized
    assert dense.keys() == expected.keys(), what
    for key, value in dense.items():
        assert torch.equal(value, expected[key]), (what, key)
    weights = {key: value for key, value in reference.named_parameters() if isinstance(value, NF4Tensor)}
    assert len(weights) == 7 * ARCH["num_layers"], what
    for key, weight in weights.items():
        assert isinstance(nf4[key], NF4Tensor), (what, key)
        for name in INNER:
            assert torch.equal(getattr(nf4[key], name), getattr(weight, name)), (what, key, name)


def _check_torchtunes_gather(model: nn.Module, reference: nn.Module, rank: int) -> None:
    """torchtune's ``training.gather_cpu_state_dict`` (its recipe's save) gives the single process's state dict."""
    gathered = training.gather_cpu_state_dict(model, is_rank_zero=rank == 0)
    if rank == 0:
        expected = reference.state_dict()  # NF4 weights dequantized
        assert gathered.keys() == expected.keys()
        for key, value in gathered.items():
            assert torch.equal(value, expected[key]), key


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6, msg=lambda message: f"{what}: {message}")


def _adapters(model: nn.Module, rank: int) -> Dict[str, torch.Tensor]:
    return get_full_state_dict(model, is_rank_zero=rank == 0, adapter_weights_only=True)


def _worker(rank: int, world_size: int) -> None:
    reference = _build("cpu")
    dense = reference.state_dict()  # NF4 weights dequantized
    requantized = _build("cpu")
    requantized.load_state_dict(dense)
    references = {"reference": reference, "requantized": requantized}
    sharded: Dict[str, nn.Module] = {}
    shard: Dict[str, Callable[[nn.Module], None]] = {"ours": _ours, "plain": _plain, "torchtune": _torchtune}
    for what, apply in shard.items():
        # torchtune's sharding on the meta device, then filled by the project's loader; the others from real weights.
        model = _build("meta" if what == "torchtune" else "cpu")
        apply(model)
        if what == "torchtune":
            materialize_(model, "cpu", seed=0)
        sharded[what] = model
    sharded["torchtune_loader"] = _build("meta")
    _torchtune(sharded["torchtune_loader"])
    _load_as_torchtune(sharded["torchtune_loader"], dense)
    reference_of = {what: "requantized" if what == "torchtune_loader" else "reference" for what in sharded}
    locals_ = {n: p._local_tensor for n, p in sharded["plain"].named_parameters() if isinstance(p, DTensor)}
    uneven = {n for n, local in locals_.items() if isinstance(local, UnevenNF4Tensor)}
    even = {n for n, local in locals_.items() if type(local) is NF4Tensor}
    assert uneven and (even if world_size != 3 else not even), (sorted(uneven), sorted(even))
    for what, model in sharded.items():
        _check_state(model, references[reference_of[what]], rank, what)
    _check_torchtunes_gather(sharded["torchtune_loader"], requantized, rank)
    expected_losses = {name: _train(model, world_size, None) for name, model in references.items()}
    expected = {name: model.state_dict() for name, model in references.items()}
    moved = [value.abs().max().item() for key, value in expected["reference"].items() if "lora_b" in key]
    assert len(moved) == 7 * ARCH["num_layers"] and min(moved) > 1e-3, moved  # zero at the start
    for what, model in sharded.items():
        losses = _train(model, world_size, rank, summed=what == "ours")
        want = reference_of[what]
        torch.testing.assert_close(losses, expected_losses[want], rtol=1e-5, atol=0, msg=f"{what}: {losses}")
        adapters = _adapters(model, rank)
        if rank == 0:
            assert adapters and all("lora_" in key for key in adapters), what
            for key, value in adapters.items():
                _close(value, expected[want][key], f"{what} {key}")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_plain_fully_shard_and_torchtunes_shard_model_and_loader_equal_one_process_and_ours(world_size):
    run_distributed(_worker, world_size)


def _dora_worker(rank: int, world_size: int) -> None:
    def build(device: str) -> nn.Module:
        return models.qlora_qwen3(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                                  use_dora=True, dtype=torch.float32, device=device, seed=0, **ARCH)  # fmt: skip

    reference = build("cpu")
    expected = {key: value for key, value in reference.state_dict().items() if "magnitude" in key}
    tokens, labels = _batch(world_size, 0)
    expected_loss = _token_losses(reference, tokens, labels).mean()
    for what, apply in {"ours": _ours, "plain": _plain}.items():
        model = build("meta")
        apply(model)
        materialize_(model, "cpu", seed=0)  # the magnitudes computed from the sharded bases
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        loss = _token_losses(model, tokens[rows], labels[rows]).mean().detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        _close(loss, expected_loss, f"{what} loss")
        adapters = _adapters(model, rank)
        if rank == 0:
            assert len(expected) == 7 * ARCH["num_layers"] and expected.keys() <= adapters.keys(), what
            for key, value in expected.items():
                _close(adapters[key], value, f"{what} {key}")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_dora_magnitudes_from_unevenly_sharded_nf4_equal_one_process(world_size):
    """DoRA's magnitudes are the row norms of each rank's base rows, which an unevenly sharded NF4 weight does not
    hold (it holds whole scale groups): they are gathered first. On 2 ranks the 97-row MLP weights are uneven, on 3
    all of them."""
    run_distributed(_dora_worker, world_size)

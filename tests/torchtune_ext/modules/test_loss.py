"""LinearCrossEntropyLoss: loss and gradients against an independent reference, and against torchtune's loss.

The reference is the full, unchunked fp32 logits, computed here from fp32 copies of the output's parameters (NF4
bases dequantized, LoRA written out), and ``F.cross_entropy`` in fp32. Errors are norm-wise relative:
``||ours - ref|| / ||ref||``. Tolerances (measured worst case on these cases in brackets):

- fp32 1e-5 (6.3e-7 grads, 9e-8 loss): only the summation order differs (chunks, the fused softmax).
- bf16 1e-2 (4.2e-3 grads, 1.8e-5 loss): the logits are rounded to bf16 (8 bits) before the fp32 softmax, and
  ``softmax - onehot`` again before the gradient matmuls, as in torchtune; the test also checks that each error
  is at most 1.5x torchtune's ``CEWithChunkedOutputLoss`` error on the same case.
- fp16 2e-3 (5.2e-4 grads, 7.8e-6 loss): the same roundings with 11 bits.
- fp32 params of a pruned vocabulary inside a bf16/fp16 model: their logits are fp32, their errors fp32-like.
"""

import copy
import weakref
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from conftest import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torchtune.models.qwen2 import lora_qwen2
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_ext.models import TINY_QWEN_ARGS, build_qlora, lora_tiny_llama, qlora_tiny_llama
from torchtune_ext.modules import LoRALinear, prune_vocab_
from torchtune_ext.modules.loss import LinearCrossEntropyLoss, auto_chunk_size, linear_cross_entropy

VOCAB, DIM = 512, 256
ATTN = ["q_proj", "v_proj"]
LORA = dict(lora_attn_modules=ATTN, lora_rank=8, lora_alpha=16)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
KEPT = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:200]


def _adapter_dtype(dtype):
    return torch.float32 if dtype == torch.float16 else dtype  # fp16 trains fp32 master adapters


@cache
def _built(name, dtype):
    model = _build(name, dtype)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LoRA B starts at zero: make the adapter paths (and LoRA A's gradients) count
        for param_name, param in model.named_parameters():
            if param_name.endswith("lora_b.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _build(name, dtype):
    if name == "tied":
        return qlora_tiny_llama(ATTN, dtype=dtype, device="cpu")
    args = {**TINY_QWEN_ARGS, "tie_word_embeddings": False}
    return build_qlora(
        lora_qwen2, apply_lora_to_output=True, dtype=dtype, adapter_dtype=_adapter_dtype(dtype), device="cpu",
        **LORA, **args,
    )  # fmt: skip


def _model(name, dtype):
    """A fresh copy of a cached tiny model (sharing its frozen NF4 weights)."""
    model = _built(name, dtype)
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters() if not p.requires_grad})


def _dense(weight):
    """An NF4 base dequantized by torchao itself (independent of our kernels), as fp32."""
    return weight.get_original_weight().float() if type(weight).__name__ == "NF4Tensor" else weight.float()


def _lora_logits(h, p, base, scaling):
    return F.linear(h, base) + scaling * F.linear(F.linear(h, p["lora_a"]), p["lora_b"])


def _case(kind, dtype):
    """(output, trainable params by name, fp32 reference logits fn(h, fp32 params))."""
    if kind == "tied":
        model = _model("tied", dtype)
        return model.output, {"weight": model.tok_embeddings.weight}, lambda h, p: F.linear(h, p["weight"])
    if kind == "linear":  # an untied model's output (what build_qlora gives it)
        torch.manual_seed(0)
        output = nn.Linear(DIM, VOCAB, bias=False, dtype=dtype)
        return output, {"weight": output.weight}, lambda h, p: F.linear(h, p["weight"])
    if kind == "lora_nf4":
        output = _model("lora", dtype).output
        base = _dense(output.weight)
        params = {"lora_a": output.lora_a.weight, "lora_b": output.lora_b.weight}
        return output, params, lambda h, p: _lora_logits(h, p, base, output.scaling)
    if kind == "lora_dense":
        torch.manual_seed(0)
        output = LoRALinear(DIM, VOCAB, rank=8, alpha=16, dtype=dtype, adapter_dtype=_adapter_dtype(dtype))
        nn.init.normal_(output.lora_b.weight, 0, 0.05)
        params = {"weight": output.weight, "lora_a": output.lora_a.weight, "lora_b": output.lora_b.weight}
        return output, params, lambda h, p: _lora_logits(h, p, p["weight"], output.scaling)
    if kind == "pruned_tied":
        model = _model("tied", dtype)
        pruning = prune_vocab_(model, KEPT)
        return model.output, {"weight": pruning.weight}, lambda h, p: F.linear(h, p["weight"])
    model = _model("lora", dtype)
    pruning = prune_vocab_(model, KEPT)
    lora = pruning.output
    params = {"weight": lora.weight, "lora_a": lora.lora_a.weight, "lora_b": lora.lora_b.weight}
    return model.output, params, lambda h, p: _lora_logits(h, p, p["weight"], lora.scaling)


KINDS = ["tied", "linear", "lora_nf4", "lora_dense", "pruned_tied", "pruned_lora"]
VOCABS = {"pruned_tied": len(KEPT), "pruned_lora": len(KEPT)}


def _inputs(dtype, vocab, shape=(2, 37), seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, DIM, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, shape, generator=generator)
    labels[0, :6] = -100  # a prompt
    labels[1, -3:] = -100  # padding
    return hidden, labels


def _rel(ours, ref):
    return ((ours.float() - ref).norm() / ref.norm()).item()


def _reference(ref_logits, params, hidden, labels, ignore_index=-100):
    h = hidden.detach().float().requires_grad_()
    p32 = {name: p.detach().float().requires_grad_() for name, p in params.items()}
    logits = ref_logits(h, p32)
    loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index)
    loss.backward()
    return loss.detach(), h.grad, {name: p.grad for name, p in p32.items()}


def _errors(kind, dtype, fused=True, chunk_size=16, torchtune=False):
    """Relative errors of the loss and of every gradient against the fp32 reference (ours, or torchtune's
    ``CEWithChunkedOutputLoss`` over the output's 8 chunks)."""
    output, params, ref_logits = _case(kind, dtype)
    hidden, labels = _inputs(dtype, VOCABS.get(kind, VOCAB))
    if torchtune:
        loss = CEWithChunkedOutputLoss()([output(chunk) for chunk in hidden.chunk(8, dim=1)], labels)
    else:
        loss_fn = LinearCrossEntropyLoss(chunk_size=chunk_size, fused=fused)
        loss_fn.set_output(output)
        loss = loss_fn(hidden, labels)
    (loss * 3.0).backward()  # a loss scale: backward must scale the precomputed gradients
    ref_loss, ref_hidden_grad, ref_grads = _reference(ref_logits, params, hidden, labels)
    assert loss.dtype == torch.float32 and hidden.grad.dtype == dtype
    errors = {"loss": abs(loss.item() - ref_loss.item()) / ref_loss.item()}
    errors["hidden"] = _rel(hidden.grad / 3, ref_hidden_grad)
    for name, param in params.items():
        assert param.grad is not None, name
        errors[name] = _rel(param.grad / 3, ref_grads[name])
    return errors


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", KINDS)
def test_matches_fp32_reference(kind, dtype):
    errors = _errors(kind, dtype)  # 65 label tokens in chunks of 16: 4 full chunks and a partial one
    assert max(errors.values()) < TOL[dtype], errors
    if dtype != torch.float32:  # and no further from it than torchtune's loss is
        torchtune_errors = _errors(kind, dtype, torchtune=True)
        assert all(errors[k] <= 1.5 * torchtune_errors[k] + 1e-6 for k in errors), (errors, torchtune_errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["tied", "linear", "pruned_tied"])
def test_checkpoint_path_on_plain_weights(kind, dtype):
    errors = _errors(kind, dtype, fused=False, chunk_size=24)  # 3 chunks, the last one partial
    assert max(errors.values()) < TOL[dtype], errors


def test_auto_chunk_size_and_frozen_nf4_base():
    output, params, _ = _case("lora_nf4", torch.float32)
    errors = _errors("lora_nf4", torch.float32, chunk_size=None)
    assert max(errors.values()) < TOL[torch.float32], errors
    assert output.weight.grad is None
    assert auto_chunk_size(4096, 128_256, 2048) == 128  # ceil(4096 / 63) = 66 -> 128
    assert auto_chunk_size(16_384, 128_256, 2048) == 512
    assert auto_chunk_size(10, 128_256, 2048) == 128  # the minimum
    assert auto_chunk_size(4096, 8192, 2048) == 1024  # a pruned vocabulary: 4 chunks
    assert auto_chunk_size(4096, None, 2048) == 2048


def _recipe_losses(name, dtype, pruned):
    """(our loss, torchtune's loss, our model, torchtune's model) on one batch of the same model."""
    ours, theirs = _model(name, dtype), _model(name, dtype)
    tokens = KEPT[torch.randint(0, len(KEPT), (2, 40), generator=torch.Generator().manual_seed(0))]
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[0, :5] = -100
    if pruned:
        labels = prune_vocab_(ours, KEPT).remap_labels(labels)
        prune_vocab_(theirs, KEPT)
    loss_fn = LinearCrossEntropyLoss(chunk_size=16)
    loss_fn.set_model_output(ours)
    loss = loss_fn(ours(tokens), labels)
    loss.backward()
    theirs.set_num_output_chunks(8)
    ref = CEWithChunkedOutputLoss(num_output_chunks=8)(theirs(tokens), labels)
    ref.backward()
    return loss, ref, ours, theirs


@pytest.mark.parametrize(
    ("name", "pruned", "dtype"),
    [("tied", False, torch.float32), ("tied", False, torch.bfloat16), ("lora", False, torch.float32)]
    + [("lora", True, torch.bfloat16)],
    ids=["tied-fp32", "tied-bf16", "lora_output-fp32", "pruned_lora_output-bf16"],
)
def test_equals_torchtune_chunked_loss(name, pruned, dtype):
    # Same model and batch; every trainable param of the model (layer adapters included) gets the same gradient.
    # bf16: both round the logits to bf16 in the same places but sum over other chunks (loss 1e-3); the gradients
    # are accumulated in bf16 over other chunks (measured up to 7e-3, the tied embedding's): 2e-2.
    loss, ref, ours, theirs = _recipe_losses(name, dtype, pruned)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert abs(loss.item() - ref.item()) <= tol * ref.item()
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    assert any(n.startswith(("output.lora", "tok_embeddings.output.lora")) for n in grads) == (name == "lora")
    for n, p in ours.named_parameters():
        if p.requires_grad:
            assert _rel(p.grad, grads[n].float()) < (1e-5 if dtype == torch.float32 else 2e-2), n


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "checkpoint"])
def test_no_label_tokens_gives_zero_loss_and_grads(fused):
    output, params, _ = _case("lora_dense" if not fused else "tied", torch.float32)
    hidden, labels = _inputs(torch.float32, VOCAB)
    labels.fill_(-100)
    loss_fn = LinearCrossEntropyLoss(chunk_size=16, fused=fused)
    loss_fn.set_output(output)
    loss = loss_fn(hidden, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad is not None and not hidden.grad.any()
    assert all(p.grad is None or not p.grad.any() for p in params.values())
    # torchtune's CEWithChunkedOutputLoss divides by zero here (the recipe replaces its nan by 0).
    logits = [output(chunk) for chunk in hidden.detach().chunk(8, dim=1)]
    assert CEWithChunkedOutputLoss()(logits, labels).isnan()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "checkpoint"])
def test_custom_ignore_index_and_no_grad(fused):
    output, params, ref_logits = _case("tied", torch.float32)
    hidden, labels = _inputs(torch.float32, VOCAB)
    labels[labels == -100] = 7  # a real class now: ignored only by ignore_index=7
    loss_fn = LinearCrossEntropyLoss(chunk_size=10, ignore_index=7, fused=fused)
    loss_fn.set_output(output)
    ref_loss, ref_hidden_grad, _ = _reference(ref_logits, params, hidden, labels, ignore_index=7)
    with torch.no_grad():
        assert torch.allclose(loss_fn(hidden, labels), ref_loss, rtol=1e-6)
    loss_fn(hidden.flatten(0, 1), labels.flatten()).backward()  # any leading shape
    assert _rel(hidden.grad, ref_hidden_grad) < 1e-5


def test_functional_weight_grad_only_and_backward_twice():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 32, generator=generator)
    weight = torch.randn(100, 32, generator=generator).requires_grad_()
    labels = torch.randint(0, 100, (50,), generator=generator)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=7)
    loss.backward(retain_graph=True)
    weight_ref = weight.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(hidden, weight_ref), labels).backward()
    assert _rel(weight.grad, weight_ref.grad) < 1e-5
    with pytest.raises(RuntimeError, match="backward twice"):
        loss.backward()


def test_errors():
    loss_fn = LinearCrossEntropyLoss()
    hidden, labels = _inputs(torch.float32, VOCAB)
    with pytest.raises(RuntimeError, match="set_model_output"):
        loss_fn(hidden, labels)
    with pytest.raises(TypeError, match="skip_output_layer"):
        with torch.device("meta"):
            torchtune_model = lora_tiny_llama(["q_proj"])
        loss_fn.set_model_output(torchtune_model)  # torchtune 0.6.1's own decoder has no switch
    loss_fn.set_output(_case("tied", torch.float32)[0])
    with pytest.raises(ValueError, match="hidden states"):
        loss_fn([hidden], labels)
    with pytest.raises(ValueError, match="hidden states"):
        loss_fn(hidden[:, :-1], labels)
    with pytest.raises(ValueError, match="positive"):
        LinearCrossEntropyLoss(chunk_size=0)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside it."""

    def __init__(self, *existing):
        super().__init__()
        self.live = self.peak = 0
        self._sizes = {t.untyped_storage()._cdata: 0 for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self._sizes:
                storage = tensor.untyped_storage()
                self._sizes[storage._cdata] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage._cdata)
        return out

    def _free(self, key):
        self.live -= self._sizes.pop(key)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "checkpoint"])
def test_holds_one_chunk_of_logits(fused):
    vocab, tokens, chunk = 4096, 512, 16
    weight = torch.randn(vocab, 32).requires_grad_(False)
    output = nn.Linear(32, vocab, bias=False).requires_grad_(False)
    output.weight = nn.Parameter(weight, requires_grad=False)
    hidden = torch.randn(1, tokens, 32, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    loss_fn = LinearCrossEntropyLoss(chunk_size=chunk, fused=fused)
    loss_fn.set_output(output)
    with _LiveBytes(weight, hidden, labels) as tracker:
        loss_fn(hidden, labels).backward()
    chunk_logits = chunk * vocab * 4
    # fused: one fp32 buffer of a chunk's logits; checkpoint: the saved logits and the gradient's buffer; plus the
    # hidden grad (and its scaled copy)
    assert tracker.peak <= (1 if fused else 2) * chunk_logits + 2 * hidden.numel() * 4 + 2**16
    assert tracker.peak < tokens * vocab * 4 / 8


def _sharded(name, scenario, world_size):
    """(reference model, FSDP2 model, labels) for one scenario, both models returning hidden states."""
    from torch.distributed.fsdp import fully_shard

    reference, model = _model(name, torch.float32), _model(name, torch.float32)
    tokens = KEPT[torch.randint(0, len(KEPT), (2 * world_size, 24), generator=torch.Generator().manual_seed(0))]
    labels = torch.cat([tokens[:, 1:], torch.full((2 * world_size, 1), -100)], dim=1)
    labels[0, :12] = -100
    labels[2:] = -100  # rank 1 has no label tokens: it must still join every collective of the pruning unit
    if scenario == "pruned":
        labels = prune_vocab_(reference, KEPT).remap_labels(labels)
        fully_shard(prune_vocab_(model, KEPT))  # the pruning module: an FSDP unit called once per chunk
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=True)  # a root that reshards after forward: the loss must refuse it
    if scenario == "root_kept":
        model.set_reshard_after_forward(False, recurse=False)
    for unit in model.modules():
        if hasattr(unit, "set_gradient_divide_factor"):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return reference, model, tokens, labels


def _fsdp_worker(rank: int, world_size: int) -> None:
    local = slice(2 * rank, 2 * rank + 2)
    for name, scenario in [("lora", "root_resharded"), ("lora", "root_kept"), ("tied", "pruned"), ("lora", "pruned")]:
        reference, model, tokens, labels = _sharded(name, scenario, world_size)
        loss_fn = LinearCrossEntropyLoss(chunk_size=4)
        loss_fn.set_model_output(model)
        hidden = model(tokens[local])
        if scenario == "root_resharded":  # the output's params are DTensors again after the root's forward
            with pytest.raises(RuntimeError, match="set_reshard_after_forward"):
                loss_fn(hidden, labels[local])
            continue
        num_tokens = (labels != -100).sum()
        (loss_fn(hidden, labels[local]) * (labels[local] != -100).sum() / num_tokens).backward()
        ref_fn = LinearCrossEntropyLoss(chunk_size=4)
        ref_fn.set_model_output(reference)
        ref_fn(reference(tokens), labels).backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert _rel(p.grad.full_tensor(), ref_grads[n]) < 1e-5, (scenario, n)


@pytest.mark.distributed
def test_fsdp2_output_in_root_or_own_unit():
    """FSDP2 over 2 gloo ranks, one without label tokens: the output in the root unit (gathered after forward, or
    resharded: a clear error) or inside a pruning module sharded on its own (its hooks run per chunk, recompute
    included, and both ranks agree on the number of chunks)."""
    run_distributed(_fsdp_worker, 2)


def test_frozen_16_bit_output_under_fp32_takes_the_fused_path(monkeypatch):
    """An fp32 run's tied output stored in bf16 (``FrozenTiedLinear``) goes through the fused function, its table
    upcast a block of rows at a time (3 blocks here), and gives the fp32 reference's loss and gradient."""
    from torchtune_ext.modules import low_precision
    from torchtune_ext.modules.loss import _plain_weight
    from torchtune_ext.modules.low_precision import FrozenEmbedding, FrozenTiedLinear

    monkeypatch.setattr(low_precision, "_FROZEN_BLOCK_NUMEL", 32 * 100)
    torch.manual_seed(0)
    embedding = FrozenEmbedding(300, 32, dtype=torch.float32, storage_dtype=torch.bfloat16)
    output = FrozenTiedLinear(embedding, torch.float32)
    assert _plain_weight(output) is embedding.weight
    hidden = torch.randn(2, 20, 32, requires_grad=True)
    labels = torch.randint(0, 300, (2, 20))
    labels[0, :5] = -100
    loss_fn = LinearCrossEntropyLoss(chunk_size=8)
    loss_fn.set_output(output)
    loss = loss_fn(hidden, labels)
    loss.backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    logits = F.linear(ref_hidden, embedding.weight.float())
    ref = F.cross_entropy(logits.reshape(-1, 300), labels.reshape(-1))
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-5, atol=1e-7)

"""Vocab pruning: remapping, fp32 rows inside a bf16 model, tying, export, errors and FSDP2.

References are independent of the module: the unpruned model's own logits/loss/grads, its final hidden state
multiplied by the kept rows in fp32, and remapping done with a Python dict.
"""

import copy
import json
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from conftest import run_distributed
from torch import nn
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.models.qwen2 import lora_qwen2
from torchtune.modules.peft import get_adapter_params, get_merged_lora_ckpt, set_trainable_params

from torchtune_ext.models import TINY_LLAMA_ARGS, TINY_QWEN_ARGS, build_qlora, qlora_tiny_llama, qlora_tiny_qwen
from torchtune_ext.modules import (
    PrunedOutput,
    VocabPruning,
    collect_token_ids,
    export_full_vocab_state_dict,
    get_vocab_pruning,
    load_kept_ids,
    prune_state_dict,
    prune_vocab_,
    save_kept_ids,
    validate_kept_ids,
    vocab_state_dict,
)
from torchtune_ext.nf4 import NF4Tensor, dequantize_nf4

VOCAB = 512
ATTN = ["q_proj", "v_proj"]
LORA = dict(lora_attn_modules=ATTN, lora_rank=8, lora_alpha=16)


def _live(model):
    """The model's own tensors (NF4 weights as NF4Tensors): ``state_dict()`` is dense, as torchtune's."""
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}


def _untied_llama(dtype, device="cpu"):
    args = {**TINY_LLAMA_ARGS, "tie_word_embeddings": False}
    return build_qlora(lora_llama3_2, dtype=dtype, device=device, **LORA, **args)


def _untied_qwen_lora_output(dtype, device="cpu"):
    args = {**TINY_QWEN_ARGS, "tie_word_embeddings": False}
    model = build_qlora(lora_qwen2, apply_lora_to_output=True, dtype=dtype, device=device, **LORA, **args)
    if device != "meta":
        with torch.no_grad():  # LoRA B starts at zero: make the adapter path visible in the logits
            model.output.lora_b.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(3))
    return model


BUILDERS = {
    "llama_tied": lambda dtype, device="cpu": qlora_tiny_llama(ATTN, dtype=dtype, device=device),
    "qwen_tied": lambda dtype, device="cpu": qlora_tiny_qwen(ATTN, dtype=dtype, device=device),
    "llama_untied": _untied_llama,
    "qwen_lora_output": _untied_qwen_lora_output,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@cache
def _cached_model(name, dtype):
    return BUILDERS[name](dtype)


def _copy(model):
    """A copy that shares the frozen NF4 weights (deep-copying NF4Tensors is slow: it goes through torchao)."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters() if isinstance(p, NF4Tensor)})


def _model(name, dtype):
    """A fresh copy of a materialised tiny model."""
    return _copy(_cached_model(name, dtype))


def _tokens(ids: torch.Tensor, shape=(2, 16), seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return ids[torch.randint(0, ids.numel(), shape, generator=generator)]


def _logits_and_hidden(model, tokens):
    """The model's logits and its final (post-norm) hidden state."""
    captured = {}
    handle = model.norm.register_forward_hook(lambda mod, args, out: captured.update(h=out))
    logits = model(tokens)
    handle.remove()
    return logits, captured["h"]


def _reference_logits(full_model, hidden, kept):
    """fp32 logits over ``kept`` from the unpruned model's output params, computed here from scratch."""
    h = hidden.float()
    output = full_model.output
    if not isinstance(output, nn.Module):  # TiedLinear
        return F.linear(h, full_model.tok_embeddings.weight.float()[kept])
    weight = output.weight
    weight = dequantize_nf4(weight, torch.float32) if isinstance(weight, NF4Tensor) else weight.float()
    weight = weight[kept]
    out = F.linear(h, weight)
    if hasattr(output, "lora_a"):
        out = out + output.scaling * F.linear(
            F.linear(h, output.lora_a.weight.float()), output.lora_b.weight.float()[kept]
        )
    return out


def _dict_remap(ids: torch.Tensor, kept: torch.Tensor, ignore_index=-100) -> torch.Tensor:
    position = {int(v): k for k, v in enumerate(kept.tolist())}
    return torch.tensor([ignore_index if i == ignore_index else position[i] for i in ids.flatten().tolist()]).view(
        ids.shape
    )


def _ce(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def _labels(tokens):
    labels = tokens.clone()
    labels[:, :3] = -100  # a prompt the loss ignores
    return labels


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", BUILDERS)
def test_logits_over_kept_rows_match_unpruned(name, dtype):
    full = _model(name, dtype)
    kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:200]
    tokens = _tokens(kept)
    full_logits, hidden = _logits_and_hidden(full, tokens)

    model = _copy(full)
    pruning = prune_vocab_(model, kept)
    logits, pruned_hidden = _logits_and_hidden(model, tokens)

    assert model.tok_embeddings is pruning and get_vocab_pruning(model) is pruning
    assert logits.shape == (2, 16, 200) and logits.dtype == torch.float32
    assert pruning.weight.dtype == torch.float32 and pruning.model_dtype == dtype
    # The embedding is an exact fp32 copy cast back to the model dtype: the layers see identical inputs.
    torch.testing.assert_close(pruned_hidden, hidden, atol=0, rtol=0)
    torch.testing.assert_close(logits, _reference_logits(full, hidden, kept), atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(logits, full_logits[..., kept], atol=1e-5, rtol=1e-5)
        labels = _labels(tokens)
        loss = _ce(logits, pruning.remap_labels(labels))
        torch.testing.assert_close(loss, _ce(full_logits[..., kept], _dict_remap(labels, kept)))
    else:
        torch.testing.assert_close(logits, full_logits[..., kept], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", BUILDERS)
def test_full_permutation_loss_and_grads_equal_unpruned(name):
    """Keeping every id in a shuffled order: loss and gradients equal the unpruned model's (fp32)."""
    full = _model(name, torch.float32)
    kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))
    tokens = _tokens(kept)
    labels = _labels(tokens)
    model = _copy(full)
    pruning = prune_vocab_(model, kept)

    full_loss = _ce(full(tokens), labels)
    loss = _ce(model(tokens), pruning.remap_labels(labels))
    torch.testing.assert_close(loss, full_loss, atol=1e-6, rtol=1e-6)

    full_loss.backward()
    loss.backward()
    grad = pruning.weight.grad
    assert grad is not None and grad.dtype == torch.float32
    torch.testing.assert_close(grad, full.tok_embeddings.weight.grad[kept], atol=1e-6, rtol=1e-5)
    if isinstance(full.output, nn.Linear):
        torch.testing.assert_close(pruning.output.weight.grad, full.output.weight.grad[kept], atol=1e-6, rtol=1e-5)
    if hasattr(full.output, "lora_a"):
        torch.testing.assert_close(
            pruning.output.lora_b.weight.grad, full.output.lora_b.weight.grad[kept], atol=1e-6, rtol=1e-5
        )
        torch.testing.assert_close(
            pruning.output.lora_a.weight.grad, full.output.lora_a.weight.grad, atol=1e-6, rtol=1e-5
        )


def test_gradients_reach_only_used_rows():
    model = _model("llama_untied", torch.bfloat16)
    kept = torch.arange(0, VOCAB, 2)
    pruning = prune_vocab_(model, kept)
    tokens = _tokens(kept[:10])
    model(tokens).sum().backward()
    used = torch.zeros(kept.numel(), dtype=torch.bool)
    used[pruning.remap_ids(tokens).unique()] = True
    row_norms = pruning.weight.grad.norm(dim=1)
    assert (row_norms[used] > 0).all() and (row_norms[~used] == 0).all()
    assert pruning.output.weight.grad.dtype == torch.float32 and (pruning.output.weight.grad.norm(dim=1) > 0).all()


@pytest.mark.parametrize("name", ["llama_tied", "qwen_tied"])
def test_tied_stays_tied_after_a_step(name):
    model = _model(name, torch.bfloat16)
    kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))[:100]
    pruning = prune_vocab_(model, kept)
    set_trainable_params(model, get_adapter_params(model))
    assert pruning.tied and [p for p in pruning.parameters()] == [pruning.weight]
    tokens = _tokens(kept)
    before = pruning.weight.detach().clone()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    _ce(model(tokens), pruning.remap_labels(_labels(tokens))).backward()
    optimizer.step()

    assert not torch.equal(before, pruning.weight)
    assert model.tok_embeddings is pruning and model.output.pruning is pruning
    captured = {}
    handle = model.layers[0].register_forward_pre_hook(lambda mod, args: captured.update(x=args[0]))
    logits, hidden = _logits_and_hidden(model, tokens)
    handle.remove()
    # Both uses read the one updated parameter.
    expected_embeddings = pruning.weight.detach()[_dict_remap(tokens, kept)].to(torch.bfloat16)
    torch.testing.assert_close(captured["x"], expected_embeddings, atol=0, rtol=0)
    torch.testing.assert_close(logits, F.linear(hidden.float(), pruning.weight.detach()), atol=1e-5, rtol=1e-5)


def test_trainable_rows_are_adapter_params():
    model = _model("qwen_lora_output", torch.float32)
    pruning = prune_vocab_(model, torch.arange(50))
    names = set(get_adapter_params(model))
    assert {
        "tok_embeddings.weight",
        "tok_embeddings.output.weight",
        "tok_embeddings.output.lora_a.weight",
        "tok_embeddings.output.lora_b.weight",
    } <= names
    set_trainable_params(model, get_adapter_params(model))
    assert pruning.weight.requires_grad and pruning.output.weight.requires_grad

    frozen = _model("qwen_lora_output", torch.float32)
    pruning = prune_vocab_(frozen, torch.arange(50), trainable=False)
    set_trainable_params(frozen, get_adapter_params(frozen))
    assert not pruning.weight.requires_grad and not pruning.output.weight.requires_grad
    assert pruning.output.lora_a.weight.requires_grad and pruning.output.lora_b.weight.requires_grad


def _train_one_step(model, kept, lr=0.5):
    pruning = get_vocab_pruning(model)
    set_trainable_params(model, get_adapter_params(model))
    tokens = _tokens(kept)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    _ce(model(tokens), pruning.remap_labels(_labels(tokens))).backward()
    optimizer.step()
    return tokens


@pytest.mark.parametrize(
    "name, dtype",
    [(name, torch.float32) for name in BUILDERS]
    + [("llama_tied", torch.bfloat16), ("qwen_lora_output", torch.bfloat16)],
)
def test_export_restores_full_vocab(name, dtype):
    base = _model(name, dtype)
    # The live tensors (state_dict() is dense, as torchtune's); not cloned: NF4Tensor.clone() re-quantizes (lossy).
    base_sd = _live(base)
    kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:64]
    model = _copy(base)
    pruning = prune_vocab_(model, kept)
    tokens = _train_one_step(model, kept)

    full_sd = export_full_vocab_state_dict(_live(model), vocab_state_dict(base_sd), pruning.kept_ids)
    assert full_sd.keys() == base_sd.keys()
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[kept] = False
    for key in [k for k in base_sd if k == "tok_embeddings.weight" or k.startswith("output.")]:
        exported, original = full_sd[key], base_sd[key]
        pruned_key = key if key == "tok_embeddings.weight" else "tok_embeddings." + key
        trained = model.state_dict()[pruned_key]
        if key == "output.weight" and hasattr(base.output, "lora_a"):
            original = dequantize_nf4(original)
        if key == "output.lora_a.weight":
            assert exported.dtype == original.dtype and exported.shape == original.shape
            torch.testing.assert_close(exported, trained.to(original.dtype), atol=0, rtol=0)
            continue
        # The trained rows keep their precision (fp32 pruned rows over a bf16 base: fp32).
        assert exported.dtype == torch.promote_types(original.dtype, trained.dtype) and exported.shape == original.shape
        torch.testing.assert_close(exported[others], original[others].to(exported.dtype), atol=0, rtol=0)
        torch.testing.assert_close(exported[kept], trained.to(exported.dtype), atol=0, rtol=0)
    assert not torch.equal(full_sd["tok_embeddings.weight"], base_sd["tok_embeddings.weight"])

    if name == "qwen_lora_output":
        return  # its NF4 output base would be re-quantized on load; the tensors are checked above
    restored = BUILDERS[name](dtype)  # its own NF4 weights: loading must not touch the cached model's
    restored.load_state_dict(full_sd, strict=True)
    restored_logits = restored(tokens)[..., kept]
    if dtype == torch.float32:
        torch.testing.assert_close(restored_logits, model(tokens), atol=1e-5, rtol=1e-5)


def test_export_of_merged_lora_output():
    base = _model("qwen_lora_output", torch.float32)
    # The live tensors (state_dict() is dense, as torchtune's); not cloned: NF4Tensor.clone() re-quantizes (lossy).
    base_sd = _live(base)
    kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(6))[:64]
    model = _copy(base)
    pruning = prune_vocab_(model, kept)
    tokens = _train_one_step(model, kept)
    rank, alpha = pruning.output.rank, pruning.output.alpha

    # Merge the pruned output's LoRA only (the NF4 layers are another tool's business).
    output_sd = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("tok_embeddings.")}
    merged = get_merged_lora_ckpt(output_sd, rank, alpha)
    full_sd = export_full_vocab_state_dict(merged, base_sd, kept)
    assert set(full_sd) == {"tok_embeddings.weight", "output.weight"} and full_sd["output.weight"].shape == (VOCAB, 256)
    out = pruning.output
    expected = out.weight + out.scaling * out.lora_b.weight @ out.lora_a.weight
    torch.testing.assert_close(full_sd["output.weight"][kept], expected.detach(), atol=1e-6, rtol=1e-6)
    untouched = torch.ones(VOCAB, dtype=torch.bool)
    untouched[kept] = False
    torch.testing.assert_close(full_sd["output.weight"][untouched], dequantize_nf4(base.output.weight)[untouched])
    # The merged output layer gives the pruned model's logits on the kept rows.
    _, hidden = _logits_and_hidden(model, tokens)
    torch.testing.assert_close(
        F.linear(hidden.float(), full_sd["output.weight"][kept]), model(tokens), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("name", ["llama_tied", "qwen_lora_output"])
def test_meta_model_loads_pruned_base_checkpoint(name):
    full = _model(name, torch.float32)
    kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:80]
    expected = _copy(full)
    prune_vocab_(expected, kept)

    from torchtune_ext.models import materialize_

    meta = BUILDERS[name](torch.float32, device="meta")
    pruning = prune_vocab_(meta, kept)
    assert pruning.weight.is_meta and pruning.weight.shape == (80, 256)
    pruned_sd = prune_state_dict(_live(full), kept)
    assert pruned_sd.keys() == meta.state_dict().keys()
    materialize_(meta, "cpu", seed=123)
    meta.load_state_dict(pruned_sd, strict=True)
    tokens = _tokens(kept)
    torch.testing.assert_close(meta(tokens), expected(tokens), atol=0, rtol=0)


def test_remapping_policies():
    kept = [7, 3, 11, 0]
    pruning = VocabPruning(kept, vocab_size=16, embed_dim=4)
    ids = torch.tensor([[3, 0, 11, 7]])
    assert pruning.remap_ids(ids).tolist() == [[1, 3, 2, 0]]
    assert pruning.remap_labels(torch.tensor([[3, -100, 7]])).tolist() == [[1, -100, 0]]
    assert pruning.to_vocab_ids(torch.tensor([1, 3, 2, 0])).tolist() == [3, 0, 11, 7]
    with pytest.raises(ValueError, match=r"not in the kept vocabulary .*\[5\].*unknown_token_id"):
        pruning(torch.tensor([[3, 5]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pruning(torch.tensor([[3, 16]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pruning.remap_ids(torch.tensor([-1]))

    unk = VocabPruning(kept, vocab_size=16, embed_dim=4, unknown_token_id=0)
    assert unk.remap_ids(torch.tensor([5, 3, 15])).tolist() == [3, 1, 3]
    assert unk.remap_labels(torch.tensor([5, -100])).tolist() == [3, -100]
    torch.testing.assert_close(unk(torch.tensor([[5]]))[0, 0], unk.weight[3])
    with pytest.raises(ValueError, match="unknown_token_id=5 is not one of the kept ids"):
        VocabPruning(kept, vocab_size=16, embed_dim=4, unknown_token_id=5)


@pytest.mark.parametrize(
    "kept, match",
    [
        ([], "empty"),
        ([1, 2, 512], r"outside the vocabulary \[0, 512\): \[512\]"),
        ([-1, 2], r"outside the vocabulary \[0, 512\): \[-1\]"),
        ([4, 2, 4, 9, 9], r"2 duplicated id\(s\): \[4, 9\]"),
        ([1.0, 2.0], "integer"),
        (torch.tensor([[1, 2]]), "flat list"),
    ],
)
def test_invalid_kept_ids_fail_before_any_change(kept, match):
    model = _model("llama_tied", torch.float32)
    embedding = model.tok_embeddings
    with pytest.raises(ValueError, match=match):
        prune_vocab_(model, kept)
    assert model.tok_embeddings is embedding
    with pytest.raises(ValueError, match=match):
        validate_kept_ids(kept, VOCAB)


def test_invalid_models_and_state_dicts():
    model = _model("llama_tied", torch.float32)
    pruning = prune_vocab_(model, [1, 2, 3])
    with pytest.raises(ValueError, match="already pruned"):
        prune_vocab_(model, [1, 2, 3])
    with pytest.raises(ValueError, match="nn.Embedding"):
        prune_vocab_(nn.Linear(2, 2), [0])
    with pytest.raises(ValueError, match="floating-point"):
        prune_vocab_(_model("llama_tied", torch.float32), [0], dtype=torch.int32)

    odd = _model("llama_untied", torch.float32)
    odd.output = nn.Sequential(nn.Linear(256, VOCAB))
    with pytest.raises(ValueError, match="cannot prune model.output of type Sequential"):
        prune_vocab_(odd, [0])

    base_sd = _model("llama_tied", torch.float32).state_dict()
    with pytest.raises(ValueError, match="3 rows but there are 4 kept ids"):
        export_full_vocab_state_dict(model.state_dict(), base_sd, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="no 'tok_embeddings.weight'"):
        export_full_vocab_state_dict(model.state_dict(), {}, pruning.kept_ids)
    with pytest.raises(ValueError, match="no 'tok_embeddings.weight'"):
        prune_state_dict({"norm.scale": torch.ones(2)}, [0])
    with pytest.raises(ValueError, match="remap_ids expects integer"):
        pruning.remap_ids(torch.tensor([1.0]))


def test_collect_token_ids():
    data = [
        {"tokens": [5, 9, 2], "labels": [-100, 9, 2]},
        {"tokens": torch.tensor([9, 30]), "labels": torch.tensor([-100, 31])},
        [1, 5],
        torch.tensor([[40, 41]]),
    ]
    assert collect_token_ids(data, always_keep=(0, 2, None)) == [0, 1, 2, 5, 9, 30, 31, 40, 41]
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 40\)"):
        collect_token_ids(data, vocab_size=40)
    with pytest.raises(ValueError, match="mapping without 'tokens'"):
        collect_token_ids([{"input_ids": [1]}])
    with pytest.raises(ValueError, match="is a str"):
        collect_token_ids(["hello"])
    with pytest.raises(ValueError, match="negative"):
        collect_token_ids([[3, -1]])
    with pytest.raises(ValueError, match="non-integer"):
        collect_token_ids([[1.5]])


@pytest.mark.parametrize("suffix", [".json", ".txt"])
def test_kept_ids_files_round_trip(tmp_path, suffix):
    path = tmp_path / "sub" / f"kept{suffix}"
    save_kept_ids(path, torch.tensor([7, 3, 11]))
    assert load_kept_ids(path) == [7, 3, 11]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    if suffix == ".json":
        assert json.loads(path.read_text()) == [7, 3, 11]


def test_kept_ids_files_errors(tmp_path):
    text = tmp_path / "kept.txt"
    text.write_text("# ids of the train set\n1, 2 3\n4 # four\n")
    assert load_kept_ids(text) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 4\)"):
        load_kept_ids(text, vocab_size=4)
    text.write_text("1\n2\nfoo\n")
    with pytest.raises(ValueError, match=r"kept.txt:3: 'foo' is not an integer"):
        load_kept_ids(text)
    text.write_text("1\n1\n")
    with pytest.raises(ValueError, match="duplicated"):
        load_kept_ids(text)
    bad_json = tmp_path / "kept.json"
    bad_json.write_text('{"ids": [1]}')
    with pytest.raises(ValueError, match="JSON list of integer"):
        load_kept_ids(bad_json)
    bad_json.write_text("[1, 2")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_kept_ids(bad_json)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_kept_ids(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="duplicated"):
        save_kept_ids(tmp_path / "dup.json", [1, 1])


def test_pruned_output_is_not_a_module():
    model = _model("llama_untied", torch.float32)
    pruning = prune_vocab_(model, [0, 1])
    assert isinstance(model.output, PrunedOutput) and "output" not in model._modules
    assert sum(1 for m in model.modules() if m is pruning) == 1
    assert set(model.state_dict()) >= {"tok_embeddings.weight", "tok_embeddings.output.weight"}
    assert "output.weight" not in model.state_dict()


def _fsdp_worker(rank: int, world_size: int) -> None:
    from torch.distributed.tensor import DTensor

    from torchtune_ext.distributed import all_reduce_grads, shard_model

    kept = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(8))[:200]
    reference, sharded, replicated = [qlora_tiny_llama(ATTN, dtype=torch.bfloat16, device="cpu") for _ in range(3)]
    for model in (reference, sharded, replicated):  # same seed: same weights
        prune_vocab_(model, kept)
        set_trainable_params(model, get_adapter_params(model))
    # Layers in bf16; the pruning module sharded on its own in fp32, or replicated (left out of FSDP).
    for model, mode in ((sharded, "sharded"), (replicated, "replicated")):
        shard_model(model, dtype=torch.bfloat16, vocab_pruning=model.tok_embeddings, vocab_pruning_sharding=mode)
    assert isinstance(sharded.tok_embeddings.weight, DTensor) and sharded.tok_embeddings.weight.dtype == torch.float32
    assert not isinstance(replicated.tok_embeddings.weight, DTensor)

    tokens = _tokens(kept, shape=(2 * world_size, 16), seed=9)
    labels = reference.tok_embeddings.remap_labels(tokens)
    local = slice(2 * rank, 2 * rank + 2)
    ref_loss = _ce(reference(tokens), labels)
    ref_loss.backward()
    ref_grad = reference.tok_embeddings.weight.grad
    for model in (sharded, replicated):
        loss = _ce(model(tokens[local]), labels[local])
        loss.backward()
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        torch.testing.assert_close(global_loss / world_size, ref_loss.detach(), atol=2e-3, rtol=2e-3)
    all_reduce_grads(list(replicated.tok_embeddings.parameters()))

    grad = sharded.tok_embeddings.weight.grad
    assert isinstance(grad, DTensor) and grad.dtype == torch.float32
    assert grad.to_local().shape[0] == 200 // world_size
    full_grad = grad.full_tensor()
    # shard_model reduces sums (the recipes normalise the loss by the global token count instead): each rank's
    # loss here is its own mean, so the global mean's gradient is the sum over ranks / world_size.
    assert (full_grad / world_size - ref_grad).norm() <= 2e-2 * ref_grad.norm()
    # Both modes sum the same per-rank fp32 gradients.
    torch.testing.assert_close(replicated.tok_embeddings.weight.grad, full_grad, atol=1e-7, rtol=1e-6)

    for model in (reference, sharded, replicated):
        lr = 1.0 if model is reference else 1.0 / world_size
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr).step()
    assert list(sharded.tok_embeddings.parameters()) == [sharded.tok_embeddings.weight]  # still one tied param
    updated = sharded.tok_embeddings.weight.full_tensor()
    torch.testing.assert_close(updated, reference.tok_embeddings.weight.detach(), atol=2e-3, rtol=0)
    torch.testing.assert_close(replicated.tok_embeddings.weight.detach(), updated, atol=1e-7, rtol=1e-6)
    gathered = [torch.empty_like(updated) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, replicated.tok_embeddings.weight.detach())
    assert all(torch.equal(g, gathered[0]) for g in gathered)  # replicas stay identical


@pytest.mark.distributed
def test_fsdp2_pruning_module_sharded_in_fp32_or_replicated():
    """Decoder layers sharded in bf16 (shard_model); the pruning module sharded on its own in fp32, or replicated with
    its gradients summed by all_reduce_grads: both take the same steps."""
    run_distributed(_fsdp_worker, 2)

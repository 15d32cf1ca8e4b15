"""Streaming HF checkpoints: safetensors I/O, loading into NF4 vs torchtune's loader, PEFT/merged export, atomicity."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchtune import training
from torchtune.models import convert_weights
from torchtune.training import FullModelHFCheckpointer

from torchtune_ext._finite import NonFiniteError
from torchtune_ext.checkpoint import (
    HFConverter,
    QLoRAHFCheckpointer,
    _safetensors,
    atomic_directory,
    atomic_save,
    llama3_2_hf_config,
    load_base_,
    remove_stale_temporaries,
    resolve_checkpoint_files,
    write_random_hf_checkpoint,
)
from torchtune_ext.data import write_tiny_checkpoint
from torchtune_ext.distributed import get_full_state_dict
from torchtune_ext.models import (
    TINY_LLAMA_ARGS,
    init_adapters_,
    lora_tiny_llama,
    lora_tiny_qwen,
    qlora_tiny_llama,
    qlora_tiny_qwen,
)
from torchtune_ext.nf4 import NF4Tensor, nf4_scaler_block_size, to_nf4

# All attention projections get LoRA: torchtune's qwen2 builder leaves a non-LoRA output_proj dense even with
# quantize_base=True (ours quantizes every linear in the layers), so only this choice compares like with like.
LORA = dict(
    lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=8, lora_alpha=16
)
FAMILIES = {
    "llama": (qlora_tiny_llama, lora_tiny_llama, "LLAMA3_2"),
    "qwen": (qlora_tiny_qwen, lora_tiny_qwen, "QWEN2"),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {
        (family, dtype): write_tiny_checkpoint(root / f"{family}_{dtype}", family=family, dtype=dtype, seed=3)
        for family in FAMILIES
        for dtype in ("fp32", "bf16")
    }


def _loaded(family, base, tmp_path, dtype=torch.float32, **lora):
    builder, _, model_type = FAMILIES[family]
    model = builder(**{**LORA, **lora}, dtype=dtype)
    checkpointer = QLoRAHFCheckpointer(str(base), str(tmp_path / "out"), model_type)
    checkpointer.validate(model)
    load_base_(model, checkpointer, torch.device("cpu"))
    torch.manual_seed(0)
    init_adapters_(model, torch.device("cpu"))
    training.validate_no_params_on_meta_device(model)
    return model, checkpointer


# ------------------------------------------------------------------------------------------------ safetensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).bfloat16(),
        "c.f16": torch.randn(2, 2, 2, generator=g).half(),
        "d.i64": torch.arange(6).reshape(2, 3),
        "e.bool": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(2.5),
        "g.empty": torch.zeros(0, 4),
    }


def test_streamed_safetensors_interoperate_with_the_safetensors_library(tmp_path):
    tensors = _tensors()
    specs = [_safetensors.TensorSpec(k, v.shape, v.dtype) for k, v in tensors.items()]
    _safetensors.write_tensors(tmp_path / "ours.safetensors", specs, tensors.items())
    theirs = load_file(tmp_path / "ours.safetensors")
    assert theirs.keys() == tensors.keys()
    for k, v in tensors.items():
        assert theirs[k].dtype == v.dtype and torch.equal(theirs[k], v)

    save_file(tensors, tmp_path / "lib.safetensors")
    read = dict(_safetensors.iter_tensors(tmp_path / "lib.safetensors"))
    assert read.keys() == tensors.keys()
    for k, v in tensors.items():
        assert read[k].dtype == v.dtype and torch.equal(read[k], v)
    assert {k: tuple(v["shape"]) for k, v in _safetensors.read_header(tmp_path / "lib.safetensors").items()} == {
        k: tuple(v.shape) for k, v in tensors.items()
    }


def test_writer_rejects_a_tensor_that_does_not_match_its_spec(tmp_path):
    specs = [_safetensors.TensorSpec("x", (2, 2), torch.float32)]
    with pytest.raises(ValueError, match="does not match"):
        _safetensors.write_tensors(tmp_path / "x.safetensors", specs, [("x", torch.zeros(2, 3))])
    with pytest.raises(ValueError, match="expected 1 tensors, got 0"):
        _safetensors.write_tensors(tmp_path / "y.safetensors", specs, [])


def test_truncated_file_is_reported(tmp_path):
    save_file({"w": torch.randn(64, 64)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated"):
        list(_safetensors.iter_tensors(tmp_path / "w.safetensors"))


def test_plan_shards_respects_the_limit_and_order():
    specs = [_safetensors.TensorSpec(str(i), (n,), torch.float32) for i, n in enumerate([10, 10, 30, 5, 5])]
    shards = _safetensors.plan_shards(specs, max_shard_bytes=80)
    assert [[s.name for s in shard] for shard in shards] == [["0", "1"], ["2"], ["3", "4"]]


# ------------------------------------------------------------------------------------------------ loading


def _nf4(dense: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 round trip in our per-shape scale groups (torchao's 256 where they split over 8 ranks)."""
    return to_nf4(dense, 64, nf4_scaler_block_size(dense.shape)).get_original_weight()


def _per_shape_scale_groups_(model: torch.nn.Module) -> None:
    """Gives torchtune's NF4 weights our per-shape scale groups; loading a dense weight then quantizes in them
    (torchao's ``copy_`` keeps the target's block sizes)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, NF4Tensor):
            fresh = to_nf4(torch.zeros(weight.shape, dtype=weight.dtype), 64, nf4_scaler_block_size(weight.shape))
            module.weight = torch.nn.Parameter(fresh, requires_grad=False)


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_streamed_load_equals_torchtunes_checkpointer_and_quantization(bases, tmp_path, family):
    """Our model after streaming equals torchtune's quantize_base model loaded by FullModelHFCheckpointer."""
    ours, _ = _loaded(family, bases[(family, "fp32")], tmp_path)
    _, torchtune_builder, model_type = FAMILIES[family]
    state = FullModelHFCheckpointer(
        str(bases[(family, "fp32")]), ["model.safetensors"], model_type, str(tmp_path / "tt")
    ).load_checkpoint()[training.MODEL_KEY]
    with training.set_default_dtype(torch.float32):
        reference = torchtune_builder(**LORA, quantize_base=True)
    _per_shape_scale_groups_(reference)
    reference.load_state_dict(state, strict=False)
    reference.load_state_dict({k: v for k, v in ours.state_dict().items() if "lora" in k}, strict=False)
    for b in (ours.layers[0].attn.q_proj.lora_b, ours.layers[1].mlp.w2.lora_b):
        torch.nn.init.normal_(b.weight)  # make the adapters matter
    reference.load_state_dict({k: v for k, v in ours.state_dict().items() if "lora" in k}, strict=False)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(tokens), reference(tokens), rtol=0, atol=1e-5)


def test_bf16_checkpoint_into_fp32_model_quantizes_in_fp32(bases, tmp_path):
    ours, _ = _loaded("llama", bases[("llama", "bf16")], tmp_path)
    hf = load_file(bases[("llama", "bf16")] / "model.safetensors")
    tune = convert_weights.hf_to_tune(hf, num_heads=4, num_kv_heads=2, dim=256)
    for key in ("layers.0.attn.q_proj.weight", "layers.1.mlp.w1.weight", "layers.0.attn.output_proj.weight"):
        param = ours.get_parameter(key)
        assert param.dtype == torch.float32 and not param.requires_grad
        expected = _nf4(tune[key].float())
        torch.testing.assert_close(param.get_original_weight(), expected, rtol=0, atol=0)
    assert ours.tok_embeddings.weight.dtype == torch.float32
    assert torch.equal(ours.tok_embeddings.weight, tune["tok_embeddings.weight"].float())


def test_sharded_checkpoint_is_found_through_its_index(tmp_path):
    with training.set_default_dtype(torch.float32), torch.device("meta"):
        meta = lora_tiny_llama(lora_attn_modules=["q_proj"])
    base = write_random_hf_checkpoint(
        tmp_path / "sharded",
        meta,
        "LLAMA3_2",
        llama3_2_hf_config(**TINY_LLAMA_ARGS),
        dtype=torch.float32,
        max_shard_size_mb=1,
    )
    files = resolve_checkpoint_files(base, None)
    assert len(files) > 2 and all(f.name.startswith("model-0000") for f in files)
    model, _ = _loaded("llama", base, tmp_path)
    assert model.layers[1].mlp.w3.weight.shape == (512, 256)


def test_missing_and_mismatched_checkpoints_fail_before_loading(bases, tmp_path):
    base = bases[("llama", "fp32")]
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        QLoRAHFCheckpointer(str(base), str(tmp_path / "o"), "LLAMA3_2", checkpoint_files=["nope.safetensors"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        QLoRAHFCheckpointer(str(tmp_path / "absent"), str(tmp_path / "o"), "LLAMA3_2")
    with pytest.raises(ValueError, match="not supported"):
        QLoRAHFCheckpointer(str(base), str(tmp_path / "o"), "GEMMA")
    with pytest.raises(ValueError, match="inside"):
        QLoRAHFCheckpointer(str(base), str(base / "out"), "LLAMA3_2")
    checkpointer = QLoRAHFCheckpointer(str(base), str(tmp_path / "o"), "LLAMA3_2")
    with pytest.raises(ValueError, match=r"shape \(512, 256\).*expects \(768, 256\)"):
        checkpointer.validate(qlora_tiny_llama(**LORA, intermediate_dim=768))
    with pytest.raises(ValueError, match="lacks 9 weight"):
        checkpointer.validate(qlora_tiny_llama(**LORA, num_layers=3))
    with pytest.raises(ValueError, match="not a weight of the configured model"):
        checkpointer.validate(qlora_tiny_llama(**LORA, num_layers=1))
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ PEFT


def test_peft_conversion_matches_torchtune_for_llama_lora():
    converter = HFConverter(
        "LLAMA3_2", num_heads=4, num_kv_heads=2, embed_dim=256, head_dim=64, tie_word_embeddings=True
    )
    g = torch.Generator().manual_seed(0)
    adapters = {
        "layers.0.attn.q_proj.lora_a.weight": torch.randn(8, 256, generator=g),
        "layers.0.attn.q_proj.lora_b.weight": torch.randn(256, 8, generator=g),
        "layers.0.attn.k_proj.lora_b.weight": torch.randn(128, 8, generator=g),
        "layers.1.mlp.w2.lora_b.weight": torch.randn(256, 8, generator=g),
    }
    expected = convert_weights.tune_to_peft_adapter_weights(adapters, num_heads=4, num_kv_heads=2, dim=256)
    ours = dict(converter.to_peft(k, v) for k, v in adapters.items())
    assert ours.keys() == expected.keys()
    for k in ours:
        assert torch.equal(ours[k], expected[k]), k


@pytest.mark.parametrize("model_type", ["LLAMA3_2", "QWEN2"])
def test_peft_tensors_follow_the_base_weights_layout(model_type):
    """HF(W) + s * B_peft @ A_peft == HF(W + s * B @ A), and DoRA magnitudes follow the same rows."""
    converter = HFConverter(
        model_type, num_heads=4, num_kv_heads=2, embed_dim=256, head_dim=64, tie_word_embeddings=True
    )
    g = torch.Generator().manual_seed(1)
    for proj, rows in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128)):
        w, a, b, m = (
            torch.randn(rows, 256, generator=g),
            torch.randn(8, 256, generator=g),
            torch.randn(rows, 8, generator=g),
            torch.rand(rows, generator=g),
        )
        key = f"layers.0.attn.{proj}"
        hf_key, hf_merged = converter.to_hf(f"{key}.weight", w + 2.0 * b @ a)
        _, hf_w = converter.to_hf(f"{key}.weight", w)
        peft_a_key, peft_a = converter.to_peft(f"{key}.lora_a.weight", a)
        peft_b_key, peft_b = converter.to_peft(f"{key}.lora_b.weight", b)
        peft_m_key, peft_m = converter.to_peft(f"{key}.magnitude", m)
        assert peft_a_key == f"base_model.model.{hf_key[:-7]}.lora_A.weight"
        assert peft_b_key == f"base_model.model.{hf_key[:-7]}.lora_B.weight"
        assert peft_m_key == f"base_model.model.{hf_key[:-7]}.lora_magnitude_vector"
        torch.testing.assert_close(hf_w + 2.0 * peft_b @ peft_a, hf_merged)
        _, hf_m = converter.to_hf(f"{key}.weight", m.unsqueeze(-1).expand(rows, 256).contiguous())
        torch.testing.assert_close(peft_m, hf_m[:, 0])
        if model_type == "QWEN2":
            assert torch.equal(peft_b, b)


# ------------------------------------------------------------------------------------------------ saving


def _trained(family, base, tmp_path):
    model, checkpointer = _loaded(family, base, tmp_path)
    for name, param in model.named_parameters():
        if "lora_b" in name:
            torch.nn.init.normal_(param, std=0.05)
    adapter_config = dict(
        target_modules=["q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3"],
        rank=8,
        alpha=16,
        dropout=0.0,
        use_dora=False,
    )
    return model, checkpointer, adapter_config


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_save_writes_peft_adapter_and_merged_model(bases, tmp_path, family):
    base = bases[(family, "fp32")]
    model, checkpointer, adapter_config = _trained(family, base, tmp_path)
    checkpointer.max_shard_bytes = 2 * 1024**2  # several shards
    state = get_full_state_dict(model, keep_nf4=True, cpu_offload=False)
    step_dir = checkpointer.save(state, step=7, adapter_config=adapter_config, save_merged=True, dtype=torch.bfloat16)
    assert step_dir == tmp_path / "out" / "step_7"
    assert sorted(p.name for p in (step_dir / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    merged_files = sorted(p.name for p in (step_dir / "merged").iterdir())
    assert not any(n.startswith("adapter") for n in merged_files)
    assert "config.json" in merged_files and "model.safetensors.index.json" in merged_files
    assert [p.name for p in tmp_path.joinpath("out").iterdir()] == ["step_7"]  # no temporary leftovers

    config = json.loads((step_dir / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"]
    )
    assert config["base_model_name_or_path"] == str(base.resolve())
    merged_config = json.loads((step_dir / "merged" / "config.json").read_text())
    assert merged_config["torch_dtype"] == merged_config["dtype"] == "bfloat16"

    index = json.loads((step_dir / "merged" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    merged = {k: v for shard in shards for k, v in load_file(step_dir / "merged" / shard).items()}
    assert merged.keys() == index["weight_map"].keys() == load_file(base / "model.safetensors").keys()
    peft = load_file(step_dir / "adapter" / "adapter_model.safetensors")
    assert all(v.dtype == torch.float32 for v in peft.values())

    # Independent reference: torchao's dequantization of the NF4 base + scale * B @ A, in HF layout.
    hf_base = load_file(base / "model.safetensors")
    for hf_key, value in merged.items():
        assert value.dtype == torch.bfloat16
        reference = hf_base[hf_key]
        if hf_key.endswith("proj.weight"):
            reference = _nf4(reference)
            if family == "llama" and hf_key.split(".")[-2] in ("q_proj", "k_proj"):
                # NF4 blocks run along torchtune's (permuted) rows: quantize in that layout, as the model does.
                tune_key, tune_w = HFConverter.for_model("LLAMA3_2", model).to_tune(hf_key, hf_base[hf_key])
                reference = HFConverter.for_model("LLAMA3_2", model).to_hf(tune_key, _nf4(tune_w))[1]
            prefix = "base_model.model." + hf_key[: -len(".weight")]
            if f"{prefix}.lora_A.weight" in peft:
                reference = reference + 2.0 * peft[f"{prefix}.lora_B.weight"] @ peft[f"{prefix}.lora_A.weight"]
        torch.testing.assert_close(value, reference.to(torch.bfloat16), rtol=0, atol=0, msg=hf_key)


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_merge_base_original_merges_onto_the_checkpoints_own_weights(bases, tmp_path, family):
    """merge_base="original": every merged tensor is the checkpoint's own (unquantized) tensor + scale * B @ A."""
    base = bases[(family, "fp32")]
    model, checkpointer, adapter_config = _trained(family, base, tmp_path)
    state = get_full_state_dict(model, keep_nf4=True, cpu_offload=False)
    nf4_dir = checkpointer.save(state, 1, adapter_config, save_merged=True, dtype=torch.float32)
    original_dir = checkpointer.save(state, 2, adapter_config, True, torch.float32, merge_base="original")
    merged = {k: v for p in (original_dir / "merged").glob("*.safetensors") for k, v in load_file(p).items()}
    merged_nf4 = {k: v for p in (nf4_dir / "merged").glob("*.safetensors") for k, v in load_file(p).items()}
    peft = load_file(original_dir / "adapter" / "adapter_model.safetensors")
    hf_base = load_file(base / "model.safetensors")
    assert merged.keys() == hf_base.keys()
    quantized = 0
    for hf_key, value in merged.items():
        reference = hf_base[hf_key]
        prefix = "base_model.model." + hf_key[: -len(".weight")]
        if f"{prefix}.lora_A.weight" in peft:
            reference = reference + 2.0 * peft[f"{prefix}.lora_B.weight"] @ peft[f"{prefix}.lora_A.weight"]
        torch.testing.assert_close(value, reference, rtol=1e-6, atol=1e-6, msg=hf_key)
        quantized += not torch.equal(value, merged_nf4[hf_key])
    # Only the NF4 weights differ between the two merges (the norms and the embedding are the checkpoint's in both).
    assert quantized == sum(k.endswith("proj.weight") for k in merged)
    with pytest.raises(ValueError, match="merge_base='fp8'"):
        checkpointer.save(state, 3, adapter_config, True, torch.float32, merge_base="fp8")


def test_merged_config_names_one_dtype_whatever_the_bases_transformers(bases, tmp_path):
    """A base written by transformers 5 has only ``dtype``; 4.x wrote only ``torch_dtype``: the merged config.json
    holds both, equal to the merged weights' dtype, never the base's."""
    base = tmp_path / "base_tf5"
    shutil.copytree(bases[("llama", "bf16")], base)
    config = json.loads((base / "config.json").read_text())
    config.pop("torch_dtype")
    (base / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    model, checkpointer, adapter_config = _trained("llama", base, tmp_path)
    state = get_full_state_dict(model, keep_nf4=True, cpu_offload=False)
    for step, dtype, name in ((1, torch.float32, "float32"), (2, torch.float16, "float16")):
        merged = checkpointer.save(state, step, adapter_config, save_merged=True, dtype=dtype) / "merged"
        written = json.loads((merged / "config.json").read_text())
        assert (written["dtype"], written["torch_dtype"]) == (name, name)
        assert {v.dtype for p in merged.glob("*.safetensors") for v in load_file(p).values()} == {dtype}


def test_atomic_directory_leaves_nothing_on_failure_and_replaces_on_success(tmp_path):
    final = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("1")
    with atomic_directory(final) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert [p.name for p in final.iterdir()] == ["b"]


def test_remove_stale_temporaries_deletes_only_killed_writes(tmp_path):
    stale_dir = tmp_path / ".step_4.tmp-0123abcd"
    (stale_dir / "adapter").mkdir(parents=True)
    (stale_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"half")
    (tmp_path / ".step_2.old-89abcdef").mkdir()
    (tmp_path / ".recipe_state.pt.tmp-00000000").write_bytes(b"half")
    kept = ["step_2", ".hidden_user_file", "notes.tmp-0123abcd", ".step_6.tmp-xyz"]
    (tmp_path / "step_2").mkdir()
    for name in kept[1:]:
        (tmp_path / name).write_text("keep")
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == [
        ".recipe_state.pt.tmp-00000000",
        ".step_2.old-89abcdef",
        ".step_4.tmp-0123abcd",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_atomic_save_replaces_the_file(tmp_path):
    atomic_save({"step": 1}, tmp_path / "state" / "s.pt")
    atomic_save({"step": 2}, tmp_path / "state" / "s.pt")
    assert torch.load(tmp_path / "state" / "s.pt") == {"step": 2}
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["s.pt"]


# ------------------------------------------------------------------------------------- issue 24: safe exports


def test_merged_model_is_written_after_and_apart_from_the_adapter(bases, tmp_path):
    """The adapter folder is committed first; a merged model that would hold non-finite values (fp16 overflow of
    base + B @ A) is refused, naming the tensor, and the adapter stays."""
    model, checkpointer, adapter_config = _trained("llama", bases[("llama", "fp32")], tmp_path)
    with torch.no_grad():
        model.layers[0].attn.q_proj.lora_a.weight.fill_(1e3)
        model.layers[0].attn.q_proj.lora_b.weight.fill_(1e3)  # 2 * 8 * 1e6 per entry: beyond fp16's 65504
    state = get_full_state_dict(model, keep_nf4=True, cpu_offload=False)
    with pytest.raises(NonFiniteError, match="The merged model's layers.0.attn.q_proj.weight holds NaN or infinite"):
        checkpointer.save(state, step=3, adapter_config=adapter_config, save_merged=True, dtype=torch.float16)
    step_dir = tmp_path / "out" / "step_3"
    assert sorted(p.name for p in step_dir.iterdir()) == ["adapter"]  # no merged model, no temporary
    peft = load_file(step_dir / "adapter" / "adapter_model.safetensors")
    assert peft["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].eq(1e3).all()

    # In fp32 the same merge is finite, and its announced size is the size of what is written.
    merged_dir = checkpointer.save_merged(state, 3, adapter_config, torch.float32)
    written = sum(t.numel() * t.element_size() for p in merged_dir.glob("*.safetensors") for t in load_file(p).values())
    assert checkpointer.merged_nbytes(state, torch.float32) == written
    assert checkpointer.merged_nbytes(state, torch.float16) == written // 2


def test_stale_temporaries_of_a_killed_merged_export_are_removed(bases, tmp_path):
    _, checkpointer = _loaded("llama", bases[("llama", "fp32")], tmp_path)
    stale = tmp_path / "out" / "step_4" / ".merged.tmp-0123abcd"
    stale.mkdir(parents=True)
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    (tmp_path / "out" / "step_4" / "adapter").mkdir()
    assert checkpointer.remove_stale_temporaries() == [stale]
    assert [p.name for p in (tmp_path / "out" / "step_4").iterdir()] == ["adapter"]

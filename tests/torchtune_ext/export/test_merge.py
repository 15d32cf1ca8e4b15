"""``tune-ext merge`` (torchtune_ext.export.merge_adapter): the recipe's merged folder, file for file, from the base
and the adapter alone; loadable by transformers with its tokenizer; a PEFT-written adapter merges as PEFT's
``merge_and_unload``; ``merged_dtype``; bad adapters fail before anything is written."""

from pathlib import Path

import pytest
import torch
from conftest import TINY_ADAPTER_CONFIG, tiny_trained_state
from safetensors.torch import load_file

from torchtune_ext.checkpoint import llama3_2_hf_config, qwen2_hf_config, write_random_hf_checkpoint
from torchtune_ext.cli import main
from torchtune_ext.data import write_tiny_checkpoint
from torchtune_ext.export import merge_adapter
from torchtune_ext.models import TINY_LLAMA_ARGS, TINY_QWEN_ARGS, lora_tiny_llama, lora_tiny_qwen

transformers = pytest.importorskip("transformers")


def _recipe_outputs(tmp: Path, family: str):
    """What the recipe's checkpointer writes for a trained-looking model: adapter + merged (nf4 and original)."""
    base = write_tiny_checkpoint(tmp / "base", family=family, dtype="fp32", seed=3)
    _, checkpointer, state = tiny_trained_state(base, tmp / "out", family, max_shard_size_mb=1)
    nf4 = checkpointer.save(state, 1, TINY_ADAPTER_CONFIG, save_merged=True, dtype=torch.float32)
    original = checkpointer.save(state, 2, TINY_ADAPTER_CONFIG, True, torch.float32, merge_base="original")
    return base, nf4, original


def _files(folder: Path):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module", params=["llama", "qwen"])
def outputs(request, tmp_path_factory):
    return _recipe_outputs(tmp_path_factory.mktemp(f"merge_{request.param}"), request.param)


@pytest.mark.parametrize("merge_base", ["nf4", "original"])
def test_merge_equals_the_recipe_s_merged_output(outputs, tmp_path, merge_base):
    base, nf4, original = outputs
    step = nf4 if merge_base == "nf4" else original
    merged = merge_adapter(
        base, step / "adapter", tmp_path / "merged", merge_base=merge_base, compute_dtype="fp32", max_shard_size_mb=1
    )
    assert len(list(merged.glob("*.safetensors"))) > 1  # several shards, as the recipe's
    assert _files(merged) == _files(step / "merged")  # byte for byte: weights, index, config, tokenizer files


def test_merged_folder_loads_in_transformers_with_its_tokenizer(outputs, tmp_path):
    base, nf4, _ = outputs
    merged = merge_adapter(base, nf4 / "adapter", tmp_path / "merged")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(merged))
    from torchtune_ext.data import tiny_tokenizer

    text = "Reverse: hello"
    if "qwen2" not in (base / "config.json").read_text():
        # transformers 5 forces its Qwen2 tokenizer class on model_type qwen2, whatever the files say
        assert tokenizer(text)["input_ids"] == tiny_tokenizer().encode(text, add_bos=True, add_eos=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(merged))
    assert model.dtype == torch.float32  # the base's dtype
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = pipe(text, max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert out.startswith(text)


def test_merged_dtype_defaults_to_the_base_s_and_can_be_set(tmp_path):
    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="bf16", seed=1)
    _, nf4, _ = _recipe_outputs(tmp_path / "run", "llama")
    default = merge_adapter(base, nf4 / "adapter", tmp_path / "default")
    fp16 = merge_adapter(base, nf4 / "adapter", tmp_path / "fp16", merged_dtype="fp16")
    for folder, dtype, name in ((default, torch.bfloat16, "bfloat16"), (fp16, torch.float16, "float16")):
        tensors = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
        assert {v.dtype for v in tensors.values()} == {dtype}
        assert transformers.AutoConfig.from_pretrained(str(folder)).to_dict()["dtype"] == name


def test_peft_written_adapter_merges_as_peft_merge_and_unload(tmp_path):
    peft = pytest.importorskip("peft")
    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    expected = peft_model.merge_and_unload().state_dict()
    main(
        [
            "merge",
            "--base",
            str(tmp_path / "base"),
            "--adapter",
            str(tmp_path / "adapter"),
            "--output",
            str(tmp_path / "merged"),
            "--merge-base",
            "original",
            "--merged-dtype",
            "fp32",
        ]
    )
    merged = {k: v for f in (tmp_path / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(merged) == set(expected)
    for key, value in merged.items():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=0, msg=key)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[key], load_file(tmp_path / "base" / "model.safetensors")[key])


def test_adapter_of_another_base_fails_before_writing(outputs, tmp_path):
    """A one-layer base of the same family: the adapter's second layer names the mismatch; nothing is written."""
    base, nf4, _ = outputs
    family = "qwen" if "qwen2" in (base / "config.json").read_text() else "llama"
    builder, args, hf_config, model_type = {
        "llama": (lora_tiny_llama, TINY_LLAMA_ARGS, llama3_2_hf_config, "LLAMA3_2"),
        "qwen": (lora_tiny_qwen, TINY_QWEN_ARGS, qwen2_hf_config, "QWEN2"),
    }[family]
    with torch.device("meta"):
        meta = builder(lora_attn_modules=["q_proj"], num_layers=1)
    config = hf_config(**{**args, "num_layers": 1}, dtype=torch.float32)
    other = write_random_hf_checkpoint(tmp_path / "other", meta, model_type, config, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"does not fit the model.*has layers.1.attn.q_proj.lora_a.weight"):
        merge_adapter(other, nf4 / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_merge_streams_each_base_tensor_once(outputs, tmp_path, monkeypatch):
    """One tensor read at a time, each once: host memory stays near one tensor (plus the adapter)."""
    from torchtune_ext.checkpoint import _safetensors

    base, nf4, _ = outputs
    reads = []
    read_tensor = _safetensors.read_tensor
    monkeypatch.setattr(_safetensors, "read_tensor", lambda path, name: reads.append(name) or read_tensor(path, name))
    iterated = []
    iter_tensors = _safetensors.iter_tensors
    monkeypatch.setattr(_safetensors, "iter_tensors", lambda path: iterated.append(path) or iter_tensors(path))
    merged = merge_adapter(base, nf4 / "adapter", tmp_path / "merged")
    base_names = set(_safetensors.read_header(base / "model.safetensors"))
    assert sorted(reads) == sorted(base_names)
    assert iterated == [nf4 / "adapter" / "adapter_model.safetensors"]  # the base is never read whole
    assert (merged / "config.json").is_file()


def _tree(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    "flag, value, line",
    [
        ("--base", "{tmp}/nowhere", "--base='{tmp}/nowhere' is not a folder; --base must be an HF-format model folder"),
        ("--adapter", "{nf4}", "--adapter='{nf4}' is a checkpoint folder, not its adapter; set "
         "--adapter='{nf4}/adapter'"),
        ("--adapter", "{tmp}/nowhere", "--adapter='{tmp}/nowhere' is not a folder; set --adapter to an adapter folder"),
        ("--output", "{base}", "--output='{base}' is inside --base='{base}'; give a folder outside the base model's."),
        ("--output", "{base}/config.json", "--output='{base}/config.json' is a file; the merged model is a folder"),
        ("--output", "{nf4}", "--output='{nf4}' holds files that are not a merged model, and a merge replaces the "
         "folder; give a new folder"),
    ],
    ids=["missing_base", "adapter_s_step_folder", "missing_adapter", "output_is_the_base", "output_is_a_file",
         "output_holds_a_run"],
)  # fmt: skip
def test_bad_flags_print_one_line_naming_the_flag_and_exit_2(outputs, tmp_path, capsys, flag, value, line):
    """Before: a traceback (exit code 1), or a line that named the recipe's config key (output_dir,
    checkpointer.checkpoint_dir) instead of the flag; a run's folder as --output was replaced by the merge."""
    base, nf4, _ = outputs
    names = {"tmp": tmp_path, "base": base, "nf4": nf4}
    flags = {"--base": str(base), "--adapter": str(nf4 / "adapter"), "--output": str(tmp_path / "merged")}
    flags[flag] = value.format(**names)
    before = {folder: _tree(folder) for folder in (base, nf4, tmp_path)}
    with pytest.raises(SystemExit) as exit_:
        main(["merge", *[item for pair in flags.items() for item in pair]])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tune-ext: error: {line.format(**names)}"), err
    assert {folder: _tree(folder) for folder in before} == before  # nothing written

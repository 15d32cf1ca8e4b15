"""GGUF export: the file read back with the ``gguf`` package (names, shapes, types, values, tokenizer metadata), and
loaded by llama.cpp itself (``llama-cpp-python``), whose greedy tokens must equal transformers' on the merged folder;
the types made by llama.cpp's quantizer (k-quants, q4_0, q5_0) checked the same way, and refused without it."""

import json
import os
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from torchtune_ext.data._tiny import TINY_TOKENIZER_PATH, tiny_instruct_samples
from torchtune_ext.data._tiny_checkpoint import write_tiny_checkpoint
from torchtune_ext.export import export_gguf

try:
    import llama_cpp
except ImportError:
    # .ci/run installs llama-cpp-python and sets this: there the llama.cpp checks must run, never skip.
    if os.environ.get("TORCHTUNE_EXT_REQUIRE_LLAMA_CPP") == "1":
        raise
    llama_cpp = None

# the pre-tokenizer regexes of Qwen 2's and Llama 3's tokenizer.json (they differ in the digits: 1 vs 1-3)
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
PROMPT = "Reverse: hello"
TEXT = "Count the letters: abc\n\n  It's 20245 + 7!? Sort: zyx"  # for the BPE tokenizers
# the tiny SentencePiece model has no byte fallback: llama.cpp aborts on a character outside its vocabulary
SPM_TEXT = "Sort the letters: zyx Repeat twice: ab ab Uppercase: q"
NEW_TOKENS = 16


def _bpe_tokenizer(folder: Path, split: str = _QWEN_SPLIT) -> None:
    """A byte-level BPE tokenizer.json with Qwen 2's (or Llama 3's) pre-tokenizer, trained on the tiny data set
    plus some digits (~300 tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [s[k] for s in tiny_instruct_samples("train", 512) for k in ("input", "output")] + ["2024 123 99"] * 50
    tokenizer.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(str(folder))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf")
    llama = write_tiny_checkpoint(root / "llama", "llama")
    shutil.copy(TINY_TOKENIZER_PATH, llama / "tokenizer.model")
    qwen = write_tiny_checkpoint(root / "qwen", "qwen")
    _bpe_tokenizer(qwen)
    (qwen / "tokenizer.model").unlink(missing_ok=True)  # a BPE-only folder (the tiny base ships SentencePiece too)
    llama_bpe = write_tiny_checkpoint(root / "llama_bpe", "llama", seed=1)
    _bpe_tokenizer(llama_bpe, _LLAMA3_SPLIT)
    (llama_bpe / "tokenizer.model").unlink(missing_ok=True)
    wide = write_tiny_checkpoint(root / "llama_wide", "llama", std=0.1, embedding_std=0.3)
    shutil.copy(TINY_TOKENIZER_PATH, wide / "tokenizer.model")
    untied = write_tiny_checkpoint(root / "llama_untied", "llama", seed=2, tie_word_embeddings=False)
    shutil.copy(TINY_TOKENIZER_PATH, untied / "tokenizer.model")
    return {"llama": llama, "qwen": qwen, "llama_wide": wide, "llama_bpe": llama_bpe, "llama_untied": untied}


def _hf_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _values(tensor) -> np.ndarray:
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _field(reader, key):
    return reader.fields[key].contents()


def _hf_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, written out with view/transpose
    rows, cols = w.shape
    return w.view(n_head, 2, rows // n_head // 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("type_", ["f16", "q8_0"])
def test_llama_gguf_tensors_and_sentencepiece_vocab(models, tmp_path, type_):
    out = export_gguf(models["llama"], tmp_path / "m.gguf", type_)
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    hf = _hf_tensors(models["llama"])
    matrix = gguf.GGMLQuantizationType.F16 if type_ == "f16" else gguf.GGMLQuantizationType.Q8_0
    # 2 blocks x (2 norms + 7 matrices) + token_embd + output_norm + rope_freqs; tied: no output.weight
    assert len(tensors) == 21 and "output.weight" not in tensors
    assert tensors["blk.1.attn_k.weight"].tensor_type == matrix
    assert tensors["blk.1.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert [int(d) for d in tensors["blk.0.attn_k.weight"].shape] == [256, 128]  # GGUF lists ne0 first
    tol = 1e-3 if type_ == "f16" else 2e-3  # q8_0: |error| <= max|block| / 254 (weights ~ N(0, 0.02))
    q = _hf_permute(hf["model.layers.0.self_attn.q_proj.weight"], 4).numpy()
    k = _hf_permute(hf["model.layers.1.self_attn.k_proj.weight"], 2).numpy()
    np.testing.assert_allclose(_values(tensors["blk.0.attn_q.weight"]), q, atol=tol, rtol=0)
    np.testing.assert_allclose(_values(tensors["blk.1.attn_k.weight"]), k, atol=tol, rtol=0)
    np.testing.assert_allclose(
        _values(tensors["token_embd.weight"]), hf["model.embed_tokens.weight"].numpy(), atol=3 * tol, rtol=0
    )
    # llama3 RoPE scaling (factor 32, low 1, high 4, 8192): the highest frequencies unscaled, the lowest / 32
    rope = _values(tensors["rope_freqs.weight"])
    assert rope.shape == (32,) and rope[0] == 1.0 and rope[-1] == 32.0
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "general.file_type") == (1 if type_ == "f16" else 7)
    assert _field(reader, "llama.rope.freq_base") == 500_000.0
    assert _field(reader, "llama.attention.head_count_kv") == 2
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(TINY_TOKENIZER_PATH))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert len(tokens) == 512 and tokens[: sp.vocab_size()] == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    assert tokens[96] == "[PAD96]" and _field(reader, "tokenizer.ggml.token_type")[96] == gguf.TokenType.UNUSED
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 1 and _field(reader, "tokenizer.ggml.eos_token_id") == 2


def test_qwen_gguf_biases_and_bpe_vocab(models, tmp_path):
    out = export_gguf(models["qwen"], tmp_path / "m.gguf", "q8_0")
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    hf = _hf_tensors(models["qwen"])
    assert len(tensors) == 2 * 12 + 2 and "rope_freqs.weight" not in tensors  # + q/k/v biases, no llama3 RoPE
    bias = tensors["blk.0.attn_q.bias"]
    assert bias.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(_values(bias), hf["model.layers.0.self_attn.q_proj.bias"].numpy())
    # Qwen 2 keeps HF's row order (llama.cpp uses NeoX RoPE for it)
    np.testing.assert_allclose(
        _values(tensors["blk.0.attn_q.weight"]), hf["model.layers.0.self_attn.q_proj.weight"].numpy(), atol=2e-3
    )
    vocab = json.loads((models["qwen"] / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert _field(reader, "general.architecture") == "qwen2"
    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert len(tokens) == 512 and all(tokens[i] == piece for piece, i in vocab.items())
    eos = vocab["<|endoftext|>"]
    assert _field(reader, "tokenizer.ggml.token_type")[eos] == gguf.TokenType.CONTROL
    assert _field(reader, "tokenizer.ggml.eos_token_id") == eos
    assert len(_field(reader, "tokenizer.ggml.merges")) == len(
        json.loads((models["qwen"] / "tokenizer.json").read_text())["model"]["merges"]
    )


def test_untied_bf16_llama_and_chat_template(tmp_path):
    """A separate lm_head becomes output.weight; bf16 weights are exact in f16 (up to f16's subnormal spacing,
    2**-24, below 6.1e-5); the chat template and
    add_bos_token of tokenizer_config.json are carried."""
    folder = write_tiny_checkpoint(tmp_path / "untied", "llama", dtype="bf16", tie_word_embeddings=False)
    shutil.copy(TINY_TOKENIZER_PATH, folder / "tokenizer.model")
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "add_bos_token": True}))
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", "f16"))
    tensors = {t.name: t for t in reader.tensors}
    hf = _hf_tensors(folder)
    assert len(tensors) == 22
    subnormal = 2.0**-25  # half of f16's subnormal spacing: the rounding bound
    for name, key in (
        ("output.weight", "lm_head.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
    ):
        np.testing.assert_allclose(_values(tensors[name]), hf[key].float().numpy(), rtol=0, atol=subnormal)
    assert _field(reader, "tokenizer.chat_template") == template
    assert _field(reader, "tokenizer.ggml.add_bos_token") is True


def test_bad_input_fails_before_writing(models, tmp_path):
    out = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="--type 'q4_k' is not supported"):
        export_gguf(models["llama"], out, "q4_k")
    no_tokenizer = tmp_path / "no_tok"
    shutil.copytree(models["llama"], no_tokenizer, ignore=shutil.ignore_patterns("tokenizer.*"))
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        export_gguf(no_tokenizer, out)
    other = tmp_path / "other"
    shutil.copytree(models["llama"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        export_gguf(other, out)
    assert list(tmp_path.glob("*.gguf*")) == [] and list(tmp_path.glob(".m.gguf*")) == []
    export_gguf(no_tokenizer, out, tokenizer_dir=TINY_TOKENIZER_PATH)  # --tokenizer <a .model file of any name>
    assert out.is_file()


@pytest.mark.parametrize(
    "output, line",
    [
        ("{tmp}", "--output='{tmp}' is a folder; give the .gguf file's path, e.g. --output='{tmp}/model.gguf'."),
        ("{tmp}/no/m.gguf", "--output='{tmp}/no/m.gguf': its folder {tmp}/no does not exist; create it first"),
    ],
    ids=["an_existing_folder", "a_missing_folder"],
)
def test_a_bad_output_fails_before_converting(models, tmp_path, capsys, monkeypatch, output, line):
    """Before: an existing folder failed with IsADirectoryError after the whole conversion."""
    import torchtune_ext.export._gguf as gguf_module
    from torchtune_ext.cli import main

    converted = []
    monkeypatch.setattr(gguf_module, "_write", lambda *args: converted.append(args))
    output, line = output.format(tmp=tmp_path), line.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["export", "gguf", "--model", str(models["llama"]), "--output", output])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tune-ext: error: {line}"), lines
    assert not converted and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("type_", ["q4_k_m", "q6_k", "q4_0"])
def test_llama_cpp_types_without_llama_cpp_fail_before_writing(models, tmp_path, monkeypatch, type_):
    """The types llama.cpp's quantizer makes name the fix when ``llama_cpp`` is not importable, and leave no file."""
    from torchtune_ext.cli import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    out = tmp_path / "out" / "m.gguf"
    fix = rf"--type {type_} is made by llama.cpp's quantizer.*pip install llama-cpp-python.*make llama-cpp"
    with pytest.raises(ImportError, match=fix):
        export_gguf(models["llama"], out, type_)
    with pytest.raises(SystemExit, match=fix):
        main(["export", "gguf", "--model", str(models["llama"]), "--output", str(out), "--type", type_])
    assert list(tmp_path.iterdir()) == []  # not even the output folder


def _hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.no_grad()
def _hf_greedy(model, ids: list) -> list:
    ids = list(ids)
    for _ in range(NEW_TOKENS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-NEW_TOKENS:]


def _llama_cpp(path: Path):
    return llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)


def _llama_cpp_greedy(llm, ids: list) -> list:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(NEW_TOKENS):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def _llama_cpp_logits(llm, ids: list) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def _prompt_ids(folder: Path) -> list:
    if (folder / "tokenizer.model").is_file():
        import sentencepiece as spm

        return [1] + spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).encode(PROMPT)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).encode(PROMPT)


def _text_ids(folder: Path, text: str) -> list:
    if (folder / "tokenizer.model").is_file():
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).encode(text)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).encode(text, add_special_tokens=False)


# max |logit difference| llama.cpp vs transformers fp32, teacher-forced over 28 positions, in units of the logits'
# std (~1 for the tiny models, ~5 for "llama_wide"); measured: f16 <= 0.008, q8_0 <= 0.23
_LOGIT_TOL = {"f16": 0.01, "q8_0": 0.3}


@pytest.mark.skipif(llama_cpp is None, reason="llama.cpp check needs llama-cpp-python (pip install llama-cpp-python)")
@pytest.mark.parametrize("family", ["llama", "qwen", "llama_wide", "llama_bpe", "llama_untied"])
def test_llama_cpp_greedy_tokens_equal_transformers(models, tmp_path, family):
    """llama.cpp loads the file; its tokenizer, its greedy tokens (16, f16) and, teacher-forced, its logits match
    transformers on the merged folder. The tied tiny models' greedy output repeats one token; "llama_wide" (weights
    ~ N(0, 0.1)) and "llama_untied" have varied greedy sequences. q8_0 (measured): greedy equal for 16/16 tokens on
    the tiny Llama, Llama-BPE and Qwen, 11/16 untied, 6/16 wide (near-ties flip), teacher-forced argmax 25-28 of 28."""
    folder = models[family]
    ids = _prompt_ids(folder)
    seq = ids + [int(i) for i in np.random.default_rng(0).integers(3, 96, 28 - len(ids))]
    hf = _hf_model(folder)
    expected = _hf_greedy(hf, ids)
    with torch.no_grad():
        reference = hf(torch.tensor([seq])).logits[0].numpy()
    assert len(set(reference.argmax(-1).tolist())) >= 10
    if family in ("llama_wide", "llama_untied"):
        assert len(set(expected)) >= 5  # not one repeated token
    for type_ in ("f16", "q8_0"):
        llm = _llama_cpp(export_gguf(folder, tmp_path / f"{type_}.gguf", type_))
        if type_ == "f16":
            vocab = llama_cpp.Llama(str(tmp_path / "f16.gguf"), vocab_only=True, verbose=False)
            spm = (folder / "tokenizer.model").is_file()
            assert vocab.tokenize(PROMPT.encode(), add_bos=spm, special=False) == ids
            text = SPM_TEXT if spm else TEXT
            assert vocab.tokenize(text.encode(), add_bos=False, special=False) == _text_ids(folder, text)
        logits = _llama_cpp_logits(llm, seq)
        assert np.abs(logits - reference).max() < _LOGIT_TOL[type_] * reference.std()
        greedy = _llama_cpp_greedy(llm, ids)
        if type_ == "f16":
            np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))
            assert greedy == expected
        else:
            assert (logits.argmax(-1) == reference.argmax(-1)).mean() >= 0.85
            assert greedy[:6] == expected[:6]


# --type -> (llama.cpp's file type id, GGML type of blk.0.attn_q.weight, max |error| of its values / weights' std;
# measured 0.40, 0.19, 0.22, 0.12, 0.072)
_QUANTIZER_TYPES = {
    "q4_0": (2, "Q4_0", 0.5),
    "q5_0": (8, "Q5_0", 0.25),
    "q4_k_m": (15, "Q4_K", 0.3),
    "q5_k_m": (17, "Q5_K", 0.16),
    "q6_k": (18, "Q6_K", 0.1),
}


@pytest.mark.skipif(llama_cpp is None, reason="llama.cpp's quantizer needs llama-cpp-python (make llama-cpp)")
def test_llama_cpp_quantizer_types(models, tmp_path):
    """q4_0 ... q6_k: llama.cpp's quantizer writes the file (read back with ``gguf``'s own dequantizer): the file type,
    the matrices' GGML types (llama.cpp's per-tensor rules: the tied embedding, llama.cpp's output projection, in
    Q6_K; Q4_K_M / Q5_K_M: the last block's attn_v and ffn_down too), values near the merged weights, norms kept F32,
    smaller than f16, and no temporary file left. The tiny model's rows (256, 512) fill whole 256-value k-quant
    blocks: no fallback type."""
    hf = _hf_tensors(models["llama"])
    q = _hf_permute(hf["model.layers.0.self_attn.q_proj.weight"], 4).numpy()
    f16_size = export_gguf(models["llama"], tmp_path / "f16.gguf", "f16").stat().st_size
    for type_, (file_type, matrix, tol) in _QUANTIZER_TYPES.items():
        out = export_gguf(models["llama"], tmp_path / f"{type_}.gguf", type_)
        reader = gguf.GGUFReader(out)
        tensors = {t.name: t for t in reader.tensors}
        assert _field(reader, "general.file_type") == file_type and len(tensors) == 21
        assert tensors["blk.0.attn_q.weight"].tensor_type == getattr(gguf.GGMLQuantizationType, matrix)
        assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert np.abs(_values(tensors["blk.0.attn_q.weight"]) - q).max() < tol * q.std()
        assert out.stat().st_size < f16_size
        six = {name for name, t in tensors.items() if t.tensor_type == gguf.GGMLQuantizationType.Q6_K}
        if type_ == "q6_k":
            assert len(six) == 15
        else:
            blk1 = {"blk.1.attn_v.weight", "blk.1.ffn_down.weight"} if type_.endswith("_k_m") else set()
            assert six == {"token_embd.weight", *blk1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["f16.gguf", *(f"{t}.gguf" for t in _QUANTIZER_TYPES)])


def _hf_model_with_gguf_weights(folder: Path, path: Path):
    """transformers' model of ``folder`` holding the weights of the GGUF file as ``gguf`` dequantizes them (Llama
    q/k rows permuted back to HF's order): what llama.cpp should compute on a quantized file."""
    reader = gguf.GGUFReader(path)
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[_field(reader, "general.architecture")]
    model = _hf_model(folder)
    config = model.config
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    with torch.no_grad():
        for key, param in model.state_dict().items():
            name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
            if name not in tensors:  # the tied lm_head
                continue
            w = torch.from_numpy(_values(tensors[name]).copy())
            heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(key.split(".")[-2])
            if arch == gguf.MODEL_ARCH.LLAMA and heads and key.endswith(".weight"):
                rows, cols = w.shape  # the inverse of _hf_permute
                w = w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
            param.copy_(w.reshape(param.shape))
    return model


# greedy tokens asserted equal to transformers' on the dequantized weights; "llama_wide"'s first token is near-tied
# (measured: its greedy path departs at once for q5_k_m, from llama.cpp's 8-bit activations alone)
_QUANTIZED_GREEDY = {"llama": 16, "qwen": 16, "llama_untied": 8, "llama_wide": 0}


@pytest.mark.skipif(llama_cpp is None, reason="llama.cpp's quantizer needs llama-cpp-python (make llama-cpp)")
@pytest.mark.parametrize("family", ["llama", "qwen", "llama_wide", "llama_untied"])
def test_llama_cpp_runs_quantized_files(models, tmp_path, family):
    """llama.cpp loads the files its quantizer wrote (q4_0 ... q6_k) and computes the model they hold: greedy tokens
    and teacher-forced logits match transformers on the file's dequantized weights (llama.cpp also rounds the
    activations to 8 bits in its quantized dot products). On the tied tiny Llama and Qwen the greedy tokens equal
    transformers' on the unquantized merged folder too (16/16 for every type, measured); on "llama_wide" and
    "llama_untied" 4-6 bit weights move near-tied logits and the greedy path departs after 0-3 tokens."""
    folder = models[family]
    ids = _prompt_ids(folder)
    seq = ids + [int(i) for i in np.random.default_rng(0).integers(3, 96, 28 - len(ids))]
    unquantized = _hf_greedy(_hf_model(folder), ids)
    for type_ in _QUANTIZER_TYPES:
        path = export_gguf(folder, tmp_path / f"{type_}.gguf", type_)
        hf = _hf_model_with_gguf_weights(folder, path)
        expected = _hf_greedy(hf, ids)
        with torch.no_grad():
            reference = hf(torch.tensor([seq])).logits[0].numpy()
        llm = _llama_cpp(path)
        logits = _llama_cpp_logits(llm, seq)
        greedy = _llama_cpp_greedy(llm, ids)
        assert np.abs(logits - reference).max() < 0.3 * reference.std()
        assert (logits.argmax(-1) == reference.argmax(-1)).mean() >= 0.9
        n = _QUANTIZED_GREEDY[family]
        assert greedy[:n] == expected[:n]
        if family in ("llama", "qwen"):
            assert greedy == unquantized


def test_cli_export_gguf(models, tmp_path, capsys):
    from torchtune_ext.cli import main

    out = tmp_path / "cli.gguf"
    main(["export", "gguf", "--model", str(models["qwen"]), "--output", str(out), "--type", "q8_0"])
    assert "Wrote" in capsys.readouterr().out
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 7
    bad = tmp_path / "bad"
    shutil.copytree(models["qwen"], bad)
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SystemExit) as exit_:
        main(["export", "gguf", "--model", str(bad), "--output", str(tmp_path / "bad.gguf")])
    assert exit_.value.code == 2 and "architectures='GPT2LMHeadModel' cannot be exported" in capsys.readouterr().err


def test_config_layouts_of_transformers_4_and_5_give_the_same_file(models, tmp_path):
    """transformers 5 writes RoPE as ``rope_parameters`` (theta inside), 4.x as ``rope_theta`` + ``rope_scaling``:
    both give the file's freq_base and llama3 factors. Before: a 5.x config was written with freq_base 10,000."""
    config = json.loads((models["llama"] / "config.json").read_text())
    scaling = config.pop("rope_scaling")
    rope_parameters = {"rope_theta": 123_456.0, **scaling}
    files = {}
    for layout, fields in (
        ("4", {"rope_theta": 123_456.0, "rope_scaling": {**scaling, "type": scaling.pop("rope_type")}}),
        ("5", {"rope_parameters": rope_parameters}),
    ):
        folder = tmp_path / layout / "merged"
        shutil.copytree(models["llama"], folder)
        other = {k: v for k, v in config.items() if k != "rope_theta"}
        (folder / "config.json").write_text(json.dumps({**other, **fields}))
        files[layout] = gguf.GGUFReader(export_gguf(folder, tmp_path / f"{layout}.gguf"))
    for reader in files.values():
        assert _field(reader, "llama.rope.freq_base") == 123_456.0
        tensors = {t.name: t for t in reader.tensors}
        assert _values(tensors["rope_freqs.weight"])[-1] == 32.0
    fields = [{k: _field(r, k) for k in r.fields} for r in files.values()]
    assert fields[0] == fields[1]


@pytest.mark.parametrize(
    "change, line",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type='dynamic'"),
        ({"architectures": ["MistralForCausalLM"]}, "architectures='MistralForCausalLM'"),
    ],
    ids=["rope_type", "architecture"],
)
def test_unsupported_config_fails_before_writing(models, tmp_path, change, line):
    folder = tmp_path / "m"
    shutil.copytree(models["qwen"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=line):
        export_gguf(folder, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_a_pre_tokenizer_llama_cpp_lacks_is_refused(models, tmp_path):
    """GPT-2's byte-level regex alone is no pre-tokenizer llama.cpp runs for these families: refused, naming
    --tokenizer, before writing (before: written as the family's, so llama.cpp split text otherwise)."""
    folder = tmp_path / "m"
    shutil.copytree(models["qwen"], folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="--tokenizer .*the pre-tokenizer of its tokenizer.json is none llama.cpp"):
        export_gguf(folder, tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf*"))

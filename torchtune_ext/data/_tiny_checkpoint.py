"""The tiny default's base model: a random-init HF-format checkpoint generated on first use (no download)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Union

import torch
from torchtune.training import set_default_dtype

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.checkpoint import llama3_2_hf_config, qwen2_hf_config, write_random_hf_checkpoint
from torchtune_ext.data._tiny import TINY_TOKENIZER_PATH
from torchtune_ext.models import TINY_LLAMA_ARGS, TINY_QWEN_ARGS, lora_tiny_llama, lora_tiny_qwen

_FAMILIES = {
    "llama": (lora_tiny_llama, TINY_LLAMA_ARGS, llama3_2_hf_config, "LLAMA3_2"),
    "qwen": (lora_tiny_qwen, TINY_QWEN_ARGS, qwen2_hf_config, "QWEN2"),
}


def write_tiny_checkpoint(
    checkpoint_dir: Union[str, Path],
    family: str = "llama",
    dtype: str = "fp32",
    seed: int = 0,
    std: float = 0.02,
    embedding_std: float = 0.06,
    tie_word_embeddings: bool = True,
    overwrite: bool = False,
) -> Path:
    """Writes the tiny model's random-init HF checkpoint (``config.json`` + ``model.safetensors``) if missing.

    The tiny default's config calls this before loading, so the real streaming load path runs on a fresh clone.

    Args:
        checkpoint_dir (Union[str, Path]): the folder.
        family (str): "llama" (``qlora_tiny_llama``, LLAMA3_2 layout) or "qwen" (``qlora_tiny_qwen``, QWEN2).
        dtype (str): weights' dtype: fp32, bf16 or fp16.
        seed (int): RNG seed of the weights.
        std (float): init standard deviation.
        embedding_std (float): standard deviation of the (tied) token embedding; a larger one than ``std`` lets
            the frozen output projection reach confident predictions, so that the adapters can learn fast.
        tie_word_embeddings (bool): False writes a separate ``lm_head.weight`` (train with
            ``model.tie_word_embeddings=False``), as Llama 3.1 8B and Qwen 2.5 7B have.
        overwrite (bool): rewrite even if the folder holds a checkpoint.

    Returns:
        Path: ``checkpoint_dir``.

    Raises:
        ValueError: on an unknown family.
    """
    if family not in _FAMILIES:
        raise ValueError(f"Unknown tiny model family {family!r}; use one of {sorted(_FAMILIES)}.")
    checkpoint_dir = Path(checkpoint_dir)
    files = [checkpoint_dir / "config.json", checkpoint_dir / "model.safetensors"]
    if not overwrite and all(f.is_file() for f in files):
        write_tiny_tokenizer_files(checkpoint_dir)  # folders written before the tokenizer files were
        return checkpoint_dir
    builder, args, hf_config, model_type = _FAMILIES[family]
    torch_dtype = parse_dtype(dtype)
    with set_default_dtype(torch_dtype), torch.device("meta"):
        model = builder(lora_attn_modules=["q_proj"], tie_word_embeddings=tie_word_embeddings)
    config = hf_config(**{**args, "tie_word_embeddings": tie_word_embeddings}, dtype=torch_dtype)
    write_random_hf_checkpoint(
        checkpoint_dir, model, model_type, config, dtype=torch_dtype, seed=seed, std=std, embedding_std=embedding_std
    )
    return write_tiny_tokenizer_files(checkpoint_dir)


#: what ``AutoTokenizer`` reads next to the tiny SentencePiece model (the ids torchtune's ``llama2_tokenizer`` gives).
_TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "legacy": False,
    "model_max_length": TINY_LLAMA_ARGS["max_seq_len"],
}


def write_tiny_tokenizer_files(folder: Union[str, Path]) -> Path:
    """Writes the tiny tokenizer in HF layout (``tokenizer.model``, ``tokenizer_config.json``) and a
    ``generation_config.json`` into a model folder, where missing, so that ``AutoTokenizer`` and
    ``pipeline("text-generation")`` work on it and on the merged models exported from it.

    Args:
        folder (Union[str, Path]): the model folder.

    Returns:
        Path: ``folder``.
    """
    folder = Path(folder)
    files = {
        "tokenizer_config.json": _TOKENIZER_CONFIG,
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False},
    }
    for name, content in files.items():
        if not (folder / name).is_file():
            (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    if not (folder / "tokenizer.model").is_file():
        shutil.copyfile(TINY_TOKENIZER_PATH, folder / "tokenizer.model")
    return folder

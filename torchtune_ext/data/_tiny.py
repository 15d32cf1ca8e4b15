"""The embedded tiny default: a deterministic instruction data set and its SentencePiece tokenizer.

The data set is made of short, learnable string transformations (reverse, uppercase, repeat, count, sort) over
random lowercase words, generated from a seed, so a fresh clone needs no download. The tokenizer is a small BPE
SentencePiece model trained on the train split; it ships as ``torchtune_ext/assets/tiny_tokenizer.model`` and
:func:`train_tiny_tokenizer` regenerates it bit for bit. It loads with torchtune's ``llama2_tokenizer``.
"""

from __future__ import annotations

import io
import random
import string
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from torch.utils.data import Dataset
from torchtune.data import InputOutputToMessages
from torchtune.datasets._sft import SFTTransform
from torchtune.models.llama2 import Llama2Tokenizer, llama2_tokenizer
from torchtune.modules.transforms import Transform

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TINY_TOKENIZER_PATH = ASSETS_DIR / "tiny_tokenizer.model"
TINY_TOKENIZER_VOCAB_SIZE = 96

#: split name -> (seed, number of samples)
TINY_SPLITS: Dict[str, tuple] = {"train": (0, 4096), "validation": (1, 256)}

_TASKS = ("reverse", "uppercase", "repeat", "count", "sort")


def _sample(rng: random.Random) -> Dict[str, str]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6)))
    task = rng.choice(_TASKS)
    if task == "reverse":
        return {"input": f"Reverse: {word}", "output": word[::-1]}
    if task == "uppercase":
        return {"input": f"Uppercase: {word}", "output": word.upper()}
    if task == "repeat":
        return {"input": f"Repeat twice: {word}", "output": f"{word} {word}"}
    if task == "count":
        return {"input": f"Count the letters: {word}", "output": str(len(word))}
    return {"input": f"Sort the letters: {word}", "output": "".join(sorted(word))}


def tiny_instruct_samples(split: str = "train", num_samples: Optional[int] = None) -> List[Dict[str, str]]:
    """Generates the tiny instruction data set deterministically.

    Args:
        split (str): "train" or "validation" (different seeds).
        num_samples (Optional[int]): how many samples; None: the split's default (4096 train, 256 validation).

    Returns:
        List[Dict[str, str]]: samples with "input" (the instruction) and "output" (the answer).

    Raises:
        ValueError: on an unknown split.
    """
    if split not in TINY_SPLITS:
        raise ValueError(f"Unknown split {split!r} for the tiny data set; use one of {sorted(TINY_SPLITS)}.")
    seed, default_size = TINY_SPLITS[split]
    rng = random.Random(seed)
    return [_sample(rng) for _ in range(default_size if num_samples is None else num_samples)]


class TinyInstructDataset(Dataset):
    """Map-style SFT data set over in-memory input/output samples, tokenized like torchtune's ``SFTDataset``.

    Args:
        samples (List[Dict[str, str]]): samples with "input" and "output".
        model_transform (Transform): the tokenizer (turns messages into "tokens" and "mask").
        train_on_input (bool): whether the prompt tokens count in the loss. Default: False.
    """

    def __init__(self, samples: List[Dict[str, str]], model_transform: Transform, train_on_input: bool = False):
        self._data = samples
        self._prepare_sample = SFTTransform(
            message_transform=InputOutputToMessages(train_on_input=train_on_input),
            model_transform=model_transform,
        )

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return self._prepare_sample(self._data[index])


def tiny_instruct_dataset(
    tokenizer: Transform,
    split: str = "train",
    num_samples: Optional[int] = None,
    train_on_input: bool = False,
    packed: bool = False,
) -> TinyInstructDataset:
    """Builds the tiny instruction data set (the embedded default's data; no download).

    Args:
        tokenizer (Transform): tokenizer, e.g. :func:`tiny_tokenizer`.
        split (str): "train" or "validation".
        num_samples (Optional[int]): number of samples; None: the split's default size.
        train_on_input (bool): whether the prompt tokens count in the loss. Default: False.
        packed (bool): not supported (the samples are a few tokens long); must be False.

    Returns:
        TinyInstructDataset: the data set.

    Raises:
        ValueError: if ``packed`` is True.
    """
    if packed:
        raise ValueError("The tiny data set does not support packed=True; set dataset.packed=False.")
    return TinyInstructDataset(tiny_instruct_samples(split, num_samples), tokenizer, train_on_input)


def train_tiny_tokenizer(output_path: Union[str, Path], vocab_size: int = TINY_TOKENIZER_VOCAB_SIZE) -> Path:
    """Trains the tiny BPE SentencePiece tokenizer on the train split (deterministic; ~0.1 s).

    Args:
        output_path (Union[str, Path]): where to write the ``.model`` file.
        vocab_size (int): vocabulary size; must stay <= the tiny models' 512.

    Returns:
        Path: ``output_path``.
    """
    import sentencepiece as spm

    lines = [text for sample in tiny_instruct_samples("train") for text in (sample["input"], sample["output"])]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        normalization_rule_name="identity",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    output_path.write_bytes(model.getvalue())
    return output_path


def tiny_tokenizer(max_seq_len: Optional[int] = None, path: Optional[str] = None) -> Llama2Tokenizer:
    """The tiny default's tokenizer: torchtune's ``llama2_tokenizer`` on the shipped SentencePiece model.

    Args:
        max_seq_len (Optional[int]): truncate tokenized samples to this length.
        path (Optional[str]): a different ``.model`` file; None: the shipped one.

    Returns:
        Llama2Tokenizer: the tokenizer (no prompt template; pad id 0).
    """
    return llama2_tokenizer(path=str(path or TINY_TOKENIZER_PATH), max_seq_len=max_seq_len, prompt_template=None)

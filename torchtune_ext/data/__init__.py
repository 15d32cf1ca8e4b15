"""Data for the embedded tiny default: a deterministic instruction data set and its SentencePiece tokenizer."""

from torchtune_ext.data._tiny import (
    TINY_SPLITS,
    TINY_TOKENIZER_PATH,
    TinyInstructDataset,
    tiny_instruct_dataset,
    tiny_instruct_samples,
    tiny_tokenizer,
    train_tiny_tokenizer,
)
from torchtune_ext.data._tiny_checkpoint import write_tiny_checkpoint, write_tiny_tokenizer_files

__all__ = [
    "TINY_SPLITS",
    "TINY_TOKENIZER_PATH",
    "TinyInstructDataset",
    "tiny_instruct_dataset",
    "tiny_instruct_samples",
    "tiny_tokenizer",
    "train_tiny_tokenizer",
    "write_tiny_checkpoint",
    "write_tiny_tokenizer_files",
]

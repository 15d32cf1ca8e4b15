"""The embedded tiny default's data: deterministic samples, a reproducible shipped tokenizer, SFT tokenization."""

import json

import pytest
import torch
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX
from torchtune.models.llama2 import llama2_tokenizer

from torchtune_ext.checkpoint import QLoRAHFCheckpointer
from torchtune_ext.data import (
    TINY_TOKENIZER_PATH,
    tiny_instruct_dataset,
    tiny_instruct_samples,
    tiny_tokenizer,
    train_tiny_tokenizer,
    write_tiny_checkpoint,
)
from torchtune_ext.models import TINY_LLAMA_ARGS, qlora_tiny_llama, qlora_tiny_qwen


def _expected_output(instruction: str) -> str:
    """Recomputes each task's answer from the instruction text alone."""
    task, word = instruction.rsplit(": ", 1)
    return {
        "Reverse": word[::-1],
        "Uppercase": word.upper(),
        "Repeat twice": f"{word} {word}",
        "Count the letters": str(len(word)),
        "Sort the letters": "".join(sorted(word)),
    }[task]


def test_samples_are_deterministic_correct_and_cover_every_task():
    train = tiny_instruct_samples("train")
    assert train == tiny_instruct_samples("train")
    assert len(train) == 4096 and len(tiny_instruct_samples("validation")) == 256
    assert train[:50] != tiny_instruct_samples("validation", 50)
    for sample in train:
        assert sample["output"] == _expected_output(sample["input"])
    assert {s["input"].rsplit(": ", 1)[0] for s in train} == {
        "Reverse",
        "Uppercase",
        "Repeat twice",
        "Count the letters",
        "Sort the letters",
    }


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match="validation"):
        tiny_instruct_samples("test")


def test_shipped_tokenizer_is_reproducible(tmp_path):
    regenerated = train_tiny_tokenizer(tmp_path / "tok.model")
    assert regenerated.read_bytes() == TINY_TOKENIZER_PATH.read_bytes()
    assert TINY_TOKENIZER_PATH.stat().st_size < 1_000_000


def test_tokenizer_loads_with_torchtune_and_round_trips_every_sample():
    tokenizer = llama2_tokenizer(str(TINY_TOKENIZER_PATH), prompt_template=None)
    assert tokenizer.vocab_size <= TINY_LLAMA_ARGS["vocab_size"]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 0)
    for sample in tiny_instruct_samples("validation"):
        for text in sample.values():
            ids = tokenizer.encode(text, add_bos=False, add_eos=False)
            assert 0 not in ids, f"{text!r} hits <unk>"
            assert tokenizer.decode(ids) == text


def test_dataset_masks_the_prompt_and_trains_on_the_answer():
    tokenizer = tiny_tokenizer(max_seq_len=64)
    dataset = tiny_instruct_dataset(tokenizer, split="validation")
    assert len(dataset) == 256
    for index in range(0, 256, 17):
        sample, item = tiny_instruct_samples("validation")[index], dataset[index]
        tokens, labels = torch.tensor(item["tokens"]), torch.tensor(item["labels"])
        trained = labels != CROSS_ENTROPY_IGNORE_IDX
        assert tokens[0] == tokenizer.bos_id and tokens[-1] == tokenizer.eos_id
        assert torch.equal(labels[trained], tokens[trained])
        prompt_len = len(tokenizer.encode(sample["input"], add_bos=True, add_eos=False))
        assert not trained[:prompt_len].any() and trained[prompt_len:].all()
        answer = tokenizer.decode(tokens[trained][:-1].tolist())
        assert answer.strip() == sample["output"]


def test_packed_is_rejected():
    with pytest.raises(ValueError, match="packed"):
        tiny_instruct_dataset(tiny_tokenizer(), packed=True)


@pytest.mark.parametrize("family, builder", [("llama", qlora_tiny_llama), ("qwen", qlora_tiny_qwen)])
def test_tiny_checkpoint_matches_the_tiny_model_and_is_written_once(tmp_path, family, builder):
    path = write_tiny_checkpoint(tmp_path / "base", family=family, dtype="bf16")
    files = sorted(p.name for p in path.iterdir())
    # with the tokenizer in HF layout, so that AutoTokenizer works on it and on merged models
    tokenizer_files = ["generation_config.json", "tokenizer.model", "tokenizer_config.json"]
    assert files == sorted(["config.json", "model.safetensors", *tokenizer_files])
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["vocab_size"] == 512 and config["tie_word_embeddings"]
    model_type = "LLAMA3_2" if family == "llama" else "QWEN2"
    checkpointer = QLoRAHFCheckpointer(str(path), str(tmp_path / "out"), model_type)
    checkpointer.validate(builder(lora_attn_modules=["q_proj"], dtype=torch.float32))  # keys and shapes match
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    write_tiny_checkpoint(path, family=family)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime

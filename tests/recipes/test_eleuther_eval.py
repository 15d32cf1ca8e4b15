"""The eleuther_eval recipe end to end, offline: a local lm-eval multiple-choice task over the tiny data set's
vocabulary, on a freshly trained tiny adapter (NF4 base + adapter) and on a full-precision HF folder; lm-eval's
log-likelihoods and accuracy against the model's own, computed here with torch."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_recipe, run_main, run_recipe_in_process
from omegaconf import OmegaConf

from torchtune_ext._shipped import recipe_of
from torchtune_ext.data import tiny_instruct_samples, tiny_tokenizer
from torchtune_ext.generation import load_model_with_adapter

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'torchtune_ext[eval]'")

pytestmark = pytest.mark.integration_test

REPO = Path(__file__).resolve().parents[2]
TUNE = Path(sys.executable).parent / "tune"
STEPS = 3
TASK = "tiny_choice"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _tune(recipe: str, config: str, *overrides: str) -> str:
    result = subprocess.run(
        [str(TUNE), "run", recipe, "--config", config, *overrides],
        cwd=REPO,
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise AssertionError(f"{recipe} failed:\n{result.stdout[-3000:]}\n{result.stderr[-4000:]}")
    return result.stdout + result.stderr


def _write_task(folder: Path) -> list:
    """A 3-way multiple-choice lm-eval task over the tiny validation split (answers of other samples as distractors)."""
    samples = tiny_instruct_samples("validation", 16)
    rng = random.Random(0)
    docs = []
    for i, sample in enumerate(samples[:12]):
        choices = [sample["output"], samples[(i + 5) % 16]["output"], samples[(i + 11) % 16]["output"]]
        order = rng.sample(range(3), 3)
        docs.append({"question": sample["input"], "choices": [choices[j] for j in order], "answer": order.index(0)})
    folder.mkdir(parents=True)
    data = folder / "tiny_choice.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / "tiny_choice.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}} Answer:'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return docs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eleuther")
    run_recipe_in_process(
        REPO / "recipes" / "qlora_finetune_single_device.py",
        ["--config", "configs/tiny/qlora_single_device.yaml"]
        + [
            f"output_dir={tmp / 'out'}",
            f"checkpointer.checkpoint_dir={tmp / 'base'}",
            f"max_steps_per_epoch={STEPS}",
            "batch_size=4",
        ],
        cwd=REPO,
    )
    return tmp, _write_task(tmp / "tasks")


def _choice_logprobs(model, docs) -> list:
    """Sum of log p(choice tokens | question) per choice: the continuation is ' <choice>', split off as lm-eval
    splits it (the whole text's tokens after the context's)."""
    tokenizer = tiny_tokenizer()
    scores = []
    for doc in docs:
        context = f"{doc['question']} Answer:"
        ctx = tokenizer.encode(context, add_bos=False, add_eos=False)
        row = []
        for choice in doc["choices"]:
            cont = tokenizer.encode(f"{context} {choice}", add_bos=False, add_eos=False)[len(ctx) :]
            tokens = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = model(tokens[:, :-1]).float().log_softmax(-1)[0, len(ctx) - 1 :]
            row.append(logp.gather(-1, torch.tensor(cont)[:, None]).sum().item())
        scores.append(row)
    return scores


def _check(results_file: Path, docs, expected) -> float:
    output = json.loads(results_file.read_text())
    accuracy = sum(max(range(3), key=row.__getitem__) == doc["answer"] for row, doc in zip(expected, docs)) / len(docs)
    assert output["results"][TASK]["acc,none"] == pytest.approx(accuracy, abs=1e-9)
    samples = sorted(output["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    for sample, row in zip(samples, expected):
        got = [float(resp[0][0]) for resp in sample["resps"]]
        assert got == pytest.approx(row, rel=1e-4, abs=1e-4)
    return accuracy


def test_eleuther_eval_on_the_model_as_it_trained(trained):
    tmp, docs = trained
    adapter = tmp / "out" / f"step_{STEPS}" / "adapter"
    results = tmp / "adapter_results.json"
    output = _tune(
        "recipes/eleuther_eval.py",
        "configs/tiny/eleuther_eval.yaml",
        f"checkpointer.checkpoint_dir={tmp / 'base'}",
        f"adapter_dir={adapter}",
        f"tasks=[{TASK}]",
        f"include_path={tmp / 'tasks'}",
        f"output_file={results}",
        "batch_size=5",  # 36 requests: batches of unequal lengths, the last one short
    )
    assert TASK in output and "into NF4 + adapter" in output
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "eleuther_eval.yaml")
    model = load_model_with_adapter(tmp / "base", adapter, model=cfg.model, dtype="fp32")
    _check(results, docs, _choice_logprobs(model, docs))


def test_eleuther_eval_on_a_full_precision_folder_against_transformers(trained):
    transformers = pytest.importorskip("transformers")
    tmp, docs = trained
    results = tmp / "merged_results.json"
    _tune(
        "recipes/eleuther_eval.py",
        "configs/tiny/eleuther_eval.yaml",
        f"merged_dir={tmp / 'base'}",
        f"tasks=[{TASK}]",
        f"include_path={tmp / 'tasks'}",
        f"output_file={results}",
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "base", torch_dtype=torch.float32).eval()
    _check(results, docs, _choice_logprobs(lambda tokens: hf(tokens).logits, docs))


def test_configs_belong_to_the_recipe_and_bad_settings_fail_first():
    from torchtune_ext.evaluation import EleutherEvalRecipe

    assert recipe_of("tiny/eleuther_eval") == recipe_of("llama3_2/1B_eleuther_eval") == "eleuther_eval"
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "eleuther_eval.yaml")
    for override, message in (("tasks=[]", "tasks is empty"), ("batch_size=0", "batch_size=0")):
        bad = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override, "tasks=[x]"] if override != "tasks=[]" else []))
        if override == "tasks=[]":
            bad.tasks = []
        with pytest.raises(ValueError, match=message):
            EleutherEvalRecipe(bad)


def test_a_misspelt_task_prints_one_line_and_exits_2_before_loading(tmp_path, monkeypatch, capfd):
    """Before: the model loaded, then lm-eval raised a KeyError (a traceback, exit code 1). In this process: the
    entry point as ``tune run`` calls it."""
    _write_task(tmp_path / "tasks")
    written = tmp_path / "results.json"
    recipe = REPO / "recipes" / "eleuther_eval.py"
    result = run_main(
        load_recipe(recipe).recipe_main,
        [str(recipe), "--config", "configs/tiny/eleuther_eval.yaml"]
        + [f"checkpointer.checkpoint_dir={tmp_path / 'base'}", "adapter_dir=null", f"output_file={written}"]
        + ["tasks=[tiny_choise]", f"include_path={tmp_path / 'tasks'}"],
        monkeypatch,
        capfd,
        cwd=REPO,
        **OFFLINE,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("eleuther_eval: error: ")]
    assert errors == [
        "eleuther_eval: error: tasks: 'tiny_choise' is not an lm-eval task, group or tag: did you mean 'tiny_choice' "
        "or 'multiple_choice'?"
    ], output[-4000:]
    assert "Loaded" not in output and not written.exists() and not (tmp_path / "base").exists()

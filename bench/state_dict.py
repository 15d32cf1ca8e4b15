"""Benchmark: full / adapter-only state-dict gathering and full-state-dict loading on a 2-rank gloo group.

Model: a ~222M-parameter bf16 QLoRA Llama 3.2-style decoder (torchtune's ``lora_llama3_2`` component builder through
``torchtune_ext.models.build_qlora``: 12 layers, dim 1024, vocab 36864, LoRA rank 8 on q/v and the MLP), built on the
meta device and FSDP2-sharded (each layer, then the root) on 2 CPU ranks. Compared, on rank 0 (time until every rank
is done, and peak RSS above the RSS before the call):

- full gather: ``torchtune_ext.distributed.get_full_state_dict`` vs torchtune's ``gather_cpu_state_dict`` vs torch DCP's
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (DCP returns NF4Tensors, not dequantized weights);
- adapter-only gather: ``get_full_state_dict(adapter_weights_only=True)`` vs ``gather_cpu_state_dict(...,
  adapter_weights_only=True)``;
- load into the meta model: ``load_full_state_dict`` (every rank holds the state dict, and with
  ``broadcast_from_rank0``) vs torchtune's ``load_from_full_model_state_dict`` vs DCP's ``set_model_state_dict``.

Before timing, the script checks that ours and torchtune's gathered dicts are equal, and that both loads give equal
models. Run::

    python bench/state_dict.py [--repeats 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL_ARGS: Dict[str, Any] = dict(
    lora_attn_modules=["q_proj", "v_proj"],
    apply_lora_to_mlp=True,
    lora_rank=8,
    lora_alpha=16,
    vocab_size=36864,
    num_layers=12,
    num_heads=16,
    num_kv_heads=4,
    embed_dim=1024,
    intermediate_dim=4096,
    max_seq_len=2048,
    tie_word_embeddings=True,
)
WORLD_SIZE = 2


def _build_sharded_model():
    from torch.distributed.fsdp import fully_shard
    from torchtune.models.llama3_2 import lora_llama3_2

    from torchtune_ext.models import build_qlora

    model = build_qlora(lora_llama3_2, dtype=torch.bfloat16, device="meta", **MODEL_ARGS)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _random_full_state_dict(model) -> Dict[str, torch.Tensor]:
    """Same random bf16 tensors on every rank (seeded), shaped like the model's state dict."""
    generator = torch.Generator().manual_seed(0)
    full = {}
    for key, value in model.state_dict().items():
        full[key] = (torch.randn(value.shape, generator=generator) * 0.02).to(torch.bfloat16)
    return full


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Returns freed heap memory to the OS (so that the base RSS is real), then resets the peak RSS (VmHWM)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _measure(fn: Callable[[], Any], repeats: int, setup: Optional[Callable[[], Any]] = None) -> Tuple[float, float]:
    """Best time (s, until every rank is done) and rank-0 peak RSS increase (MB) over ``repeats`` runs."""
    best_time, best_peak = float("inf"), float("inf")
    for _ in range(repeats):
        arg = setup() if setup is not None else None
        _reset_peak()
        dist.barrier()
        base = _rss_mb()
        start = time.perf_counter()
        out = fn(arg) if setup is not None else fn()
        dist.barrier()
        elapsed = time.perf_counter() - start
        peak = _peak_mb() - base
        del out, arg
        best_time, best_peak = min(best_time, elapsed), min(best_peak, peak)
    return best_time, best_peak


def _assert_equal(ours: Dict[str, torch.Tensor], theirs: Dict[str, torch.Tensor], what: str) -> None:
    from torchtune_ext.nf4 import NF4Tensor

    if ours.keys() != theirs.keys():
        raise AssertionError(f"{what}: key sets differ: {sorted(ours.keys() ^ theirs.keys())[:5]}")
    for key, value in ours.items():
        other = theirs[key]
        if isinstance(other, NF4Tensor):
            other = other.get_original_weight()
        if value.dtype != other.dtype or not torch.equal(value, other):
            raise AssertionError(f"{what}: {key} differs")


def _worker(rank: int, port: int, repeats: int, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torchtune.training import gather_cpu_state_dict, load_from_full_model_state_dict

    from torchtune_ext.distributed import (
        destroy_distributed,
        get_full_state_dict,
        init_distributed,
        load_full_state_dict,
    )
    from torchtune_ext.nf4 import NF4Tensor

    init_distributed(torch.device("cpu"), timeout_s=1800)

    is_rank_zero = rank == 0
    cpu = torch.device("cpu")
    model = _build_sharded_model()
    num_params = sum(p.numel() for p in model.parameters())
    full_sd = _random_full_state_dict(model)
    rows: List[Dict[str, Any]] = []

    def row(what: str, ours: Tuple[float, float], peer_name: str, peer: Tuple[float, float], note: str = ""):
        rows.append(dict(what=what, ours=ours, peer_name=peer_name, peer=peer, note=note))

    # Loads (into fresh meta models) and their correctness check.
    load_full_state_dict(model, full_sd)
    tt_model = _build_sharded_model()
    load_from_full_model_state_dict(tt_model, dict(full_sd), cpu, strict=True)
    _assert_equal(get_full_state_dict(model), get_full_state_dict(tt_model), "load: ours vs torchtune")
    del tt_model
    ours_load = _measure(lambda m: load_full_state_dict(m, full_sd), repeats, _build_sharded_model)
    ours_bcast = _measure(
        lambda m: load_full_state_dict(m, full_sd if is_rank_zero else None, broadcast_from_rank0=True),
        repeats,
        _build_sharded_model,
    )
    tt_load = _measure(
        lambda m: load_from_full_model_state_dict(m, dict(full_sd), cpu, strict=True), repeats, _build_sharded_model
    )
    row("load (every rank holds the dict)", ours_load, "torchtune load_from_full_model_state_dict", tt_load)
    row("load (broadcast_from_rank0)", ours_bcast, "torchtune load_from_full_model_state_dict", tt_load)
    dcp_opts = StateDictOptions(full_state_dict=True, strict=True)
    dcp_model = _build_sharded_model()
    set_model_state_dict(dcp_model, full_sd, options=dcp_opts)
    still_nf4 = isinstance(dcp_model.layers[0].mlp.w1.weight._local_tensor, NF4Tensor)
    del dcp_model
    dcp_load = _measure(lambda m: set_model_state_dict(m, full_sd, options=dcp_opts), repeats, _build_sharded_model)
    note = "" if still_nf4 else "DCP replaces the NF4 weights with dense bf16 shards: no quantization"
    row("load (every rank holds the dict)", ours_load, "DCP set_model_state_dict", dcp_load, note)
    full_sd = None  # free it before the gathers
    gc.collect()

    # Gathers, after checking ours equals torchtune's.
    _assert_equal(get_full_state_dict(model), gather_cpu_state_dict(model, is_rank_zero), "full gather")
    ours_adapters = get_full_state_dict(model, adapter_weights_only=True)
    tt_adapters = gather_cpu_state_dict(model, is_rank_zero, adapter_weights_only=True)
    _assert_equal(ours_adapters, tt_adapters, "adapter gather")
    ours_full = _measure(lambda: get_full_state_dict(model), repeats)
    tt_full = _measure(lambda: gather_cpu_state_dict(model, is_rank_zero), repeats)
    dcp_full = _measure(
        lambda: get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        repeats,
    )
    row("full gather", ours_full, "torchtune gather_cpu_state_dict", tt_full)
    row("full gather", ours_full, "DCP get_model_state_dict(full)", dcp_full, "DCP returns NF4Tensors (packed)")
    ours_ad = _measure(lambda: get_full_state_dict(model, adapter_weights_only=True), repeats)
    tt_ad = _measure(lambda: gather_cpu_state_dict(model, is_rank_zero, adapter_weights_only=True), repeats)
    row("adapter-only gather", ours_ad, "torchtune gather_cpu_state_dict(adapter_weights_only)", tt_ad)

    if is_rank_zero:
        with open(result_path, "w") as f:
            json.dump(dict(rows=rows, num_params=num_params, num_adapters=len(ours_adapters)), f)
    destroy_distributed()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


GOALS = {"full gather": 0.33, "adapter-only gather": 0.05, "load (every rank holds the dict)": 0.2}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement; the best is reported")
    parser.add_argument("--out", default=None, help="append the result table to this markdown file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.start_processes(
            _worker, args=(_free_port(), args.repeats, result_path), nprocs=WORLD_SIZE, start_method="spawn"
        )
        with open(result_path) as f:
            result = json.load(f)
    cpus = f"{os.cpu_count()} CPUs (shared)"
    machine = f"{platform.machine()}, {cpus}, {WORLD_SIZE} gloo ranks, torch {torch.__version__}"
    date = datetime.date.today().isoformat()
    command = "python bench/state_dict.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"### state dict bench ({result['num_params'] / 1e6:.0f}M-param bf16 QLoRA, {result['num_adapters']} adapter "
        f"tensors)",
        "",
        "| what | command | ours (s / peak MB) | peer | peer (s / peak MB) | time ratio | goal | peak RSS ratio "
        "| machine | date |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ours_t, ours_m = r["ours"]
        peer_t, peer_m = r["peer"]
        peer, ratio = f"{peer_t:.2f} / {peer_m:.0f}", f"{ours_t / peer_t:.3f}x"
        mem_ratio = f"{ours_m / peer_m:.2f}x" if peer_m > 1 else "n/a"
        if r["note"]:
            peer += f" ({r['note']})"
        goal = f"<= {GOALS[r['what']]}x" if r["what"] in GOALS and r["peer_name"].startswith("torchtune") else ""
        lines.append(
            f"| {r['what']} | `{command.strip()}` | {ours_t:.2f} / {ours_m:.0f} | {r['peer_name']} | {peer} | "
            f"{ratio} | {goal} | {mem_ratio} | {machine} | {date} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n\n")


if __name__ == "__main__":
    main()

"""The distributed recipe's per-rank dry run (fake process group, fake tensors) against a real 2-rank
gloo CPU run of the same recipe step on real tensors: each rank's tensor peak within 5%.

The reference is the recipe's own step on a real model materialized from the same ``model:`` section, sharded by
the recipe's ``_parallelize`` on a real gloo group (all-gathers and reduce-scatters that move data), every live
storage counted; the estimate runs the same step on fake tensors over torch's fake process group, in this process.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_distributed
from omegaconf import DictConfig, OmegaConf

from recipes.qlora_finetune_distributed import QLoRAFinetuneRecipeDistributed
from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipe
from torchtune_ext.config import ConfigError
from torchtune_ext.memory import (
    GIB,
    HostMemory,
    collect_rank_hosts,
    dry_run_target,
    dry_run_world_size,
    fake_process_group,
    host_total,
    per_rank_dry_run,
)
from torchtune_ext.models import materialize_
from torchtune_ext.training import (
    build_qlora_model,
    default_adapter_dtype,
    frozen_weights_dtype,
    parse_dtype,
)

CONFIG = "configs/tiny/qlora_distributed.yaml"
BATCH, SEQ_LEN = 2, 128
SETTINGS = {
    "fp32_checkpointed": ["dtype=fp32", "enable_activation_checkpointing=True"],
    "bf16": ["dtype=bf16", "enable_activation_checkpointing=False"],
}


def _cfg(*overrides: str) -> DictConfig:
    base = ["dry_run=True", "checkpointer.checkpoint_dir=/nonexistent/torchtune_ext_per_rank", "model.vocab_size=4096"]
    return OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist([*base, *overrides]))


def _real_peaks(rank: int, world_size: int, out_dir: str) -> None:
    """Worker: each setting's real step on this rank of the gloo group; the peak written to a file."""
    peaks = {}
    # The estimate models the step a GPU runs; on x86 CPUs our fp32 products take oneDNN (modules/_cpu_gemm.py),
    # whose result copies a GPU never makes: the reference runs torch.mm, as the estimate and a GPU do.
    with torch.backends.mkldnn.flags(enabled=False):
        _measure_settings(peaks)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(peaks))


def _measure_settings(peaks: dict) -> None:
    for name, overrides in SETTINGS.items():
        cfg = _cfg(*overrides)
        dtype = parse_dtype(cfg.dtype)
        frozen = frozen_weights_dtype(None, dtype, {"dtype": "bfloat16"})
        model = build_qlora_model(cfg.model, dtype, default_adapter_dtype(dtype, None), frozen)
        materialize_(model, "cpu", seed=0)
        estimator = QLoRAFinetuneRecipeDistributed(cfg).memory_estimator(cfg, model=model)
        peaks[name] = estimator.estimate(BATCH, SEQ_LEN).peak_bytes


@pytest.mark.distributed
def test_per_rank_dry_run_matches_a_real_two_rank_gloo_run(tmp_path):
    run_distributed(_real_peaks, 2, str(tmp_path))
    for rank in range(2):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, overrides in SETTINGS.items():
            cfg = _cfg(*overrides)
            with fake_process_group(rank, 2):
                estimate = QLoRAFinetuneRecipeDistributed(cfg).memory_estimator(cfg).estimate(BATCH, SEQ_LEN)
            assert estimate.breakdown["gathered_params"] > 0  # the model ran sharded
            assert abs(estimate.peak_bytes - real[name]) <= 0.05 * real[name], (rank, name, estimate.peak_bytes, real)


def _gathered_bytes(module) -> int:
    """Bytes of the all-gather outputs of an FSDP2 unit (its params unsharded, as FSDP2 itself sized them)."""
    params = module._get_fsdp_state()._fsdp_param_group.fsdp_params
    return sum(t.numel() * t.element_size() for p in params for t in p.all_gather_outputs)


def test_fsdp_frees_are_followed():
    """FSDP2 frees each layer's gathered params after its forward and backward (storage resized to 0 bytes, no op
    to see): at the peak the gathered params are the root's (kept after forward) and at most 2 layers' (the one in
    use and the one prefetched), by FSDP2's own all-gather output sizes; with 6 layers, counting every layer once
    gathered would exceed that."""
    cfg = _cfg("dtype=bf16", "model.num_layers=6", "enable_activation_checkpointing=True")
    with fake_process_group(0, 2):
        estimator = QLoRAFinetuneRecipeDistributed(cfg).memory_estimator(cfg)
        gathered = estimator.estimate(BATCH, SEQ_LEN).breakdown["gathered_params"]
        layer = _gathered_bytes(estimator.model.layers[0])
        root = _gathered_bytes(estimator.model)
    assert root + layer <= gathered <= root + 2 * layer + 8 * 1024, (gathered, root, layer)


def test_world_size_is_checked_before_anything():
    with pytest.raises(ConfigError, match="world_size=1"):
        dry_run_world_size(_cfg("world_size=1"))
    assert dry_run_world_size(_cfg()) == 2
    assert not torch.distributed.is_initialized()


def test_host_ram_of_the_ranks_on_one_machine_is_their_sum(capsys):
    """Each rank offloads its own batch's layer inputs, as one rank alone does (activations are not sharded), so the
    pinned offload buffers on the host are world_size x the single-rank figure; the host's report sums every rank's
    own figures (process, loading, pinned) and checks that sum against host_memory_gb."""
    seq_len = 100  # each layer input 2 x 100 x 256 x 2 bytes: a pinned block of 131,072 bytes rounds it up
    settings = ["dtype=fp16", "enable_activation_checkpointing=True", "enable_activation_offloading=True"]
    cfg = _cfg(*settings, "host_memory_gb=64", f"batch_size={BATCH}", f"tokenizer.max_seq_len={seq_len}")
    single = QLoRAFinetuneRecipe(cfg).memory_estimator(cfg).estimate(BATCH, seq_len)  # one rank, no process group
    assert single.pinned_host_bytes > single.host_bytes > 0
    with collect_rank_hosts() as ranks:
        reports = per_rank_dry_run(QLoRAFinetuneRecipeDistributed, cfg)
    assert ranks == []  # the dry run collects into its own list
    assert len(reports) == 3 and "2 ranks on one machine" in reports[-1]
    for rank in range(2):
        with fake_process_group(rank, 2):
            estimate = QLoRAFinetuneRecipeDistributed(cfg).memory_estimator(cfg).estimate(BATCH, seq_len)
            assert dry_run_target(cfg, torch.device("cpu"), torch.float16).ranks_per_host == 2
        assert estimate.pinned_host_bytes == single.pinned_host_bytes
        assert f"pinned offload buffers {single.pinned_host_bytes / GIB:.2f} GiB" in reports[rank]
    host = host_total([HostMemory(100, 1000, single.pinned_host_bytes)] * 2)
    assert (host.process, host.loading, host.pinned) == (200, 2000, 2 * single.pinned_host_bytes)
    per_rank = [
        float(line.split("host RAM, this rank: ")[1].split()[0])
        for line in reports[:2]
        for line in line.splitlines()
        if "host RAM, this rank: " in line
    ]
    summed = float(reports[-1].split("host (2 ranks): needs ")[1].split()[0])
    assert len(per_rank) == 2 and abs(summed - sum(per_rank)) <= 0.011, (per_rank, summed)
    assert not torch.distributed.is_initialized()
    assert "host (2 ranks): needs" in capsys.readouterr().out

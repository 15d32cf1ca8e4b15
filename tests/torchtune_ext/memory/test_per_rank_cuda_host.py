"""The per-rank dry run on a host with GPUs (Kaggle's 2x T4): its meshes are built on the CPU, where its fake tensors
and batches are, whatever accelerator the host has. CUDA is reported available in this process as FSDP2 asks for it
(``torch._C._get_accelerator``, its default mesh's device, and ``torch.cuda.is_available``), its current stream not
capturing a graph, as an optimizer's step then asks on torch 2.11 (``torch.cuda.is_current_stream_capturing``, which
on a CUDA build without a driver fails); the reference is the same dry run with no accelerator reported."""

import pytest
import torch
from omegaconf import OmegaConf

from recipes.qlora_finetune_distributed import QLoRAFinetuneRecipeDistributed
from torchtune_ext.memory import per_rank_dry_run

CONFIG = "configs/tiny/qlora_distributed.yaml"

pytestmark = pytest.mark.stack  # what FSDP2 and the optimizer's step ask of CUDA is torch's, per version


def _reports():
    overrides = [
        "dry_run=True",
        "world_size=2",
        "checkpointer.checkpoint_dir=/nonexistent/torchtune_ext_per_rank",
        "device_memory_gb=15",
        "host_memory_gb=30",
        "tokenizer.max_seq_len=64",
        "batch_size=2",
    ]
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(overrides))
    return per_rank_dry_run(QLoRAFinetuneRecipeDistributed, cfg)


def _peaks(reports):
    """Each rank's peak and its breakdown (the report's lines before its notes; host RAM and free disk vary)."""
    return [report.split("  note:")[0] for report in reports[:2]]


def test_per_rank_dry_run_with_cuda_reported_available(monkeypatch):
    reference = _reports()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda *args: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ours = _reports()
    assert not torch.distributed.is_initialized()
    assert len(ours) == 3 and "all-gathered params (FSDP2)" in _peaks(ours)[1]
    assert _peaks(ours) == _peaks(reference)

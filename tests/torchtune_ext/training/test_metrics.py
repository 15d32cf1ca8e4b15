"""Memory and throughput metrics."""

import time

import torch

from torchtune_ext.training import Throughput, format_memory_stats, memory_stats, peak_rss_bytes, rss_bytes


def test_peak_rss_tracks_a_large_allocation():
    before = peak_rss_bytes()
    block = torch.ones(64 * 1024**2 // 4 + before // 4)  # larger than the current peak, touched
    assert peak_rss_bytes() >= block.numel() * 4
    assert rss_bytes() >= block.numel() * 4
    del block


def test_cpu_memory_stats_report_rss_in_gib():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"peak_rss", "rss"}
    assert 0 < stats["rss"] <= stats["peak_rss"] + 1e-3
    assert "peak_rss" in format_memory_stats(stats) and "GiB" in format_memory_stats(stats)


def test_throughput_counts_tokens_per_second():
    meter = Throughput()
    meter.add(100)
    meter.add(torch.tensor(50))
    time.sleep(0.05)
    rate = meter.tokens_per_second()
    assert meter.tokens == 150 and 0 < rate <= 150 / 0.05
    meter.reset()
    assert meter.tokens == 0


def test_progress_note_shows_tokens_per_second_and_the_bounding_peak_over_ranks():
    from torchtune_ext.training._summary import progress_note

    cpu = {"tokens_per_second": 1739.4, "peak_rss": 2.126, "rss": 2.0}
    assert progress_note(cpu) == " | 1,739 tok/s | 2.13 GiB"
    two_ranks = {
        "tokens_per_second": 20000.0,
        "peak_rss/rank0": 9.0,
        "peak_memory_alloc/rank0": 11.5,
        "peak_memory_alloc/rank1": 12.25,
    }
    assert progress_note(two_ranks) == " | 20,000 tok/s | 12.25 GiB"  # the device bounds a CUDA run

"""The kept-id pass of vocab pruning: streamed (one sample alive at a time), shared by the ranks (rows r::N, union by
all-reduce), saved for a resume, and timed from a sample for the dry run."""

import random
import weakref
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from conftest import run_distributed

from torchtune_ext.modules.vocab_pruning import (
    estimate_scan_seconds,
    load_scanned_kept_ids,
    resolve_kept_ids,
    save_scanned_kept_ids,
    scan_kept_ids,
)

VOCAB = 1000


class _Sample(dict):
    """A dict sample that weak references can track."""


class CountingDataset:
    """A map-style data set that builds each sample on access and tracks how many are alive at once."""

    def __init__(self, rows: int, seed: int = 0, vocab: int = VOCAB, bad_row: int = -1):
        self.rows = rows
        self.seed = seed
        self.vocab = vocab
        self.bad_row = bad_row
        self.read: List[int] = []
        self.alive = 0
        self.max_alive = 0

    def __len__(self) -> int:
        return self.rows

    def _release(self) -> None:
        self.alive -= 1

    def __getitem__(self, index: int) -> Dict[str, Any]:
        rng = random.Random(self.seed * 1_000_003 + index)
        tokens = [rng.randrange(self.vocab // 2) for _ in range(rng.randrange(1, 20))]
        labels = [-100] * 3 + [rng.randrange(self.vocab // 2, self.vocab) for _ in range(5)]
        if index == self.bad_row:
            tokens[0] = self.vocab + 7
        self.read.append(index)
        sample = _Sample(tokens=tokens, labels=torch.tensor(labels))
        self.alive += 1
        self.max_alive = max(self.max_alive, self.alive)
        weakref.finalize(sample, self._release)
        return sample


def _reference(datasets, always_keep=()) -> List[int]:
    """Independent reference: a python set over every sample's ids (negative labels skipped)."""
    seen = set(i for i in always_keep if i is not None)
    for dataset in datasets:
        for index in range(len(dataset)):
            sample = dataset[index]
            seen.update(int(i) for i in sample["tokens"])
            seen.update(int(i) for i in sample["labels"] if int(i) >= 0)
    return sorted(seen)


def test_scan_matches_a_set_and_streams_one_sample_at_a_time():
    data, val = CountingDataset(300, seed=1), CountingDataset(40, seed=2)
    ids = scan_kept_ids([data, None, val], VOCAB, always_keep=(999, None, 0), progress=False)
    assert ids == _reference([CountingDataset(300, seed=1), CountingDataset(40, seed=2)], always_keep=(999, 0))
    assert data.read == list(range(300)) and val.read == list(range(40))
    # Memory flat in the data set's size: no sample outlives its own step.
    assert data.max_alive == 1 and val.max_alive == 1


def test_scan_rejects_bad_ids():
    with pytest.raises(ValueError, match="data item 5 has token id 1007, outside the vocabulary"):
        scan_kept_ids([CountingDataset(10, bad_row=5)], VOCAB, progress=False)
    with pytest.raises(ValueError, match="always_keep id 1000"):
        scan_kept_ids([CountingDataset(3)], VOCAB, always_keep=(1000,), progress=False)
    with pytest.raises(ValueError, match="non-integer"):
        scan_kept_ids([[[1.5, 2.0]]], VOCAB, progress=False)


def _scan_worker(rank: int, world_size: int, out: str) -> None:
    data, val = CountingDataset(301, seed=1), CountingDataset(41, seed=2)
    ids = scan_kept_ids([data, val], VOCAB, always_keep=(998,), progress=False)
    torch.save({"ids": ids, "read": data.read + [-1] + val.read}, f"{out}/rank{rank}.pt")
    with pytest.raises(ValueError, match="outside the vocabulary") if rank == 1 else pytest.raises(RuntimeError):
        # Rank 1 reads the bad row; both ranks fail instead of one hanging in the all-reduce.
        scan_kept_ids([CountingDataset(10, bad_row=3)], VOCAB, progress=False)


@pytest.mark.distributed
def test_scan_on_two_ranks_equals_one_rank_and_splits_the_rows(tmp_path: Path):
    run_distributed(_scan_worker, 2, str(tmp_path))
    expected = _reference([CountingDataset(301, seed=1), CountingDataset(41, seed=2)], always_keep=(998,))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results[0]["ids"] == expected and results[1]["ids"] == expected
    assert results[0]["read"] == list(range(0, 301, 2)) + [-1] + list(range(0, 41, 2))
    assert results[1]["read"] == list(range(1, 301, 2)) + [-1] + list(range(1, 41, 2))


def test_scanned_ids_round_trip_and_are_reused_only_for_the_same_data(tmp_path: Path):
    path = tmp_path / "recipe_state" / "kept_token_ids.pt"
    data = CountingDataset(50)
    save_scanned_kept_ids(path, [3, 1, 7], VOCAB, [data, None])
    assert torch.load(path, weights_only=True)["kept_ids"].tolist() == [3, 1, 7]
    assert load_scanned_kept_ids(path, VOCAB, [data]) == [3, 1, 7]
    assert load_scanned_kept_ids(path, VOCAB + 1, [data]) is None
    assert load_scanned_kept_ids(path, VOCAB, [CountingDataset(51)]) is None
    assert load_scanned_kept_ids(tmp_path / "absent.pt", VOCAB, [data]) is None

    # A resume takes the saved ids without reading a row; without them, it scans.
    fresh = CountingDataset(50)
    assert resolve_kept_ids(None, VOCAB, object(), [fresh], scanned=path) == [3, 1, 7]
    assert fresh.read == []
    assert resolve_kept_ids(None, VOCAB, object(), [fresh], scanned=tmp_path / "absent.pt") == _reference([data])


def test_estimate_times_a_sample_of_rows():
    data, val = CountingDataset(10_000), CountingDataset(100)
    estimate = estimate_scan_seconds([data, val], VOCAB, world_size=2, sample_rows=64)
    assert estimate.rows == 10_100
    assert estimate.sampled == len(data.read) + len(val.read) == 64
    assert data.read[0] == 0 and data.read[-1] == 9_999  # spread over the data, not its head
    assert estimate.seconds > 0

"""The kept token ids: collected from the data (streamed, shared over ranks), saved and loaded."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from tqdm import tqdm

from torchtune_ext.distributed import group_device, world_info
from torchtune_ext.modules.vocab_pruning._module import KeptIds, validate_kept_ids


def collect_token_ids(
    data: Iterable[Any], always_keep: Iterable[int] = (), vocab_size: Optional[int] = None
) -> List[int]:
    """The sorted set of token ids a dataset uses, plus ``always_keep``.

    Args:
        data (Iterable[Any]): items that are token id sequences (lists or tensors) or dicts with ``"tokens"``
            (and optionally ``"labels"``, whose negative values, e.g. -100, are skipped), such as torchtune's
            SFT datasets.
        always_keep (Iterable[int]): ids to keep whether or not they occur: the tokenizer's bos, eos and pad ids
            (padding is added by the collator, not by the dataset), and any ids generation may need.
        vocab_size (Optional[int]): if given, ids must be in ``[0, vocab_size)``.

    Returns:
        List[int]: sorted unique token ids.

    Raises:
        ValueError: on an item of another type, a negative token id or an id outside the vocabulary.
    """
    seen = set(int(i) for i in always_keep if i is not None)
    for index, item in enumerate(data):
        if isinstance(item, Mapping):
            if "tokens" not in item:
                raise ValueError(f"data item {index} is a mapping without 'tokens' (keys: {sorted(item)}).")
            seen.update(_ids_of(item["tokens"], index))
            if "labels" in item:
                seen.update(i for i in _ids_of(item["labels"], index, skip_negative=True))
        elif isinstance(item, (torch.Tensor, Sequence)) and not isinstance(item, (str, bytes)):
            seen.update(_ids_of(item, index))
        else:
            raise ValueError(
                f"data item {index} is a {type(item).__name__}; expected a token id sequence or a dict with 'tokens'."
            )
    if seen and min(seen) < 0:
        raise ValueError(f"token id {min(seen)} is negative; token ids are in [0, vocab_size).")
    if vocab_size is not None and seen and max(seen) >= vocab_size:
        raise ValueError(f"token id {max(seen)} is outside the vocabulary [0, {vocab_size}).")
    return sorted(seen)


def _ids_of(values: Any, index: int, skip_negative: bool = False) -> List[int]:
    ids = values.flatten().tolist() if isinstance(values, torch.Tensor) else list(values)
    if any(isinstance(i, float) or isinstance(i, bool) for i in ids):
        raise ValueError(f"data item {index} holds non-integer token ids.")
    ids = [int(i) for i in ids]
    return [i for i in ids if i >= 0] if skip_negative else ids


def save_kept_ids(path: Union[str, Path], kept_ids: KeptIds) -> None:
    """Writes kept token ids atomically: a JSON list for ``*.json``, else one id per line.

    Args:
        path (Union[str, Path]): destination file.
        kept_ids (KeptIds): the ids (must be unique non-negative integers).

    Raises:
        ValueError: on empty, non-integer, negative or duplicated ids.
    """
    ids = validate_kept_ids(kept_ids, vocab_size=torch.iinfo(torch.int64).max).tolist()
    text = json.dumps(ids) if Path(path).suffix == ".json" else "".join(f"{i}\n" for i in ids)
    _atomic_write(Path(path), lambda f: f.write(text.encode()))


def _atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Writes a file through ``write(f)`` into a temporary file next to ``path``, then renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_kept_ids(path: Union[str, Path], vocab_size: Optional[int] = None) -> List[int]:
    """Reads kept token ids from a JSON list (``*.json``) or a text file of integers.

    Text files hold integers separated by whitespace or commas; ``#`` starts a comment.

    Args:
        path (Union[str, Path]): the file.
        vocab_size (Optional[int]): if given, the ids are validated against ``[0, vocab_size)``.

    Returns:
        List[int]: the ids, in file order.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: on malformed content, or ids that :func:`validate_kept_ids` rejects.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"kept ids file {str(path)!r} does not exist (write one with save_kept_ids).")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            ids = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{path} must hold a JSON list of integer token ids.")
    else:
        ids = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            for word in line.split("#", 1)[0].replace(",", " ").split():
                try:
                    ids.append(int(word))
                except ValueError:
                    raise ValueError(f"{path}:{line_no}: {word!r} is not an integer token id.") from None
    validate_kept_ids(ids, vocab_size if vocab_size is not None else torch.iinfo(torch.int64).max)
    return ids


#: the file next to the recipe state that holds the scanned kept ids, so a resume does not scan again.
KEPT_IDS_FILENAME = "kept_token_ids.pt"


def _mark_ids(mask: torch.Tensor, values: Any, index: int, skip_negative: bool = False) -> None:
    """Sets ``mask[id] = 1`` for every id of one sample's token ids (a tensor or a sequence)."""
    ids = values if isinstance(values, torch.Tensor) else torch.as_tensor(list(values))
    ids = ids.flatten()
    if ids.numel() == 0:
        return
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"data item {index} holds non-integer token ids ({ids.dtype}).")
    ids = ids.long()
    if skip_negative:
        ids = ids[ids >= 0]
        if ids.numel() == 0:
            return
    low, high = torch.aminmax(ids)
    if low < 0:
        raise ValueError(f"data item {index} has token id {int(low)}: token ids are in [0, vocab_size).")
    if high >= mask.numel():
        raise ValueError(
            f"data item {index} has token id {int(high)}, outside the vocabulary [0, {mask.numel()}); is the "
            "tokenizer the model's?"
        )
    mask[ids] = 1


def _mark_sample(mask: torch.Tensor, item: Any, index: int) -> None:
    if isinstance(item, Mapping):
        if "tokens" not in item:
            raise ValueError(f"data item {index} is a mapping without 'tokens' (keys: {sorted(item)}).")
        _mark_ids(mask, item["tokens"], index)
        if "labels" in item:
            _mark_ids(mask, item["labels"], index, skip_negative=True)
    elif isinstance(item, (torch.Tensor, Sequence)) and not isinstance(item, (str, bytes)):
        _mark_ids(mask, item, index)
    else:
        raise ValueError(
            f"data item {index} is a {type(item).__name__}; expected a token id sequence or a dict with 'tokens'."
        )


def _union_over_ranks(mask: torch.Tensor, error: Optional[BaseException]) -> torch.Tensor:
    """The union of every rank's id mask (an all-reduce MAX of ``uint8``), raising on every rank if one failed."""
    buffer = torch.cat([mask, torch.tensor([error is not None], dtype=torch.uint8)]).to(group_device())
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if buffer[-1]:
        raise RuntimeError("another rank failed while scanning the data for vocab pruning's token ids (see its log).")
    return buffer[:-1].cpu()


def scan_kept_ids(
    datasets: Sequence[Optional[Any]], vocab_size: int, always_keep: Iterable[Optional[int]] = (), progress: bool = True
) -> List[int]:
    """The sorted token ids that the data sets use, plus ``always_keep``, in one streamed pass shared by the ranks.

    Samples are read one at a time into a ``vocab_size`` mask, so memory does not grow with the data. Rank ``r`` of
    ``N`` reads rows ``r, r + N, ...`` of each data set and the masks are merged by an all-reduce MAX (a union):
    every rank gets the same ids. Collective when a process group is initialized. Rank 0 shows a progress bar with
    rows/s.

    Args:
        datasets (Sequence[Optional[Any]]): map-style data sets (``len`` and ``[i]``) whose items are token id
            sequences or dicts with ``"tokens"`` (and ``"labels"``, negative values skipped); None entries are
            skipped.
        vocab_size (int): the model's vocabulary size ``V``.
        always_keep (Iterable[Optional[int]]): ids kept whether or not they occur (the tokenizer's bos, eos and pad
            ids); None entries are skipped.
        progress (bool): show the progress bar on rank 0. Default: True.

    Returns:
        List[int]: the sorted unique ids.

    Raises:
        ValueError: on an item of another type, non-integer ids or ids outside ``[0, vocab_size)`` (on every rank).
    """
    rank, world_size = world_info()
    mask = torch.zeros(vocab_size, dtype=torch.uint8)
    present = [d for d in datasets if d is not None]
    error: Optional[BaseException] = None
    total = sum(len(range(rank, len(d), world_size)) for d in present)
    bar = tqdm(total=total, unit="rows", desc="Vocab pruning: token ids", disable=not progress or rank != 0)
    try:
        for dataset in present:
            for index in range(rank, len(dataset), world_size):
                _mark_sample(mask, dataset[index], index)
                bar.update()
    except (ValueError, TypeError) as err:
        error = err
    finally:
        bar.close()
    if world_size > 1:
        mask = _union_over_ranks(mask, error)
    elif error is not None:
        raise error
    for token_id in always_keep:
        if token_id is not None:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"always_keep id {token_id} is outside the vocabulary [0, {vocab_size}).")
            mask[token_id] = 1
    return mask.nonzero().flatten().tolist()


@dataclass(frozen=True)
class ScanEstimate:
    """How long :func:`scan_kept_ids` will take, from a measured sample of rows.

    Attributes:
        rows (int): rows of all the data sets.
        sampled (int): rows read to measure.
        seconds (float): the pass's estimated time on each rank.
    """

    rows: int
    sampled: int
    seconds: float


def estimate_scan_seconds(
    datasets: Sequence[Optional[Any]], vocab_size: int, world_size: int = 1, sample_rows: int = 64
) -> ScanEstimate:
    """Times reading (and tokenizing) ``sample_rows`` rows spread over the data sets, and scales to the pass.

    Args:
        datasets (Sequence[Optional[Any]]): the data sets :func:`scan_kept_ids` will read.
        vocab_size (int): the model's vocabulary size.
        world_size (int): ranks sharing the pass. Default: 1.
        sample_rows (int): rows to time. Default: 64.

    Returns:
        ScanEstimate: the estimate.
    """
    present = [d for d in datasets if d is not None]
    rows = sum(len(d) for d in present)
    mask = torch.zeros(vocab_size, dtype=torch.uint8)
    sampled = 0
    start = time.perf_counter()
    for dataset in present:
        count = min(len(dataset), max(1, round(sample_rows * len(dataset) / max(rows, 1))))
        for index in torch.linspace(0, len(dataset) - 1, count).round().long().unique().tolist():
            _mark_sample(mask, dataset[index], index)
            sampled += 1
    elapsed = time.perf_counter() - start
    per_rank = -(-rows // world_size)
    return ScanEstimate(rows, sampled, elapsed / max(sampled, 1) * per_rank)


def _row_counts(datasets: Sequence[Optional[Any]]) -> List[int]:
    return [len(d) for d in datasets if d is not None]


def save_scanned_kept_ids(path: Union[str, Path], kept_ids: KeptIds, vocab_size: int, datasets: Sequence[Any]) -> None:
    """Writes the result of :func:`scan_kept_ids` atomically (a plain tensor dict, read with ``weights_only``).

    Args:
        path (Union[str, Path]): the file, e.g. ``<output_dir>/recipe_state/kept_token_ids.pt``.
        kept_ids (KeptIds): the ids.
        vocab_size (int): the vocabulary size they were scanned for.
        datasets (Sequence[Any]): the scanned data sets (their row counts are stored, to recognise them).
    """
    record = {
        "kept_ids": validate_kept_ids(kept_ids, vocab_size),
        "vocab_size": vocab_size,
        "rows": _row_counts(datasets),
    }
    _atomic_write(Path(path), lambda f: torch.save(record, f))


def load_scanned_kept_ids(path: Union[str, Path], vocab_size: int, datasets: Sequence[Any]) -> Optional[List[int]]:
    """The ids :func:`save_scanned_kept_ids` wrote, if they were scanned from data sets of these sizes.

    Args:
        path (Union[str, Path]): the file.
        vocab_size (int): this run's vocabulary size.
        datasets (Sequence[Any]): this run's data sets.

    Returns:
        Optional[List[int]]: the ids; None if the file is absent, unreadable, or from another vocabulary or data.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
        if record["vocab_size"] != vocab_size or list(record["rows"]) != _row_counts(datasets):
            return None
        return validate_kept_ids(record["kept_ids"], vocab_size).tolist()
    except (OSError, RuntimeError, KeyError, TypeError, ValueError):
        return None

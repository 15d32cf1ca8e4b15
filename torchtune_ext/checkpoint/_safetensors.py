"""Read and write safetensors files one tensor at a time.

Why not ``safetensors.safe_open``: it memory-maps the whole file, and every page a read touches stays in the
process's resident set until the file is closed, so reading a shard tensor by tensor peaks at the shard's size in
RSS (measured in BENCHMARKS.md). Here each tensor is read with ``readinto`` into its own buffer, which is the only
host memory it takes. That reader needs each tensor's data offsets, which ``safe_open`` does not expose (it gives
names, shapes and dtypes), so the header is read here too. Writing streams as well: the header is computed from the
tensors' specs, then each tensor's bytes are written as it is produced. The files are plain safetensors
(``safetensors.safe_open`` and ``transformers`` read them).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Sequence, Tuple, Union

import torch

from torchtune_ext.checkpoint._writes import writing

PathLike = Union[str, Path]

_DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES: Dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


class TensorSpec:
    """Name, shape and dtype of a tensor to write.

    Args:
        name (str): the key in the file.
        shape (Sequence[int]): the tensor's shape.
        dtype (torch.dtype): the tensor's dtype.
    """

    def __init__(self, name: str, shape: Sequence[int], dtype: torch.dtype):
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def read_header(path: PathLike) -> Dict[str, Dict]:
    """Reads a safetensors file's header (no tensor data).

    Args:
        path (PathLike): the file.

    Returns:
        Dict[str, Dict]: tensor name -> {"dtype", "shape", "data_offsets"}; "__metadata__" is dropped.

    Raises:
        ValueError: if the file is not a safetensors file.
    """
    with open(path, "rb") as f:
        return _read_header(f, path)[0]


def _read_header(f, path: PathLike) -> Tuple[Dict[str, Dict], int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes).")
    (length,) = struct.unpack("<Q", raw)
    if length > os.fstat(f.fileno()).st_size - 8:
        raise ValueError(f"{path} is not a safetensors file (its header length exceeds the file's size).")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a safetensors file (unreadable header).") from err
    header.pop("__metadata__", None)
    return header, 8 + length


def check_complete(path: PathLike) -> Dict[str, Dict]:
    """Reads a safetensors file's header and checks that the file holds all the data it announces.

    Args:
        path (PathLike): the file.

    Returns:
        Dict[str, Dict]: the header, as :func:`read_header`.

    Raises:
        ValueError: if the file is not a safetensors file or is truncated.
    """
    with open(path, "rb") as f:
        header, data_start = _read_header(f, path)
    needed = data_start + max((info["data_offsets"][1] for info in header.values()), default=0)
    size = os.path.getsize(path)
    if size < needed:
        raise ValueError(
            f"{path} is truncated: its header announces {needed} bytes but the file has {size} (an interrupted "
            "download or copy?); download it again."
        )
    return header


def iter_tensors(path: PathLike, device: Union[str, torch.device] = "cpu") -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for every tensor of a safetensors file, reading one tensor at a time.

    Args:
        path (PathLike): the file.
        device (Union[str, torch.device]): where to put each tensor (it is read into host memory first).

    Yields:
        Tuple[str, torch.Tensor]: in file order.

    Raises:
        ValueError: on a dtype this reader does not know or a truncated file.
    """
    with open(path, "rb") as f:
        header, data_start = _read_header(f, path)
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            yield name, _read_one(f, path, name, info, data_start).to(device)


def read_tensor(path: PathLike, name: str) -> torch.Tensor:
    """Reads one tensor of a safetensors file (its bytes only).

    Args:
        path (PathLike): the file.
        name (str): the tensor's key.

    Returns:
        torch.Tensor: the tensor, on the CPU.

    Raises:
        KeyError: if the file has no such tensor.
        ValueError: on an unsupported dtype or a truncated file.
    """
    with open(path, "rb") as f:
        header, data_start = _read_header(f, path)
        if name not in header:
            raise KeyError(f"{path} has no tensor {name!r}.")
        return _read_one(f, path, name, header[name], data_start)


def _read_one(f, path: PathLike, name: str, info: Dict, data_start: int) -> torch.Tensor:
    if info["dtype"] not in _DTYPES:
        raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}.")
    begin, end = info["data_offsets"]
    buffer = torch.empty(end - begin, dtype=torch.uint8)
    f.seek(data_start + begin)
    if end > begin and f.readinto(memoryview(buffer.numpy())) != end - begin:
        raise ValueError(f"{path} is truncated: tensor {name} ends past the end of the file.")
    return buffer.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def _header_bytes(specs: Sequence[TensorSpec], metadata: Dict[str, str]) -> bytes:
    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        if spec.dtype not in _NAMES:
            raise ValueError(f"Cannot write tensor {spec.name} of dtype {spec.dtype} to safetensors.")
        header[spec.name] = {
            "dtype": _NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def write_tensors(
    path: PathLike,
    specs: Sequence[TensorSpec],
    tensors: Iterable[Tuple[str, torch.Tensor]],
    metadata: Dict[str, str] = None,
) -> None:
    """Writes a safetensors file from a stream of tensors, holding one tensor in memory at a time.

    Args:
        path (PathLike): output file (written in place; callers write into a temporary directory).
        specs (Sequence[TensorSpec]): every tensor's name, shape and dtype, in the order ``tensors`` yields them.
        tensors (Iterable[Tuple[str, torch.Tensor]]): ``(name, tensor)`` pairs matching ``specs``.
        metadata (Dict[str, str]): the header's ``__metadata__``. Default: ``{"format": "pt"}``.

    Raises:
        ValueError: if a tensor does not match its spec, or there are fewer or more tensors than specs.
        WriteError: if the file cannot be written (naming it and the cause).
    """
    with writing(path), open(path, "wb") as f:
        f.write(_header_bytes(specs, metadata or {"format": "pt"}))
        count = 0
        for (name, tensor), spec in zip(tensors, specs):
            if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"Tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match its header entry "
                    f"{spec.name} {spec.shape} {spec.dtype}."
                )
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
            count += 1
        if count != len(specs):
            raise ValueError(f"{path}: expected {len(specs)} tensors, got {count}.")
        f.flush()
        os.fsync(f.fileno())


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> List[List[TensorSpec]]:
    """Splits tensors, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own shard).

    Args:
        specs (Sequence[TensorSpec]): the tensors, in write order.
        max_shard_bytes (int): size limit of a shard.

    Returns:
        List[List[TensorSpec]]: the shards.
    """
    shards: List[List[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards

"""CPU kernels for frozen weights as stored, on x86-64 (``_cpu_kernels.c``): NF4 decoding, and the products of a few
tokens with an NF4 or 16-bit weight.

Why native code: a decoded token multiplies each weight once, so its products are bound by reading the weights. The
torch path first writes a dense fp32 copy of each weight (NF4: eight times its bytes; a 16-bit output projection:
twice) and reads it back; PEFT + bitsandbytes decode through bitsandbytes' fused NF4 kernel. The products here read
the NF4 codes (or the 16-bit values) once, with AVX-512 or AVX2, and compute in fp32 from the weight values torchao
computes (``table[code] * scale`` rounded to the NF4 tensor's dtype), so only the summation order differs; decoding
writes those values exactly, in the dtype asked for, in one pass (torch needs a gather, a multiply and a cast).

They are built on first use with the system C compiler (``$CC``, else ``cc``; under a second) into the cache
folder (``$TORCHTUNE_EXT_CACHE``, else ``~/.cache/torchtune_ext``) under the hash of the source and the compiler
command, and loaded with ctypes; parallel processes build them once (a file lock). Where they cannot be (no
compiler, not an x86-64 CPU with AVX2, FMA and F16C, ``TORCHTUNE_EXT_NATIVE=0``), :func:`cpu_kernels_available` is
False, the callers keep the torch path (same values; products summed in another order), and the reason is logged
once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import filelock
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from torchtune_ext._cache import cache_dir
from torchtune_ext._compat import NF4Tensor

#: products of at most this many tokens (rows) go through the kernel; more: the torch path (dequantize, then one
#: matrix product, which reuses each dequantized weight across the tokens).
MAX_TOKENS = 4
#: the environment variable that turns the kernels off (``0``) or keeps them to AVX2 on an AVX-512 CPU (``avx2``).
ENV_SWITCH = "TORCHTUNE_EXT_NATIVE"

_SOURCE = Path(__file__).with_name("_cpu_kernels.c")
_ROUND_MODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_log = logging.getLogger(__name__)
_state: Dict[str, Any] = {}  # "library" and "level" once loaded, "reason" when it cannot be
_tables: Dict[torch.dtype, torch.Tensor] = {}
_layouts = WeakIdKeyDictionary()  # codes tensor -> Optional[_NF4Layout]


class _Unavailable(RuntimeError):
    """Why the kernels cannot run; ``fixable``: by the user (a compiler), so worth a warning."""

    def __init__(self, reason: str, fixable: bool = False):
        super().__init__(reason)
        self.fixable = fixable


def _compiler_command(output: Path, openmp: bool) -> list:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise _Unavailable(f"no C compiler ({compiler!r} is not on PATH)", fixable=True)
    flags = ["-O3", "-fPIC", "-shared", *(["-fopenmp"] if openmp else [])]
    return [compiler, *flags, str(_SOURCE), "-o", str(output)]


def _build(target: Path) -> None:
    """Compiles the kernel into ``target`` (written whole, then renamed into place)."""
    errors = []
    for openmp in (True, False):  # Apple's clang has no OpenMP: one thread per product there
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = _compiler_command(built, openmp)
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                os.replace(built, target)
                return
            errors.append(f"{' '.join(command)}: {result.stderr.strip()[-400:]}")
    raise _Unavailable("the C compiler failed: " + " | ".join(errors), fixable=True)


def _load() -> ctypes.CDLL:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        raise _Unavailable(f"{ENV_SWITCH}=0")
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform not in ("linux", "darwin"):
        raise _Unavailable(f"written for x86-64 Linux and macOS, not {platform.machine()} {sys.platform}")
    digest = hashlib.sha256(_SOURCE.read_bytes() + repr(_compiler_command(Path("x"), True)).encode()).hexdigest()
    target = cache_dir() / "kernels" / f"cpu_kernels-{digest[:16]}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(target) + ".lock"):
        if not target.is_file():
            _build(target)
    library = ctypes.CDLL(str(target))
    level = library.tte_cpu_level()  # 1: AVX-512F, 2: AVX2 + FMA + F16C
    if level == 0:
        raise _Unavailable("this CPU has neither AVX-512F nor AVX2 + FMA + F16C")
    if os.environ.get(ENV_SWITCH) == "avx2":  # every AVX-512 CPU has AVX2, FMA and F16C
        level = 2
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.tte_nf4_gemv.argtypes = [i32, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i32, ptr, i32]
    library.tte_nf4_gemv.restype = None
    library.tte_dense16_gemv.argtypes = [i32, ptr, i64, i64, ptr, i64, i32, ptr, i32]
    library.tte_dense16_gemv.restype = None
    library.tte_nf4_decode.argtypes = [i32, ptr, i64, ptr, i64, ptr, i64, i64, i64, i32, i32, ptr, i64, i32]
    library.tte_nf4_decode.restype = None
    _state["level"] = level
    return library


def _library() -> Optional[ctypes.CDLL]:
    if "library" not in _state and "reason" not in _state:
        try:
            _state["library"] = _load()
        except (_Unavailable, OSError, subprocess.SubprocessError) as error:
            _state["reason"] = str(error)
            fixable = getattr(error, "fixable", True)  # OSError: an unwritable cache folder, a broken build
            _log.log(
                logging.WARNING if fixable else logging.INFO,
                "CPU NF4 kernels unavailable (%s): NF4 decoding and generation on this CPU go through torch, several "
                "times slower per generated token%s",
                error,
                f"; install a C compiler or set CC to one (or {ENV_SWITCH}=0 to use torch without this warning)"
                if fixable
                else "",
            )
    return _state.get("library")


def cpu_kernels_available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call).

    Returns:
        bool: True where :func:`nf4_mv` and :func:`dense16_mv` can run.
    """
    return _library() is not None


def cpu_kernels_unavailable_reason() -> Optional[str]:
    """
    Returns:
        Optional[str]: why the kernel is unavailable (after :func:`cpu_kernels_available` said so), else None.
    """
    return _state.get("reason")


def _levels(dtype: torch.dtype, nf4: torch.Tensor) -> torch.Tensor:
    """The NF4 table in fp32 (every NF4Tensor of a dtype carries the same 16 levels, ``nf4``)."""
    table = _tables.get(dtype)
    if table is None:
        table = _tables[dtype] = nf4.float().contiguous()
    return table


@contextmanager
def cpu_kernels_off() -> Iterator[None]:
    """Within: the kernels are reported unavailable, so NF4 decoding and products take the torch path (the memory
    estimate, which models an accelerator's step; comparisons). Nests.
    """
    global _state
    saved = _state
    _state = {"reason": "turned off by cpu_kernels_off()"}
    try:
        yield
    finally:
        _state = saved


def _plain_cpu(x: torch.Tensor) -> bool:
    """CPU tensors that hold data (not fake, not traced by torch.compile: the kernels are opaque to both), the
    kernels available. Compiling is asked first: dynamo folds it, and traces nothing after it."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or not cpu_kernels_available():
        return False
    return not is_fake(x)


@dataclass(frozen=True)
class _NF4Layout:
    out_dim: int
    in_dim: int
    dtype: torch.dtype


def _nf4_layout(weight: NF4Tensor) -> Optional[_NF4Layout]:
    """``weight``'s shape and dtype where the kernels can read it, else None; kept per codes tensor (each attribute
    of an NF4Tensor goes through its ``__torch_function__``: a decoded token would pay for them in every layer; a
    weight moved or converted gets new codes)."""
    codes = weight.quantized_data
    if codes in _layouts:
        return _layouts[codes]
    layout = None
    on_cpu = weight.device.type == "cpu" and not is_fake(weight)
    if on_cpu and weight.dim() == 2 and weight.is_contiguous() and weight.dtype in _ROUND_MODES:
        (out_dim, in_dim), block_size = weight.shape, weight.block_size
        aligned = in_dim % 32 == 0 and block_size % 32 == 0 and in_dim % block_size == 0
        if aligned and codes.is_contiguous() and codes.numel() * 2 == weight.numel():
            layout = _NF4Layout(out_dim, in_dim, weight.dtype)
    _layouts[codes] = layout
    return layout


def nf4_mv_supports(x: torch.Tensor, weight: NF4Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`nf4_mv` computes ``x.to(dtype) @ dequant(weight, dtype).T``: at most :data:`MAX_TOKENS`
    tokens on the CPU, a contiguous 2-D weight of whole blocks whose width and block size are multiples of 32, a
    compute ``dtype`` that is fp32 or the weight's, and the kernels available.

    Args:
        x (torch.Tensor): ``(..., in_dim)``.
        weight (NF4Tensor): ``(out_dim, in_dim)``.
        dtype (torch.dtype): the compute dtype.

    Returns:
        bool: whether the kernel applies.
    """
    if not _plain_cpu(x):
        return False
    layout = _nf4_layout(weight)
    return layout is not None and x.numel() <= MAX_TOKENS * layout.in_dim and dtype in (torch.float32, layout.dtype)


def nf4_mv(x: torch.Tensor, weight: NF4Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype) @ dequant(weight, dtype).T``, reading the NF4 codes (where :func:`nf4_mv_supports`): the
    weight's values in its dtype, products summed in fp32, the result in ``dtype``.

    Args:
        x (torch.Tensor): ``(..., in_dim)``.
        weight (NF4Tensor): ``(out_dim, in_dim)``.
        scales (torch.Tensor): its dequantized block scales in fp32, contiguous (``dequantize_nf4_scalers``).
        dtype (torch.dtype): the compute dtype.

    Returns:
        torch.Tensor: ``(..., out_dim)`` in ``dtype``.
    """
    layout = _layouts[weight.quantized_data]
    tokens = x.numel() // layout.in_dim
    # the kernel takes each group of 32 values as its 16 even positions, then its 16 odd ones
    grouped = x.to(dtype).float().reshape(tokens, layout.in_dim // 32, 16, 2).transpose(-1, -2).contiguous()
    out = torch.empty(tokens, layout.out_dim, dtype=torch.float32)
    _library().tte_nf4_gemv(
        _state["level"],
        grouped.data_ptr(),
        tokens,
        layout.in_dim,
        weight.quantized_data.data_ptr(),
        scales.data_ptr(),
        _levels(layout.dtype, weight.nf4).data_ptr(),
        layout.out_dim,
        weight.block_size,
        _ROUND_MODES[layout.dtype],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], layout.out_dim).to(dtype)


def dense16_mv_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`dense16_mv` computes ``x @ weight.T``: a CPU ``x`` of at most :data:`MAX_TOKENS` rows, a
    contiguous 2-D bf16 or fp16 weight, and the kernel available.

    Args:
        x (torch.Tensor): ``(tokens, in_dim)``.
        weight (torch.Tensor): ``(out_dim, in_dim)``.

    Returns:
        bool: whether the kernel applies.
    """
    if not (_plain_cpu(x) and _plain_cpu(weight)) or x.dim() != 2 or x.shape[0] > MAX_TOKENS:
        return False
    sixteen_bit = weight.dtype in (torch.bfloat16, torch.float16) and weight.dim() == 2
    return sixteen_bit and weight.is_contiguous()


def dense16_mv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp32 for a 16-bit weight, reading it as stored (where :func:`dense16_mv_supports`).

    Args:
        x (torch.Tensor): ``(tokens, in_dim)``, any float dtype (read as fp32).
        weight (torch.Tensor): ``(out_dim, in_dim)``, bf16 or fp16.

    Returns:
        torch.Tensor: ``(tokens, out_dim)`` in fp32.
    """
    tokens, in_dim = x.shape
    x = x.float().contiguous()
    out = torch.empty(tokens, weight.shape[0], dtype=torch.float32)
    _library().tte_dense16_gemv(
        _state["level"],
        x.data_ptr(),
        tokens,
        in_dim,
        weight.data_ptr(),
        weight.shape[0],
        int(weight.dtype == torch.float16),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def nf4_decode_supports(weight: NF4Tensor, packed: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether :func:`nf4_decode` decodes ``packed`` into ``out``: CPU tensors with data, rows of whole blocks whose
    length and block size are multiples of 32, unit strides within a row, an fp32/bf16/fp16 weight and output, and
    the kernel available.

    Args:
        weight (NF4Tensor): the weight the codes belong to.
        packed (torch.Tensor): ``(rows, cols // 2)`` uint8 codes (or 1-D: one row).
        out (torch.Tensor): ``(rows, cols)`` (or 1-D) to write.

    Returns:
        bool: whether the kernel applies.
    """
    if not (_plain_cpu(packed) and _plain_cpu(out)) or packed.dim() not in (1, 2) or packed.dim() != out.dim():
        return False
    cols, block_size = out.shape[-1], weight.block_size
    aligned = cols % 32 == 0 and block_size % 32 == 0 and cols % block_size == 0 and packed.shape[-1] * 2 == cols
    unit = packed.stride(-1) == 1 and out.stride(-1) == 1 and packed.dtype == torch.uint8
    dtypes = weight.dtype in _ROUND_MODES and out.dtype in _ROUND_MODES
    return aligned and unit and dtypes


def nf4_decode(weight: NF4Tensor, packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Writes the weight values of ``packed`` into ``out`` (where :func:`nf4_decode_supports`): torchao's
    ``table[code] * scale`` in the weight's dtype, converted to ``out``'s dtype as ``.to`` would.

    Args:
        weight (NF4Tensor): the weight the codes belong to.
        packed (torch.Tensor): ``(rows, cols // 2)`` uint8 codes, two per byte (the high nibble first).
        scales (torch.Tensor): ``(rows, cols // block_size)`` fp32 block scales (1-D with a 1-D ``packed``), unit
            stride within a row.
        out (torch.Tensor): ``(rows, cols)``.
    """
    packed, scales, out = (t if t.dim() == 2 else t.unsqueeze(0) for t in (packed, scales, out))
    _library().tte_nf4_decode(
        _state["level"],
        packed.data_ptr(),
        packed.stride(0),
        scales.data_ptr(),
        scales.stride(0),
        _levels(weight.dtype, weight.nf4).data_ptr(),
        out.shape[0],
        out.shape[1],
        weight.block_size,
        _ROUND_MODES[weight.dtype],
        _ROUND_MODES[out.dtype],
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )

"""``tune-ext merge``: a LoRA adapter (ours or PEFT's) merged into its HF base checkpoint without a GPU, streamed
shard by shard: every base tensor is read from its file when its turn comes, merged and written, so host memory
stays near one tensor plus the adapter. The merge itself is the training recipe's
(:meth:`~torchtune_ext.checkpoint.QLoRAHFCheckpointer.write_merged`): the same files, bit for bit, as the
recipe's ``merged/`` folder for the same adapter and ``merge_base``."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from torchtune_ext.checkpoint import (
    MERGE_BASES,
    QLoRAHFCheckpointer,
    atomic_directory,
    base_keys,
    check_writable,
    read_adapter_state,
    read_hf_config,
    read_peft_adapter,
)
from torchtune_ext.config import ConfigError
from torchtune_ext.generation import build_model_for
from torchtune_ext.models import torchtune_builder_for
from torchtune_ext.nf4 import NF4Tensor, quantize_nf4
from torchtune_ext.training import dtype_or_checkpoints

PathLike = Union[str, Path]


class _StreamedState(Mapping[str, torch.Tensor]):
    """The trained model's state dict as the recipe's merge reads it, made on demand: base weights read from the
    checkpoint when asked for (NF4 weights quantized as the training loader does, in the compute dtype; the others
    in the model's dtypes), the adapter's tensors from memory."""

    def __init__(
        self,
        checkpointer: QLoRAHFCheckpointer,
        model_dtypes: Dict[str, Tuple[torch.dtype, bool]],
        adapters: Dict[str, torch.Tensor],
        token_rows: Dict[str, Tuple[List[int], torch.Tensor]],
    ):
        self._checkpointer = checkpointer
        self._model_dtypes = model_dtypes  # key -> (dtype, is NF4)
        self._adapters = adapters
        self._token_rows = token_rows

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._adapters:
            return self._adapters[key]
        dtype, nf4 = self._model_dtypes[key]
        tensor = self._checkpointer.read_tensor(key).to(dtype)
        if key in self._token_rows:
            ids, rows = self._token_rows[key]
            tensor[torch.as_tensor(ids)] = rows.to(dtype)
        return quantize_nf4(tensor) if nf4 else tensor

    def __iter__(self) -> Iterator[str]:
        yield from self._model_dtypes
        yield from self._adapters

    def __len__(self) -> int:
        return len(self._model_dtypes) + len(self._adapters)

    def __contains__(self, key: object) -> bool:
        return key in self._model_dtypes or key in self._adapters


def merge_adapter(
    base_dir: PathLike,
    adapter_dir: PathLike,
    output_dir: PathLike,
    *,
    merged_dtype: Optional[str] = None,
    merge_base: str = "nf4",
    compute_dtype: Optional[str] = None,
    max_shard_size_mb: int = 4096,
) -> Path:
    """Merges a PEFT LoRA adapter into its base HF checkpoint and writes an HF model folder, atomically.

    Args:
        base_dir (PathLike): the base HF folder (``config.json`` + safetensors).
        adapter_dir (PathLike): the adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        output_dir (PathLike): the merged model's folder: new, empty or an earlier merge's (replaced).
        merged_dtype (Optional[str]): fp32, bf16 or fp16; None: the base checkpoint's own dtype.
        merge_base (str): ``nf4``: onto the NF4-dequantized base (the model as trained); ``original``: onto the
            checkpoint's own weights (PEFT's ``merge_and_unload`` on the original model).
        compute_dtype (Optional[str]): the dtype the adapter trained in, in which ``nf4`` quantizes the base (as
            the training loader did); None: the base checkpoint's dtype.
        max_shard_size_mb (int): size limit of a merged shard.

    Returns:
        Path: ``output_dir``.

    Raises:
        ConfigError: naming the flag of ``tune-ext merge`` (``--base``, ``--adapter``, ``--output``, ...) and the
            fix: a missing base or adapter (``ConfigFileNotFoundError``), an adapter that does not fit the base, an
            unknown dtype or ``merge_base``, an output that is a file, inside the base's folder, holding other files
            or not writable; all before anything is written.
    """
    if merge_base not in MERGE_BASES:
        raise ConfigError(f"--merge-base={merge_base!r} is not supported; use one of {list(MERGE_BASES)}.")
    model_type = torchtune_builder_for(read_hf_config(Path(base_dir), "--base"))[2]
    adapter = read_peft_adapter(adapter_dir, "--adapter")
    output_dir = _check_output(Path(output_dir), Path(base_dir))
    checkpointer = QLoRAHFCheckpointer(str(base_dir), str(output_dir), model_type, max_shard_size_mb=max_shard_size_mb)
    compute = dtype_or_checkpoints(compute_dtype, checkpointer.hf_config, "--compute-dtype")
    merged = dtype_or_checkpoints(merged_dtype, checkpointer.hf_config, "--merged-dtype")
    model = build_model_for(checkpointer, adapter, None, compute)
    base = base_keys(model)
    dtypes = {key: (value.dtype, isinstance(value, NF4Tensor)) for key, value in base.items()}
    adapters, token_rows = read_adapter_state(adapter, checkpointer.converter, torch.float32)
    state = _StreamedState(checkpointer, dtypes, adapters, token_rows)
    config = {"rank": int(adapter.config["r"]), "alpha": adapter.config["lora_alpha"]}
    with atomic_directory(output_dir) as tmp:
        shapes = {key: value.shape for key, value in base.items()}
        checkpointer.write_merged(state, tmp, merged, config, merge_base, shapes=shapes)
    return output_dir


def _check_output(output_dir: Path, base_dir: Path) -> Path:
    """``--output``: a folder to create (or an earlier merge's, to replace), outside the base's folder, that this user
    can write."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(
            f"--output={str(output_dir)!r} is a file; the merged model is a folder: give a folder path.", "--output"
        )
    base = base_dir.resolve()
    if output_dir.resolve() == base or base in output_dir.resolve().parents:
        raise ConfigError(
            f"--output={str(output_dir)!r} is inside --base={str(base_dir)!r}; give a folder outside the base model's.",
            "--output",
        )
    if output_dir.is_dir() and any(output_dir.iterdir()) and not (output_dir / "config.json").is_file():
        raise ConfigError(
            f"--output={str(output_dir)!r} holds files that are not a merged model, and a merge replaces the folder; "
            "give a new folder (or an earlier merge's).",
            "--output",
        )
    check_writable(output_dir, "--output")
    return output_dir

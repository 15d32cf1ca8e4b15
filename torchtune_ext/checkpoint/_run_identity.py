"""What defines a run, which a resume must match: :class:`RunIdentity` (the config keys that define the run, the
base checkpoint's files and the tokenizer's files by content, the data set's size and the global batch) and the
lines that list where a resumed run differs from the saved one."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf

from torchtune_ext.config import TOKENIZER_FILE_KEYS

PathLike = Union[str, Path]

#: Config keys (and key prefixes, ending in ".") that define the run: a resume must match them.
IDENTITY_CONFIG_KEYS = (
    "model.",
    "tokenizer.",
    "dataset.",
    "vocab_pruning.",
    "checkpointer.model_type",
    "seed",
    "shuffle",
    "gradient_accumulation_steps",
    "optimizer._component_",
    "lr_scheduler._component_",
    "collate_fn",
)
#: The identity entry of the tokenizer's files: their content (:func:`tokenizer_files_identity`), not their paths
#: (moving a folder is not another run).
TOKENIZER_FILES = "tokenizer_files"
#: Config keys replaced by derived identity entries, or meaningless to compare.
NOT_COMPARED = ("resume_from_checkpoint", "dtype", "adapter_dtype", "frozen_dtype", "global_batch_size")
#: Bytes of the data region of each base checkpoint file that its identity hashes, at evenly spaced offsets.
BASE_SAMPLE_BYTES, BASE_SAMPLES = 4096, 16
_UNSET = "(unset)"


def flatten_config(cfg: Union[DictConfig, Dict[str, Any]]) -> Dict[str, Any]:
    """A config as ``{"a.b.c": value}`` with interpolations resolved; lists of scalars stay lists, lists of
    sections are numbered (``dataset.0.source``).

    Args:
        cfg (Union[DictConfig, Dict[str, Any]]): the recipe config.

    Returns:
        Dict[str, Any]: the flat config, plain types only.
    """
    tree = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False) if isinstance(cfg, DictConfig) else cfg
    flat: Dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                walk(f"{prefix}{key}.", child)
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            for i, child in enumerate(value):
                walk(f"{prefix}{i}.", child)
        else:
            flat[prefix[:-1]] = list(value) if isinstance(value, (list, tuple)) else value

    walk("", tree)
    return flat


def names_tokenizer_file(key: str) -> bool:
    return key.startswith("tokenizer.") and key.split(".")[-1] in TOKENIZER_FILE_KEYS


def _defines_run(key: str) -> bool:
    if names_tokenizer_file(key):
        return False
    return any(key.startswith(k) if k.endswith(".") else key == k for k in IDENTITY_CONFIG_KEYS)


def base_checkpoint_identity(paths: Sequence[PathLike]) -> Dict[str, str]:
    """An identity of each base checkpoint file that costs a few reads, whatever its size: its size, a hash of its
    safetensors header (names, dtypes, shapes) and a hash of ``BASE_SAMPLES`` blocks of its data at evenly spaced
    offsets (other weights of the same shapes, e.g. another fine-tune of the same model, differ there).

    Args:
        paths (Sequence[PathLike]): the checkpoint's safetensors files.

    Returns:
        Dict[str, str]: ``base_checkpoint.<file name>`` -> ``"<size> bytes, header <hash>, data <hash>"``.
    """
    identity = {}
    for path in paths:
        path = Path(path)
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            length = int.from_bytes(raw, "little") if len(raw) == 8 else 0
            header = hashlib.sha256(raw + f.read(min(length, size))).hexdigest()[:16]
            start = 8 + length
            data = hashlib.sha256()
            span = max(size - start - BASE_SAMPLE_BYTES, 0)
            for i in range(BASE_SAMPLES):
                f.seek(start + span * i // max(BASE_SAMPLES - 1, 1))
                data.update(f.read(BASE_SAMPLE_BYTES))
        identity[f"base_checkpoint.{path.name}"] = f"{size} bytes, header {header}, data {data.hexdigest()[:16]}"
    return identity


def tokenizer_files_identity(tokenizer: Dict[str, Any]) -> Dict[str, str]:
    """The content of each file the tokenizer section names (``TOKENIZER_FILE_KEYS``): its size and a hash of all of
    it (tokenizer files are megabytes; the base checkpoint's identity samples its gigabytes). Another tokenizer gives
    other token ids, at another path or rewritten at the same one; the same file in another folder is the same run.

    Args:
        tokenizer (Dict[str, Any]): the ``tokenizer`` section, interpolations resolved.

    Returns:
        Dict[str, str]: ``<key>`` -> ``"<size> bytes, sha256 <hash>"``, for each file key set (paths relative to the
        working directory, as the tokenizer reads them).
    """
    identity = {}
    for key in TOKENIZER_FILE_KEYS:
        value = tokenizer.get(key)
        if isinstance(value, str):
            data = Path(value).read_bytes()
            identity[key] = f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}"
    return identity


@dataclass(frozen=True)
class RunIdentity:
    """What a run is (``identity``: a resume must match it) and how it is run (``settings``: may change on resume).

    Args:
        identity (Dict[str, Any]): flat keys -> plain values.
        settings (Dict[str, Any]): the rest of the config, flat.
    """

    identity: Dict[str, Any]
    settings: Dict[str, Any]

    @classmethod
    def from_config(
        cls,
        cfg: DictConfig,
        *,
        checkpoint_paths: Sequence[PathLike],
        dataset_size: int,
        global_batch_size: int,
        dtypes: Dict[str, torch.dtype],
    ) -> RunIdentity:
        """
        Args:
            cfg (DictConfig): the recipe config.
            checkpoint_paths (Sequence[PathLike]): the base checkpoint's files.
            dataset_size (int): samples in the training data set.
            global_batch_size (int): samples per micro-batch over all ranks (per-rank ``batch_size`` x ranks).
            dtypes (Dict[str, torch.dtype]): the resolved ``dtype``, ``adapter_dtype`` and ``frozen_dtype``.

        Returns:
            RunIdentity: the run's identity and settings.
        """
        flat = flatten_config(cfg)
        identity = {k: v for k, v in flat.items() if _defines_run(k)}
        identity.update({name: str(dtype).replace("torch.", "") for name, dtype in dtypes.items()})
        identity.update(
            dataset_size=int(dataset_size),
            global_batch_size=int(global_batch_size),
            **base_checkpoint_identity(checkpoint_paths),
        )
        tokenizer = {k[len("tokenizer.") :]: v for k, v in flat.items() if k.startswith("tokenizer.")}
        identity[TOKENIZER_FILES] = tokenizer_files_identity(tokenizer)
        settings = {k: v for k, v in flat.items() if not _defines_run(k) and k not in NOT_COMPARED}
        return cls(identity=identity, settings=settings)


def _show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def differences(saved: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """``key: saved -> current`` for every key whose value differs (``(unset)`` where a side lacks it)."""
    keys = sorted(set(saved) | set(current))
    return [
        f"{key}: {_show(saved.get(key, _UNSET))} -> {_show(current.get(key, _UNSET))}"
        for key in keys
        if saved.get(key, _UNSET) != current.get(key, _UNSET)
    ]


def _without_disabled_pruning(identity: Dict[str, Any]) -> Dict[str, Any]:
    """``identity`` without its ``vocab_pruning.*`` keys where pruning is off: a section with ``enabled: False``
    (the distributed configs', whatever its other keys say) and none (the single-device configs') are the same run."""
    if identity.get("vocab_pruning.enabled"):
        return identity
    return {k: v for k, v in identity.items() if not k.startswith("vocab_pruning.")}


def identity_differences(saved: RunIdentity, current: RunIdentity) -> Tuple[List[str], List[str]]:
    """Where ``current`` is not the ``saved`` run.

    Args:
        saved (RunIdentity): the saved run's identity and settings.
        current (RunIdentity): this run's.

    Returns:
        Tuple[List[str], List[str]]: the differences in what defines the run (a resume is refused on any), and
        lines to log (the tokenizer files an older state did not record).
    """
    # Older states recorded no tokenizer files, and some tokenizer paths among the config keys compared.
    old = _without_disabled_pruning({k: v for k, v in saved.identity.items() if not names_tokenizer_file(k)})
    new = _without_disabled_pruning(dict(current.identity))
    saved_files, files = old.pop(TOKENIZER_FILES, None), new.pop(TOKENIZER_FILES, {})
    changed = differences(old, new)
    notes = []
    if saved_files is None and files:
        notes.append(
            f"The recipe state does not record the tokenizer's files (saved by an earlier version): "
            f"tokenizer.{', tokenizer.'.join(files)} not compared with the saved run's."
        )
    elif saved_files is not None:
        changed += _tokenizer_changes(saved_files, files, saved.settings, current.settings)
    return changed, notes


def _tokenizer_changes(
    saved: Dict[str, str], current: Dict[str, str], saved_settings: Dict[str, Any], settings: Dict[str, Any]
) -> List[str]:
    """``tokenizer.<key>: <saved path> (<content>) -> <path> (<content>): ...; <fix>`` for each tokenizer file whose
    content differs from the saved run's."""
    lines = []
    for key in TOKENIZER_FILE_KEYS:
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        old_path, new_path = saved_settings.get(f"tokenizer.{key}"), settings.get(f"tokenizer.{key}")
        if old is None:
            fix = f"remove tokenizer.{key}"
        elif old_path == new_path:
            fix = f"put back the {old_path} the run trained with"
        else:
            fix = f"set tokenizer.{key}={old_path}"
        was = f"{old_path} ({old})" if old else "(not set)"
        now = f"{new_path} ({new})" if new else "(not set)"
        lines.append(f"tokenizer.{key}: {was} -> {now}: another tokenizer gives other token ids; {fix}")
    return lines


def batch_hint(saved: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """How to resume with the saved global batch on this run's ranks, when it differs."""
    old, new = saved.get("global_batch_size"), current.get("global_batch_size")
    if old == new or not isinstance(old, int):
        return []
    return [
        f"(global_batch_size is samples per micro-batch over all ranks: batch_size per rank x ranks; set "
        f"global_batch_size={old} (distributed recipe) or batch_size so that it is {old} on this number of ranks)"
    ]

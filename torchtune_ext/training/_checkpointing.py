"""Streaming HF checkpoints for QLoRA models: load tensor by tensor into NF4, save PEFT adapters, merged models and
resumable recipe state, every write atomic.

Loading: the model is built on the meta device; each checkpoint tensor is read on its own (see
``_safetensors``), converted to torchtune's layout, cast to the compute dtype on the training device and, for
the frozen linears, quantized to NF4 right away, so host memory stays near one tensor plus the NF4 model instead
of a whole high-precision state dict (torchtune's ``FullModelHFCheckpointer`` loads every file into one dict).

Saving, under ``output_dir``:

- ``step_{N}/adapter/``: ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT format, for
  ``peft.PeftModel.from_pretrained(base, path)``), adapter tensors in their param dtype.
- ``step_{N}/merged/``: the merged model, ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` +
  ``config.json`` (+ the base folder's tokenizer files), in the compute dtype. No ``adapter_*`` files here:
  transformers would apply them on top of already merged weights.
- ``recipe_state/recipe_state.pt``: adapters in torchtune keys, optimizer, LR scheduler, loss scaler, data
  loader position, RNG states, step, for ``resume_from_checkpoint=True``.

Every folder is written into a temporary sibling and renamed into place; the recipe state file is replaced with
``os.replace``; a crash never leaves a half-written checkpoint under its final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torchtune.modules.peft import get_merged_lora_ckpt
from torchtune.training.checkpointing._utils import FormattedCheckpointFiles

from torchtune_ext._compat import NF4Tensor
from torchtune_ext.modules.low_precision import dequantize_nf4, to_nf4_frozen
from torchtune_ext.modules.peft import DoRALinear, LoRALinear
from torchtune_ext.training import _safetensors
from torchtune_ext.training._hf import HFConverter, hf_dtype_name, is_adapter_key, peft_adapter_config, read_hf_config

PathLike = Union[str, Path]

SAFETENSORS_INDEX = "model.safetensors.index.json"
ADAPTER_DIRNAME = "adapter"
MERGED_DIRNAME = "merged"
RECIPE_STATE_DIRNAME = "recipe_state"
RECIPE_STATE_FILENAME = "recipe_state.pt"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_EMBEDDING_KEYS = ("tok_embeddings.weight", "output.weight")


# --------------------------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_directory(final: PathLike) -> Iterator[Path]:
    """Yields a temporary sibling of ``final`` to write into; on success it is renamed to ``final``.

    An existing ``final`` is replaced (moved aside, then deleted after the rename). On an exception the temporary
    folder is deleted and ``final`` is left as it was.

    Args:
        final (PathLike): the folder to produce.

    Yields:
        Path: the temporary folder.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_save(obj: Any, path: PathLike) -> None:
    """``torch.save`` into a temporary file next to ``path``, then ``os.replace`` it into place.

    Args:
        obj (Any): what to save.
        path (PathLike): destination file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """Flushes a file, or a folder's entries (POSIX only: other systems cannot open a folder), to disk."""
    if path.is_dir() and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flushes every file and folder under ``folder``, and ``folder`` itself, so a renamed checkpoint survives a
    machine crash with its data."""
    for path in sorted(folder.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(folder)


_STALE_TEMPORARY = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]{8}$")


def remove_stale_temporaries(folder: PathLike) -> List[Path]:
    """Deletes the temporary files and folders that killed writes of :func:`atomic_directory` and
    :func:`atomic_save` left directly in ``folder`` (``.NAME.tmp-XXXXXXXX``, ``.NAME.old-XXXXXXXX``).

    Call it only while nothing writes into ``folder``.

    Args:
        folder (PathLike): an output folder; a missing one is fine.

    Returns:
        List[Path]: what was deleted.
    """
    folder = Path(folder)
    stale = sorted(p for p in folder.iterdir() if _STALE_TEMPORARY.match(p.name)) if folder.is_dir() else []
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def check_writable(folder: PathLike, what: str) -> None:
    """Checks that ``folder`` exists as a writable folder or can be created, without creating anything.

    Args:
        folder (PathLike): the folder.
        what (str): its config key, for the error.

    Raises:
        ValueError: if the nearest existing ancestor is not a folder, or not writable.
    """
    ancestor = Path(folder).absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(
            f"{what}={str(folder)!r} is not writable ({ancestor} is not a folder this user can write to); set "
            f"{what} to a writable folder."
        )


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------------------------- checkpoint files


def resolve_checkpoint_files(
    checkpoint_dir: PathLike, checkpoint_files: Union[List[str], Dict[str, str], None]
) -> List[Path]:
    """The safetensors files of an HF checkpoint, checked to exist.

    Args:
        checkpoint_dir (PathLike): the HF model folder.
        checkpoint_files (Union[List[str], Dict[str, str], None]): file names; torchtune's
            ``{filename_format, max_filename}`` form; or None to read ``model.safetensors.index.json`` (or take
            ``model.safetensors``).

    Returns:
        List[Path]: the files, sorted.

    Raises:
        FileNotFoundError: naming every missing file and what to fix.
        ValueError: on files that are not safetensors.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(
            f"checkpointer.checkpoint_dir={str(checkpoint_dir)!r} does not exist. Download the model first (e.g. "
            "`tune download <hf-repo> --output-dir <dir>`) and point checkpointer.checkpoint_dir at it."
        )
    if isinstance(checkpoint_files, (dict, DictConfig)):
        names = FormattedCheckpointFiles.from_dict(dict(checkpoint_files)).build_checkpoint_filenames()
    elif checkpoint_files is None:
        index = checkpoint_dir / SAFETENSORS_INDEX
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            names = ["model.safetensors"]
    else:
        names = list(checkpoint_files)
    if not names:
        raise ValueError("checkpointer.checkpoint_files is empty; list the model's *.safetensors files.")
    not_safetensors = [n for n in names if not str(n).endswith(".safetensors")]
    if not_safetensors:
        raise ValueError(
            f"checkpointer.checkpoint_files {not_safetensors} are not safetensors files; this checkpointer streams "
            "HF safetensors checkpoints (HF repos ship them as model*.safetensors)."
        )
    paths = sorted(checkpoint_dir / n for n in names)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Checkpoint file(s) not found: {missing}. Fix checkpointer.checkpoint_files (or set it to null to read "
            f"{SAFETENSORS_INDEX}) or checkpointer.checkpoint_dir."
        )
    return paths


# --------------------------------------------------------------------------------------------- module surgery


def _owner(model: nn.Module, key: str) -> Tuple[nn.Module, str]:
    prefix, _, name = key.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), name


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor, requires_grad: bool) -> None:
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value, requires_grad=requires_grad)
    else:
        module._buffers[name] = value


def _base_keys(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's non-adapter state-dict entries (on a meta model: shapes and dtypes, no memory)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not is_adapter_key(k)}


@torch.no_grad()
def materialize_adapters_(model: nn.Module, device: torch.device) -> None:
    """Creates every tensor still on the meta device and initialises it: LoRA (Kaiming A, zero B) from the global
    RNG in module order, DoRA magnitudes from the loaded base, RoPE caches.

    Args:
        model (nn.Module): a model whose base weights are loaded.
        device (torch.device): the training device.

    Raises:
        RuntimeError: if a tensor stays on meta (a weight missing from the checkpoint that is no adapter).
    """
    for module in model.modules():
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None and tensor.is_meta:
                empty = torch.empty_like(tensor, device=device)
                _set_tensor(module, name, empty, getattr(tensor, "requires_grad", False))
    with torch.device(device):
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.initialize_parameters()
            if hasattr(module, "rope_init"):
                module.rope_init()
    for module in model.modules():
        if isinstance(module, DoRALinear):
            module.initialize_dora_magnitude()


def check_materialized(model: nn.Module) -> None:
    """
    Args:
        model (nn.Module): the model.

    Raises:
        RuntimeError: naming params or buffers still on the meta device.
    """
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise RuntimeError(f"{len(meta)} tensors were neither loaded nor initialised, e.g. {meta[:8]}")


# --------------------------------------------------------------------------------------------- the checkpointer


class QLoRAHFCheckpointer:
    """Streams HF safetensors checkpoints into meta-built QLoRA models and writes PEFT / merged HF / recipe state.

    Constructing it only validates paths (nothing is created), so a bad config fails before any work.

    Args:
        checkpoint_dir (str): the HF model folder (``config.json`` + ``*.safetensors``).
        output_dir (str): where checkpoints go (created at the first save).
        model_type (str): LLAMA2, LLAMA3, LLAMA3_2, MISTRAL or QWEN2.
        checkpoint_files (Union[List[str], Dict[str, str], None]): see :func:`resolve_checkpoint_files`.
        recipe_checkpoint (Optional[str]): recipe state to resume from; None: ``output_dir/recipe_state/``.
        base_model_name_or_path (Optional[str]): written into ``adapter_config.json``; None: the ``repo_id`` that
            ``tune download`` left in the folder, else the folder's absolute path.
        max_shard_size_mb (int): size limit of a merged-model shard. Default: 4096.

    Raises:
        FileNotFoundError: on a missing folder, file or ``config.json``.
        ValueError: on an unsupported model type or non-safetensors files.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        output_dir: str,
        model_type: str,
        checkpoint_files: Union[List[str], Dict[str, str], None] = None,
        recipe_checkpoint: Optional[str] = None,
        base_model_name_or_path: Optional[str] = None,
        max_shard_size_mb: int = 4096,
    ):
        if isinstance(checkpoint_files, ListConfig):
            checkpoint_files = OmegaConf.to_container(checkpoint_files)
        HFConverter(model_type, 1, 1, 1, 1, False)  # validates model_type
        self.model_type = model_type
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_paths = resolve_checkpoint_files(self.checkpoint_dir, checkpoint_files)
        self.hf_config = read_hf_config(self.checkpoint_dir)
        self.output_dir = Path(output_dir)
        check_writable(self.output_dir, "output_dir")
        if (
            self.output_dir.resolve() == self.checkpoint_dir.resolve()
            or self.checkpoint_dir.resolve() in self.output_dir.resolve().parents
        ):
            raise ValueError(
                f"output_dir={str(output_dir)!r} is inside checkpointer.checkpoint_dir; pick an output folder outside "
                "the base model's folder."
            )
        self.recipe_checkpoint = (
            Path(recipe_checkpoint)
            if recipe_checkpoint
            else self.output_dir / RECIPE_STATE_DIRNAME / RECIPE_STATE_FILENAME
        )
        self.base_model_name_or_path = base_model_name_or_path or self._repo_id() or str(self.checkpoint_dir.resolve())
        self.max_shard_bytes = int(max_shard_size_mb * 1024**2)

    def _repo_id(self) -> Optional[str]:
        path = self.checkpoint_dir / "original_repo_id.json"
        return json.loads(path.read_text()).get("repo_id") if path.is_file() else None

    # ------------------------------------------------------------------------------------------------ loading

    def validate(self, model: nn.Module) -> None:
        """Checks the checkpoint files against a (meta) model from their headers and sizes only: complete files,
        and the model's keys and shapes.

        Args:
            model (nn.Module): the QLoRA model.

        Raises:
            ValueError: on a truncated file, or listing every unexpected, missing or mis-shaped weight.
        """
        converter = HFConverter.for_model(self.model_type, model)
        expected = _base_keys(model)
        seen, unexpected, mis_shaped = set(), [], []
        for path in self.checkpoint_paths:
            for hf_key, info in _safetensors.check_complete(path).items():
                try:
                    converted = converter.to_tune(hf_key, torch.empty(info["shape"], device="meta"))
                except Exception:  # torchtune's key mapping raises a bare Exception on an unknown key
                    converted = (hf_key, None)
                if converted is None:
                    continue
                key = converted[0]
                if key not in expected:
                    unexpected.append(f"{path.name}: {hf_key}")
                    continue
                shape = tuple(converted[1].shape)
                if tuple(expected[key].shape) != shape:
                    mis_shaped.append(
                        f"{path.name}: {hf_key} has shape {shape} but the configured model expects "
                        f"{tuple(expected[key].shape)} for {key}"
                    )
                seen.add(key)
        missing = sorted(set(expected) - seen)
        if unexpected or missing or mis_shaped:
            problems = (
                [f"{len(unexpected)} tensor(s) that are not a weight of the configured model: {unexpected[:8]}"]
                if unexpected
                else []
            )
            problems += [f"it lacks {len(missing)} weight(s) of the configured model: {missing[:8]}"] if missing else []
            problems += mis_shaped[:8]
            raise ValueError(
                f"The checkpoint in {self.checkpoint_dir} does not match the configured model: "
                + "; ".join(problems)
                + ". Do the model config (`model:`), checkpointer.model_type and checkpointer.checkpoint_files match "
                "the checkpoint?"
            )

    @torch.no_grad()
    def load_base(self, model: nn.Module, device: torch.device) -> None:
        """Streams the base weights into a meta-built model: one tensor at a time, quantizing NF4 weights on the fly.

        Adapters, DoRA magnitudes and RoPE caches are then created by :func:`materialize_adapters_`.

        Args:
            model (nn.Module): the QLoRA model on the meta device.
            device (torch.device): the training device.
        """
        self.validate(model)
        converter = HFConverter.for_model(self.model_type, model)
        expected = _base_keys(model)
        for path in self.checkpoint_paths:
            for hf_key, tensor in _safetensors.iter_tensors(path):
                converted = converter.to_tune(hf_key, tensor)
                if converted is None:
                    continue
                key, value = converted
                target = expected[key]
                value = value.to(device=device, dtype=target.dtype)
                if isinstance(target, NF4Tensor):
                    value = to_nf4_frozen(value, target.block_size, target.scaler_block_size)
                owner, name = _owner(model, key)
                _set_tensor(owner, name, value, requires_grad=False)
                del tensor, value

    # ------------------------------------------------------------------------------------------------ saving

    def _merged_specs(self, state: Dict[str, torch.Tensor], converter: HFConverter, dtype: torch.dtype):
        specs = []
        for key, tensor in state.items():
            if is_adapter_key(key):
                continue
            hf_key, hf_meta = converter.to_hf(key, torch.empty(tensor.shape, device="meta"))
            specs.append((key, _safetensors.TensorSpec(hf_key, hf_meta.shape, dtype)))
        return specs

    @staticmethod
    def _merged_tensor(
        state: Dict[str, torch.Tensor], key: str, dtype: torch.dtype, rank: int, alpha: float
    ) -> torch.Tensor:
        """One tensor of the merged model: dequantized base + (alpha / rank) * B @ A (DoRA: rescaled), in fp32."""
        tensor = state[key]
        dense = dequantize_nf4(tensor) if isinstance(tensor, NF4Tensor) else tensor.detach()
        module_key = key[: -len(".weight")] if key.endswith(".weight") else key
        if f"{module_key}.lora_a.weight" not in state:
            return dense.to(device="cpu", dtype=dtype)
        sub = {key: dense.to(device="cpu", dtype=torch.float32)}
        for suffix in (".lora_a.weight", ".lora_b.weight", ".magnitude"):
            if module_key + suffix in state:
                sub[module_key + suffix] = state[module_key + suffix].detach().to("cpu", torch.float32)
        return get_merged_lora_ckpt(sub, rank=rank, alpha=alpha)[key].to(dtype)

    def _write_merged(self, model: nn.Module, folder: Path, dtype: torch.dtype, rank: int, alpha: float) -> None:
        converter = HFConverter.for_model(self.model_type, model)
        state = _unwrapped_state_dict(model)
        specs = self._merged_specs(state, converter, dtype)
        by_hf_key = {spec.name: key for key, spec in specs}
        shards = _safetensors.plan_shards([spec for _, spec in specs], self.max_shard_bytes)
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"

            def tensors(shard=shard):
                for spec in shard:
                    key = by_hf_key[spec.name]
                    yield converter.to_hf(key, self._merged_tensor(state, key, dtype, rank, alpha))

            _safetensors.write_tensors(folder / name, shard, tensors())
            for spec in shard:
                weight_map[spec.name] = name
                total += spec.nbytes
        _write_json(folder / SAFETENSORS_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(folder / "config.json", {**self.hf_config, "torch_dtype": hf_dtype_name(dtype)})
        for src in sorted(self.checkpoint_dir.iterdir()):
            skip = (
                src.suffix in _WEIGHT_SUFFIXES
                or src.name.startswith("adapter_")
                or src.name in (SAFETENSORS_INDEX, "config.json", "pytorch_model.bin.index.json")
            )
            if src.is_file() and not skip:
                shutil.copy2(src, folder / src.name)

    def _write_adapter(self, model: nn.Module, folder: Path, adapter_config: Dict[str, Any]) -> None:
        converter = HFConverter.for_model(self.model_type, model)
        state = _unwrapped_state_dict(model)
        adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
        converted = [converter.to_peft(k, v.detach().to("cpu")) for k, v in adapters.items()]
        converted += _trainable_token_rows(state, adapter_config.get("trainable_token_indices"))
        specs = [_safetensors.TensorSpec(k, v.shape, v.dtype) for k, v in converted]
        _safetensors.write_tensors(folder / "adapter_model.safetensors", specs, converted)
        config = peft_adapter_config(base_model_name_or_path=self.base_model_name_or_path, **adapter_config)
        _write_json(folder / "adapter_config.json", config)

    def save(
        self,
        model: nn.Module,
        step: int,
        adapter_config: Dict[str, Any],
        save_merged: bool,
        dtype: torch.dtype,
    ) -> Path:
        """Writes ``output_dir/step_{step}/`` atomically: the PEFT adapter and (optionally) the merged model.

        Args:
            model (nn.Module): the trained QLoRA model.
            step (int): global step, names the folder.
            adapter_config (Dict[str, Any]): ``target_modules``, ``rank``, ``alpha``, ``dropout``, ``use_dora``,
                optionally ``trainable_token_indices`` (``{"embed_tokens": ids}``, plus ``"lm_head"`` when
                untied): the adapter then also carries those rows of the model's (full-vocabulary) embedding /
                output weight, as PEFT's trainable tokens.
            save_merged (bool): also write the merged model.
            dtype (torch.dtype): dtype of the merged model's tensors.

        Returns:
            Path: the step folder.
        """
        final = self.output_dir / f"step_{step}"
        with atomic_directory(final) as tmp:
            (tmp / ADAPTER_DIRNAME).mkdir()
            self._write_adapter(model, tmp / ADAPTER_DIRNAME, adapter_config)
            if save_merged:
                (tmp / MERGED_DIRNAME).mkdir()
                self._write_merged(model, tmp / MERGED_DIRNAME, dtype, adapter_config["rank"], adapter_config["alpha"])
        return final

    def remove_stale_temporaries(self) -> List[Path]:
        """Deletes what writes killed in an earlier run left in ``output_dir`` and its recipe-state folder (see
        :func:`remove_stale_temporaries`); call it before this run's first write.

        Returns:
            List[Path]: what was deleted.
        """
        folders = {self.output_dir, self.output_dir / RECIPE_STATE_DIRNAME, self.recipe_checkpoint.parent}
        return [path for folder in sorted(folders) for path in remove_stale_temporaries(folder)]

    def save_recipe_state(self, state: Dict[str, Any]) -> Path:
        """Atomically writes the recipe state for resuming.

        Args:
            state (Dict[str, Any]): the state.

        Returns:
            Path: the file.
        """
        path = self.output_dir / RECIPE_STATE_DIRNAME / RECIPE_STATE_FILENAME
        atomic_save(state, path)
        return path

    def load_recipe_state(self) -> Dict[str, Any]:
        """
        Returns:
            Dict[str, Any]: the saved recipe state.

        Raises:
            FileNotFoundError: if there is none.
        """
        if not self.recipe_checkpoint.is_file():
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {self.recipe_checkpoint} does not exist: resume with the same "
                "output_dir as the interrupted run, or set checkpointer.recipe_checkpoint to its recipe_state.pt."
            )
        try:
            state = torch.load(self.recipe_checkpoint, map_location="cpu", weights_only=False)
        except Exception as err:
            raise ValueError(
                f"{self.recipe_checkpoint} is not a readable recipe state ({type(err).__name__}: {str(err)[:200]}). "
                "Delete it to start over, or set checkpointer.recipe_checkpoint to another recipe_state.pt."
            ) from err
        missing = (
            [k for k in ("global_step", "epochs_run", "adapter", "optimizer", "dtype") if k not in state]
            if isinstance(state, dict)
            else ["a dict"]
        )
        if missing:
            raise ValueError(f"{self.recipe_checkpoint} is not a readable recipe state (it lacks {missing}).")
        return state


#: PEFT trainable-tokens module name -> (torchtune key of the full-vocabulary weight, PEFT key of its rows).
_TRAINABLE_TOKEN_KEYS = {
    "embed_tokens": (
        "tok_embeddings.weight",
        "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta",
    ),
    "lm_head": ("output.weight", "base_model.model.lm_head.token_adapter.trainable_tokens_delta"),
}


def _trainable_token_rows(
    state: Dict[str, torch.Tensor], indices: Optional[Dict[str, List[int]]]
) -> List[Tuple[str, torch.Tensor]]:
    """The PEFT trainable-tokens tensors: the rows at ``indices[name]`` of each named full-vocabulary weight."""
    rows = []
    for name, ids in (indices or {}).items():
        if name not in _TRAINABLE_TOKEN_KEYS:
            raise ValueError(f"trainable_token_indices has {name!r}; supported: {sorted(_TRAINABLE_TOKEN_KEYS)}.")
        tune_key, peft_key = _TRAINABLE_TOKEN_KEYS[name]
        if tune_key not in state:
            raise ValueError(
                f"trainable_token_indices[{name!r}] is set but the model state has no {tune_key!r} (a tied model "
                "has no separate output weight: pass embed_tokens only)."
            )
        weight = state[tune_key].detach().to("cpu")
        rows.append((peft_key, weight[torch.as_tensor(list(ids), dtype=torch.long)].contiguous()))
    return rows


def _unwrapped_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The live params and buffers under clean keys (activation-checkpoint and compile wrappers stripped)."""
    return model.state_dict(keep_vars=True)


# --------------------------------------------------------------------------------------------- random checkpoints


@torch.no_grad()
def write_random_hf_checkpoint(
    checkpoint_dir: PathLike,
    model: nn.Module,
    model_type: str,
    hf_config: Dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    embedding_std: Optional[float] = None,
    max_shard_size_mb: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Path:
    """Writes a random-weight HF checkpoint for a torchtune architecture, one tensor at a time.

    Weights ~ N(0, std) (embeddings: ``embedding_std``), biases ~ N(0, std), norm scales = 1. Used for the tiny
    default and for memory benchmarks.

    Args:
        checkpoint_dir (PathLike): output folder (written atomically).
        model (nn.Module): the architecture, typically built on the meta device (no memory); adapters are ignored.
        model_type (str): checkpointer model type (decides the HF layout).
        hf_config (Dict[str, Any]): written as ``config.json``.
        dtype (torch.dtype): weights' dtype.
        seed (int): RNG seed.
        std (float): init standard deviation.
        embedding_std (Optional[float]): standard deviation of the token embedding (and untied output); None: std.
        max_shard_size_mb (Optional[int]): None: one ``model.safetensors``; else shards + index.
        progress (Optional[Callable[[str], None]]): called with each HF key as it is written.

    Returns:
        Path: ``checkpoint_dir``.
    """
    converter = HFConverter.for_model(model_type, model)
    base = _base_keys(model)
    generator = torch.Generator().manual_seed(seed)

    def make(key: str, shape) -> torch.Tensor:
        if key.endswith(".scale"):
            return torch.ones(shape, dtype=dtype)
        scale = embedding_std if embedding_std is not None and key in _EMBEDDING_KEYS else std
        return torch.empty(shape, dtype=torch.float32).normal_(0, scale, generator=generator).to(dtype)

    specs = [
        _safetensors.TensorSpec(converter.to_hf(k, torch.empty(v.shape, device="meta"))[0], v.shape, dtype)
        for k, v in base.items()
    ]
    keys = dict(zip([s.name for s in specs], base))
    shards = [specs] if max_shard_size_mb is None else _safetensors.plan_shards(specs, max_shard_size_mb * 1024**2)
    with atomic_directory(checkpoint_dir) as tmp:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = (
                "model.safetensors"
                if max_shard_size_mb is None
                else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            )

            def tensors(shard=shard):
                for spec in shard:
                    if progress is not None:
                        progress(spec.name)
                    yield converter.to_hf(keys[spec.name], make(keys[spec.name], base[keys[spec.name]].shape))

            _safetensors.write_tensors(tmp / name, shard, tensors())
            weight_map.update({spec.name: name for spec in shard})
        if max_shard_size_mb is not None:
            total = sum(spec.nbytes for spec in specs)
            _write_json(tmp / SAFETENSORS_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(tmp / "config.json", {**hf_config, "torch_dtype": hf_dtype_name(dtype)})
    return Path(checkpoint_dir)

"""HF checkpoints for QLoRA models: stream the base in, write PEFT adapters, merged HF models and resumable state.

Reading: the checkpoint's safetensors files are read one tensor at a time (see ``_safetensors``) and converted to
torchtune's layout, in chunks of a bounded size (:meth:`QLoRAHFCheckpointer.read_base`), so host memory stays near
one chunk instead of a whole high-precision state dict (torchtune's ``FullModelHFCheckpointer`` loads every file
into one dict). :func:`~torchtune_ext.checkpoint.load_base_` puts the chunks into a (sharded or not) model.

Saving, under ``output_dir``, from a full state dict (:func:`torchtune_ext.distributed.get_full_state_dict`, NF4
weights kept packed):

- ``step_{N}/adapter/``: ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT format, for
  ``peft.PeftModel.from_pretrained(base, path)``), adapter tensors in their param dtype.
- ``step_{N}/merged/``: the merged model, ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` +
  ``config.json`` (+ the base folder's tokenizer files), in the ``dtype`` asked for; its config names it under
  both keys transformers reads (``dtype``: 5.x, ``torch_dtype``: 4.x). No ``adapter_*`` files here: transformers
  would apply them on top of already merged weights. ``merge_base="nf4"`` (default, as torchtune) merges onto the
  NF4-dequantized base, i.e. exactly the trained model; ``"original"`` onto the checkpoint's own weights, read
  tensor by tensor.
- ``recipe_state/recipe_state.pt`` (and the one before, ``recipe_state.prev.pt``): a
  :class:`~torchtune_ext.checkpoint.RecipeState` (adapters in torchtune keys, optimizer, LR scheduler, loss scaler,
  global data position, RNG states, step, the run's identity), for ``resume_from_checkpoint=True``.

Every write is atomic (``_atomic``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torchtune.modules.peft import get_merged_lora_ckpt
from torchtune.training.checkpointing._utils import FormattedCheckpointFiles

from torchtune_ext.checkpoint import _safetensors
from torchtune_ext.checkpoint._atomic import atomic_directory, check_writable, remove_stale_temporaries
from torchtune_ext.checkpoint._hf import (
    SAFETENSORS_INDEX,
    HFConverter,
    is_adapter_key,
    peft_adapter_config,
    read_hf_config,
    write_hf_model_files,
    write_json,
)
from torchtune_ext.checkpoint._recipe_state import RecipeState
from torchtune_ext.checkpoint._validate import check_checkpoint_matches, check_finite_merged
from torchtune_ext.checkpoint._writes import writing
from torchtune_ext.config import ConfigFileNotFoundError  # one line, no traceback
from torchtune_ext.modules.vocab_pruning import is_vocab_key
from torchtune_ext.nf4 import NF4Tensor, dequantize_nf4

PathLike = Union[str, Path]

ADAPTER_DIRNAME = "adapter"
MERGED_DIRNAME = "merged"
RECIPE_STATE_DIRNAME = "recipe_state"
RECIPE_STATE_FILENAME = "recipe_state.pt"
#: ``merge_base`` values: merge onto the NF4-dequantized base (the trained model) or the checkpoint's weights.
MERGE_BASES = ("nf4", "original")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


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
        raise ConfigFileNotFoundError(
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
        raise ConfigFileNotFoundError(
            f"Checkpoint file(s) not found: {missing}. Fix checkpointer.checkpoint_files (or set it to null to read "
            f"{SAFETENSORS_INDEX}) or checkpointer.checkpoint_dir."
        )
    return paths


def base_keys(model: nn.Module) -> Dict[str, torch.Tensor]:
    """
    Args:
        model (nn.Module): a torchtune model (on meta: shapes and dtypes, no memory).

    Returns:
        Dict[str, torch.Tensor]: its state-dict entries that a base checkpoint provides (no adapters), as they are
        in the model (NF4Tensors for quantized weights).
    """
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not is_adapter_key(k)}


class QLoRAHFCheckpointer:
    """Reads HF safetensors checkpoints in chunks and writes PEFT / merged HF / recipe state.

    Constructing it only validates paths (nothing is created), so a bad config fails before any work. Call
    :meth:`validate` with the (meta) model before reading or saving.

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
        ValueError: on an unsupported model type, non-safetensors files or an output folder inside the base's.
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
        self._converter: Optional[HFConverter] = None
        self._nf4_keys: frozenset = frozenset()
        #: torchtune key -> (file, HF key) of every base tensor, from the headers.
        self._locations: Dict[str, Tuple[Path, str]] = {}

    def _repo_id(self) -> Optional[str]:
        path = self.checkpoint_dir / "original_repo_id.json"
        return json.loads(path.read_text()).get("repo_id") if path.is_file() else None

    @property
    def converter(self) -> HFConverter:
        """HFConverter: the HF <-> torchtune converter of the validated model.

        Raises:
            RuntimeError: before :meth:`validate`.
        """
        if self._converter is None:
            raise RuntimeError("QLoRAHFCheckpointer.validate(model) must run before reading or saving checkpoints.")
        return self._converter

    # ------------------------------------------------------------------------------------------------ reading

    def validate(self, model: nn.Module, builder: Optional[str] = None) -> None:
        """Checks the checkpoint files against a (meta) model from their headers and sizes only: no git-lfs pointer,
        complete files, ``config.json`` (model type, heads, tied output) against the model, and the model's keys and
        shapes; remembers the model's layout for reading and saving.

        Args:
            model (nn.Module): the QLoRA model, unpruned (vocab pruning comes after).
            builder (Optional[str]): the model's builder (``model._component_``), named in errors.

        Raises:
            ValueError: on a git-lfs pointer, a truncated file, a config.json that disagrees with the model, or listing
                every unexpected, missing or mis-shaped weight.
        """
        converter = HFConverter.for_model(self.model_type, model)
        check_checkpoint_matches(self, model, builder)
        expected = base_keys(model)
        locations, unexpected, mis_shaped = {}, [], []
        for path in self.checkpoint_paths:
            for hf_key, info in _safetensors.check_complete(path).items():
                try:  # one HF tensor may hold several (Phi's fused qkv_proj)
                    converted = converter.to_tune_all(hf_key, torch.empty(info["shape"], device="meta"))
                except Exception:  # torchtune's key mapping raises a bare Exception on an unknown key
                    converted = [(hf_key, None)]
                for key, meta in converted:
                    if key not in expected:
                        unexpected.append(f"{path.name}: {hf_key}")
                        continue
                    shape = tuple(meta.shape)
                    if tuple(expected[key].shape) != shape:
                        mis_shaped.append(
                            f"{path.name}: {hf_key} has shape {tuple(info['shape'])} but the configured model "
                            f"expects {tuple(expected[key].shape)} for {key}"
                        )
                    locations[key] = (path, hf_key)
        missing = sorted(set(expected) - set(locations))
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
        self._converter = converter
        self._nf4_keys = frozenset(k for k, v in expected.items() if isinstance(v, NF4Tensor))
        self._locations = locations

    def chunk_plan(self, max_chunk_bytes: int) -> List[Tuple[Path, int]]:
        """How :meth:`read_base` splits the checkpoint, the same on every rank (from the files' headers).

        Args:
            max_chunk_bytes (int): bytes per chunk of consecutive tensors (a bigger tensor is a chunk of its own;
                0: one tensor per chunk).

        Returns:
            List[Tuple[Path, int]]: ``(file, tensor count)`` per chunk, in file order.
        """
        plan = []
        for path in self.checkpoint_paths:
            header = _safetensors.read_header(path)
            count = size = 0
            for info in sorted(header.values(), key=lambda info: info["data_offsets"][0]):
                nbytes = info["data_offsets"][1] - info["data_offsets"][0]
                if count and size + nbytes > max_chunk_bytes:
                    plan.append((path, count))
                    count = size = 0
                count, size = count + 1, size + nbytes
            if count:
                plan.append((path, count))
        return plan

    def read_base(self, plan: List[Tuple[Path, int]]) -> Iterator[Dict[str, torch.Tensor]]:
        """Yields the base checkpoint chunk by chunk as torchtune-key state dicts, reading one tensor at a time.

        Args:
            plan (List[Tuple[Path, int]]): from :meth:`chunk_plan`.

        Yields:
            Dict[str, torch.Tensor]: one chunk (tensors torchtune drops, such as a tied ``lm_head``, left out).
        """
        tensors, current = None, None
        for path, count in plan:
            if path != current:
                tensors, current = _safetensors.iter_tensors(path), path
            state = {}
            for _ in range(count):
                state.update(self.converter.to_tune_all(*next(tensors)))
            yield state

    def read_tensor(self, key: str) -> torch.Tensor:
        """
        Args:
            key (str): a torchtune key of the base model.

        Returns:
            torch.Tensor: that tensor of the base checkpoint, in torchtune's layout and the checkpoint's dtype.
        """
        path, hf_key = self._locations[key]
        return dict(self.converter.to_tune_all(hf_key, _safetensors.read_tensor(path, hf_key)))[key]

    def read_vocab(self) -> Dict[str, torch.Tensor]:
        """The base's full-vocabulary embedding/output tensors (torchtune keys), to export a vocab-pruned model into.

        Returns:
            Dict[str, torch.Tensor]: ``tok_embeddings.weight`` and ``output.*`` (untied).
        """
        return {key: self.read_tensor(key) for key in self._locations if is_vocab_key(key)}

    # ------------------------------------------------------------------------------------------------ saving

    def _base_tensor(self, state: Dict[str, torch.Tensor], key: str, merge_base: str) -> torch.Tensor:
        """A base weight to merge onto: the model's (NF4 dequantized) or, for an NF4 weight with
        ``merge_base="original"``, the checkpoint's own."""
        if merge_base == "original" and key in self._nf4_keys:
            return self.read_tensor(key)
        tensor = state[key]
        return dequantize_nf4(tensor) if isinstance(tensor, NF4Tensor) else tensor.detach()

    def _merged_tensor(
        self, state: Dict[str, torch.Tensor], key: str, dtype: torch.dtype, adapter_config: Dict[str, Any], base: str
    ) -> torch.Tensor:
        """One tensor of the merged model: base + (alpha / rank) * B @ A (DoRA: rescaled), computed in fp32."""
        dense = self._base_tensor(state, key, base)
        module_key = key[: -len(".weight")] if key.endswith(".weight") else key
        if f"{module_key}.lora_a.weight" not in state:
            return dense.to(device="cpu", dtype=dtype)
        sub = {key: dense.to(device="cpu", dtype=torch.float32)}
        for suffix in (".lora_a.weight", ".lora_b.weight", ".magnitude"):
            if module_key + suffix in state:
                sub[module_key + suffix] = state[module_key + suffix].detach().to("cpu", torch.float32)
        merged = get_merged_lora_ckpt(sub, rank=adapter_config["rank"], alpha=adapter_config["alpha"])
        return merged[key].to(dtype)

    def write_merged(
        self,
        state: Mapping[str, torch.Tensor],
        folder: Path,
        dtype: torch.dtype,
        adapter_config: Dict[str, Any],
        base: str,
        shapes: Optional[Dict[str, torch.Size]] = None,  # a lazy state (tune-ext merge) gives its shapes
    ) -> None:
        """Writes the merged model (shards, index, config.json, the base's other files) into ``folder``, one tensor
        at a time, each read from ``state`` when its turn comes.

        Args:
            state (Mapping[str, torch.Tensor]): torchtune keys -> base weights (NF4 or dense) and adapters.
            folder (Path): an existing, empty folder.
            dtype (torch.dtype): the merged tensors' dtype.
            adapter_config (Dict[str, Any]): ``rank`` and ``alpha`` at least.
            base (str): ``merge_base``.
            shapes (Optional[Dict[str, torch.Size]]): every base key's shape; None: from ``state``'s tensors.
        """
        converter = self.converter
        shapes = shapes or {k: v.shape for k, v in state.items()}
        # an HF tensor may be several of ours (Phi's fused qkv_proj / gate_up_proj)
        groups = converter.hf_groups({k: v for k, v in shapes.items() if not is_adapter_key(k)})
        specs = [_safetensors.TensorSpec(hf_key, shape, dtype) for hf_key, (_, shape) in groups.items()]
        shards = _safetensors.plan_shards(specs, self.max_shard_bytes)

        def tensors(shard):
            for spec in shard:
                merged = {k: self._merged_tensor(state, k, dtype, adapter_config, base) for k in groups[spec.name][0]}
                yield converter.group_to_hf({k: check_finite_merged(k, v) for k, v in merged.items()})

        write_hf_model_files(folder, shards, tensors, self.hf_config, dtype)  # one HF folder writer
        for src in sorted(self.checkpoint_dir.iterdir()):
            skip = (
                src.suffix in _WEIGHT_SUFFIXES
                or src.name.startswith("adapter_")
                or src.name in (SAFETENSORS_INDEX, "config.json", "pytorch_model.bin.index.json")
            )
            if src.is_file() and not skip:
                with writing(folder / src.name):  # a failed copy names the file and the cause
                    shutil.copy2(src, folder / src.name)

    def _write_adapter(self, state: Dict[str, torch.Tensor], folder: Path, adapter_config: Dict[str, Any]) -> None:
        adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
        converted = self.converter.adapters_to_peft({k: v.detach().to("cpu") for k, v in adapters.items()})
        converted += _trainable_token_rows(state, adapter_config.get("trainable_token_indices"))
        specs = [_safetensors.TensorSpec(k, v.shape, v.dtype) for k, v in converted]
        _safetensors.write_tensors(folder / "adapter_model.safetensors", specs, converted)
        config = peft_adapter_config(base_model_name_or_path=self.base_model_name_or_path, **adapter_config)
        config = self.converter.peft_config(  # Phi: fused target modules
            config, list(adapter_config["target_modules"]), adapter_config["rank"], adapter_config["alpha"]
        )
        write_json(folder / "adapter_config.json", config)

    def save(
        self,
        state_dict: Dict[str, torch.Tensor],
        step: int,
        adapter_config: Dict[str, Any],
        save_merged: bool,
        dtype: torch.dtype,
        merge_base: str = "nf4",
    ) -> Path:
        """Writes ``output_dir/step_{step}/`` atomically with the PEFT adapter, then (optionally) the merged model
        into it (:meth:`save_merged`): a failed merged export keeps the adapter.

        Args:
            state_dict (Dict[str, torch.Tensor]): the trained model's full state dict with the unpruned model's keys
                (e.g. ``get_full_state_dict(model, keep_nf4=True)``; NF4 weights may be NF4Tensors or dense; with
                ``save_merged=False`` the adapters suffice).
            step (int): global step, names the folder.
            adapter_config (Dict[str, Any]): ``target_modules``, ``rank``, ``alpha``, ``dropout``, ``use_dora``,
                optionally ``trainable_token_indices`` (``{"embed_tokens": ids}``, plus ``"lm_head"`` when
                untied): the adapter then also carries those rows of the (full-vocabulary) embedding / output
                weight, as PEFT's trainable tokens.
            save_merged (bool): also write the merged model.
            dtype (torch.dtype): dtype of the merged model's tensors.
            merge_base (str): ``"nf4"``: merge onto the NF4-dequantized base (the model as trained);
                ``"original"``: onto the base checkpoint's own weights (streamed from its files).

        Returns:
            Path: the step folder.

        Raises:
            ValueError: on an unknown ``merge_base``.
            WriteError: naming the file that could not be written and the cause.
        """
        if merge_base not in MERGE_BASES:
            raise ValueError(f"merge_base={merge_base!r} is not supported; use one of {list(MERGE_BASES)}.")
        final = self.output_dir / f"step_{step}"
        with atomic_directory(final) as tmp:
            (tmp / ADAPTER_DIRNAME).mkdir()
            self._write_adapter(state_dict, tmp / ADAPTER_DIRNAME, adapter_config)
        if save_merged:  # small files first
            self.save_merged(state_dict, step, adapter_config, dtype, merge_base)
        return final

    def save_merged(
        self,
        state_dict: Dict[str, torch.Tensor],
        step: int,
        adapter_config: Dict[str, Any],
        dtype: torch.dtype,
        merge_base: str = "nf4",
    ) -> Path:
        """Writes the merged model into ``output_dir/step_{step}/merged/`` atomically (arguments as :meth:`save`).

        Returns:
            Path: the merged model's folder.
        """
        final = self.output_dir / f"step_{step}" / MERGED_DIRNAME
        with atomic_directory(final) as tmp:
            self.write_merged(state_dict, tmp, dtype, adapter_config, merge_base)
        return final

    def merged_nbytes(self, state_dict: Dict[str, torch.Tensor], dtype: torch.dtype) -> int:
        """
        Args:
            state_dict (Dict[str, torch.Tensor]): as for :meth:`save`.
            dtype (torch.dtype): the merged model's dtype.

        Returns:
            int: the bytes of the merged model's tensors (its files' size, but for headers and small files).
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(t.numel() * itemsize for k, t in state_dict.items() if not is_adapter_key(k))

    def remove_stale_temporaries(self) -> List[Path]:
        """Deletes what writes killed in an earlier run left in ``output_dir`` and its recipe-state folder (see
        :func:`~torchtune_ext.checkpoint.remove_stale_temporaries`); call it before this run's first write.

        Returns:
            List[Path]: what was deleted.
        """
        folders = {self.output_dir, self.output_dir / RECIPE_STATE_DIRNAME, self.recipe_checkpoint.parent}
        folders |= {p for p in self.output_dir.glob("step_*") if p.is_dir()}  # killed merged exports
        return [path for folder in sorted(folders) for path in remove_stale_temporaries(folder)]

    def save_recipe_state(self, state: RecipeState) -> Path:
        """Atomically writes the recipe state for resuming, keeping the previous one (see :class:`RecipeState`).

        Args:
            state (RecipeState): the state.

        Returns:
            Path: the file.
        """
        return state.save(self.output_dir / RECIPE_STATE_DIRNAME / RECIPE_STATE_FILENAME)

    def load_recipe_state(self) -> RecipeState:
        """
        Returns:
            RecipeState: the saved recipe state, or the previous one if it cannot be read (see
            :meth:`RecipeState.load`).

        Raises:
            FileNotFoundError: if there is none.
            ValueError: if it is not a readable recipe state, or holds anything but tensors and plain data.
        """
        return RecipeState.load(self.recipe_checkpoint)


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

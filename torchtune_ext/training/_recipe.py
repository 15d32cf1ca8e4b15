"""The QLoRA recipe, whatever the number of ranks: setup, training loop, checkpoints, resume and the end-of-run summary.

``recipes/qlora_finetune_single_device.py`` and ``recipes/qlora_finetune_distributed.py`` subclass
:class:`QLoRARecipe`: the single-device recipe as it is (one rank, no process group), the distributed one with the
process group, per-rank batch sizes and FSDP2 sharding (:meth:`QLoRARecipe._parallelize`). Every library call below
works on one rank and on many, so both recipes run the same code:

setup (:meth:`QLoRARecipe.setup`), in this order; nothing is written before step 4:
    1. seed; settings and every config check that is cheap (:class:`RecipeSettings`, in ``__init__``)
    2. the model on the meta device, checked against the checkpoint's headers; tokenizer, loss, data sets
    3. data checks (labels within ``max_seq_len``, enough batches), vocab-pruning ids, the resumed recipe state
    4. stale temporaries of killed writes removed, metric logger opened
    5. the model: vocab pruning (meta), trainable params, activation checkpointing, compile, sharding, the base
       streamed in and quantized (``load_base_``), adapters initialised or resumed (``init_adapters_``)
    6. optimizer (resumed), loss scaler, data loaders (resumed position), LR schedule

one optimizer step (:meth:`QLoRARecipe.train`): for each of ``gradient_accumulation_steps`` micro-batches, the loss
(a mean over label tokens) times the micro-batch's label-token count, scaled (fp16) and back-propagated; then the
gradients are divided by the step's global label-token count (all ranks, all micro-batches), unscaled, clipped, and
the optimizer steps (unless fp16 overflowed); logs, validation and checkpoints follow at their intervals.

Hacking a recipe: the step is three public methods a copied recipe overrides (``tune-ext cp
qlora_finetune_single_device my_recipe.py``, see ``docs/hacking.md``): :meth:`QLoRARecipe.loss_step` (forward and
loss: the objective), :meth:`QLoRARecipe.forward_backward` (one micro-batch) and :meth:`QLoRARecipe.optimizer_step`
(the update). The loop lives here, in one library class, rather than in the recipe file because both recipes run
it (one loop for any world size, as torchtitan's ``Trainer``; torchtune's two recipes copy 647 of 808 lines and
drift), and a recipe file that imported another recipe would be loaded twice under two module names
(``recipes.<name>`` in a clone, ``torchtune_ext.recipes.<name>`` installed).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from torchtune_ext.checkpoint import (  # [issue 17] output-dir checks; [issue 25] bounded disk
    RECIPE_STATE_DIRNAME,
    DataPosition,
    QLoRAHFCheckpointer,
    RecipeState,
    RunIdentity,
    check_output_dir,
    claim_output_dir,
    load_base_,
    merge_at_epoch_end,
    plain_rng_state,
    remove_old_checkpoints,
)
from torchtune_ext.config import check_config  # [issue 17]
from torchtune_ext.distributed import (
    all_reduce_grads,
    all_reduce_sum,
    check_nf4_sharding,  # [issue 23]
    clip_grad_norm_,
    get_full_optimizer_state,
    get_full_state_dict,
    load_full_optimizer_state,
    replicated_params,
    unwrap_key,
)
from torchtune_ext.memory import MemoryEstimator
from torchtune_ext.models import check_adapter_state, init_adapters_
from torchtune_ext.modules.loss import LinearCrossEntropyLoss
from torchtune_ext.modules.rope import share_rope_
from torchtune_ext.modules.transformer import tile_mlp_
from torchtune_ext.modules.vocab_pruning import (
    KEPT_IDS_FILENAME,
    VocabPruning,
    prune_vocab_,
    resolve_kept_ids,
    save_scanned_kept_ids,
)
from torchtune_ext.training._activations import activation_offloading
from torchtune_ext.training._builders import build_dataset, build_qlora_model, build_tokenizer
from torchtune_ext.training._checkpointing import disk_plan, exportable, log_dir_name
from torchtune_ext.training._data import build_data_loader, check_data, pad_batch_, shifted_labels
from torchtune_ext.training._dry_run import dry_run_report, recipe_memory_estimator
from torchtune_ext.training._export import check_run_folders, export_merged
from torchtune_ext.training._interrupt import (
    InterruptGuard,
    continued_metric_logger,
    interrupted_message,
    resume_command,
)
from torchtune_ext.training._metrics import Throughput, format_memory_stats, gather_memory_stats, memory_stats
from torchtune_ext.training._nonfinite import NonFiniteGuard, check_base_finite
from torchtune_ext.training._precision import DistributedLossScaler, LossScaler, check_param_dtypes
from torchtune_ext.training._rng import all_rng_states, seed_everything, set_rng_state
from torchtune_ext.training._settings import LoRASettings, RecipeSettings, dtype_or_checkpoints, frozen_weights_dtype
from torchtune_ext.training._summary import run_summary
from torchtune_ext.training._validation import ValidationHistory

log = utils.get_logger("INFO")


class QLoRARecipe(FTRecipeInterface):
    """QLoRA fine-tuning on one rank or many; see the module docstring for the order of setup and the training step.

    Subclass it to hack the step: override :meth:`loss_step`, :meth:`forward_backward` or :meth:`optimizer_step`
    (``recipes/qlora_finetune_single_device.py`` shows how). They read the components set up by :meth:`setup`:
    ``self._model``, ``self._loss_fn``, ``self._optimizer``, ``self._trainable_params``, ``self._loss_scaler``,
    ``self._lr_scheduler`` (the attributes listed below).

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ValueError: on an unknown dtype or invalid settings (every cheap check runs here).
        RuntimeError: on bf16 where the device does not support it.
    """

    # ------------------------------------------------------------------------------------- the recipe's attributes
    world_size: int = 1
    rank: int = 0
    settings: RecipeSettings  # the config's settings, read and checked once (``__init__``)
    max_steps_per_epoch: Optional[int]  # the setting's, or on resume the saved run's
    # components (``_build_components``)
    _checkpointer: QLoRAHFCheckpointer
    _lora: LoRASettings
    _frozen_dtype: torch.dtype  # storage of the frozen weights that are not NF4 (embedding, output)
    _model: nn.Module
    _tokenizer: Any
    _loss_fn: nn.Module
    # vocab pruning: kept ids, module
    _kept_ids: Optional[List[int]]
    _pruning: Optional[VocabPruning]
    # training state
    _adapter_params: Dict[str, nn.Parameter]  # get_adapter_params(model): LoRA/DoRA params and trained pruned rows
    _adapter_keys: List[str]  # their unwrapped keys, in the same order
    _trainable_params: List[nn.Parameter]  # the optimizer's params, in that order
    _replicated_params: List[nn.Parameter]  # trainable params every rank holds whole (all of them on one rank)
    _optimizer: torch.optim.Optimizer
    _loss_scaler: LossScaler
    _lr_scheduler: Any
    _sampler: StatefulDistributedSampler
    _dataloader: StatefulDataLoader
    _val_dataloader: Optional[StatefulDataLoader]
    seed: int
    epochs_run: int
    global_step: int
    _steps_in_epoch_done: int
    loss_history: List[float]

    def __init__(self, cfg: DictConfig) -> None:
        dry_run = bool(cfg.get("dry_run", False))  # estimates for the configured device, which need not be here
        check_config(cfg, dry_run=dry_run)  # [issue 17] keys, ranges, device, files: before anything is done
        if not dry_run and str(cfg.device).startswith("cuda"):
            # Before CUDA allocates: growable segments instead of fixed blocks leave little fragmentation when
            # batch shapes vary (the memory estimate's allowance assumes it; the user's own setting is kept).
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.settings = RecipeSettings.from_config(cfg)
        self.max_steps_per_epoch = self.settings.max_steps_per_epoch  # a resume keeps the saved run's
        self._activation_offloading: ContextManager = contextlib.nullcontext()
        self._pruning = None
        self._kept_ids = None
        self._pad_to_multiple: Optional[int] = None
        self.epochs_run = 0
        self.global_step = 0
        self._steps_in_epoch_done = 0
        self.loss_history = []
        self._val_history = ValidationHistory()  # [issue 18] validation loss on the console and in the summary
        self._train_tokens = 0.0
        self._train_seconds = 0.0

    @property
    def _is_rank_zero(self) -> bool:
        return self.rank == 0

    def _info(self, message: str) -> None:
        utils.log_rank_zero(log, message)

    # ---------------------------------------------------------------------------------------------------- setup

    def setup(self, cfg: DictConfig) -> None:
        """Builds everything in the order of the module docstring; nothing is written under ``output_dir`` before
        the config, the data and the resumed state have been checked. Collective on several ranks."""
        check_run_folders(cfg)  # [issue 24] every folder the run writes is writable, before anything is written
        self._set_seed(cfg)
        # [issue 17] a busy output_dir, or one holding another run's checkpoints, is refused before any write
        check_output_dir(
            cfg.checkpointer.output_dir, self.settings.resume_from_checkpoint, self.settings.overwrite_output_dir
        )
        self._generate_base_checkpoint(cfg)
        dataset, val_dataset = self._build_components(cfg)
        settings = self.settings
        check_data(
            dataset,
            val_dataset,
            settings.max_seq_len,
            self._loss_fn.ignore_index,
            settings.batch_size,
            settings.gradient_accumulation_steps,
            self.world_size,
        )
        if self.settings.vocab_pruning is not None:
            self._resolve_kept_ids(dataset, val_dataset)
        self._run = self._run_identity(cfg, dataset)  # [issue 24] what a resume must match
        state = self._checkpointer.load_recipe_state() if self.settings.resume_from_checkpoint else None
        if state is not None:
            self._check_recipe_state(state)
        self._saved_log_dir = state.metric_log_dir if state is not None else None  # [issue 17]

        loss_scaler = DistributedLossScaler if self.world_size > 1 else LossScaler
        self._loss_scaler = loss_scaler(
            enabled=self.settings.dtype == torch.float16, device=self.settings.device, **cfg.get("loss_scaler", {})
        )
        self._guard = NonFiniteGuard(self._loss_scaler)  # [issue 24]

        # From here on, outputs are written.
        self._start_writing(cfg)
        self._save_scanned_kept_ids(dataset, val_dataset)  # [issue 25] a resume reuses the kept-id pass
        disk = disk_plan(
            self.settings,
            self.world_size,
            self.max_steps_per_epoch,
            self._model,
            self._checkpointer.output_dir,
            len(dataset),
            self._merged_dtype,
        )
        self._info(disk.format())  # [issue 25]

        self._load_model(state)
        self._optimizer = config.instantiate(cfg.optimizer, self._trainable_params)
        self._setup_loss()
        self._setup_dataloaders(cfg, dataset, val_dataset)
        self._setup_schedule(cfg, state)

    def _set_seed(self, cfg: DictConfig) -> None:
        """The config's seed (torchtune's ``set_seed`` agrees on it across ranks), with the same streams on every
        rank until the model is initialised, so every rank draws the single-device run's initial adapters."""
        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))
        seed_everything(self.seed)

    def _generate_base_checkpoint(self, cfg: DictConfig) -> None:
        """The tiny default writes its random base checkpoint on first use (rank 0; the others wait)."""
        if cfg.get("generate_base_checkpoint", None) is None:
            return
        if self._is_rank_zero:
            config.instantiate(cfg.generate_base_checkpoint)
        if dist.is_initialized():
            dist.barrier()

    def _build_components(self, cfg: DictConfig) -> Tuple[Any, Optional[Any]]:
        """Builds what can be checked before anything is written: the checkpointer (validated against the model,
        built on the meta device), tokenizer, loss, and the training and validation data sets.

        Returns:
            Tuple[Any, Optional[Any]]: the training data set and the validation one (None without ``dataset_val``).
        """
        self._checkpointer = config.instantiate(cfg.checkpointer)
        self._lora = LoRASettings.from_config(cfg.model)
        self._frozen_dtype = frozen_weights_dtype(
            self.settings.frozen_dtype, self.settings.dtype, self._checkpointer.hf_config
        )
        # [issue 18] merged_dtype: the merged export's dtype (default: the base checkpoint's)
        self._merged_dtype = dtype_or_checkpoints(self.settings.merged_dtype, self._checkpointer.hf_config)
        self._model = build_qlora_model(cfg.model, self.settings.dtype, self.settings.adapter_dtype, self._frozen_dtype)
        check_nf4_sharding(self._model, self.world_size)  # [issue 23] refuse/report NF4 layouts before any load
        self._checkpointer.validate(self._model, builder=cfg.model.get("_component_"))  # [issue 24] names the builder
        self._tokenizer = build_tokenizer(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        dataset = build_dataset(cfg.dataset, self._tokenizer)
        val_cfg = cfg.get("dataset_val", None)
        return dataset, build_dataset(val_cfg, self._tokenizer, "dataset_val") if val_cfg is not None else None

    def _resolve_kept_ids(self, dataset: Any, val_dataset: Optional[Any]) -> None:
        """Vocab pruning: the kept token ids (a file, else the ids the data uses: one pass shared by the ranks, or
        the pass a resumed run saved); every rank gets the same."""
        vocab_size = self._model.tok_embeddings.num_embeddings
        scanned = self._checkpointer.recipe_checkpoint.parent / KEPT_IDS_FILENAME
        self._kept_ids = resolve_kept_ids(
            self.settings.vocab_pruning["kept_ids"],
            vocab_size,
            self._tokenizer,
            [dataset, val_dataset],
            scanned=scanned if self.settings.resume_from_checkpoint else None,  # [issue 25]
        )
        self._info(f"Vocab pruning: keeping {len(self._kept_ids)} of {vocab_size} token ids.")

    def _run_identity(self, cfg: DictConfig, dataset: Any) -> RunIdentity:
        """What defines this run (recorded in every recipe state, checked on resume) and its other settings."""
        dtypes = {
            "dtype": self.settings.dtype,
            "adapter_dtype": self.settings.adapter_dtype,
            "frozen_dtype": self._frozen_dtype,
        }
        return RunIdentity.from_config(
            cfg,
            checkpoint_paths=self._checkpointer.checkpoint_paths,
            dataset_size=len(dataset),
            global_batch_size=self.settings.batch_size * self.world_size,
            dtypes=dtypes,
        )

    def _save_scanned_kept_ids(self, dataset: Any, val_dataset: Optional[Any]) -> None:
        """Rank 0 writes the kept ids the data pass found next to the recipe state, for a resume."""
        if self._kept_ids is not None and self.settings.vocab_pruning["kept_ids"] is None and self._is_rank_zero:
            path = self._checkpointer.output_dir / RECIPE_STATE_DIRNAME / KEPT_IDS_FILENAME
            vocab_size = self._model.tok_embeddings.num_embeddings
            save_scanned_kept_ids(path, self._kept_ids, vocab_size, [dataset, val_dataset])

    def _check_recipe_state(self, state: RecipeState) -> None:
        """Checks a resumed recipe state against this run (its identity, adapter shapes, kept ids) before any
        weight loads, logs the allowed changes, and takes its position.

        Raises:
            ValueError: listing what differs in what defines the run, or if the adapters differ.
        """
        for line in state.check_resume(self._run, self._kept_ids, self.settings.epochs, self.world_size):  # [issue 24]
            self._info(line)
        check_adapter_state(self._model, state.adapter)
        if state.max_steps_per_epoch != self.max_steps_per_epoch:
            self._info(
                f"Config max_steps_per_epoch={self.max_steps_per_epoch} differs from the checkpoint's; using "
                f"{state.max_steps_per_epoch}."
            )
            self.max_steps_per_epoch = state.max_steps_per_epoch
        self.epochs_run = state.epochs_run
        self.global_step = state.global_step
        self._steps_in_epoch_done = state.steps_in_epoch_done
        if state.checkpoint_path is not None:  # [issue 24] the summary names it (a finished run trains no further)
            self._last_checkpoint = state.checkpoint_path

    def _start_writing(self, cfg: DictConfig) -> None:
        """Rank 0, once everything has been checked: locks the output folder (collective), clears what killed writes
        of an earlier run left in it and opens the metric logger."""
        # [issue 17] one run per output_dir: rank 0 holds its lock until the process ends
        self._output_lock = claim_output_dir(
            self._checkpointer.output_dir, self.settings.resume_from_checkpoint, self.settings.overwrite_output_dir
        )
        if not self._is_rank_zero:
            return
        stale = self._checkpointer.remove_stale_temporaries()
        if stale:
            log.info(
                f"Deleted {len(stale)} temporary file(s)/folder(s) of interrupted writes: {[p.name for p in stale]}"
            )
        # [issue 17] a resume continues the interrupted run's TensorBoard folder
        self._metric_logger = config.instantiate(continued_metric_logger(cfg.metric_logger, self._saved_log_dir))
        self._metric_logger.log_config(cfg)

    def _load_model(self, state: Optional[RecipeState]) -> None:
        """Prunes (meta), marks trainable params, wraps, shards, then streams the base in and initialises (or
        restores) the adapters; every rank holds only its shards throughout."""
        start = time.perf_counter()
        model = self._model
        pruning_cfg = self.settings.vocab_pruning
        self._prepare_model(model)
        self._parallelize()
        load_base_(
            model, self._checkpointer, self.settings.device, pruning=self._pruning, sharded_device=self._sharded_device
        )
        check_base_finite(model, self._checkpointer.checkpoint_dir, self._checkpointer.converter.to_hf)  # [issue 24]
        init_adapters_(model, self.settings.device, state.adapter if state is not None else None)
        training.validate_no_params_on_meta_device(model)

        adapters = self._adapter_params = get_adapter_params(model)
        self._adapter_keys = [unwrap_key(model, name) for name in adapters]
        self._trainable_params = [p for p in adapters.values() if p.requires_grad]
        self._replicated_params = replicated_params(model)
        # LoRA/DoRA params in the adapter dtype; pruned rows (and a pruned output's adapters) in the pruning dtype.
        check_param_dtypes(
            [(k, p) for k, p in zip(self._adapter_keys, adapters.values()) if not k.startswith("tok_embeddings.")],
            self.settings.adapter_dtype,
            "adapter",
        )
        if self.rank > 0:
            # Own RNG streams per rank from here on (dropout), as torchtune's seed + rank.
            seed_everything(self.seed + self.rank)
        self._info(
            f"Loaded {self._checkpointer.checkpoint_dir} into NF4"
            + (f" on {self.world_size} ranks" if self.world_size > 1 else "")
            + f" in {time.perf_counter() - start:.1f} s: compute dtype {self.settings.dtype}, adapters "
            f"{self.settings.adapter_dtype}, "
            f"frozen embedding/output stored in {self._frozen_dtype}, device {self.settings.device}"
            + (f", vocab pruning in {pruning_cfg['dtype']}" if pruning_cfg else "")
            + "."
        )

    def _prepare_model(self, model: nn.Module) -> None:
        """What the model gets before its weights: vocab pruning (the kept ids known), only the adapters (and
        trained pruned rows) trainable, tiled MLPs, activation checkpointing per decoder layer, compile, activation
        offloading."""
        pruning_cfg = self.settings.vocab_pruning
        if pruning_cfg is not None and self._kept_ids is not None:
            self._pruning = prune_vocab_(
                model,
                self._kept_ids,
                dtype=pruning_cfg["dtype"],
                unknown_token_id=pruning_cfg["unknown_token_id"],
                trainable=pruning_cfg["trainable"],
            )
        set_trainable_params(model, get_adapter_params(model))
        share_rope_(model, self.settings.max_seq_len)  # [issue 25] one RoPE cache, sized for the run, grown on demand
        if self.settings.tiled_mlp_tokens is not None:
            tile_mlp_(model, self.settings.tiled_mlp_tokens)
        if self.settings.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if self.settings.compile:
            training.compile_model(model, verbose=self._is_rank_zero)
        if not self.settings.dry_run:
            self._activation_offloading = activation_offloading(model, self.settings.enable_activation_offloading)

    def _parallelize(self) -> None:
        """Shards the model (the distributed recipe); one rank keeps it whole."""

    @property
    def _sharded_device(self) -> Optional[torch.device]:
        """Where sharded params live (the host under FSDP CPU offload); None: the training device."""
        return None

    def _setup_loss(self) -> None:
        """``LinearCrossEntropyLoss`` takes over the output projection (the model returns hidden states); torchtune's
        ``CEWithChunkedOutputLoss`` gets the model's chunked logits."""
        if isinstance(self._loss_fn, LinearCrossEntropyLoss):
            self._loss_fn.set_model_output(self._model)
            return
        if self.settings.compile:
            self._loss_fn = training.compile_loss(self._loss_fn)
        if isinstance(self._loss_fn, CEWithChunkedOutputLoss):
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

    # --------------------------------------------------------------------------------------------------- data

    def _setup_dataloaders(self, cfg: DictConfig, dataset: Any, val_dataset: Optional[Any]) -> None:
        """Training (shuffled per ``cfg.shuffle``, last partial batch dropped) and validation data loaders."""
        loader = partial(
            build_data_loader,
            collate_fn=self.settings.collate_fn,
            batch_size=self.settings.batch_size,
            seed=self.seed,
            pad_id=self._tokenizer.pad_id,
            ignore_index=self._loss_fn.ignore_index,
            world_size=self.world_size,
            rank=self.rank,
        )
        self._sampler, self._dataloader = loader(dataset, cfg.dataset, shuffle=cfg.shuffle, drop_last=True)
        self._val_dataloader = None
        if val_dataset is not None:
            self._val_dataloader = loader(val_dataset, cfg.dataset_val, shuffle=False, drop_last=False)[1]

    def _setup_schedule(self, cfg: DictConfig, state: Optional[RecipeState]) -> None:
        """Steps per epoch (at least one: ``_check_data``), the LR scheduler, and (resuming) the optimizer, loss
        scaler, data and RNG positions."""
        self._steps_per_epoch = len(self._dataloader) // self.settings.gradient_accumulation_steps
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        if state is not None:  # [issue 24] this run's optimizer hyperparameters; the global data position
            hyperparameters = state.restore_optimizer_(self._optimizer, load_full_optimizer_state)
            self._loss_scaler.load_state_dict(state.loss_scaler)
            state.restore_sampler_(self._sampler, self.world_size)
        self._lr_scheduler = config.instantiate(
            cfg.lr_scheduler,
            self._optimizer,
            num_training_steps=self.settings.epochs * self._steps_per_epoch,
            last_epoch=self.global_step - 1,
        )
        # Restored when training starts, after the data loader iterator has drawn its seed.
        self._rng_to_restore = None
        if state is not None:
            state.restore_lr_scheduler_(self._lr_scheduler, hyperparameters)  # [issue 24]
            self._rng_to_restore = state.rng_for(self.rank, self.world_size)  # [issue 24]
        self._info(f"Memory after setup: {format_memory_stats(self._memory_metrics())}")

    # ---------------------------------------------------------------------------------------------- cross-rank

    def _memory_metrics(self) -> Dict[str, float]:
        """This rank's memory figures, or every rank's (``<name>/rank<r>``) on several ranks. Collective."""
        return memory_stats(self.settings.device) if self.world_size == 1 else gather_memory_stats(self.settings.device)

    # ----------------------------------------------------------------------------------------------- training

    def loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean loss over the batch's label tokens (0 if it has none): forward and loss, no backward. Override
        it to change the objective (a regulariser, another loss); training and validation both call it (check
        ``self._model.training`` for a training-only term).

        Args:
            batch (Dict[str, torch.Tensor]): ``tokens`` and ``labels`` (unshifted), on the device; ``labels`` is
                popped.

        Returns:
            torch.Tensor: a scalar, the mean over label tokens.
        """
        if self._pad_to_multiple is not None:  # the distributed recipe's sharded vocab pruning
            pad_batch_(batch, self._pad_to_multiple, self._tokenizer.pad_id, self._loss_fn.ignore_index)
        labels = shifted_labels(batch.pop("labels"), self._loss_fn.ignore_index)
        with self._activation_offloading:
            output = self._model(**batch)  # hidden states for LinearCrossEntropyLoss, else (chunked) logits
        if self._pruning is not None:
            labels = self._pruning.remap_labels(labels, ignore_index=self._loss_fn.ignore_index)
        if not isinstance(output, list):
            labels = labels.reshape(-1)
            output = output.reshape(-1, output.size(-1))
        loss = self._loss_fn(output, labels)
        # torchtune's losses give nan without label tokens; the micro-batch still runs backward (FSDP's collectives),
        # contributing zero. LinearCrossEntropyLoss gives 0 itself, keeping its output calls equal across ranks.
        if not isinstance(self._loss_fn, LinearCrossEntropyLoss) and not (labels != self._loss_fn.ignore_index).any():
            loss = sum(chunk.sum() for chunk in (output if isinstance(output, list) else [output])) * 0.0
        del output
        return loss

    @torch.no_grad()
    def _validate(self) -> float:
        """The validation loss, averaged over the label tokens of all ranks."""
        self._model.eval()
        total, count = 0.0, 0
        for i, batch in enumerate(self._val_dataloader):
            if self.settings.max_validation_steps is not None and i >= self.settings.max_validation_steps:
                break
            utils.batch_to_device(batch, self.settings.device)
            num_tokens = int((batch["labels"] != self._loss_fn.ignore_index).sum())
            total += float(self.loss_step(batch)) * num_tokens
            count += num_tokens
        self._model.train()
        sums = all_reduce_sum(torch.tensor([total, count], dtype=torch.float64))
        return float(sums[0] / sums[1].clamp(min=1))

    def forward_backward(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: its loss weighted by its label-token count (the loss is a mean over tokens; the step
        then normalises the sum over all micro-batches and ranks), scaled (fp16) and back-propagated. Override it to
        change what a micro-batch does around the loss (e.g. several forward passes); :meth:`loss_step` is the
        place for the objective itself.

        Args:
            batch (Dict[str, torch.Tensor]): ``tokens`` and ``labels``, on the device.

        Returns:
            Tuple[torch.Tensor, torch.Tensor]: the weighted loss (detached) and the label-token count.
        """
        batch_tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
        loss = self.loss_step(batch) * batch_tokens
        self._loss_scaler.scale(loss).backward()
        return loss.detach(), batch_tokens

    def optimizer_step(self, num_tokens: torch.Tensor) -> Tuple[Dict[str, float], float]:
        """Normalises the gradients by the step's global label-token count, clips, steps and zeroes them. Override
        it to change the update (e.g. gradient surgery before ``super().optimizer_step``); called once per
        ``gradient_accumulation_steps`` micro-batches, on every rank (keep its collectives).

        Args:
            num_tokens (torch.Tensor): this rank's label tokens over the step's micro-batches.

        Returns:
            Tuple[Dict[str, float], float]: step metrics (grad norm; loss scale and skipped steps in fp16) and
            the global token count.
        """
        global_tokens = float(all_reduce_sum(num_tokens))
        all_reduce_grads(self._replicated_params)
        self._loss_scaler.unscale_(self._optimizer)
        for param in self._trainable_params:
            if param.grad is not None:
                param.grad.mul_(1.0 / max(global_tokens, 1.0))
        max_norm = math.inf if self.settings.clip_grad_norm is None else float(self.settings.clip_grad_norm)
        grad_norm = clip_grad_norm_(self._trainable_params, max_norm=max_norm)
        self._loss_scaler.step(self._optimizer)
        self._optimizer.zero_grad(set_to_none=True)
        self._lr_scheduler.step()
        metrics = {"grad_norm": grad_norm.item()}
        if self._loss_scaler.enabled:
            metrics.update(loss_scale=self._loss_scaler.get_scale(), skipped_steps=self._loss_scaler.skipped_steps)
        return metrics, global_tokens

    def _log_step(
        self,
        loss: float,
        step_metrics: Dict[str, float],
        throughput: Throughput,
        num_tokens: float,
        global_tokens: float,
    ) -> None:
        rank_tokens_per_second = throughput.tokens_per_second()
        metrics = {
            "loss": loss,
            "lr": self._optimizer.param_groups[0]["lr"],
            "tokens_per_second": rank_tokens_per_second * global_tokens / max(num_tokens, 1.0),
            **({"tokens_per_second_per_rank": rank_tokens_per_second} if self.world_size > 1 else {}),
            **step_metrics,
            **self._memory_metrics(),
        }
        if self._is_rank_zero:
            self._metric_logger.log_dict(metrics, step=self.global_step)

    def train(self) -> None:
        """Trains (:meth:`_train_epochs`); SIGINT or SIGTERM stop it after the current step with a resumable
        checkpoint and exit code 128 + signal (:meth:`_stop_interrupted`)."""
        with InterruptGuard() as self._interrupt:  # [issue 17]
            self._train_epochs()

    def _train_epochs(self) -> None:
        """The training loop: gradient accumulation normalised by the global label-token count of each step (all
        ranks, all micro-batches), as torchtune's recipes; checkpoints every ``save_every_n_steps`` and at the end
        of each epoch; stops after ``stop_after_step`` with a resumable checkpoint."""
        if self.settings.compile:
            self._info("torch.compile is enabled: the first iterations are slow.")
        throughput = Throughput()
        self._first_step_of_run = self.global_step + 1
        running_loss, num_tokens = 0.0, 0
        for curr_epoch in range(self.epochs_run, self.settings.epochs):
            self._sampler.set_epoch(curr_epoch)
            pbar = tqdm(
                total=self._steps_per_epoch,
                initial=self._steps_in_epoch_done,
                dynamic_ncols=True,
                disable=not self._is_rank_zero,
            )
            micro_batches = 0
            if self._rng_to_restore is not None and self._steps_in_epoch_done == 0:
                # [issue 17] resumed at an epoch's start: the uninterrupted run's iterator drew from this state
                set_rng_state(self._rng_to_restore, self.settings.device)
                self._rng_to_restore = None
            batches = iter(self._dataloader)  # draws a seed from the global RNG, as at the start of the run
            if self._rng_to_restore is not None:
                set_rng_state(self._rng_to_restore, self.settings.device)
                self._rng_to_restore = None
            step_start = time.perf_counter()
            for batch in batches:
                if self._steps_in_epoch_done >= self._steps_per_epoch:
                    break
                utils.batch_to_device(batch, self.settings.device)
                loss, batch_tokens = self.forward_backward(batch)
                num_tokens += batch_tokens
                throughput.add(batch_tokens)
                running_loss += loss
                micro_batches += 1
                if micro_batches % self.settings.gradient_accumulation_steps != 0:
                    continue

                step_metrics, global_tokens = self.optimizer_step(num_tokens)
                self._train_tokens += global_tokens
                self._train_seconds += time.perf_counter() - step_start
                self.global_step += 1
                self._steps_in_epoch_done += 1
                loss_value = float(all_reduce_sum(running_loss)) / max(global_tokens, 1.0)
                self.loss_history.append(loss_value)
                pbar.update(1)
                pbar.set_description(
                    f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_value:.4f}" + self._guard.progress()  # [issue 24]
                )
                if self.global_step % self.settings.log_every_n_steps == 0:
                    self._log_step(loss_value, step_metrics, throughput, float(num_tokens), global_tokens)
                    throughput.reset()
                self._guard.check_step(
                    self.global_step, loss_value, step_metrics, self._lr(), self._last_saved()
                )  # [issue 24]
                running_loss, num_tokens = 0.0, 0
                if self._should_validate():
                    val_loss = self._validate()
                    if self._is_rank_zero:
                        self._metric_logger.log_dict({"val_loss": val_loss}, step=self.global_step)
                        self._val_history.add(self.global_step, val_loss)  # [issue 18]

                mid_epoch = self._steps_in_epoch_done < self._steps_per_epoch
                if mid_epoch and self._interrupt.requested():  # [issue 17] a signal: save this step and exit
                    pbar.close()
                    self._stop_interrupted(end_of_epoch=False)
                if self.settings.stop_after_step is not None and self.global_step >= self.settings.stop_after_step:
                    if mid_epoch:
                        pbar.close()
                        self.save_checkpoint(end_of_epoch=False, full=False)
                        self._info(
                            f"Stopped after step {self.global_step} (stop_after_step); resume with "
                            "resume_from_checkpoint=True."
                        )
                        return
                elif (
                    self.settings.save_every_n_steps
                    and self.global_step % self.settings.save_every_n_steps == 0
                    and mid_epoch
                ):
                    self.save_checkpoint(end_of_epoch=False, full=False)
                step_start = time.perf_counter()
            pbar.close()
            self.epochs_run += 1
            self._steps_in_epoch_done = 0
            # [issue 25] the merged model once, at the end (or every epoch with merge_every_epoch)
            self.save_checkpoint(
                end_of_epoch=True,
                full=merge_at_epoch_end(self.epochs_run, self.settings.epochs, self.settings.merge_every_epoch),
            )
            if self.settings.stop_after_step is not None and self.global_step >= self.settings.stop_after_step:
                return
            if curr_epoch + 1 < self.settings.epochs and self._interrupt.requested():  # [issue 17]
                self._stop_interrupted(end_of_epoch=True)

    def _stop_interrupted(self, end_of_epoch: bool) -> None:
        """[issue 17] Saves this step as a resumable checkpoint (adapter + recipe state, no merged model; at the end
        of an epoch it is saved already) and exits with 128 + the signal, printing the step and the resume command.

        Raises:
            SystemExit: always.
        """
        if not end_of_epoch:
            self.save_checkpoint(end_of_epoch=False, full=False)
        if not self._is_rank_zero:
            self._interrupt.exit()
        self._metric_logger.close()
        epoch, steps = (
            (self.epochs_run, self._steps_per_epoch)
            if end_of_epoch
            else (self.epochs_run + 1, self._steps_in_epoch_done)
        )
        batch = steps * self.settings.gradient_accumulation_steps
        self._interrupt.exit(
            interrupted_message(
                self._interrupt.signum, self.global_step, epoch, batch, self._last_checkpoint, resume_command()
            )
        )

    def _should_validate(self) -> bool:
        return bool(
            self._val_dataloader is not None
            and self.settings.run_val_every_n_steps
            and self.global_step % self.settings.run_val_every_n_steps == 0
        )

    # ------------------------------------------------------------------------------------------- checkpoints

    def _recipe_state(
        self, end_of_epoch: bool, adapters: Dict[str, torch.Tensor], optimizer: Dict[str, Any], rng: List[Any]
    ) -> RecipeState:
        """What :meth:`save_checkpoint` saves to resume (rank 0), the data position over all ranks."""
        steps_in_epoch = 0 if end_of_epoch else self._steps_in_epoch_done  # a new epoch: a fresh pass over the data
        samples_per_step = self.settings.batch_size * self.world_size * self.settings.gradient_accumulation_steps
        return RecipeState(
            global_step=self.global_step,
            epochs_run=self.epochs_run,
            steps_in_epoch_done=steps_in_epoch,
            total_epochs=self.settings.epochs,
            max_steps_per_epoch=self.max_steps_per_epoch,
            identity=self._run.identity,
            settings=self._run.settings,
            position=DataPosition(
                epoch=self.epochs_run,
                samples_consumed=steps_in_epoch * samples_per_step,
                dataset_size=len(self._sampler.dataset),
                seed=self._sampler.seed,
                shuffle=bool(self._sampler.shuffle),
                world_size=self.world_size,
            ),
            adapter=adapters,
            optimizer=optimizer,
            lr_scheduler=self._lr_scheduler.state_dict(),
            loss_scaler=self._loss_scaler.state_dict(),
            rng_per_rank=[plain_rng_state(r) for r in rng],
            kept_ids=self._kept_ids,
            checkpoint=self._last_checkpoint.name,
            metric_log_dir=log_dir_name(self._metric_logger),  # [issue 17] continued on resume
        )

    def save_checkpoint(self, end_of_epoch: bool = True, full: bool = True) -> None:
        """Saves the adapter (PEFT), then the recipe state (which commits the checkpoint: a resume never starts from a
        step without its folder), then optionally the merged model (if the disk has room; a failed export keeps the
        others). Non-finite adapters are never saved. Collective. Only the adapters are gathered unless the
        merged model is written; NF4 weights are gathered packed.

        Args:
            end_of_epoch (bool): called at the end of an epoch (the next run starts a fresh pass over the data).
            full (bool): also write the merged model (unless ``save_adapter_weights_only``).
        """
        start = time.perf_counter()
        # [issue 24] nothing non-finite is written: a run of skipped fp16 steps or a non-finite adapter stops here
        last, adapters = self._last_saved(), self._named_adapters()
        self._guard.check_before_save(self.global_step, self._lr(), last, adapters, self.settings.dtype)
        save_merged = full and not self.settings.save_adapter_weights_only
        # One rank: the live tensors, no copies; the saver moves one tensor at a time to the host.
        state = get_full_state_dict(
            self._model, adapter_weights_only=not save_merged, keep_nf4=True, cpu_offload=self.world_size > 1
        )
        optimizer = get_full_optimizer_state(self._optimizer)
        rng = all_rng_states(self.settings.device, self.world_size)
        if self._is_rank_zero:
            adapters = {k: state[k].detach().to("cpu", copy=True) for k in self._adapter_keys}
            # Saved at the end too: a finished run can be extended by raising `epochs` and resuming.
            self._last_checkpoint = self._checkpointer.save(
                exportable(state, self._checkpointer, self._pruning, self._kept_ids),
                step=self.global_step,
                adapter_config=self._lora.adapter_config(self._pruning),
                save_merged=False,  # [issue 24] the merged model comes last, after the recipe state (export_merged)
                dtype=self.settings.dtype,
                merge_base=self.settings.merge_base,
            )
            # [issue 24] one typed recipe state
            self._checkpointer.save_recipe_state(self._recipe_state(end_of_epoch, adapters, optimizer, rng))
            # [issue 25] bounded disk: older step folders go once this one is complete
            remove_old_checkpoints(self._checkpointer.output_dir, self.settings.keep_last_n, self._last_checkpoint)
            if save_merged:  # [issue 24] skipped if the disk has no room for it; a failed write keeps the above
                self._merged_note = export_merged(
                    self._checkpointer,
                    exportable(state, self._checkpointer, self._pruning, self._kept_ids),
                    self.global_step,
                    self._lora.adapter_config(self._pruning),
                    self._merged_dtype,  # [issue 18] merged_dtype
                    self.settings.merge_base,
                )
            log.info(f"Checkpoint saved to {self._last_checkpoint} in {time.perf_counter() - start:.1f} s.")
        del state
        if dist.is_initialized():
            dist.barrier()
        self._last_checkpoint = self._checkpointer.output_dir / f"step_{self.global_step}"  # [issue 24] every rank

    def _lr(self) -> float:
        return self._optimizer.param_groups[0]["lr"]

    def _named_adapters(self) -> List[Tuple[str, nn.Parameter]]:
        return list(zip(self._adapter_keys, self._adapter_params.values()))

    def _last_saved(self) -> Optional[Path]:
        """The last checkpoint this run wrote (None before its first save)."""
        return getattr(self, "_last_checkpoint", None)

    # ----------------------------------------------------------------------------------------------- dry run

    def memory_estimator(self, cfg: DictConfig, model: Optional[nn.Module] = None) -> MemoryEstimator:
        """This recipe's training step for its config, ready to estimate on fake tensors: the model built from
        ``model:`` on the meta device and prepared as for training (trainable adapters, activation checkpointing,
        the loss, activation offloading), and this recipe's own micro-batch and optimizer step, run on a copy of the
        recipe (``torchtune_ext.memory.recipe_step_estimator``: this one is never rewritten). Needs no checkpoint,
        no data and no GPU (vocab pruning and compile are left out).

        Args:
            cfg (DictConfig): the recipe config.
            model (Optional[nn.Module]): a real model (built from the same ``model:`` section, materialized on the
                CPU) to run the same step on real tensors instead, counted the same way: the estimate's validation.

        Returns:
            MemoryEstimator: call ``estimate(batch_size, seq_len)`` or ``max_seq_len_that_fits(gib)``.
        """
        return recipe_memory_estimator(self, cfg, model)

    def dry_run(self, cfg: DictConfig) -> str:
        """Estimates the peak device memory of this config's training step without loading weights or data, and
        says whether it fits on the device (``device_memory_gb``, in GiB, or the CUDA device's own) and the longest
        sequence that does.

        Args:
            cfg (DictConfig): the recipe config (``tokenizer.max_seq_len``: the padded length estimated).

        Returns:
            str: the report (also printed).

        Raises:
            ValueError: without ``tokenizer.max_seq_len``.
        """
        report = dry_run_report(self, cfg)
        print(report, flush=True)
        return report

    # ----------------------------------------------------------------------------------------------- the end

    def cleanup(self) -> None:
        """Closes the metric logger and prints (rank 0) the run's summary: loss, peak memory, mean tokens/s, and
        where the outputs are. Collective."""
        memory = self._memory_metrics()
        if not self._is_rank_zero:
            return
        self._metric_logger.close()
        self._output_lock.release()  # [issue 17]
        summary = run_summary(
            world_size=self.world_size,
            losses=self.loss_history,
            first_step=getattr(self, "_first_step_of_run", self.global_step + 1),
            last_step=self.global_step,
            validation=self._val_history,
            memory=memory,
            guard=self._guard,
            train_tokens=self._train_tokens,
            train_seconds=self._train_seconds,
            checkpoint=self._last_saved(),
            merged_note=getattr(self, "_merged_note", None),
            output_dir=self._checkpointer.output_dir,
            base_dir=self._checkpointer.checkpoint_dir,
            log_dir=getattr(self._metric_logger, "log_dir", None),
        )
        print(summary, flush=True)

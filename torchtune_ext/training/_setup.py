"""Setting a QLoRA run up, whatever the number of ranks: the setup pieces the recipe file's ``setup`` calls in order.

:class:`RecipeSetup` reads the settings (``__init__``: the world size from the launcher, or one device without one)
and builds what the loop needs; the recipe file's ``setup`` calls these pieces in this order, and nothing is written
before step 4:
    1. seed; settings and every config check that is cheap (:class:`RecipeSettings`, in ``__init__``)
    2. the model on the meta device, checked against the checkpoint's headers; tokenizer, loss, data sets
    3. data checks (labels within ``max_seq_len``, enough batches), vocab-pruning ids, the resumed recipe state
       (steps 2-3, with the writable-folder and ``output_dir`` checks: :meth:`RecipeSetup.check_start`, which
       ``tune-ext validate`` runs too)
    4. stale temporaries of killed writes removed, metric logger opened (:meth:`RecipeSetup._start_writing`)
    5. the model (:meth:`RecipeSetup._load_model`): vocab pruning (meta), trainable params, activation
       checkpointing, compile, FSDP2 sharding on several ranks, the base streamed in and quantized
       (``load_base_``), adapters initialised or resumed (``init_adapters_``)
    6. optimizer (resumed), loss, data loaders (resumed position), LR schedule

Every piece works on one rank and on many: on several ranks the model is sharded per decoder layer
(:meth:`RecipeSetup._parallelize`), batches are per rank and the loss scaler agrees on overflows across ranks.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from functools import partial
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import modules, training, utils
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.recipe_interfaces import FTRecipeInterface

from torchtune_ext.checkpoint import (  # output-dir checks; bounded disk
    RECIPE_STATE_DIRNAME,
    QLoRAHFCheckpointer,
    RecipeState,
    RunIdentity,
    check_output_dir,
    claim_output_dir,
    load_base_,
    on_rank_zero,
)
from torchtune_ext.config import check_config, instantiate_component, recipe_setting
from torchtune_ext.data import TINY_SPLITS
from torchtune_ext.distributed import (
    check_fsdp_cpu_offload,
    check_nf4_sharding,
    launched_world_size,
    load_full_optimizer_state,
    optimizer_param_groups,
    per_rank_batch_size,
    replicated_params,
    shard_model,
    unwrap_key,
)
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
from torchtune_ext.nf4 import cache_nf4_decoding_tables
from torchtune_ext.training._activations import activation_offloading
from torchtune_ext.training._allocator import use_expandable_segments
from torchtune_ext.training._builders import build_dataset, build_optimizer, build_qlora_model, build_tokenizer
from torchtune_ext.training._checkpointing import disk_plan
from torchtune_ext.training._data import build_data_loader, check_data
from torchtune_ext.training._export import check_run_folders
from torchtune_ext.training._interrupt import continued_metric_logger
from torchtune_ext.training._metrics import MemoryPeaks, format_memory_stats, gather_memory_stats
from torchtune_ext.training._nonfinite import NonFiniteGuard, check_base_finite
from torchtune_ext.training._precision import DistributedLossScaler, LossScaler, check_param_dtypes
from torchtune_ext.training._rng import seed_everything
from torchtune_ext.training._settings import (
    LoRASettings,
    RecipeSettings,
    dtype_or_checkpoints,
    frozen_weights_dtype,
)
from torchtune_ext.training._validation import ValidationHistory

log = utils.get_logger("INFO")


def launched_world_size_and_rank() -> Tuple[int, int]:
    """The world size and rank a distributed launcher (torchrun, ``tune run --nproc_per_node``) set, or one device.

    Returns:
        Tuple[int, int]: ``(WORLD_SIZE, RANK)`` under a launcher, else ``(1, 0)``.

    Raises:
        RuntimeError: if the launcher's variables are set only in part.
    """
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return 1, 0
    return launched_world_size(), int(os.environ["RANK"])


class RecipeSetup(FTRecipeInterface):
    """The setup pieces of a QLoRA recipe, in the order of the module docstring; the recipe file's class builds on
    them (through :class:`torchtune_ext.training.QLoRARecipe`) and calls them from its ``setup``.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ValueError: on an unknown dtype or invalid settings (every cheap check runs here), ``fsdp_cpu_offload``
            on the CPU (several ranks), or a ``global_batch_size`` that does not split over the ranks.
        RuntimeError: on bf16 where the device does not support it.
    """

    # ------------------------------------------------------------------------------------- the recipe's attributes
    world_size: int  # the launcher's, or 1 without one
    rank: int
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
    finished: bool
    epochs_run: int
    global_step: int
    _steps_in_epoch_done: int
    loss_history: List[float]

    def __init__(self, cfg: DictConfig) -> None:
        self.world_size, self.rank = launched_world_size_and_rank()
        dry_run = bool(recipe_setting(cfg, "dry_run"))  # estimates for the configured device, which need not be here
        check_config(  # keys, ranges, device, files: before anything is done
            cfg,
            dry_run=dry_run,
            splits={"torchtune_ext.data.tiny_instruct_dataset": TINY_SPLITS},
            plain_sections={"loss_scaler": LossScaler},
        )
        if not dry_run:  # before anything is allocated on the device; the user's own allocator settings are kept
            use_expandable_segments(torch.device(str(cfg.device)))
        self.settings = RecipeSettings.from_config(cfg)
        global_batch_size = recipe_setting(cfg, "global_batch_size")
        batch_size = per_rank_batch_size(self.settings.batch_size, global_batch_size, self.world_size)
        self.settings = replace(self.settings, batch_size=batch_size)  # per rank
        # one rank: unsharded, whatever fsdp_cpu_offload says
        self._fsdp_cpu_offload = bool(recipe_setting(cfg, "fsdp_cpu_offload")) and self.world_size > 1
        if self._fsdp_cpu_offload:
            check_fsdp_cpu_offload(self._fsdp_cpu_offload, self.settings.device, self.world_size)
        self._reshard_after_forward = bool(recipe_setting(cfg, "fsdp_reshard_after_forward"))
        self.process_group_timeout_s = float(recipe_setting(cfg, "process_group_timeout_s"))
        self._memory_peaks = MemoryPeaks(self.settings.device)  # logged per window, the run's in the summary
        self.max_steps_per_epoch = self.settings.max_steps_per_epoch  # a resume keeps the saved run's
        self._activation_offloading: ContextManager = contextlib.nullcontext()
        self._pruning = None
        self._kept_ids = None
        self._pad_to_multiple: Optional[int] = None
        self.finished = False  # resumed a run that had finished: nothing is loaded, trained or written
        self.epochs_run = 0
        self.global_step = 0
        self._steps_in_epoch_done = 0
        self.loss_history = []
        self._val_history = ValidationHistory()  # validation loss on the console and in the summary
        self._train_tokens = 0.0
        self._train_seconds = 0.0

    @property
    def _is_rank_zero(self) -> bool:
        return self.rank == 0

    def _info(self, message: str) -> None:
        utils.log_rank_zero(log, message)

    # ---------------------------------------------------------------------------------------------------- setup

    def _setup_loss_scaler(self, cfg: DictConfig) -> None:
        """The loss scaler (dynamic loss scaling in fp16, its overflow agreed across ranks; a no-op otherwise) and
        the non-finite guard that watches it."""
        loss_scaler = DistributedLossScaler if self.world_size > 1 else LossScaler
        self._loss_scaler = loss_scaler(
            enabled=self.settings.dtype == torch.float16,
            device=self.settings.device,
            **(recipe_setting(cfg, "loss_scaler") or {}),
        )
        self._guard = NonFiniteGuard(self._loss_scaler, self.settings.clip_grad_norm)

    def _log_disk_plan(self, num_samples: int) -> None:
        """Logs the disk the run's checkpoints will take, and whether the folder has room."""
        disk = disk_plan(
            self.settings,
            self.world_size,
            self.max_steps_per_epoch,
            self._model,
            self._checkpointer.output_dir,
            num_samples,
            self._merged_dtype,
        )
        self._info(disk.format())

    def _setup_optimizer(self, cfg: DictConfig) -> None:
        """The optimizer over the trainable params, one param group per kind of param (sharded or not, device,
        dtype): fused and foreach AdamW need it. Its resumed state is loaded with the schedule."""
        groups = optimizer_param_groups(self._trainable_params)
        self._optimizer = instantiate_component(cfg.optimizer, "optimizer", groups)

    def check_start(self, cfg: DictConfig) -> Tuple[Any, Optional[Any], Optional[RecipeState]]:
        """Steps 2-3 of the module docstring: every check before the run writes anything (``tune-ext validate`` runs
        it too). Builds the checkpointer, the model on the meta device, the tokenizer, loss and data sets, and loads
        the recipe state to resume, if any; no weight is loaded. Writes the tiny base checkpoint where
        ``generate_base_checkpoint`` asks for it. A resumed run that had finished sets :attr:`finished`.

        Returns:
            Tuple[Any, Optional[Any], Optional[RecipeState]]: the training and validation data sets, and the recipe
            state to resume from (None for a new run).

        Raises:
            ConfigError: on the first failing check, naming the key and the fix.
        """
        check_run_folders(cfg)  # every folder the run writes is writable, before anything is written
        self._set_seed(cfg)
        # a busy output_dir, or one holding another run's checkpoints, is refused before any write
        check_output_dir(
            cfg.checkpointer.output_dir, self.settings.resume_from_checkpoint, self.settings.overwrite_output_dir
        )
        self._generate_base_checkpoint(cfg)
        dataset, val_dataset = self._build_components(cfg)
        settings = self.settings
        check_data(
            dataset,
            val_dataset if settings.run_val_every_n_steps else None,
            settings.max_seq_len,
            self._loss_fn.ignore_index,
            settings.batch_size,
            settings.gradient_accumulation_steps,
            self.world_size,
        )
        if self.settings.vocab_pruning is not None:
            self._resolve_kept_ids(dataset, val_dataset)
        self._run = self._run_identity(cfg, dataset)  # what a resume must match
        state = self._checkpointer.load_recipe_state() if self.settings.resume_from_checkpoint else None
        if state is not None:
            self._check_recipe_state(state)
            self.finished = self.epochs_run >= self.settings.epochs  # said so (step, outputs)
        self._saved_log_dir = state.metric_log_dir if state is not None else None
        return dataset, val_dataset, state

    def _set_seed(self, cfg: DictConfig) -> None:
        """The config's seed (torchtune's ``set_seed`` agrees on it across ranks), with the same streams on every
        rank until the model is initialised, so every rank draws the single-device run's initial adapters."""
        self.seed = training.set_seed(seed=cfg.seed, debug_mode=recipe_setting(cfg, "cudnn_deterministic_mode"))
        seed_everything(self.seed)

    def _generate_base_checkpoint(self, cfg: DictConfig) -> None:
        """The tiny default writes its random base checkpoint on first use (rank 0; the others wait)."""
        # a value it refuses stops every rank (collective)
        if recipe_setting(cfg, "generate_base_checkpoint") is not None:
            on_rank_zero(lambda: instantiate_component(cfg.generate_base_checkpoint, "generate_base_checkpoint"))

    def _build_components(self, cfg: DictConfig) -> Tuple[Any, Optional[Any]]:
        """Builds what can be checked before anything is written: the checkpointer (validated against the model,
        built on the meta device), tokenizer, loss, and the training and validation data sets.

        Returns:
            Tuple[Any, Optional[Any]]: the training data set and the validation one (None without ``dataset_val``).
        """
        self._checkpointer = instantiate_component(cfg.checkpointer, "checkpointer")
        self._lora = LoRASettings.from_config(cfg.model)
        self._frozen_dtype = frozen_weights_dtype(
            self.settings.frozen_dtype, self.settings.dtype, self._checkpointer.hf_config
        )
        # merged_dtype: the merged export's dtype (default: the base checkpoint's)
        self._merged_dtype = dtype_or_checkpoints(self.settings.merged_dtype, self._checkpointer.hf_config)
        self._model = build_qlora_model(cfg.model, self.settings.dtype, self.settings.adapter_dtype, self._frozen_dtype)
        check_nf4_sharding(self._model, self.world_size)  # refuse/report NF4 layouts before any load
        self._checkpointer.validate(self._model, builder=cfg.model.get("_component_"))  # names the builder
        self._tokenizer = build_tokenizer(cfg.tokenizer)
        self._loss_fn = instantiate_component(cfg.loss, "loss")
        if not self.settings.dry_run:  # over one parameter, so a refused value fails now; a dry run builds its own
            probe = [nn.Parameter(torch.zeros(1, device=self.settings.device))]
            build_optimizer(cfg.optimizer, cfg.lr_scheduler, probe)
        dataset = build_dataset(cfg.dataset, self._tokenizer)
        val_cfg = recipe_setting(cfg, "dataset_val")
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
            scanned=scanned if self.settings.resume_from_checkpoint else None,
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
        for line in state.check_resume(self._run, self._kept_ids, self.settings.epochs):
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
        if state.checkpoint_path is not None:  # the summary names it (a finished run trains no further)
            self._last_checkpoint = state.checkpoint_path

    def _epoch_and_batch(self) -> Tuple[int, int]:
        """The epoch (from 1) of the last completed step and its batches done (all of them between epochs)."""
        if self._steps_in_epoch_done == 0 and self.epochs_run > 0:
            epoch, steps = self.epochs_run, self._steps_per_epoch
        else:
            epoch, steps = self.epochs_run + 1, self._steps_in_epoch_done
        return epoch, steps * self.settings.gradient_accumulation_steps

    def _start_writing(self, cfg: DictConfig) -> None:
        """Rank 0, once everything has been checked: locks the output folder (collective), clears what killed writes
        of an earlier run left in it and opens the metric logger."""
        # one run per output_dir: rank 0 holds its lock until the process ends
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
        # a resume continues the interrupted run's TensorBoard folder
        metric_logger = continued_metric_logger(cfg.metric_logger, self._saved_log_dir)
        self._metric_logger = instantiate_component(metric_logger, "metric_logger")
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
        check_base_finite(model, self._checkpointer.checkpoint_dir, self._checkpointer.converter.to_hf)
        if self.settings.compile:
            cache_nf4_decoding_tables(model, self.settings.device)
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
        share_rope_(model, self.settings.max_seq_len)  # one RoPE cache, sized for the run, grown on demand
        if self.settings.tiled_mlp_tokens is not None:
            tile_mlp_(model, self.settings.tiled_mlp_tokens)
        if self.settings.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if self.settings.compile:
            training.compile_model(model, verbose=self._is_rank_zero)
        if not self.settings.dry_run:
            self._activation_offloading = activation_offloading(model, self.settings.enable_activation_offloading)

    #: The mesh FSDP shards over; None: torch's default for the process group (on the host's accelerator). The
    #: per-rank dry run sets a CPU one: its fake tensors and batches are on the CPU whatever the host has.
    _device_mesh: Optional[DeviceMesh] = None

    def _parallelize(self) -> None:
        """On several ranks, FSDP2 per decoder layer over :attr:`_device_mesh` in the compute dtype (fp32 gradient
        reduction), the vocab-pruning module sharded on its own in fp32 or replicated; one rank keeps it whole."""
        if self.world_size == 1:
            return
        pruning_cfg = self.settings.vocab_pruning
        shard_model(
            self._model,
            dtype=self.settings.dtype,
            vocab_pruning=self._pruning,
            vocab_pruning_sharding=pruning_cfg["sharding"] if pruning_cfg is not None else "sharded",
            reshard_after_forward=self._reshard_after_forward,
            cpu_offload=self._fsdp_cpu_offload,
            mesh=self._device_mesh,
        )

    @property
    def _sharded_device(self) -> Optional[torch.device]:
        """Where sharded params live (the host under FSDP CPU offload); None: the training device."""
        return torch.device("cpu") if self._fsdp_cpu_offload else None

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
            pruning_cfg = self.settings.vocab_pruning
            if self.world_size > 1 and pruning_cfg is not None and pruning_cfg["sharding"] == "sharded":
                # Each output chunk is a call of the pruning module's own FSDP unit (an all-gather): every rank must
                # make the same number of calls, whatever its sequence length (LinearCrossEntropyLoss agrees on its
                # number of chunks itself).
                self._pad_to_multiple = self._loss_fn.num_output_chunks

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
        """Steps per epoch (at least one: ``check_data``), the LR scheduler, and (resuming) the optimizer, loss
        scaler, data and RNG positions."""
        self._steps_per_epoch = len(self._dataloader) // self.settings.gradient_accumulation_steps
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        if state is not None:  # this run's optimizer hyperparameters; the global data position
            load = partial(load_full_optimizer_state, params=self._trainable_params)  # numbered in this order
            hyperparameters = state.restore_optimizer_(self._optimizer, load)
            self._loss_scaler.load_state_dict(state.loss_scaler)
            state.restore_sampler_(self._sampler, self.world_size)
        self._lr_scheduler = instantiate_component(
            cfg.lr_scheduler,
            "lr_scheduler",
            self._optimizer,
            num_training_steps=self.settings.epochs * self._steps_per_epoch,
            last_epoch=self.global_step - 1,
        )
        # Restored when training starts, after the data loader iterator has drawn its seed.
        self._rng_to_restore = None
        if state is not None:
            state.restore_lr_scheduler_(self._lr_scheduler, hyperparameters)
            self._rng_to_restore = state.rng_for(self.rank, self.world_size)
            if self.epochs_run < self.settings.epochs:  # the step the interrupt message named
                self._info(state.describe_position(self.world_size, *self._epoch_and_batch()))  # the data
        self._info(f"Memory after setup: {format_memory_stats(self._memory_metrics(window=True))}")

    # ---------------------------------------------------------------------------------------------- cross-rank

    def _memory_metrics(self, window: bool = False) -> Dict[str, float]:
        """This rank's memory figures, or every rank's (``<name>/rank<r>``) on several ranks: the peaks since the
        last window's (``window``, which starts the next) or the run's. Collective."""
        stats = self._memory_peaks.window() if window else self._memory_peaks.overall()
        return stats if self.world_size == 1 else gather_memory_stats(self.settings.device, stats=stats)

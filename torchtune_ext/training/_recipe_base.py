"""The part of a QLoRA recipe that does not depend on how many ranks run it: settings, data loaders, the loss, the
optimizer step, the training loop, resume bookkeeping and the end-of-run summary.

``recipes/qlora_finetune_single_device.py`` and ``recipes/qlora_finetune_distributed.py`` subclass
:class:`QLoRARecipeBase` and write their own ``setup`` (building, sharding and loading the model) and
``save_checkpoint``. The distributed recipe overrides the hooks that cross ranks: :meth:`_sum_over_ranks`,
:meth:`_reduce_grads`, :meth:`_clip_gradients`, :meth:`_memory_metrics`, :meth:`_load_optimizer_state`.
"""

import math
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.modules.peft import get_adapter_params
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from torchtune_ext.training._hf import HFConverter
from torchtune_ext.training._metrics import Throughput, format_memory_stats, memory_stats
from torchtune_ext.training._recipe_utils import (
    LoRASettings,
    build_dataset,
    build_qlora_model,
    parse_vocab_pruning,
    positive_int,
    resolve_kept_ids,
    set_rng_state,
    shifted_labels,
)

log = utils.get_logger("INFO")


def _lora_shapes(adapters: Dict[str, torch.Tensor]) -> Dict[str, Tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in adapters.items() if ".lora_" in k or k.endswith(".magnitude")}


class QLoRARecipeBase(FTRecipeInterface):
    """Shared training loop and bookkeeping of the QLoRA recipes (one rank by default).

    A subclass's ``__init__`` sets ``_device``, ``_dtype``, ``_adapter_dtype``, ``_batch_size`` and ``seed`` and calls
    :meth:`_read_settings`. Its ``setup`` calls :meth:`_build_components` and runs its checks (nothing is written
    yet), then :meth:`_start_writing`; it loads the model, sets ``_optimizer``, ``_loss_scaler`` and
    ``_trainable_params``, and ends with :meth:`_setup_dataloaders` and :meth:`_setup_schedule`. It implements
    ``save_checkpoint``; ``train`` and ``cleanup`` are here.
    """

    world_size: int = 1
    rank: int = 0

    @property
    def _is_rank_zero(self) -> bool:
        return self.rank == 0

    def _read_settings(self, cfg: DictConfig) -> None:
        """Reads and checks the settings both recipes take (everything but the batch size and device set-up).

        Args:
            cfg (DictConfig): the recipe config.

        Raises:
            ValueError: on a non-positive count, or ``enable_activation_offloading``.
        """
        self._output_dir = cfg.output_dir
        self._log_every_n_steps = positive_int(cfg, "log_every_n_steps", 1)
        self._gradient_accumulation_steps = positive_int(cfg, "gradient_accumulation_steps", 1)
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self.total_epochs = positive_int(cfg, "epochs", 1)
        self.max_steps_per_epoch = positive_int(cfg, "max_steps_per_epoch", None)
        self._stop_after_step = positive_int(cfg, "stop_after_step", None)
        self._save_every_n_steps = positive_int(cfg, "save_every_n_steps", None)
        self._run_val_every_n_steps = positive_int(cfg, "run_val_every_n_steps", None)
        self._max_validation_steps = positive_int(cfg, "max_validation_steps", None)
        self._resume_from_checkpoint = cfg.get("resume_from_checkpoint", False)
        self._save_adapter_weights_only = cfg.get("save_adapter_weights_only", False)
        self._enable_activation_checkpointing = cfg.get("enable_activation_checkpointing", False)
        self._compile = cfg.get("compile", False)
        if cfg.get("enable_activation_offloading", False):
            raise ValueError(
                "enable_activation_offloading is not supported by this recipe; use "
                "enable_activation_checkpointing=True to save activation memory."
            )
        self._vocab_pruning_cfg = parse_vocab_pruning(cfg.get("vocab_pruning", None))
        self._pruning = None
        self._kept_ids: Optional[List[int]] = None
        self._pad_to_multiple: Optional[int] = None
        self.epochs_run = 0
        self.global_step = 0
        self._steps_in_epoch_done = 0
        self.loss_history: List[float] = []

    def _build_components(self, cfg: DictConfig) -> Tuple[Any, Optional[Any]]:
        """Builds what can be checked before anything is written: the checkpointer (validated against the model,
        built on the meta device), the HF key converter, tokenizer, loss, and the training and validation data sets.

        Returns:
            Tuple[Any, Optional[Any]]: the training data set and the validation one (None without ``dataset_val``).
        """
        self._checkpointer = config.instantiate(cfg.checkpointer)
        self._lora = LoRASettings.from_config(cfg.model)
        self._model = build_qlora_model(cfg.model, self._dtype, self._adapter_dtype)
        self._checkpointer.validate(self._model)
        self._converter = HFConverter.for_model(self._checkpointer.model_type, self._model)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        dataset = build_dataset(cfg.dataset, self._tokenizer)
        val_cfg = cfg.get("dataset_val", None)
        return dataset, build_dataset(val_cfg, self._tokenizer) if val_cfg is not None else None

    def _resolve_kept_ids(self, dataset: Any, val_dataset: Optional[Any]) -> None:
        """Vocab pruning: the kept token ids (a file, else the ids the data uses); every rank computes the same."""
        vocab_size = self._model.tok_embeddings.num_embeddings
        self._kept_ids = resolve_kept_ids(
            self._vocab_pruning_cfg["kept_ids"], vocab_size, self._tokenizer, [dataset, val_dataset]
        )
        self._info(f"Vocab pruning: keeping {len(self._kept_ids)} of {vocab_size} token ids.")

    def _check_samples_have_labels(self, dataset: Any, max_seq_len: Optional[int], limit: int = 64) -> None:
        """Fails if none of the first ``limit`` samples keeps a label token after truncation (prompts longer than
        ``max_seq_len``), which would train on nothing; warns if some do not.

        Raises:
            ValueError: if none of them has a label token.
        """
        ignore_index = self._loss_fn.ignore_index
        count = min(len(dataset), limit)
        empty = [i for i in range(count) if all(int(label) == ignore_index for label in dataset[i]["labels"])]
        if count and len(empty) == count:
            raise ValueError(
                f"None of the first {count} samples of the data set keeps a label token after truncation to "
                f"tokenizer.max_seq_len={max_seq_len}: their prompts are longer. Raise tokenizer.max_seq_len."
            )
        if empty and self._is_rank_zero:
            log.warning(
                f"{len(empty)} of the first {count} samples have no label token within tokenizer.max_seq_len="
                f"{max_seq_len} (e.g. sample {empty[0]}); they do not train."
            )

    def _check_adapter_shapes(self, saved: Dict[str, torch.Tensor]) -> None:
        """Resuming: the recipe state's LoRA/DoRA shapes must be the (unsharded, meta) model's; vocab-pruning
        rows are checked through the kept ids (:meth:`_restore_progress`).

        Raises:
            ValueError: naming the first differing adapters.
        """
        expected, found = _lora_shapes(get_adapter_params(self._model)), _lora_shapes(saved)
        if found != expected:
            differ = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
            raise ValueError(
                "The recipe state's adapters do not match the model's (different lora_attn_modules, "
                "apply_lora_to_mlp or lora_rank?): "
                + "; ".join(f"{k}: saved {found.get(k)}, model {expected.get(k)}" for k in differ[:4])
            )

    def _start_writing(self, cfg: DictConfig) -> None:
        """Rank 0, once the config has been validated: clears what killed writes of an earlier run left in the
        output folder and opens the metric logger."""
        if not self._is_rank_zero:
            return
        stale = self._checkpointer.remove_stale_temporaries()
        if stale:
            log.info(
                f"Deleted {len(stale)} temporary file(s)/folder(s) of interrupted writes: {[p.name for p in stale]}"
            )
        self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)

    # ------------------------------------------------------------------------------------------ cross-rank hooks

    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over all ranks, on the CPU."""
        return value.detach().cpu()

    def _reduce_grads(self) -> None:
        """Makes the gradients global before they are scaled and clipped (nothing to do on one rank)."""

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self._trainable_params, max_norm=max_norm)

    def _memory_metrics(self) -> Dict[str, float]:
        return memory_stats(self._device)

    def _load_optimizer_state(self, state: Dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state)

    def _info(self, message: str) -> None:
        utils.log_rank_zero(log, message)

    # ------------------------------------------------------------------------------------------------- resume

    def _restore_progress(self, state: Dict[str, Any]) -> None:
        """Checks the recipe state against this run (dtype, vocab pruning) and takes its seed and position.

        Raises:
            ValueError: if the dtype or the kept token ids differ.
        """
        if state["dtype"] != str(self._dtype):
            raise ValueError(
                f"The recipe state was saved with dtype {state['dtype']} but this run uses {self._dtype}; "
                "resume with the same dtype."
            )
        if state.get("kept_ids") != self._kept_ids:
            raise ValueError(
                "The recipe state's vocab pruning (kept token ids) differs from this run's; resume with the same "
                "vocab_pruning settings and data."
            )
        if state["seed"] != self.seed:
            self._info(f"Config seed {self.seed} differs from the checkpoint's; using {state['seed']}.")
            self.seed = state["seed"]
        if state["max_steps_per_epoch"] != self.max_steps_per_epoch:
            self._info(
                f"Config max_steps_per_epoch={self.max_steps_per_epoch} differs from the checkpoint's; using "
                f"{state['max_steps_per_epoch']}."
            )
            self.max_steps_per_epoch = state["max_steps_per_epoch"]
        self.epochs_run = state["epochs_run"]
        self.global_step = state["global_step"]
        self._steps_in_epoch_done = state["steps_in_epoch_done"]

    def _progress_state(self, end_of_epoch: bool) -> Dict[str, Any]:
        """The recipe-state entries both recipes save (the adapters, optimizer and RNG states are theirs)."""
        return {
            "global_step": self.global_step,
            "epochs_run": self.epochs_run,
            "steps_in_epoch_done": 0 if end_of_epoch else self._steps_in_epoch_done,
            "seed": self.seed,
            "total_epochs": self.total_epochs,
            "max_steps_per_epoch": self.max_steps_per_epoch,
            "dtype": str(self._dtype),
            "lr_scheduler": self._lr_scheduler.state_dict(),
            "loss_scaler": self._loss_scaler.state_dict(),
            # A new epoch starts a fresh pass over the data.
            "dataloader": None if end_of_epoch else self._dataloader.state_dict(),
            "kept_ids": self._kept_ids,
        }

    # --------------------------------------------------------------------------------------------------- data

    def _setup_dataloaders(self, cfg: DictConfig, dataset: Any, val_dataset: Optional[Any]) -> None:
        """Training (shuffled per ``cfg.shuffle``, last partial batch dropped) and validation data loaders."""
        collate_fn = cfg.get("collate_fn", "torchtune.data.padded_collate_sft")
        self._sampler, self._dataloader = self._data_loader(
            dataset, cfg.dataset, shuffle=cfg.shuffle, collate_fn=collate_fn, drop_last=True
        )
        self._val_dataloader = None
        if val_dataset is not None:
            self._val_dataloader = self._data_loader(
                val_dataset, cfg.dataset_val, shuffle=False, collate_fn=collate_fn, drop_last=False
            )[1]

    def _data_loader(
        self, dataset: Any, cfg_dataset: Any, shuffle: bool, collate_fn: str, drop_last: bool
    ) -> Tuple[StatefulDistributedSampler, StatefulDataLoader]:
        packed = (
            getattr(dataset, "packed", False)
            if isinstance(cfg_dataset, ListConfig)
            else cfg_dataset.get("packed", False)
        )
        if "left_pad_sequence" in collate_fn:
            raise RuntimeError("left_pad_sequence collator is only for inference.")
        collate = _get_component_from_path(collate_fn)
        # Every rank must run the same number of batches (FSDP's collectives). Training pads the index list to a
        # multiple of the world size (torchtune's behaviour); validation (no dropped batches) drops the remainder
        # instead, so that no sample counts twice in the validation loss. One rank: no padding either way.
        sampler = StatefulDistributedSampler(
            dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=shuffle,
            seed=self.seed,
            drop_last=not drop_last,
        )
        dataloader = StatefulDataLoader(
            dataset=dataset,
            batch_size=self._batch_size,
            sampler=sampler,
            collate_fn=padded_collate_packed
            if packed
            else partial(collate, padding_idx=self._tokenizer.pad_id, ignore_idx=self._loss_fn.ignore_index),
            # dropping the last partial batch keeps shapes static (compile) and batches comparable
            drop_last=drop_last,
        )
        return sampler, dataloader

    def _setup_schedule(self, cfg: DictConfig, state: Optional[Dict[str, Any]]) -> None:
        """Steps per epoch, the LR scheduler, and (resuming) the optimizer, loss scaler, data and RNG positions.

        Raises:
            ValueError: if an epoch has fewer batches than ``gradient_accumulation_steps``.
        """
        self._steps_per_epoch = len(self._dataloader) // self._gradient_accumulation_steps
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        if self._steps_per_epoch == 0:
            raise ValueError(
                f"The data set gives {len(self._dataloader)} batches per rank, fewer than "
                f"gradient_accumulation_steps={self._gradient_accumulation_steps}: lower batch_size or "
                "gradient_accumulation_steps."
            )
        if state is not None:
            self._load_optimizer_state(state["optimizer"])
            self._loss_scaler.load_state_dict(state["loss_scaler"])
            if state["dataloader"] is not None:
                self._dataloader.load_state_dict(state["dataloader"])
        self._lr_scheduler = config.instantiate(
            cfg.lr_scheduler,
            self._optimizer,
            num_training_steps=self.total_epochs * self._steps_per_epoch,
            last_epoch=self.global_step - 1,
        )
        # Restored when training starts, after the data loader iterator has drawn its seed.
        self._rng_to_restore = None
        if state is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
            per_rank = state.get("rng_per_rank")
            self._rng_to_restore = (
                per_rank[self.rank] if per_rank and len(per_rank) == self.world_size else state["rng"]
            )
        self._ignore_labels_cache = torch.full((self._batch_size, 1), self._loss_fn.ignore_index, device=self._device)
        self._info(f"Memory after setup: {format_memory_stats(self._memory_metrics())}")

    # ----------------------------------------------------------------------------------------------- training

    def _pad_batch(self, batch: Dict[str, torch.Tensor]) -> None:
        """Right-pads tokens (pad id) and labels (ignored) to a multiple of ``_pad_to_multiple``; causal attention
        makes the extra positions invisible to the others, so the loss is unchanged. Packed batches are left."""
        if self._pad_to_multiple is None or "mask" in batch:
            return
        extra = -batch["tokens"].shape[1] % self._pad_to_multiple
        if extra:
            batch["tokens"] = nn.functional.pad(batch["tokens"], (0, extra), value=self._tokenizer.pad_id)
            batch["labels"] = nn.functional.pad(batch["labels"], (0, extra), value=self._loss_fn.ignore_index)

    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean loss over the batch's label tokens (0 if it has none)."""
        self._pad_batch(batch)
        labels = shifted_labels(batch.pop("labels"), self._ignore_labels_cache)
        logits = self._model(**batch)
        if self._pruning is not None:
            labels = self._pruning.remap_labels(labels, ignore_index=self._loss_fn.ignore_index)
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        loss = self._loss_fn(logits, labels)
        # A micro-batch without label tokens still runs backward (FSDP's collectives), contributing zero.
        if not bool((labels != self._loss_fn.ignore_index).any()):
            loss = sum(chunk.sum() for chunk in (logits if isinstance(logits, list) else [logits])) * 0.0
        del logits
        return loss

    @torch.no_grad()
    def _validate(self) -> float:
        """The validation loss, averaged over the label tokens of all ranks."""
        self._model.eval()
        total, count = 0.0, 0
        for i, batch in enumerate(self._val_dataloader):
            if self._max_validation_steps is not None and i >= self._max_validation_steps:
                break
            utils.batch_to_device(batch, self._device)
            num_tokens = int((batch["labels"] != self._loss_fn.ignore_index).sum())
            total += float(self._loss_step(batch)) * num_tokens
            count += num_tokens
        self._model.train()
        sums = self._sum_over_ranks(torch.tensor([total, count], dtype=torch.float64))
        return float(sums[0] / sums[1].clamp(min=1))

    def _optimizer_step(self, num_tokens: torch.Tensor) -> Tuple[Dict[str, float], float]:
        """Normalises the gradients by the step's global label-token count, clips, steps and zeroes them.

        Returns:
            Tuple[Dict[str, float], float]: step metrics (grad norm; loss scale and skipped steps in fp16) and
            the global token count.
        """
        global_tokens = float(self._sum_over_ranks(num_tokens))
        self._reduce_grads()
        self._loss_scaler.unscale_(self._optimizer)
        for param in self._trainable_params:
            if param.grad is not None:
                param.grad.mul_(1.0 / max(global_tokens, 1.0))
        max_norm = math.inf if self._clip_grad_norm is None else float(self._clip_grad_norm)
        grad_norm = self._clip_gradients(max_norm)
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
        """The training loop: gradient accumulation normalised by the global label-token count of each step (all
        ranks, all micro-batches), as torchtune's recipes; checkpoints every ``save_every_n_steps`` and at the end
        of each epoch; stops after ``stop_after_step`` with a resumable checkpoint."""
        if self._compile:
            self._info("torch.compile is enabled: the first iterations are slow.")
        throughput = Throughput()
        self._first_step_of_run = self.global_step + 1
        running_loss, num_tokens = 0.0, 0
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            self._sampler.set_epoch(curr_epoch)
            pbar = tqdm(
                total=self._steps_per_epoch,
                initial=self._steps_in_epoch_done,
                dynamic_ncols=True,
                disable=not self._is_rank_zero,
            )
            micro_batches = 0
            batches = iter(self._dataloader)  # draws a seed from the global RNG, as at the start of the run
            if self._rng_to_restore is not None:
                set_rng_state(self._rng_to_restore, self._device)
                self._rng_to_restore = None
            for batch in batches:
                if self._steps_in_epoch_done >= self._steps_per_epoch:
                    break
                utils.batch_to_device(batch, self._device)
                batch_tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
                num_tokens += batch_tokens
                throughput.add(batch_tokens)
                # The loss is a mean over tokens; weighting by the count lets the step normalise over all of them.
                loss = self._loss_step(batch) * batch_tokens
                running_loss += loss.detach()
                self._loss_scaler.scale(loss).backward()
                micro_batches += 1
                if micro_batches % self._gradient_accumulation_steps != 0:
                    continue

                step_metrics, global_tokens = self._optimizer_step(num_tokens)
                self.global_step += 1
                self._steps_in_epoch_done += 1
                loss_value = float(self._sum_over_ranks(running_loss)) / max(global_tokens, 1.0)
                self.loss_history.append(loss_value)
                pbar.update(1)
                pbar.set_description(f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_value:.4f}")
                if self.global_step % self._log_every_n_steps == 0:
                    self._log_step(loss_value, step_metrics, throughput, float(num_tokens), global_tokens)
                    throughput.reset()
                running_loss, num_tokens = 0.0, 0
                if self._should_validate():
                    val_loss = self._validate()
                    if self._is_rank_zero:
                        self._metric_logger.log_dict({"val_loss": val_loss}, step=self.global_step)

                mid_epoch = self._steps_in_epoch_done < self._steps_per_epoch
                if self._stop_after_step is not None and self.global_step >= self._stop_after_step:
                    if mid_epoch:
                        pbar.close()
                        self.save_checkpoint(curr_epoch, end_of_epoch=False, full=False)
                        self._info(
                            f"Stopped after step {self.global_step} (stop_after_step); resume with "
                            "resume_from_checkpoint=True."
                        )
                        return
                elif self._save_every_n_steps and self.global_step % self._save_every_n_steps == 0 and mid_epoch:
                    self.save_checkpoint(curr_epoch, end_of_epoch=False, full=False)
            pbar.close()
            self.epochs_run += 1
            self._steps_in_epoch_done = 0
            self.save_checkpoint(curr_epoch, end_of_epoch=True)
            if self._stop_after_step is not None and self.global_step >= self._stop_after_step:
                return

    def _should_validate(self) -> bool:
        return bool(
            self._val_dataloader is not None
            and self._run_val_every_n_steps
            and self.global_step % self._run_val_every_n_steps == 0
        )

    def cleanup(self) -> None:
        """Closes the metric logger and prints (rank 0) where the outputs are."""
        if not self._is_rank_zero:
            return
        self._metric_logger.close()
        print(self._summary(), flush=True)

    def _summary(self) -> str:
        log_dir = getattr(self._metric_logger, "log_dir", None)
        checkpoint: Optional[Path] = getattr(self, "_last_checkpoint", None)
        lines = ["", "Done." if self.world_size == 1 else f"Done ({self.world_size} ranks)."]
        if self.loss_history:
            lines.append(
                f"  loss: {self.loss_history[0]:.4f} (step {self._first_step_of_run}) -> "
                f"{self.loss_history[-1]:.4f} (step {self.global_step})"
            )
        if checkpoint is not None:
            lines.append(f"  adapter (PEFT):      {checkpoint / 'adapter'}")
            if (checkpoint / "merged").is_dir():
                lines.append(f"  merged model (HF):   {checkpoint / 'merged'}")
        if (self._checkpointer.output_dir / "recipe_state").is_dir():
            lines.append(f"  resumable state:     {self._checkpointer.output_dir / 'recipe_state'}")
        if log_dir is not None:
            lines.append(f"  TensorBoard logs:    {log_dir}  (tensorboard --logdir {log_dir})")
        return "\n".join(lines)

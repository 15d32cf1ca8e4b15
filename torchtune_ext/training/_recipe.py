"""The QLoRA recipe, whatever the number of ranks: the training loop, its step, checkpoints and the end of the run.

``recipes/qlora_finetune_single_device.py`` and ``recipes/qlora_finetune_distributed.py`` subclass
:class:`QLoRARecipe`: the single-device recipe as it is (one rank, no process group), the distributed one with the
process group, per-rank batch sizes and FSDP2 sharding (:meth:`QLoRARecipe._parallelize`). Every library call below
works on one rank and on many, so both recipes run the same code. The setup, in order, is
:class:`torchtune_ext.training._setup.RecipeSetup` (``_setup.py``); the dry run is ``_dry_run.py``.

One optimizer step (:meth:`QLoRARecipe.train`): for each of ``gradient_accumulation_steps`` micro-batches, the loss
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

import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchtune import utils
from tqdm import tqdm

from torchtune_ext.checkpoint import (
    DataPosition,
    RecipeState,
    merge_at_epoch_end,
    plain_rng_state,
    remove_old_checkpoints,
)
from torchtune_ext.distributed import (
    all_reduce_grads,
    all_reduce_sum,
    clip_grad_norm_,
    get_full_optimizer_state,
    get_full_state_dict,
)
from torchtune_ext.memory import MemoryEstimator
from torchtune_ext.modules.loss import LinearCrossEntropyLoss
from torchtune_ext.training._checkpointing import exportable, log_dir_name
from torchtune_ext.training._data import pad_batch_, shifted_labels
from torchtune_ext.training._dry_run import dry_run_report, recipe_memory_estimator
from torchtune_ext.training._export import export_merged
from torchtune_ext.training._interrupt import InterruptGuard, interrupted_message, resume_command
from torchtune_ext.training._metrics import Throughput
from torchtune_ext.training._rng import all_rng_states, set_rng_state
from torchtune_ext.training._setup import RecipeSetup
from torchtune_ext.training._summary import progress_note, run_summary

log = utils.get_logger("INFO")


class QLoRARecipe(RecipeSetup):
    """QLoRA fine-tuning on one rank or many: the setup of :class:`RecipeSetup`, then the loop and step of the
    module docstring.

    Subclass it to hack the step: override :meth:`loss_step`, :meth:`forward_backward` or :meth:`optimizer_step`
    (``recipes/qlora_finetune_single_device.py`` shows how). They read the components set up by :meth:`setup`:
    ``self._model``, ``self._loss_fn``, ``self._optimizer``, ``self._trainable_params``, ``self._loss_scaler``,
    ``self._lr_scheduler`` (the attributes listed in :class:`RecipeSetup`).

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ValueError: on an unknown dtype or invalid settings (every cheap check runs here).
        RuntimeError: on bf16 where the device does not support it.
    """

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
    ) -> Dict[str, float]:
        """Logs this step's metrics (rank 0) and returns them. Collective (memory of every rank)."""
        rank_tokens_per_second = throughput.tokens_per_second()
        metrics = {
            "loss": loss,
            "lr": self._optimizer.param_groups[0]["lr"],
            "tokens_per_second": rank_tokens_per_second * global_tokens / max(num_tokens, 1.0),
            **({"tokens_per_second_per_rank": rank_tokens_per_second} if self.world_size > 1 else {}),
            **step_metrics,
            **self._memory_metrics(window=True),  # the peaks since the last logged step
        }
        if self._is_rank_zero:
            self._metric_logger.log_dict(metrics, step=self.global_step)
        return metrics

    def train(self) -> None:
        """Trains (:meth:`_train_epochs`); SIGINT or SIGTERM stop it after the current step with a resumable
        checkpoint and exit code 128 + signal (:meth:`_stop_interrupted`). A finished run trains no further."""
        if self.finished:
            return
        with InterruptGuard() as self._interrupt:
            self._train_epochs()

    def _train_epochs(self) -> None:
        """The training loop: gradient accumulation normalised by the global label-token count of each step (all
        ranks, all micro-batches), as torchtune's recipes; checkpoints every ``save_every_n_steps`` and at the end
        of each epoch; stops after ``stop_after_step`` with a resumable checkpoint."""
        if self.settings.compile:
            self._info("torch.compile is enabled: the first iterations are slow.")
        throughput = Throughput()
        speed_and_memory = ""  # of the last logged step
        self._first_step_of_run = self.global_step + 1
        running_loss, num_tokens = 0.0, 0
        for curr_epoch in range(self.epochs_run, self.settings.epochs):
            self._sampler.set_epoch(curr_epoch)
            with tqdm(  # closed (its line ended) also where a failure stops the run
                total=self._steps_per_epoch,
                initial=self._steps_in_epoch_done,
                dynamic_ncols=True,
                disable=not self._is_rank_zero,
            ) as pbar:
                micro_batches = 0
                if self._rng_to_restore is not None and self._steps_in_epoch_done == 0:
                    # resumed at an epoch's start: the uninterrupted run's iterator drew from this state
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
                    if self.global_step % self.settings.log_every_n_steps == 0:
                        logged = self._log_step(loss_value, step_metrics, throughput, float(num_tokens), global_tokens)
                        speed_and_memory = progress_note(logged)
                        throughput.reset()
                    pbar.update(1)
                    pbar.set_description(
                        f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_value:.4f}"
                        + self._guard.progress()
                        + speed_and_memory
                    )
                    self._guard.check_step(self.global_step, loss_value, step_metrics, self._lr(), self._last_saved())
                    running_loss, num_tokens = 0.0, 0
                    if self._should_validate():
                        val_loss = self._validate()
                        if self._is_rank_zero:
                            self._metric_logger.log_dict({"val_loss": val_loss}, step=self.global_step)
                            self._val_history.add(self.global_step, val_loss)

                    mid_epoch = self._steps_in_epoch_done < self._steps_per_epoch
                    if mid_epoch and self._interrupt.requested():  # a signal: save this step and exit
                        pbar.close()
                        self._stop_interrupted(end_of_epoch=False)
                    if self._stop_step_reached():
                        if mid_epoch:
                            pbar.close()
                            self.save_checkpoint(end_of_epoch=False, full=False)
                            self._stop_early()
                            return
                    elif (
                        self.settings.save_every_n_steps
                        and self.global_step % self.settings.save_every_n_steps == 0
                        and mid_epoch
                    ):
                        self.save_checkpoint(end_of_epoch=False, full=False)
                    step_start = time.perf_counter()
            self.epochs_run += 1
            self._steps_in_epoch_done = 0
            # the merged model once, at the end (or every epoch with merge_every_epoch)
            self.save_checkpoint(
                end_of_epoch=True,
                full=merge_at_epoch_end(self.epochs_run, self.settings.epochs, self.settings.merge_every_epoch),
            )
            if self._stop_step_reached():
                if self.epochs_run < self.settings.epochs:
                    self._stop_early()
                return
            if curr_epoch + 1 < self.settings.epochs and self._interrupt.requested():
                self._stop_interrupted(end_of_epoch=True)

    def _stop_step_reached(self) -> bool:
        return self.settings.stop_after_step is not None and self.global_step >= self.settings.stop_after_step

    def _stop_early(self) -> None:
        """``stop_after_step`` ended the run before its last epoch (the checkpoint is saved): says how to go on. The
        command drops ``stop_after_step``, which a resume refuses once the run has reached it."""
        self._continue_command = resume_command(drop=("stop_after_step",))
        self._info(
            f"Stopped after step {self.global_step} (stop_after_step={self.settings.stop_after_step}) with a "
            f"resumable checkpoint. Continue to the end with:\n  {self._continue_command}\n(or add a later "
            "stop_after_step to stop there again)."
        )

    def _stop_interrupted(self, end_of_epoch: bool) -> None:
        """Saves this step as a resumable checkpoint (adapter + recipe state, no merged model; at the end
        of an epoch it is saved already) and exits with 128 + the signal, printing the step and the resume command.

        Raises:
            SystemExit: always.
        """
        if not end_of_epoch:
            self.save_checkpoint(end_of_epoch=False, full=False)
        if not self._is_rank_zero:
            self._interrupt.exit()
        self._metric_logger.close()
        epoch, batch = self._epoch_and_batch()
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
            metric_log_dir=log_dir_name(self._metric_logger),  # continued on resume
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
        # nothing non-finite is written: a run of skipped fp16 steps or a non-finite adapter stops here
        last, adapters = self._last_saved(), self._named_adapters()
        self._guard.check_before_save(self.global_step, self._lr(), last, adapters, self.settings.dtype)
        save_merged = full and not self.settings.save_adapter_weights_only
        # One rank: the live tensors, no copies; the saver moves one tensor at a time to the host.
        state = get_full_state_dict(
            self._model, adapter_weights_only=not save_merged, keep_nf4=True, cpu_offload=self.world_size > 1
        )
        optimizer = get_full_optimizer_state(self._optimizer, self._trainable_params)
        rng = all_rng_states(self.settings.device, self.world_size)
        if self._is_rank_zero:
            adapters = {k: state[k].detach().to("cpu", copy=True) for k in self._adapter_keys}
            # Saved at the end too: a finished run can be extended by raising `epochs` and resuming.
            self._last_checkpoint = self._checkpointer.save(
                exportable(state, self._checkpointer, self._pruning, self._kept_ids),
                step=self.global_step,
                adapter_config=self._lora.adapter_config(self._pruning),
                save_merged=False,  # the merged model comes last, after the recipe state (export_merged)
                dtype=self.settings.dtype,
                merge_base=self.settings.merge_base,
            )
            # one typed recipe state
            self._checkpointer.save_recipe_state(self._recipe_state(end_of_epoch, adapters, optimizer, rng))
            # bounded disk: older step folders go once this one is complete
            remove_old_checkpoints(self._checkpointer.output_dir, self.settings.keep_last_n, self._last_checkpoint)
            if save_merged:  # skipped if the disk has no room for it; a failed write keeps the above
                self._merged_note = export_merged(
                    self._checkpointer,
                    exportable(state, self._checkpointer, self._pruning, self._kept_ids),
                    self.global_step,
                    self._lora.adapter_config(self._pruning),
                    self._merged_dtype,  # merged_dtype
                    self.settings.merge_base,
                )
            log.info(f"Checkpoint saved to {self._last_checkpoint} in {time.perf_counter() - start:.1f} s.")
        del state
        if dist.is_initialized():
            dist.barrier()
        self._last_checkpoint = self._checkpointer.output_dir / f"step_{self.global_step}"  # every rank

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
        where the outputs are (a resumed run that had finished said it at setup). Collective."""
        if self.finished:
            return
        memory = self._memory_metrics()
        if not self._is_rank_zero:
            return
        self._metric_logger.close()
        self._output_lock.release()
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
            continue_command=getattr(self, "_continue_command", None),
        )
        print(summary, flush=True)

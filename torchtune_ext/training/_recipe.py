"""What the recipe file's loop calls, whatever the number of ranks: logging, validation and stop conditions,
checkpoints, the dry run and the end of the run.

The recipe is one file, ``recipes/qlora_finetune_single_device.py`` (``recipes/qlora_finetune_distributed.py`` runs
it under torchtune's distributed name): its class subclasses :class:`QLoRARecipe` and holds the setup in order, the
step (forward, loss, backward; unscale, clip, optimizer step) and the loop. Everything here works on one rank and on
many (collectives are no-ops on one rank), as torchtitan's ``Trainer``. The setup pieces are
:class:`torchtune_ext.training._setup.RecipeSetup` (``_setup.py``); the dry run is ``_dry_run.py``. The guards the
loop calls are small objects of their own: :class:`~torchtune_ext.training.InterruptGuard` (signals),
:class:`~torchtune_ext.training.NonFiniteGuard` (non-finite losses and adapters) and the validation history.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchtune import utils
from tqdm import tqdm

from torchtune_ext.checkpoint import DataPosition, RecipeState, plain_rng_state, remove_old_checkpoints
from torchtune_ext.distributed import get_full_optimizer_state, get_full_state_dict
from torchtune_ext.memory import MemoryEstimator
from torchtune_ext.training._checkpointing import exportable, log_dir_name
from torchtune_ext.training._dry_run import dry_run_report, recipe_memory_estimator
from torchtune_ext.training._export import export_merged
from torchtune_ext.training._interrupt import interrupted_message, resume_command
from torchtune_ext.training._metrics import Throughput
from torchtune_ext.training._oom import DeviceOutOfMemoryError, out_of_memory_error
from torchtune_ext.training._rng import all_rng_states, set_rng_state
from torchtune_ext.training._setup import RecipeSetup
from torchtune_ext.training._summary import run_summary

log = utils.get_logger("INFO")


class QLoRARecipe(RecipeSetup):
    """What a QLoRA recipe file's class builds on: the setup pieces of :class:`RecipeSetup`, and what the loop
    calls (logging, stop conditions, checkpoints, the dry run, the summary). The recipe file adds ``setup`` (the
    pieces in order), the step (``loss_step``, ``forward_backward``, ``optimizer_step``) and the loop (``train``);
    the dry run estimates that step (:meth:`memory_estimator`).

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ValueError: on an unknown dtype or invalid settings (every cheap check runs here).
        RuntimeError: on bf16 where the device does not support it.
    """

    # ----------------------------------------------------------------------------------------- what the loop calls

    def _epoch_batches(self, epoch: int) -> Iterator[Dict[str, torch.Tensor]]:
        """The epoch's batches from the resumed position, with the RNG streams the uninterrupted run had."""
        self._sampler.set_epoch(epoch)
        if self._rng_to_restore is not None and self._steps_in_epoch_done == 0:
            # resumed at an epoch's start: the uninterrupted run's iterator drew from this state
            set_rng_state(self._rng_to_restore, self.settings.device)
            self._rng_to_restore = None
        batches = iter(self._dataloader)  # draws a seed from the global RNG, as at the start of the run
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore, self.settings.device)
            self._rng_to_restore = None
        return batches

    def _progress_bar(self) -> tqdm:
        """The epoch's progress bar (rank 0), from the resumed position; closed (its line ended) also where a failure
        stops the run."""
        return tqdm(
            total=self._steps_per_epoch,
            initial=self._steps_in_epoch_done,
            dynamic_ncols=True,
            disable=not self._is_rank_zero,
        )

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

    def _stop_step_reached(self) -> bool:
        """``stop_after_step`` is reached."""
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

    def _save_due(self) -> bool:
        """A resumable checkpoint is due this step (``save_every_n_steps``)."""
        every = self.settings.save_every_n_steps
        return bool(every and self.global_step % every == 0)

    def _should_validate(self) -> bool:
        """Validation is due this step (``run_val_every_n_steps``, with ``dataset_val``)."""
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
        the loss, activation offloading), and the recipe file's own step (its ``forward_backward`` and
        ``optimizer_step``), run on a copy of the recipe (``torchtune_ext.memory.recipe_step_estimator``: this one
        is never rewritten). Needs no checkpoint, no data and no GPU (vocab pruning and compile are left out).

        Args:
            cfg (DictConfig): the recipe config.
            model (Optional[nn.Module]): a real model (built from the same ``model:`` section, materialized on the
                CPU) to run the same step on real tensors instead, counted the same way: the estimate's validation.

        Returns:
            MemoryEstimator: call ``estimate(batch_size, seq_len)`` or ``max_seq_len_that_fits(gib)``.

        Raises:
            TypeError: on this class itself, which has no step: estimate the recipe file's class
                (``from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipe``).
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
            TypeError: on this class itself, which has no step: run the recipe file's class.
            ValueError: without ``tokenizer.max_seq_len``.
        """
        report = dry_run_report(self, cfg, self.memory_estimator)
        print(report, flush=True)
        return report

    # ----------------------------------------------------------------------------------------------- the end

    def out_of_memory(self, error: torch.OutOfMemoryError) -> DeviceOutOfMemoryError:
        """The one message for the device running out of memory in :meth:`setup` or the loop, naming the settings
        that lower the peak and the resume command (:func:`~torchtune_ext.training.out_of_memory_error`); the
        failed step's tensors are released first."""
        step = self.global_step + 1 if hasattr(self, "_first_step_of_run") else None
        return out_of_memory_error(
            error,
            step,
            self.settings,
            self._last_saved(),
            fsdp_cpu_offload=self._fsdp_cpu_offload,
            distributed=self.world_size > 1,
        )

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

"""QLoRA fine-tuning, on one device or on N with FSDP2, in an fp32, bf16 or fp16 compute dtype: the whole recipe.

One file for any world size, as torchtitan's ``train.py``: started without a launcher it trains on one device
(CUDA, CPU, ...); under ``tune run --nproc_per_node N`` (torchrun) every rank runs it and the model is sharded per
decoder layer with FSDP2 (NCCL on GPUs, gloo on CPUs). ``recipes/qlora_finetune_distributed.py`` is this file under
torchtune's distributed name: a thin entry point that runs it by path. Read it top to bottom: :meth:`setup` (in
order), the step (:meth:`loss_step`, :meth:`forward_backward`, :meth:`optimizer_step`), :meth:`validate`, and the
loop (:meth:`train`). The pieces they call are in ``torchtune_ext.training``; the guards (signals, non-finite values,
validation history, stop conditions) are small library objects the loop calls. To hack it, copy it, edit it, and
run the copy on one device or on several (``docs/hacking.md``)::

    tune-ext cp qlora_finetune_single_device my_recipe.py
    tune run my_recipe.py --config configs/tiny/qlora_single_device.yaml
    tune run --nproc_per_node 2 my_recipe.py --config configs/tiny/qlora_distributed.yaml

Run from a clone (``python recipes/qlora_finetune_single_device.py --config ...`` works too), or by name after a
``pip install`` (``tune-ext run qlora_finetune_single_device --config llama3_2/1B_qlora_single_device``)::

    tune run recipes/qlora_finetune_single_device.py --config configs/llama3_2/1B_qlora_single_device.yaml dtype=fp32
    tune run --nproc_per_node 8 recipes/qlora_finetune_distributed.py --config configs/llama3_1/8B_qlora.yaml
    # multi-node: torchrun's usual flags, e.g. --nnodes 2 --rdzv_backend c10d --rdzv_endpoint host:29500

Follows torchtune's ``lora_finetune_single_device`` and ``lora_finetune_distributed`` (same data pipeline, loss,
gradient accumulation by token count, LR schedule and logging), with these differences:

- ``dtype``: ``fp32`` (GPUs without bf16, e.g. a 16 GB T4), ``bf16``, or ``fp16``: fp16 compute with fp32 adapter
  master weights and dynamic loss scaling (the overflow check agreed across ranks); steps whose gradients overflow
  are skipped and counted (``skipped_steps``, ``loss_scale`` in the logs). ``bf16`` on a device without bf16 fails
  at start-up. The NF4 base computes in ``dtype`` too (our fork of the NF4 linear; torchao's follows the activations).
- Loading streams the HF safetensors checkpoint tensor by tensor into a meta-built model, quantizing each frozen
  linear as it arrives (on N ranks: rank 0 streams, each rank quantizes only its own shard): host RAM stays near one
  tensor plus the NF4 model.
- On N ranks: params all-gathered in the compute ``dtype``, gradients reduced in fp32; ``fsdp_cpu_offload``
  (accelerators only), ``fsdp_reshard_after_forward``, ``process_group_timeout_s`` (how long a rank waits for the
  others before failing). ``batch_size`` is per rank, as in torchtune; ``global_batch_size`` (optional) sets samples
  per micro-batch over all ranks instead. The loss is normalised by the step's label tokens over all ranks and
  micro-batches: a step on N ranks equals a one-device step on the same global batch.
- ``merge_base``: ``nf4`` (default, as torchtune) merges the adapter onto the NF4-dequantized base (exactly the
  trained model); ``original`` onto the checkpoint's own weights (streamed), see the README for the difference.
- Checkpoints (``output_dir/step_{N}/``): the adapter in PEFT format (``adapter/``), the merged model as HF
  safetensors shards + index + config.json (``merged/``), and ``recipe_state/recipe_state.pt`` for
  ``resume_from_checkpoint=True`` (optimizer, loss scaler, LR scheduler, data position, RNG states, step), which
  also allows resuming mid-epoch and on another world size. Every write is atomic. Saved dtypes: adapters in their
  param dtype (fp32 for dtype=fp32 and fp16, bf16 for dtype=bf16 unless ``adapter_dtype=fp32``), the merged model
  in ``merged_dtype`` (default: the base checkpoint's own). See docs/use-what-you-trained.md (generate, ``tune-ext
  merge``).
- Logs every step (rank 0): loss, lr, tokens/s (global and, on N ranks, per rank), grad norm, (fp16) loss scale and
  skipped steps, memory of every rank (CUDA peaks, the process's peak RSS); TensorBoard by default; a tqdm bar;
  optional validation loss every ``run_val_every_n_steps`` on ``dataset_val``.
- ``vocab_pruning``: train over the token ids the data uses (or a kept-ids file), the kept embedding/output rows in
  their own dtype (fp32 by default; on N ranks ``sharding: sharded`` or ``replicated``); the merged checkpoint is
  exported with the full vocabulary and the PEFT adapter carries trained rows as PEFT trainable tokens.
- ``dry_run=True``: the peak device memory of this file's training step and its breakdown, the host RAM the run
  needs, whether both fit with a 5% headroom (``device_profile=t4|l4|a10g|a100_40gb|a100_80gb|h100`` or
  ``device_memory_gb``; ``host_memory_gb``) and the longest sequence that does, without loading weights or data
  (``world_size=N``: each of N ranks, no launcher needed; docs/memory-estimates.md).
- ``enable_activation_offloading`` (CUDA): saved activations go to pinned host memory; ``frozen_dtype``: storage of
  the frozen token embedding / untied output; ``stop_after_step`` ends a run early with a resumable checkpoint (the
  LR schedule still spans the whole run); ``save_every_n_steps`` saves resumable checkpoints.

Bad configs (unknown dtype, missing checkpoint, NF4-incompatible layer shapes, bf16 where unsupported) fail
before anything is written, with one line and exit code 2.
"""

import math
import sys
import time
from typing import Dict, Tuple

import torch
from omegaconf import DictConfig
from torchtune import config, utils

from torchtune_ext.checkpoint import merge_at_epoch_end
from torchtune_ext.config import exit_on_config_error, parse, recipe_setting
from torchtune_ext.distributed import (
    all_reduce_grads,
    all_reduce_sum,
    clip_grad_norm_,
    destroy_distributed,
    init_distributed,
)
from torchtune_ext.memory import per_rank_dry_run
from torchtune_ext.training import (
    InterruptGuard,
    QLoRARecipe,
    Throughput,
    launched_world_size_and_rank,
    pad_batch_,
    progress_note,
    shifted_labels,
    token_mean_loss,
)


class QLoRAFinetuneRecipe(QLoRARecipe):
    """QLoRA fine-tuning on one device, or on every rank of the launcher's process group with FSDP2.

    The pieces it calls (``self._load_model``, ``self.save_checkpoint``, ...) are
    :class:`torchtune_ext.training.QLoRARecipe`'s. What the step and the loop use, set up by :meth:`setup`:
    ``self._model``, ``self._loss_fn``, ``self._optimizer``, ``self._trainable_params`` (the adapters),
    ``self._loss_scaler`` (fp16), ``self._lr_scheduler``, ``self.global_step``, ``self.world_size``, ``self.rank``.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ValueError: on an unknown dtype or invalid settings.
        RuntimeError: on bf16 where the device does not support it.
    """

    def setup(self, cfg: DictConfig) -> None:
        """Builds everything, in order; nothing is written under ``output_dir`` before the config, the data and the
        resumed state have been checked. A resumed run that had finished stops after saying so. A signal stops it
        at once (exit 128 + signal, nothing saved). Collective on several ranks."""
        with InterruptGuard(save=False):
            # config, checkpoint headers, model (meta), tokenizer, loss, data sets, resumed state: checked
            dataset, val_dataset, state = self.check_start(cfg)
            if self.finished:
                return
            self._setup_loss_scaler(cfg)  # fp16: dynamic loss scaling; the non-finite guard
            # From here on, outputs are written: output_dir locked, stale temporaries removed, metric logger opened.
            self._start_writing(cfg)
            self._save_scanned_kept_ids(dataset, val_dataset)  # vocab pruning: a resume reuses the data pass
            self._log_disk_plan(len(dataset))
            # vocab pruning, trainable adapters, activation checkpointing, compile, FSDP2 on several ranks, the base
            # streamed in and quantized, adapters initialised or resumed
            self._load_model(state)
            self._setup_optimizer(cfg)
            self._setup_loss()
            self._setup_dataloaders(cfg, dataset, val_dataset)
            self._setup_schedule(cfg, state)  # LR schedule; resumed optimizer, loss scaler, data and RNG positions

    # ------------------------------------------------------------------------------------------------- the step

    def loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and loss of one micro-batch: the mean over its label tokens (0 without any). Training and
        validation both call it.

        Args:
            batch (Dict[str, torch.Tensor]): ``tokens`` and ``labels`` (unshifted), on the device; ``labels`` is
                popped.

        Returns:
            torch.Tensor: a scalar.
        """
        if self._pad_to_multiple is not None:  # sharded vocab pruning on several ranks: equal output calls per rank
            pad_batch_(batch, self._pad_to_multiple, self._tokenizer.pad_id, self._loss_fn.ignore_index)
        labels = shifted_labels(batch.pop("labels"), self._loss_fn.ignore_index)
        with self._activation_offloading:
            output = self._model(**batch)  # hidden states for LinearCrossEntropyLoss, else (chunked) logits
        if self._pruning is not None:
            labels = self._pruning.remap_labels(labels, ignore_index=self._loss_fn.ignore_index)
        return token_mean_loss(self._loss_fn, output, labels)

    def forward_backward(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: forward, loss, backward. The loss, a mean over the micro-batch's label tokens, is
        weighted by their count: :meth:`optimizer_step` divides the sum over micro-batches and ranks by the step's.

        Returns:
            Tuple[torch.Tensor, torch.Tensor]: the weighted loss (detached) and the label-token count.
        """
        batch_tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
        loss = self.loss_step(batch) * batch_tokens
        self._loss_scaler.scale(loss).backward()  # fp16: scaled; FSDP2 reduce-scatters the gradients in fp32
        return loss.detach(), batch_tokens

    def optimizer_step(self, num_tokens: torch.Tensor) -> Tuple[Dict[str, float], float]:
        """The update, once per ``gradient_accumulation_steps`` micro-batches on every rank: the gradients divided
        by the step's label tokens over all ranks, unscaled (fp16), clipped (``clip_grad_norm``); the optimizer and
        LR schedule step (fp16: not where gradients overflowed); the gradients zeroed.

        Args:
            num_tokens (torch.Tensor): this rank's label tokens over the step's micro-batches.

        Returns:
            Tuple[Dict[str, float], float]: the step's metrics (logged) and its label tokens over all ranks.
        """
        global_tokens = float(all_reduce_sum(num_tokens))
        all_reduce_grads(self._replicated_params)  # params every rank holds whole (replicated vocab pruning)
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

    @torch.no_grad()
    def validate(self) -> float:
        """The validation loss, averaged over the label tokens of all ranks (at most ``max_validation_steps``
        batches per rank)."""
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

    # ------------------------------------------------------------------------------------------------- the loop

    def train(self) -> None:
        """The loop: per micro-batch :meth:`forward_backward`, every ``gradient_accumulation_steps`` micro-batches
        :meth:`optimizer_step`; logs every ``log_every_n_steps``, validation every ``run_val_every_n_steps``,
        resumable checkpoints every ``save_every_n_steps`` and at each epoch's end (the merged model at the last).
        ``stop_after_step`` ends it with a resumable checkpoint; SIGINT or SIGTERM after the current step, with a
        resumable checkpoint and exit code 128 + signal. A resumed run that had finished trains no further."""
        if self.finished:
            return
        if self.settings.compile:
            self._info("torch.compile is enabled: the first iterations are slow.")
        throughput = Throughput()
        speed_and_memory = ""  # of the last logged step, on the progress bar
        self._first_step_of_run = self.global_step + 1
        running_loss, num_tokens = 0.0, 0
        with InterruptGuard() as self._interrupt:
            for curr_epoch in range(self.epochs_run, self.settings.epochs):
                with self._progress_bar() as pbar:
                    micro_batches = 0
                    step_start = time.perf_counter()
                    for batch in self._epoch_batches(curr_epoch):  # from the resumed position
                        if self._steps_in_epoch_done >= self._steps_per_epoch:
                            break
                        utils.batch_to_device(batch, self.settings.device)
                        loss, batch_tokens = self.forward_backward(batch)
                        running_loss += loss
                        num_tokens += batch_tokens
                        throughput.add(batch_tokens)
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
                            logged = self._log_step(
                                loss_value, step_metrics, throughput, float(num_tokens), global_tokens
                            )
                            speed_and_memory = progress_note(logged)
                            throughput.reset()
                        pbar.update(1)
                        pbar.set_description(
                            f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_value:.4f}"
                            + self._guard.progress()
                            + speed_and_memory
                        )
                        # a non-finite loss or adapter, or too many skipped fp16 steps, stops the run here
                        self._guard.check_step(
                            self.global_step, loss_value, step_metrics, self._lr(), self._last_saved()
                        )
                        running_loss, num_tokens = 0.0, 0
                        if self._should_validate():
                            val_loss = self.validate()
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
                        elif self._save_due() and mid_epoch:
                            self.save_checkpoint(end_of_epoch=False, full=False)
                        step_start = time.perf_counter()
                self.epochs_run += 1
                self._steps_in_epoch_done = 0
                # the merged model once, at the end (or every epoch with merge_every_epoch)
                epochs = self.settings.epochs
                self.save_checkpoint(
                    end_of_epoch=True, full=merge_at_epoch_end(self.epochs_run, epochs, self.settings.merge_every_epoch)
                )
                if self._stop_step_reached():
                    if self.epochs_run < epochs:
                        self._stop_early()
                    return
                if curr_epoch + 1 < epochs and self._interrupt.requested():
                    self._stop_interrupted(end_of_epoch=True)


#: the class under the single-device name torchtune's recipes use (``LoRAFinetuneRecipeSingleDevice``)
QLoRAFinetuneRecipeSingleDevice = QLoRAFinetuneRecipe


def main(cfg: DictConfig, distributed: bool = False) -> None:
    """Runs the recipe on one device, or under a launcher on every rank, with the process group.

    Args:
        cfg (DictConfig): the parsed config.
        distributed (bool): a dry run estimates each rank's step even without a launcher (``world_size``, default
            2), as the distributed entry point asks.
    """
    world_size, rank = launched_world_size_and_rank()
    if rank == 0:
        config.log_config(recipe_name="QLoRAFinetuneRecipe", cfg=cfg)
    if recipe_setting(cfg, "dry_run"):  # the memory estimate of this file's step: no weights, no data, nothing written
        if world_size > 1 or distributed:
            per_rank_dry_run(QLoRAFinetuneRecipe, cfg)  # each rank's, on a fake process group in this process
        else:
            QLoRAFinetuneRecipe(cfg=cfg).dry_run(cfg)
        return
    recipe = QLoRAFinetuneRecipe(cfg=cfg)
    if world_size > 1:
        init_distributed(recipe.settings.device, recipe.process_group_timeout_s)
    try:
        recipe.setup(cfg=cfg)  # checks everything, then builds: model, data, optimizer, schedule, resumed state
        recipe.train()
        recipe.cleanup()  # closes the logger, prints the summary
    except torch.OutOfMemoryError as error:  # one message: the settings that lower the peak, the resume command
        raise recipe.out_of_memory(error) from None
    finally:
        if world_size > 1:
            destroy_distributed()


@exit_on_config_error("qlora_finetune_single_device")  # a config error: one line, exit code 2
@parse  # torchtune's config.parse, with overrides whose value holds "="
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run [--nproc_per_node N] recipes/qlora_finetune_single_device.py --config <yaml> [k=v]``."""
    main(cfg)


if __name__ == "__main__":
    sys.exit(recipe_main())

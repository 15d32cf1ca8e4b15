"""QLoRA fine-tuning on one device (CUDA, CPU, ...) with an fp32, bf16 or fp16 compute dtype.

To hack it, copy it and edit the step below (:meth:`QLoRAFinetuneRecipeSingleDevice.loss_step`,
``forward_backward``, ``optimizer_step``), then run the copy::

    tune-ext cp qlora_finetune_single_device my_recipe.py
    tune run my_recipe.py --config configs/tiny/qlora_single_device.yaml

The setup (in order) and the loop (:meth:`QLoRARecipe.train`) are in the library class
:class:`torchtune_ext.training.QLoRARecipe`, which the distributed recipe shares: one loop for any world size
(``docs/hacking.md`` says why, and what else can be overridden).

Run from a clone (``python recipes/qlora_finetune_single_device.py --config ...`` works too), or by name after a
``pip install`` (``tune-ext run qlora_finetune_single_device --config llama3_2/1B_qlora_single_device``)::

    tune run recipes/qlora_finetune_single_device.py --config configs/tiny/qlora_single_device.yaml
    tune run recipes/qlora_finetune_single_device.py --config configs/llama3_2/1B_qlora_single_device.yaml dtype=fp32

Follows torchtune's ``lora_finetune_single_device`` (same data pipeline, loss, gradient accumulation by token
count, LR schedule and logging), with these differences:

- ``dtype``: ``fp32`` (GPUs without bf16, e.g. a 16 GB T4), ``bf16``, or ``fp16``: fp16 compute with fp32 adapter
  master weights and dynamic loss scaling; steps whose gradients overflow are skipped and counted
  (``skipped_steps``, ``loss_scale`` in the logs). ``bf16`` on a device without bf16 fails at start-up.
  The NF4 base computes in ``dtype`` too (our fork of the NF4 linear; torchao's follows the activations).
- Loading streams the HF safetensors checkpoint tensor by tensor into a meta-built model, quantizing each frozen
  linear as it arrives: host RAM stays near one tensor plus the NF4 model.
- ``merge_base``: ``nf4`` (default, as torchtune) merges the adapter onto the NF4-dequantized base (exactly the
  trained model); ``original`` onto the checkpoint's own weights (streamed), see the README for the difference.
- Checkpoints (``output_dir/step_{N}/``): the adapter in PEFT format (``adapter/``), the merged model as HF
  safetensors shards + index + config.json (``merged/``, no adapter files), and ``recipe_state/recipe_state.pt``
  for ``resume_from_checkpoint=True`` (optimizer, loss scaler, LR scheduler, data loader position, RNG states,
  step), which also allows resuming mid-epoch. Every write is atomic. Saved dtypes: adapters in their param dtype
  (fp32 for dtype=fp32 and dtype=fp16, bf16 for dtype=bf16 unless ``adapter_dtype=fp32``), the merged model in
  ``merged_dtype`` (fp32, bf16, fp16; default: the base checkpoint's own dtype, so an fp32 run on a 16-bit
  checkpoint exports a 16-bit model). See docs/use-what-you-trained.md (generate, ``tune-ext merge``).
- Logs every step: loss, lr, tokens/s, grad norm, (fp16) loss scale and skipped steps, memory (CUDA peak
  allocated / reserved / active; the process's peak RSS); TensorBoard by default; a tqdm bar; optional
  validation loss every ``run_val_every_n_steps`` on ``dataset_val``.
- ``vocab_pruning`` (as in the distributed recipe; ``sharding`` does not apply): train over the token ids the data
  uses (or a kept-ids file), the kept embedding/output rows in their own dtype (fp32 by default); the merged
  checkpoint is exported with the full vocabulary and the PEFT adapter carries trained rows as PEFT trainable tokens.
- ``dry_run=True``: prints the peak device memory of the config's training step and its breakdown, the host RAM
  the run needs, whether both fit with a 5% headroom (``device_profile=t4|l4|a10g|a100_40gb|a100_80gb|h100`` or
  ``device_memory_gb``, else the CUDA device's own; ``host_memory_gb``, else this machine's) and the longest
  sequence that does, without loading weights or data (``torchtune_ext.memory``; docs/memory-estimates.md).
- ``enable_activation_offloading`` (CUDA): saved activations go to pinned host memory; with activation
  checkpointing that is each layer's input (offloaded gradient checkpointing).
- ``frozen_dtype``: storage of the frozen token embedding / untied output; by default in an fp32 run the 16-bit
  checkpoint's own dtype (upcast per use), so fp32 costs no more for them than bf16.
- ``stop_after_step`` ends a run early with a resumable checkpoint (the LR schedule still spans the whole run),
  e.g. to split training across time-limited sessions; ``save_every_n_steps`` saves resumable checkpoints.

Bad configs (unknown dtype, missing checkpoint, NF4-incompatible layer shapes, bf16 where unsupported) fail
before anything is written.
"""

import sys
from typing import Dict, Tuple

import torch
from omegaconf import DictConfig
from torchtune import config

from torchtune_ext.config import exit_on_config_error, parse
from torchtune_ext.training import QLoRARecipe


class QLoRAFinetuneRecipeSingleDevice(QLoRARecipe):
    """QLoRA fine-tuning on one device: :class:`torchtune_ext.training.QLoRARecipe` on one rank.

    What runs, in order (``QLoRARecipe.setup``): seed; checkpointer, model on the meta device (checked against the
    checkpoint's headers), tokenizer, loss, data sets; data and resume checks; then, writing: the model (vocab
    pruning, trainable params, activation checkpointing, compile, the base streamed in and quantized, adapters
    initialised or resumed), optimizer, loss scaler, data loaders, LR schedule. Then ``QLoRARecipe.train``: per
    micro-batch :meth:`forward_backward` (which calls :meth:`loss_step`), every ``gradient_accumulation_steps``
    micro-batches :meth:`optimizer_step`; logs, validation and checkpoints at their intervals.

    The three methods below are the step; each calls the library's version. Edit them in your copy. What they can
    use, set up by ``setup``: ``self._model``, ``self._loss_fn``, ``self._optimizer``, ``self._trainable_params``
    (the adapters), ``self._loss_scaler`` (fp16), ``self._lr_scheduler``, ``self.global_step``.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ValueError: on an unknown dtype or invalid settings.
        RuntimeError: on bf16 where the device does not support it.
    """

    def loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and loss of one micro-batch: the mean over its label tokens. Training and validation call it.

        The place to change the objective. For example an L2 penalty on the adapters, in training only::

            loss = super().loss_step(batch)
            if self._model.training:
                loss = loss + 1e-3 * sum(p.pow(2).sum() for p in self._trainable_params)
            return loss
        """
        return super().loss_step(batch)

    def forward_backward(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: ``loss_step(batch)`` times its label-token count, scaled (fp16), back-propagated.

        Returns:
            Tuple[torch.Tensor, torch.Tensor]: the weighted loss (detached) and the label-token count.
        """
        return super().forward_backward(batch)

    def optimizer_step(self, num_tokens: torch.Tensor) -> Tuple[Dict[str, float], float]:
        """The update, once per ``gradient_accumulation_steps`` micro-batches: the gradients divided by
        ``num_tokens``, unscaled (fp16), clipped (``clip_grad_norm``); the optimizer and LR schedule step; the
        gradients are zeroed. E.g. to inspect or change the gradients, do it before calling ``super()``.

        Returns:
            Tuple[Dict[str, float], float]: the step's metrics (logged) and its label-token count.
        """
        return super().optimizer_step(num_tokens)


@exit_on_config_error("qlora_finetune_single_device")  # a config error: one line, exit code 2
@parse  # torchtune's config.parse, with overrides whose value holds "="
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run recipes/qlora_finetune_single_device.py --config <yaml> [key=value ...]``."""
    config.log_config(recipe_name="QLoRAFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = QLoRAFinetuneRecipeSingleDevice(cfg=cfg)
    if cfg.get("dry_run", False):
        recipe.dry_run(cfg)  # the memory estimate only (of this class's step): no weights, no data, nothing written
        return
    recipe.setup(cfg=cfg)  # checks everything, then builds: model, data, optimizer, schedule, resumed state
    recipe.train()  # the loop: forward_backward per micro-batch, optimizer_step per step, logs, validation, saves
    recipe.cleanup()  # closes the logger, prints the summary


if __name__ == "__main__":
    sys.exit(recipe_main())

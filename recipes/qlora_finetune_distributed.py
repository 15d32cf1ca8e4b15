"""QLoRA fine-tuning on many devices with FSDP2 (NCCL on GPUs, gloo on CPUs), in an fp32, bf16 or fp16 compute dtype.

Run from a clone::

    tune run --nproc_per_node 2 recipes/qlora_finetune_distributed.py --config configs/tiny/qlora_distributed.yaml
    tune run --nproc_per_node 8 recipes/qlora_finetune_distributed.py --config configs/llama3_1/8B_qlora.yaml
    # multi-node: torchrun's usual flags, e.g. --nnodes 2 --rdzv_backend c10d --rdzv_endpoint host:29500

Same config keys, logs and checkpoints as ``recipes/qlora_finetune_single_device.py`` (switching recipes is the
file name plus ``--nproc_per_node``), with these additions:

- FSDP2 (``fully_shard``) per decoder layer, params all-gathered in the compute ``dtype`` and gradients reduced in
  fp32; the backend follows the device. ``fsdp_cpu_offload`` (accelerators only), ``fsdp_reshard_after_forward``.
- ``batch_size`` is per rank, as in torchtune; ``global_batch_size`` (optional) sets samples per micro-batch over
  all ranks instead and must be a multiple of the world size. The loss is normalised by the global number of
  label tokens of the step (all ranks, all accumulated micro-batches): a step on N ranks equals a single-device
  step on the same global batch.
- fp16: fp32 master adapters and dynamic loss scaling, with the overflow check all-reduced so that every rank skips
  the same steps.
- Loading: the model is built on the meta device and sharded; rank 0 streams the HF checkpoint in ~1 GB chunks and
  each rank quantizes only its own shard of every NF4 weight (``load_base_``).
- ``vocab_pruning``: train over the token ids the data uses (or a kept-ids file); the pruned embedding/output rows
  train in fp32, ``sharding: sharded`` (their own FSDP unit, fp32 params and reduce dtype; batches are right-padded
  to a multiple of the loss's output chunks so that every rank calls the unit equally often) or ``replicated``
  (every rank holds them, gradients all-reduced in fp32). The merged checkpoint is exported with the full
  vocabulary (trained rows in place, the base's elsewhere); the PEFT adapter carries trained rows as PEFT
  trainable tokens (``trainable_token_indices``: ``embed_tokens``, and ``lm_head`` when untied).
- Logs (rank 0): loss, lr, tokens/s (global and per rank), grad norm, loss scale and skipped steps (fp16), memory
  of every rank (``peak_rss/rank<r>``, and CUDA peaks on GPUs).
- Saving gathers adapters only (``get_full_state_dict(adapter_weights_only=True)``) unless the merged model is
  written (NF4 weights then travel packed); the recipe state holds the full (unsharded) optimizer state, so a run
  can resume on another world size, or on one device.
- ``process_group_timeout_s``: how long a rank waits for the others before failing (no silent hang).
"""

import os
import sys
from dataclasses import replace
from typing import Optional

import torch
from omegaconf import DictConfig
from torchtune import config
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_ext.config import exit_on_config_error, parse
from torchtune_ext.distributed import (
    check_fsdp_cpu_offload,
    destroy_distributed,
    init_distributed,
    launched_world_size,
    per_rank_batch_size,
    shard_model,
)
from torchtune_ext.memory import per_rank_dry_run
from torchtune_ext.training import QLoRARecipe, positive_int


class QLoRAFinetuneRecipeDistributed(QLoRARecipe):
    """QLoRA fine-tuning on FSDP2: :class:`torchtune_ext.training.QLoRARecipe` on every rank of the process group,
    with per-rank batches and the model sharded per decoder layer between building and loading it.

    What runs, in order (``QLoRARecipe.setup``, every rank): seed (the same on every rank until the adapters are
    drawn, then seed + rank); checkpointer, model on the meta device (checked against the checkpoint's headers),
    tokenizer, loss, data sets; data and resume checks; then, writing (rank 0): the model (vocab pruning, trainable
    params, activation checkpointing, compile, **sharding** (:meth:`_parallelize`), the base streamed from rank 0
    and quantized shard by shard, adapters initialised or resumed), optimizer, loss scaler (overflow agreed across
    ranks), data loaders, LR schedule. One optimizer step (``QLoRARecipe.train``): per micro-batch,
    ``loss * label_tokens`` scaled and back-propagated (FSDP reduce-scatters sums in fp32); then the gradients
    divided by the step's label tokens over all ranks, unscaled, clipped by the global norm, and the optimizer steps.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        RuntimeError: if not started by a distributed launcher, or bf16 where the device lacks it.
        ValueError: on an unknown dtype, invalid numeric settings, ``fsdp_cpu_offload`` on the CPU, a
            ``global_batch_size`` that does not split over the ranks, or an invalid ``vocab_pruning`` section.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.world_size = launched_world_size()
        self.rank = int(os.environ["RANK"])
        super().__init__(cfg)
        global_batch_size = positive_int(cfg, "global_batch_size", None)
        batch_size = per_rank_batch_size(self.settings.batch_size, global_batch_size, self.world_size)
        self.settings = replace(self.settings, batch_size=batch_size)  # per rank
        self._fsdp_cpu_offload = bool(cfg.get("fsdp_cpu_offload", False))
        check_fsdp_cpu_offload(self._fsdp_cpu_offload, self.settings.device, self.world_size)
        self._reshard_after_forward = bool(cfg.get("fsdp_reshard_after_forward", True))
        self._process_group_timeout_s = cfg.get("process_group_timeout_s", 1800)

    def _parallelize(self) -> None:
        """FSDP2 per decoder layer in the compute dtype (fp32 gradient reduction), the vocab-pruning module sharded
        on its own in fp32 or replicated."""
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
        return torch.device("cpu") if self._fsdp_cpu_offload else None

    def _setup_loss(self) -> None:
        super()._setup_loss()
        pruning_cfg = self.settings.vocab_pruning
        chunked = isinstance(self._loss_fn, CEWithChunkedOutputLoss)
        if chunked and pruning_cfg is not None and pruning_cfg["sharding"] == "sharded":
            # torchtune's loss: the output is projected chunk by chunk, each chunk a call of the pruning module's
            # own FSDP unit (an all-gather): every rank must make the same number of calls, whatever its sequence
            # length (LinearCrossEntropyLoss agrees on its number of chunks itself).
            self._pad_to_multiple = self._loss_fn.num_output_chunks


@exit_on_config_error("qlora_finetune_distributed")  # a config error: one line, exit code 2
@parse  # torchtune's config.parse, with overrides whose value holds "="
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run --nproc_per_node N recipes/qlora_finetune_distributed.py --config <yaml> [k=v ...]``."""
    if int(os.environ.get("RANK", "0")) == 0:
        config.log_config(recipe_name="QLoRAFinetuneRecipeDistributed", cfg=cfg)
    if cfg.get("dry_run", False):
        per_rank_dry_run(QLoRAFinetuneRecipeDistributed, cfg)  # each rank's peak, no launcher needed
        return
    recipe = QLoRAFinetuneRecipeDistributed(cfg=cfg)
    init_distributed(recipe.settings.device, recipe._process_group_timeout_s)
    try:
        recipe.setup(cfg=cfg)
        recipe.train()
        recipe.cleanup()
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(recipe_main())

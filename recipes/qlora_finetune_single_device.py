"""QLoRA fine-tuning on one device (CUDA, CPU, ...) with an fp32, bf16 or fp16 compute dtype.

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
- Checkpoints (``output_dir/step_{N}/``): the adapter in PEFT format (``adapter/``), the merged model as HF
  safetensors shards + index + config.json (``merged/``, no adapter files), and ``recipe_state/recipe_state.pt``
  for ``resume_from_checkpoint=True`` (optimizer, loss scaler, LR scheduler, data loader position, RNG states,
  step), which also allows resuming mid-epoch. Every write is atomic. Saved dtypes: adapters in their param dtype
  (fp32 for dtype=fp32 and dtype=fp16, bf16 for dtype=bf16 unless ``adapter_dtype=fp32``), the merged model in
  ``dtype``.
- Logs every step: loss, lr, tokens/s, grad norm, (fp16) loss scale and skipped steps, memory (CUDA peak
  allocated / reserved / active; the process's peak RSS); TensorBoard by default; a tqdm bar; optional
  validation loss every ``run_val_every_n_steps`` on ``dataset_val``.
- ``vocab_pruning`` (as in the distributed recipe; ``sharding`` does not apply): train over the token ids the data
  uses (or a kept-ids file), the kept embedding/output rows in their own dtype (fp32 by default); the merged
  checkpoint is exported with the full vocabulary and the PEFT adapter carries trained rows as PEFT trainable tokens.
- ``stop_after_step`` ends a run early with a resumable checkpoint (the LR schedule still spans the whole run),
  e.g. to split training across time-limited sessions; ``save_every_n_steps`` saves resumable checkpoints.

Bad configs (unknown dtype, missing checkpoint, NF4-incompatible layer shapes, bf16 where unsupported) fail
before anything is written.
"""

import sys
import time
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, modules, training, utils
from torchtune.modules.peft import get_adapter_params, set_trainable_params

import torchtune_ext  # noqa: F401  (registers the NF4 ops current PyTorch needs)
from torchtune_ext.modules.vocab_pruning import export_full_vocab_state_dict, prune_vocab_
from torchtune_ext.training._checkpointing import check_materialized, materialize_adapters_
from torchtune_ext.training._distributed import GatheredModelView
from torchtune_ext.training._precision import LossScaler, check_param_dtypes, default_adapter_dtype, parse_dtype
from torchtune_ext.training._recipe_base import QLoRARecipeBase
from torchtune_ext.training._recipe_utils import (
    positive_int,
    read_base_vocab_state,
    rng_state,
)

log = utils.get_logger("INFO")


class QLoRAFinetuneRecipeSingleDevice(QLoRARecipeBase):
    """QLoRA fine-tuning recipe for one device; see the module docstring for the features.

    Args:
        cfg (DictConfig): the parsed config.

    Raises:
        ValueError: on an unknown dtype or invalid numeric settings.
        RuntimeError: on bf16 where the device does not support it.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = parse_dtype(cfg.dtype, self._device)
        self._adapter_dtype = default_adapter_dtype(self._dtype, cfg.get("adapter_dtype", None))

        self._read_settings(cfg)
        self._batch_size = positive_int(cfg, "batch_size", 1)

        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))

    # ---------------------------------------------------------------------------------------------------- setup

    def setup(self, cfg: DictConfig) -> None:
        """Validates everything that can be checked cheaply, then builds and loads the model, data and optimizer.

        Nothing is written under ``output_dir`` before the config has been validated.
        """
        if cfg.get("generate_base_checkpoint", None) is not None:
            config.instantiate(cfg.generate_base_checkpoint)
        dataset, val_dataset = self._build_components(cfg)
        self._check_samples_have_labels(dataset, cfg.tokenizer.get("max_seq_len", None))
        batches = len(dataset) // self._batch_size
        if batches < self._gradient_accumulation_steps:
            raise ValueError(
                f"The data set gives {batches} batches of batch_size={self._batch_size}, fewer than "
                f"gradient_accumulation_steps={self._gradient_accumulation_steps}: lower either."
            )
        if self._vocab_pruning_cfg is not None:
            self._resolve_kept_ids(dataset, val_dataset)
        self._loss_scaler = LossScaler(
            enabled=self._dtype == torch.float16, device=self._device, **cfg.get("loss_scaler", {})
        )
        state = self._checkpointer.load_recipe_state() if self._resume_from_checkpoint else None
        if state is not None:
            self._check_recipe_state(state)

        # From here on, outputs are written.
        self._start_writing(cfg)

        self._load_model(state)
        self._trainable_params = list(self._adapter_params.values())
        self._optimizer = config.instantiate(cfg.optimizer, self._trainable_params)
        if self._compile:
            self._loss_fn = training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        self._setup_dataloaders(cfg, dataset, val_dataset)
        self._setup_schedule(cfg, state)

    def _load_model(self, state: Optional[Dict[str, Any]]) -> None:
        start = time.perf_counter()
        self._checkpointer.load_base(self._model, self._device)
        materialize_adapters_(self._model, self._device)
        check_materialized(self._model)
        pruning_cfg = self._vocab_pruning_cfg
        if pruning_cfg is not None:
            # The pruned module's (overwritten) init must not shift the RNG streams dropout and data draw from.
            with torch.random.fork_rng(devices=[self._device] if self._device.type == "cuda" else []):
                self._pruning = prune_vocab_(
                    self._model,
                    self._kept_ids,
                    dtype=pruning_cfg["dtype"],
                    unknown_token_id=pruning_cfg["unknown_token_id"],
                    trainable=pruning_cfg["trainable"],
                )
        self._adapter_params = get_adapter_params(self._model)
        if state is not None:
            self._load_adapter_state(state["adapter"])
        set_trainable_params(self._model, self._adapter_params)
        # LoRA/DoRA params in the adapter dtype; pruned rows (and a pruned output's adapters) in the pruning dtype.
        check_param_dtypes(
            [(k, p) for k, p in self._adapter_params.items() if not k.startswith("tok_embeddings.")],
            self._adapter_dtype,
            "adapter",
        )
        if self._enable_activation_checkpointing:
            training.set_activation_checkpointing(self._model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if self._compile:
            training.compile_model(self._model)
        log.info(
            f"Loaded {self._checkpointer.checkpoint_dir} into NF4 in {time.perf_counter() - start:.1f} s: compute "
            f"dtype {self._dtype}, adapters {self._adapter_dtype}, device {self._device}"
            + (f", vocab pruning in {pruning_cfg['dtype']}" if pruning_cfg else "")
            + "."
        )

    @torch.no_grad()
    def _load_adapter_state(self, adapter_state: Dict[str, torch.Tensor]) -> None:
        if set(adapter_state) != set(self._adapter_params):
            raise ValueError(
                "The recipe state's adapters do not match the model's (different lora_attn_modules, "
                "apply_lora_to_mlp, lora_rank or vocab_pruning?): "
                f"{sorted(set(adapter_state) ^ set(self._adapter_params))[:4]}"
            )
        for name, value in adapter_state.items():
            self._adapter_params[name].copy_(value)

    def _check_recipe_state(self, state: Dict[str, Any]) -> None:
        self._check_adapter_shapes(state["adapter"])
        self._restore_progress(state)

    # ------------------------------------------------------------------------------------------- checkpoints

    def _recipe_state(self, end_of_epoch: bool) -> Dict[str, Any]:
        return {
            **self._progress_state(end_of_epoch),
            "adapter": {k: v.detach().to("cpu", copy=True) for k, v in self._adapter_params.items()},
            "optimizer": self._optimizer.state_dict(),
            "rng": rng_state(self._device),
        }

    def _exportable_model(self) -> Any:
        """The model as the checkpointer should see it: a vocab-pruned one under the unpruned model's keys and
        shapes (the trained rows written into the base's full-vocabulary tensors)."""
        if self._pruning is None:
            return self._model
        base_vocab = read_base_vocab_state(self._checkpointer.checkpoint_paths, self._converter)
        state = export_full_vocab_state_dict(self._model.state_dict(keep_vars=True), base_vocab, self._kept_ids)
        return GatheredModelView(self._model, state)

    def save_checkpoint(self, epoch: int, end_of_epoch: bool = True, full: bool = True) -> None:
        """Saves the recipe state, the adapter (PEFT) and optionally the merged model.

        Args:
            epoch (int): current epoch (0-based).
            end_of_epoch (bool): called at the end of ``epoch``.
            full (bool): also write the merged model (unless ``save_adapter_weights_only``).
        """
        start = time.perf_counter()
        # Saved at the end too: a finished run can be extended by raising `epochs` and resuming.
        self._last_checkpoint = self._checkpointer.save(
            self._exportable_model(),
            step=self.global_step,
            adapter_config=self._lora.adapter_config(self._pruning),
            save_merged=full and not self._save_adapter_weights_only,
            dtype=self._dtype,
        )
        # Last: the recipe state commits the checkpoint (a resume never starts from a step without its folder).
        self._checkpointer.save_recipe_state(self._recipe_state(end_of_epoch))
        log.info(f"Checkpoint saved to {self._last_checkpoint} in {time.perf_counter() - start:.1f} s.")


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run recipes/qlora_finetune_single_device.py --config <yaml> [key=value ...]``."""
    config.log_config(recipe_name="QLoRAFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = QLoRAFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

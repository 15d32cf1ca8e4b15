"""QLoRA fine-tuning on one device (CUDA, CPU, ...) with an fp32, bf16 or fp16 compute dtype.

Run from a clone (``PYTHONPATH=.``: torchtune installs a top-level ``recipes`` package that would shadow this
folder; ``python recipes/qlora_finetune_single_device.py --config ...`` works too)::

    PYTHONPATH=. tune run recipes/qlora_finetune_single_device.py --config configs/tiny/qlora_single_device.yaml
    PYTHONPATH=. tune run recipes/qlora_finetune_single_device.py \
        --config configs/llama3_2/1B_qlora_single_device.yaml dtype=fp32

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

import math
import sys
import time
from functools import partial
from typing import Any, Dict, List, Optional

import torch
from omegaconf import DictConfig, ListConfig
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

import torchtune_ext  # noqa: F401  (registers the NF4 ops current PyTorch needs)
from torchtune_ext.modules.vocab_pruning import VocabPruning, export_full_vocab_state_dict, prune_vocab_
from torchtune_ext.training._checkpointing import QLoRAHFCheckpointer, check_materialized, materialize_adapters_
from torchtune_ext.training._distributed import GatheredModelView
from torchtune_ext.training._hf import HFConverter
from torchtune_ext.training._metrics import Throughput, format_memory_stats, memory_stats
from torchtune_ext.training._precision import LossScaler, check_param_dtypes, default_adapter_dtype, parse_dtype
from torchtune_ext.training._recipe_utils import (
    LoRASettings,
    build_dataset,
    build_qlora_model,
    parse_vocab_pruning,
    positive_int,
    read_base_vocab_state,
    resolve_kept_ids,
    rng_state,
    set_rng_state,
)

log = utils.get_logger("INFO")


def _lora_shapes(adapters: Dict[str, torch.Tensor]) -> Dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in adapters.items() if ".lora_" in k or k.endswith(".magnitude")}


def _check_samples_have_labels(dataset, max_seq_len: Optional[int], ignore_index: int, limit: int = 64) -> None:
    """Fails if none of the first ``limit`` samples keeps a label token after truncation (prompts longer than
    ``max_seq_len``), which would train on nothing (a NaN or zero-division loss)."""
    count = min(len(dataset), limit)
    empty = [i for i in range(count) if all(int(label) == ignore_index for label in dataset[i]["labels"])]
    if count and len(empty) == count:
        raise ValueError(
            f"None of the first {count} samples of the data set keeps a label token after truncation to "
            f"tokenizer.max_seq_len={max_seq_len}: their prompts are longer. Raise tokenizer.max_seq_len."
        )
    if empty:
        log.warning(f"{len(empty)} of the first {count} samples have no label token within tokenizer.max_seq_len="
                    f"{max_seq_len} (e.g. sample {empty[0]}); they do not train.")


class QLoRAFinetuneRecipeSingleDevice(FTRecipeInterface):
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

        self._output_dir = cfg.output_dir
        self._log_every_n_steps = positive_int(cfg, "log_every_n_steps", 1)
        self._gradient_accumulation_steps = positive_int(cfg, "gradient_accumulation_steps", 1)
        self._clip_grad_norm = cfg.get("clip_grad_norm", None)
        self._batch_size = positive_int(cfg, "batch_size", 1)
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
        self._vocab_pruning_cfg = parse_vocab_pruning(cfg.get("vocab_pruning", None))
        self._pruning: Optional[VocabPruning] = None
        self._kept_ids: Optional[List[int]] = None
        if cfg.get("enable_activation_offloading", False):
            raise ValueError(
                "enable_activation_offloading is not supported by this recipe; use "
                "enable_activation_checkpointing=True to save activation memory."
            )

        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))
        self.epochs_run = 0
        self.global_step = 0
        self._steps_in_epoch_done = 0
        self.loss_history: list = []

    # ---------------------------------------------------------------------------------------------------- setup

    def setup(self, cfg: DictConfig) -> None:
        """Validates everything that can be checked cheaply, then builds and loads the model, data and optimizer.

        Nothing is written under ``output_dir`` before the config has been validated.
        """
        if cfg.get("generate_base_checkpoint", None) is not None:
            config.instantiate(cfg.generate_base_checkpoint)
        self._checkpointer: QLoRAHFCheckpointer = config.instantiate(cfg.checkpointer)
        self._lora = LoRASettings.from_config(cfg.model)
        self._model = build_qlora_model(cfg.model, self._dtype, self._adapter_dtype)
        self._checkpointer.validate(self._model)
        self._converter = HFConverter.for_model(self._checkpointer.model_type, self._model)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        dataset = build_dataset(cfg.dataset, self._tokenizer)
        val_cfg = cfg.get("dataset_val", None)
        val_dataset = build_dataset(val_cfg, self._tokenizer) if val_cfg is not None else None
        _check_samples_have_labels(dataset, cfg.tokenizer.get("max_seq_len", None), self._loss_fn.ignore_index)
        batches = len(dataset) // self._batch_size
        if batches < self._gradient_accumulation_steps:
            raise ValueError(
                f"The data set gives {batches} batches of batch_size={self._batch_size}, fewer than "
                f"gradient_accumulation_steps={self._gradient_accumulation_steps}: lower either."
            )
        if self._vocab_pruning_cfg is not None:
            vocab_size = self._model.tok_embeddings.num_embeddings
            self._kept_ids = resolve_kept_ids(
                self._vocab_pruning_cfg["kept_ids"], vocab_size, self._tokenizer, [dataset, val_dataset]
            )
            log.info(f"Vocab pruning: keeping {len(self._kept_ids)} of {vocab_size} token ids.")
        self._loss_scaler = LossScaler(enabled=self._dtype == torch.float16, device=self._device,
                                       **cfg.get("loss_scaler", {}))
        state = self._checkpointer.load_recipe_state() if self._resume_from_checkpoint else None
        if state is not None:
            self._check_recipe_state(state)

        # From here on, outputs are written.
        self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)

        self._load_model(state)
        self._optimizer = config.instantiate(cfg.optimizer, list(self._adapter_params.values()))
        if self._compile:
            self._loss_fn = training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)

        collate_fn = cfg.get("collate_fn", "torchtune.data.padded_collate_sft")
        self._sampler, self._dataloader = self._setup_data(
            dataset, cfg.dataset, shuffle=cfg.shuffle, collate_fn=collate_fn, drop_last=True
        )
        self._val_dataloader = None
        if val_dataset is not None:
            self._val_dataloader = self._setup_data(
                val_dataset, val_cfg, shuffle=False, collate_fn=collate_fn, drop_last=False
            )[1]

        self._steps_per_epoch = len(self._dataloader) // self._gradient_accumulation_steps
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        if state is not None:
            self._optimizer.load_state_dict(state["optimizer"])
            self._loss_scaler.load_state_dict(state["loss_scaler"])
            if state["dataloader"] is not None:
                self._dataloader.load_state_dict(state["dataloader"])
        self._lr_scheduler = config.instantiate(
            cfg.lr_scheduler, self._optimizer,
            num_training_steps=self.total_epochs * self._steps_per_epoch, last_epoch=self.global_step - 1,
        )
        # Restored when training starts, after the data loader iterator has drawn its seed.
        self._rng_to_restore = None
        if state is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
            self._rng_to_restore = state["rng"]

        self._ignore_labels_cache = torch.full(
            (self._batch_size, 1), self._loss_fn.ignore_index, device=self._device
        )
        log.info(f"Memory after setup: {format_memory_stats(memory_stats(self._device))}")

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
                    self._model, self._kept_ids, dtype=pruning_cfg["dtype"],
                    unknown_token_id=pruning_cfg["unknown_token_id"], trainable=pruning_cfg["trainable"],
                )
        self._adapter_params = get_adapter_params(self._model)
        if state is not None:
            self._load_adapter_state(state["adapter"])
        set_trainable_params(self._model, self._adapter_params)
        # LoRA/DoRA params in the adapter dtype; pruned rows (and a pruned output's adapters) in the pruning dtype.
        check_param_dtypes(
            [(k, p) for k, p in self._adapter_params.items() if not k.startswith("tok_embeddings.")],
            self._adapter_dtype, "adapter",
        )
        if self._enable_activation_checkpointing:
            training.set_activation_checkpointing(
                self._model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        if self._compile:
            training.compile_model(self._model)
        log.info(
            f"Loaded {self._checkpointer.checkpoint_dir} into NF4 in {time.perf_counter() - start:.1f} s: compute "
            f"dtype {self._dtype}, adapters {self._adapter_dtype}, device {self._device}"
            + (f", vocab pruning in {pruning_cfg['dtype']}" if pruning_cfg else "") + "."
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
        # LoRA/DoRA shapes against the (meta) model, before anything is written; vocab-pruning rows are checked
        # through kept_ids below.
        expected, saved = _lora_shapes(get_adapter_params(self._model)), _lora_shapes(state["adapter"])
        if saved != expected:
            differ = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
            raise ValueError(
                "The recipe state's adapters do not match the model's (different lora_attn_modules, "
                "apply_lora_to_mlp or lora_rank?): "
                + "; ".join(f"{k}: saved {saved.get(k)}, model {expected.get(k)}" for k in differ[:4])
            )
        if state["dtype"] != str(self._dtype):
            raise ValueError(
                f"The recipe state was saved with dtype {state['dtype']} but this run uses {self._dtype}; "
                "resume with the same dtype."
            )
        if state["seed"] != self.seed:
            log.warning(f"Config seed {self.seed} differs from the checkpoint's; using {state['seed']}.")
            self.seed = state["seed"]
        if state.get("kept_ids") != self._kept_ids:
            raise ValueError(
                "The recipe state's vocab pruning (kept token ids) differs from this run's; resume with the same "
                "vocab_pruning settings and data."
            )
        self.epochs_run = state["epochs_run"]
        self.global_step = state["global_step"]
        self._steps_in_epoch_done = state["steps_in_epoch_done"]
        if state["max_steps_per_epoch"] != self.max_steps_per_epoch:
            log.warning(f"Config max_steps_per_epoch={self.max_steps_per_epoch} differs from the checkpoint's; using "
                        f"{state['max_steps_per_epoch']}.")
            self.max_steps_per_epoch = state["max_steps_per_epoch"]

    def _setup_data(self, dataset, cfg_dataset: Any, shuffle: bool, collate_fn: str, drop_last: bool):
        packed = getattr(dataset, "packed", False) if isinstance(cfg_dataset, ListConfig) else \
            cfg_dataset.get("packed", False)
        if "left_pad_sequence" in collate_fn:
            raise RuntimeError("left_pad_sequence collator is only for inference.")
        collate = _get_component_from_path(collate_fn)
        sampler = StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=self.seed)
        dataloader = StatefulDataLoader(
            dataset=dataset,
            batch_size=self._batch_size,
            sampler=sampler,
            collate_fn=padded_collate_packed if packed else partial(
                collate, padding_idx=self._tokenizer.pad_id, ignore_idx=self._loss_fn.ignore_index
            ),
            # dropping the last partial batch keeps shapes static (compile) and batches comparable
            drop_last=drop_last,
        )
        return sampler, dataloader

    # ------------------------------------------------------------------------------------------- checkpoints

    def _recipe_state(self, end_of_epoch: bool) -> Dict[str, Any]:
        return {
            "global_step": self.global_step,
            "epochs_run": self.epochs_run,
            "steps_in_epoch_done": 0 if end_of_epoch else self._steps_in_epoch_done,
            "seed": self.seed,
            "total_epochs": self.total_epochs,
            "max_steps_per_epoch": self.max_steps_per_epoch,
            "dtype": str(self._dtype),
            "adapter": {k: v.detach().to("cpu", copy=True) for k, v in self._adapter_params.items()},
            "optimizer": self._optimizer.state_dict(),
            "lr_scheduler": self._lr_scheduler.state_dict(),
            "loss_scaler": self._loss_scaler.state_dict(),
            # A new epoch starts a fresh pass over the data.
            "dataloader": None if end_of_epoch else self._dataloader.state_dict(),
            "rng": rng_state(self._device),
            "kept_ids": self._kept_ids,
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

    # ------------------------------------------------------------------------------------------------ training

    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.pop("labels")
        logits = self._model(**batch)
        # Shift labels: equivalent to labels[..., 1:] against logits[..., :-1, :] without slicing the logits.
        labels = torch.hstack((labels[..., 1:], self._ignore_labels_cache[: labels.shape[0]]))
        if self._pruning is not None:
            labels = self._pruning.remap_labels(labels, ignore_index=self._loss_fn.ignore_index)
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        loss = self._loss_fn(logits, labels)
        del logits
        return loss

    @torch.no_grad()
    def _validate(self) -> float:
        self._model.eval()
        total, count = torch.zeros((), device=self._device), 0
        for i, batch in enumerate(self._val_dataloader):
            if self._max_validation_steps is not None and i >= self._max_validation_steps:
                break
            utils.batch_to_device(batch, self._device)
            num_tokens = (batch["labels"] != self._loss_fn.ignore_index).sum()
            total += self._loss_step(batch) * num_tokens
            count += int(num_tokens)
        self._model.train()
        return total.item() / max(count, 1)

    def _optimizer_step(self, num_tokens: torch.Tensor) -> Dict[str, float]:
        self._loss_scaler.unscale_(self._optimizer)
        training.scale_grads(self._model, 1 / num_tokens)
        max_norm = math.inf if self._clip_grad_norm is None else float(self._clip_grad_norm)
        grad_norm = torch.nn.utils.clip_grad_norm_(self._adapter_params.values(), max_norm=max_norm)
        self._loss_scaler.step(self._optimizer)
        self._optimizer.zero_grad(set_to_none=True)
        self._lr_scheduler.step()
        metrics = {"grad_norm": grad_norm.item()}
        if self._loss_scaler.enabled:
            metrics.update(loss_scale=self._loss_scaler.get_scale(), skipped_steps=self._loss_scaler.skipped_steps)
        return metrics

    def train(self) -> None:
        """The training loop: gradient accumulation normalised by token count, as torchtune's recipe."""
        if self._compile:
            log.info("torch.compile is enabled: the first iterations are slow.")
        throughput = Throughput()
        self._first_step_of_run = self.global_step + 1
        running_loss, num_tokens = 0.0, 0
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            self._sampler.set_epoch(curr_epoch)
            pbar = tqdm(total=self._steps_per_epoch, initial=self._steps_in_epoch_done, dynamic_ncols=True)
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
                # The loss is a mean over tokens; weighting by the count lets accumulation normalise over all.
                loss = self._loss_step(batch) * batch_tokens
                running_loss += loss.detach()
                self._loss_scaler.scale(loss).backward()
                micro_batches += 1
                if micro_batches % self._gradient_accumulation_steps != 0:
                    continue

                step_metrics = self._optimizer_step(num_tokens)
                self.global_step += 1
                self._steps_in_epoch_done += 1
                loss_value = running_loss.item() / num_tokens.item()
                self.loss_history.append(loss_value)
                pbar.update(1)
                pbar.set_description(f"{curr_epoch + 1}|{self.global_step}|Loss: {loss_value:.4f}")
                if self.global_step % self._log_every_n_steps == 0:
                    self._metric_logger.log_dict(
                        {
                            "loss": loss_value,
                            "lr": self._optimizer.param_groups[0]["lr"],
                            "tokens_per_second": throughput.tokens_per_second(),
                            **step_metrics,
                            **memory_stats(self._device),
                        },
                        step=self.global_step,
                    )
                    throughput.reset()
                running_loss, num_tokens = 0.0, 0
                if self._val_dataloader is not None and self._run_val_every_n_steps and \
                        self.global_step % self._run_val_every_n_steps == 0:
                    self._metric_logger.log_dict({"val_loss": self._validate()}, step=self.global_step)

                if self._stop_after_step is not None and self.global_step >= self._stop_after_step:
                    if self._steps_in_epoch_done < self._steps_per_epoch:
                        pbar.close()
                        self.save_checkpoint(curr_epoch, end_of_epoch=False, full=False)
                        log.info(f"Stopped after step {self.global_step} (stop_after_step); resume with "
                                 "resume_from_checkpoint=True.")
                        return
                elif self._save_every_n_steps and self.global_step % self._save_every_n_steps == 0 and \
                        self._steps_in_epoch_done < self._steps_per_epoch:
                    self.save_checkpoint(curr_epoch, end_of_epoch=False, full=False)
            pbar.close()
            self.epochs_run += 1
            self._steps_in_epoch_done = 0
            self.save_checkpoint(curr_epoch, end_of_epoch=True)
            if self._stop_after_step is not None and self.global_step >= self._stop_after_step:
                return

    def cleanup(self) -> None:
        """Closes the metric logger and prints where the outputs are."""
        self._metric_logger.close()
        log_dir = getattr(self._metric_logger, "log_dir", None)
        checkpoint = getattr(self, "_last_checkpoint", None)
        lines = ["", "Done."]
        if self.loss_history:
            lines.append(f"  loss: {self.loss_history[0]:.4f} (step {self._first_step_of_run}) -> "
                         f"{self.loss_history[-1]:.4f} (step {self.global_step})")
        if checkpoint is not None:
            lines.append(f"  adapter (PEFT):      {checkpoint / 'adapter'}")
            if (checkpoint / "merged").is_dir():
                lines.append(f"  merged model (HF):   {checkpoint / 'merged'}")
        if (self._checkpointer.output_dir / "recipe_state").is_dir():
            lines.append(f"  resumable state:     {self._checkpointer.output_dir / 'recipe_state'}")
        if log_dir is not None:
            lines.append(f"  TensorBoard logs:    {log_dir}  (tensorboard --logdir {log_dir})")
        print("\n".join(lines), flush=True)


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

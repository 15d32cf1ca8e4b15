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
  each rank quantizes only its own shard of every NF4 weight (``load_full_state_dict``).
- ``vocab_pruning``: train over the token ids the data uses (or a kept-ids file); the pruned embedding/output rows
  train in fp32, ``sharding: sharded`` (their own FSDP unit, fp32 params and reduce dtype; batches are right-padded
  to a multiple of the loss's output chunks so that every rank calls the unit equally often) or ``replicated``
  (every rank holds them, gradients all-reduced in fp32). The merged checkpoint is exported with the full
  vocabulary (trained rows in place, the base's elsewhere); the PEFT adapter carries trained rows as PEFT
  trainable tokens (``trainable_token_indices``: ``embed_tokens``, and ``lm_head`` when untied).
- Logs (rank 0): loss, lr, tokens/s (global and per rank), grad norm, loss scale and skipped steps (fp16), memory
  of every rank (``peak_rss/rank<r>``, and CUDA peaks on GPUs).
- Saving gathers adapters only (``get_full_state_dict(adapter_weights_only=True)``) unless the merged model is
  written; the recipe state holds the full (unsharded) optimizer state, so a run can resume on another world size.
- ``process_group_timeout_s``: how long a rank waits for the others before failing (no silent hang).
"""

import os
import random
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtune import config, modules, training, utils
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.modules.peft.lora import _lora_a_init_params, _lora_b_init_params

import torchtune_ext  # noqa: F401  (registers the NF4 ops current PyTorch needs)
from torchtune_ext.modules.low_precision import dequantize_nf4
from torchtune_ext.modules.peft import DoRALinear, LoRALinear
from torchtune_ext.modules.vocab_pruning import (
    export_full_vocab_state_dict,
    prune_state_dict,
    prune_vocab_,
)
from torchtune_ext.training import _safetensors
from torchtune_ext.training._distributed import (
    DistributedLossScaler,
    GatheredModelView,
    all_reduce_grads,
    all_reduce_sum,
    check_dataset_size,
    check_fsdp_cpu_offload,
    clip_grad_norm_,
    destroy_distributed,
    gather_memory_stats,
    init_distributed,
    launched_world_size,
    per_rank_batch_size,
    replicated_params,
    shard_model,
)
from torchtune_ext.training._precision import check_param_dtypes, default_adapter_dtype, parse_dtype
from torchtune_ext.training._recipe_base import QLoRARecipeBase
from torchtune_ext.training._recipe_utils import (
    is_vocab_key,
    positive_int,
    read_base_vocab_state,
    rng_state,
)
from torchtune_ext.training._state_dict import get_full_state_dict
from torchtune_ext.training._state_dict_load import load_full_state_dict
from torchtune_ext.training._state_dict_utils import unwrap_key

log = utils.get_logger("INFO")

#: rank 0 reads the base checkpoint in chunks of about this many bytes.
_LOAD_CHUNK_BYTES = 1 << 30


class QLoRAFinetuneRecipeDistributed(QLoRARecipeBase):
    """QLoRA fine-tuning recipe on FSDP2; see the module docstring for the features.

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
        self._device = utils.get_device(device=cfg.device)
        self._dtype = parse_dtype(cfg.dtype, self._device)
        self._adapter_dtype = default_adapter_dtype(self._dtype, cfg.get("adapter_dtype", None))
        self._fsdp_cpu_offload = bool(cfg.get("fsdp_cpu_offload", False))
        check_fsdp_cpu_offload(self._fsdp_cpu_offload, self._device, self.world_size)
        self._reshard_after_forward = bool(cfg.get("fsdp_reshard_after_forward", True))
        self._process_group_timeout_s = cfg.get("process_group_timeout_s", 1800)

        self._read_settings(cfg)
        self._batch_size = per_rank_batch_size(
            positive_int(cfg, "batch_size", 1), positive_int(cfg, "global_batch_size", None), self.world_size
        )
        self.seed: Optional[int] = None

    def _set_seed(self, cfg: DictConfig) -> None:
        """Seeds every rank with the same seed (torchtune's ``set_seed`` agrees on it across ranks), so all ranks
        draw the same initial adapters as the single-device recipe; ranks > 0 get their own streams (dropout)
        once the model is initialised."""
        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        np.random.seed(self.seed)

    # ---------------------------------------------------------------------------------------------------- setup

    def setup(self, cfg: DictConfig) -> None:
        """Validates everything that can be checked cheaply, then builds, shards and loads the model, data and
        optimizer. Collective: every rank calls it. Nothing is written under ``output_dir`` before the config has
        been validated.
        """
        self._set_seed(cfg)
        if cfg.get("generate_base_checkpoint", None) is not None:
            if self._is_rank_zero:
                config.instantiate(cfg.generate_base_checkpoint)
            dist.barrier()
        dataset, val_dataset = self._build_components(cfg)
        self._check_samples_have_labels(dataset, cfg.tokenizer.get("max_seq_len", None))
        check_dataset_size(len(dataset), self._batch_size, self.world_size)
        if val_dataset is not None:
            check_dataset_size(len(val_dataset), self._batch_size, self.world_size)
        if self._vocab_pruning_cfg is not None:
            self._resolve_kept_ids(dataset, val_dataset)
        state = self._checkpointer.load_recipe_state() if self._resume_from_checkpoint else None
        if state is not None:
            self._check_recipe_state(state)

        # From here on, outputs are written.
        self._start_writing(cfg)

        self._load_model(state)
        self._optimizer = config.instantiate(cfg.optimizer, self._trainable_params)
        self._loss_scaler = DistributedLossScaler(
            enabled=self._dtype == torch.float16, device=self._device, **cfg.get("loss_scaler", {})
        )
        if self._compile:
            self._loss_fn = training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
            if self._pruning is not None and self._vocab_pruning_cfg["sharding"] == "sharded":
                # The output is projected chunk by chunk, each chunk a call of the pruning module's own FSDP unit
                # (an all-gather): every rank must make the same number of calls, whatever its sequence length.
                self._pad_to_multiple = self._loss_fn.num_output_chunks
        self._setup_dataloaders(cfg, dataset, val_dataset)
        self._setup_schedule(cfg, state)

    def _check_recipe_state(self, state: Dict[str, Any]) -> None:
        self._check_adapter_shapes(state["adapter"])
        saved_world = state.get("world_size", 1)
        if saved_world != self.world_size and state["dataloader"] is not None:
            utils.log_rank_zero(
                log,
                f"The recipe state was saved with {saved_world} rank(s), this run has {self.world_size}: the data "
                "position within the epoch is kept but the samples each rank sees differ from an uninterrupted run.",
            )
        self._restore_progress(state)

    # ------------------------------------------------------------------------------------------------- model

    def _load_model(self, state: Optional[Dict[str, Any]]) -> None:
        """Prunes (meta), marks trainable params, wraps, shards, then loads base weights and adapters."""
        start = time.perf_counter()
        model = self._model
        pruning_cfg = self._vocab_pruning_cfg
        if pruning_cfg is not None:
            self._pruning = prune_vocab_(
                model,
                self._kept_ids,
                dtype=pruning_cfg["dtype"],
                unknown_token_id=pruning_cfg["unknown_token_id"],
                trainable=pruning_cfg["trainable"],
            )
        set_trainable_params(model, get_adapter_params(model))
        if self._enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if self._compile:
            training.compile_model(model, verbose=self._is_rank_zero)
        shard_model(
            model,
            dtype=self._dtype,
            vocab_pruning=self._pruning,
            vocab_pruning_sharding=pruning_cfg["sharding"] if pruning_cfg is not None else "sharded",
            reshard_after_forward=self._reshard_after_forward,
            cpu_offload=self._fsdp_cpu_offload,
        )
        self._load_base()
        self._init_adapters(state["adapter"] if state is not None else None)
        training.validate_no_params_on_meta_device(model)

        self._adapter_keys = [unwrap_key(model, name) for name in get_adapter_params(model)]
        # The single-device recipe's optimizer order (get_adapter_params), so recipe states are interchangeable.
        self._trainable_params = [p for p in get_adapter_params(model).values() if p.requires_grad]
        self._replicated_params = replicated_params(model)
        adapter_params = {k: p for k, p in zip(self._adapter_keys, get_adapter_params(model).values())}
        # LoRA/DoRA params in the adapter dtype; a pruned output's live in the vocab-pruning dtype.
        lora_params = {
            k: p
            for k, p in adapter_params.items()
            if ("lora" in k or "magnitude" in k) and not k.startswith("tok_embeddings.")
        }
        check_param_dtypes(lora_params.items(), self._adapter_dtype, "adapter")
        if self.rank > 0:
            # Own RNG streams per rank from here on (dropout), as torchtune's seed + rank.
            torch.manual_seed(self.seed + self.rank)
            random.seed(self.seed + self.rank)
            np.random.seed(self.seed + self.rank)
        utils.log_rank_zero(
            log,
            f"Loaded {self._checkpointer.checkpoint_dir} into NF4 on {self.world_size} ranks in "
            f"{time.perf_counter() - start:.1f} s: compute dtype {self._dtype}, adapters {self._adapter_dtype}, "
            f"device {self._device}"
            + (f", vocab pruning {pruning_cfg['sharding']} in {pruning_cfg['dtype']}" if pruning_cfg else "")
            + ".",
        )

    def _load(self, state_dict: Optional[Dict[str, torch.Tensor]], broadcast_from_rank0: bool) -> None:
        """``load_full_state_dict`` onto the training device; with FSDP CPU offload, sharded params go to the host
        (FSDP moves them to the device for compute) and unsharded ones (a replicated vocab-pruning module) to the
        device."""
        if not self._fsdp_cpu_offload:
            load_full_state_dict(
                self._model, state_dict, device=self._device, strict=False, broadcast_from_rank0=broadcast_from_rank0
            )
            return
        sharded_keys = {
            unwrap_key(self._model, k)
            for k, v in self._model.state_dict(keep_vars=True).items()
            if isinstance(v, DTensor)
        }
        for keep_sharded, device in ((True, torch.device("cpu")), (False, self._device)):
            part = (
                None
                if state_dict is None
                else {k: v for k, v in state_dict.items() if (k in sharded_keys) == keep_sharded}
            )
            load_full_state_dict(
                self._model, part, device=device, strict=False, broadcast_from_rank0=broadcast_from_rank0
            )

    def _load_chunks(self) -> List[Tuple[Any, int]]:
        """The loading plan, the same on every rank (from the files' headers): ``(file, tensor count)`` per chunk of
        consecutive tensors of at most ``_LOAD_CHUNK_BYTES`` (a bigger tensor is a chunk of its own)."""
        plan = []
        for path in self._checkpointer.checkpoint_paths:
            header = _safetensors.read_header(path)
            count = size = 0
            for info in sorted(header.values(), key=lambda info: info["data_offsets"][0]):
                nbytes = info["data_offsets"][1] - info["data_offsets"][0]
                if count and size + nbytes > _LOAD_CHUNK_BYTES:
                    plan.append((path, count))
                    count = size = 0
                count, size = count + 1, size + nbytes
            if count:
                plan.append((path, count))
        return plan

    def _read_chunks(self, plan: List[Tuple[Any, int]]) -> Iterator[Dict[str, torch.Tensor]]:
        """Rank 0: yields each chunk of the plan as a torchtune-key state dict, reading one tensor at a time."""
        tensors = None
        current = None
        for path, count in plan:
            if path != current:
                tensors, current = _safetensors.iter_tensors(path), path
            state = {}
            for _ in range(count):
                converted = self._converter.to_tune(*next(tensors))
                if converted is not None:
                    state[converted[0]] = converted[1]
            yield state

    @torch.no_grad()
    def _load_base(self) -> None:
        """Rank 0 streams the checkpoint in chunks of about ``_LOAD_CHUNK_BYTES`` and sends each tensor; every rank
        quantizes its own shard. Host memory: one chunk on rank 0, one tensor on the others."""
        plan = self._load_chunks()
        chunks = self._read_chunks(plan) if self._is_rank_zero else (None for _ in plan)
        vocab: Dict[str, torch.Tensor] = {}
        for state in chunks:
            if state is not None and self._pruning is not None:
                vocab.update({k: state.pop(k) for k in list(state) if is_vocab_key(k)})
            self._load(state, broadcast_from_rank0=True)
            del state
        if self._pruning is not None:
            pruned = (
                prune_state_dict(vocab, self._kept_ids, dtype=self._vocab_pruning_cfg["dtype"])
                if self._is_rank_zero
                else None
            )
            del vocab
            self._load(pruned, broadcast_from_rank0=True)

    def _initial_adapters(self) -> Dict[str, torch.Tensor]:
        """Full initial LoRA tensors, drawn from the global RNG in module order like the single-device recipe's
        ``materialize_adapters_`` (Kaiming A, zero B), identical on every rank; DoRA magnitudes as placeholders."""
        adapters = {}
        for name, module in self._model.named_modules():
            if not isinstance(module, LoRALinear):
                continue
            key = unwrap_key(self._model, name)
            a = torch.empty(module.rank, module.in_dim, dtype=self._adapter_dtype, device=self._device)
            b = torch.empty(module.out_dim, module.rank, dtype=self._adapter_dtype, device=self._device)
            _lora_a_init_params(_WeightHolder(a))
            _lora_b_init_params(_WeightHolder(b))
            adapters[f"{key}.lora_a.weight"] = a
            adapters[f"{key}.lora_b.weight"] = b
            if isinstance(module, DoRALinear):
                # Placeholder: the magnitude is computed from the loaded base once every shard is in place.
                adapters[f"{key}.magnitude"] = torch.zeros(module.out_dim, dtype=self._adapter_dtype)
        return adapters

    @torch.no_grad()
    def _init_adapters(self, resumed: Optional[Dict[str, torch.Tensor]]) -> None:
        """Initialises (or restores) adapters, DoRA magnitudes and RoPE caches on the sharded model."""
        adapters = self._initial_adapters()
        if resumed is not None:
            expected = {unwrap_key(self._model, n) for n in get_adapter_params(self._model)}
            if set(resumed) != expected:
                raise ValueError(
                    "The recipe state's adapters do not match the model's (different lora_attn_modules, "
                    f"apply_lora_to_mlp, lora_rank or vocab_pruning?): {sorted(set(resumed) ^ expected)[:4]}"
                )
            adapters.update(resumed)
        self._load(adapters, broadcast_from_rank0=False)
        with torch.device(self._device):
            for module in self._model.modules():
                if hasattr(module, "rope_init"):
                    module.rope_init()
        if resumed is None:
            for module in self._model.modules():
                if isinstance(module, DoRALinear):
                    _init_dora_magnitude(module)

    # ------------------------------------------------------------------------------------------- checkpoints

    def _full_optimizer_state(self) -> Dict[str, Any]:
        """The optimizer state with every sharded tensor gathered, in ``optimizer.state_dict()``'s own layout
        (param indices), on rank 0; the same layout the single-device recipe saves. Collective."""
        local = self._optimizer.state_dict()
        full_state: Dict[int, Dict[str, Any]] = {}
        for index in sorted(local["state"]):
            entry = {}
            for name, value in local["state"][index].items():
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                if self._is_rank_zero:
                    entry[name] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            full_state[index] = entry
        return {"state": full_state, "param_groups": local["param_groups"]} if self._is_rank_zero else {}

    def _load_optimizer_state(self, full: Dict[str, Any]) -> None:
        """Loads a full optimizer state (this recipe's or the single-device recipe's), each rank keeping its shard."""
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        saved = [i for group in full["param_groups"] for i in group["params"]]
        if len(saved) != len(params):
            raise ValueError(
                f"The recipe state's optimizer has {len(saved)} params, this model {len(params)}: resume with the "
                "same model, LoRA and vocab_pruning settings."
            )
        state = {}
        for index, entry in full["state"].items():
            param = params[index]
            state[index] = {
                name: _like_param(value, param) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                for name, value in entry.items()
            }
        self._optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})

    def _exportable(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A gathered state dict under the unpruned model's keys and shapes (full vocabulary)."""
        if self._pruning is None:
            return state_dict
        return export_full_vocab_state_dict(
            state_dict, read_base_vocab_state(self._checkpointer.checkpoint_paths, self._converter), self._kept_ids
        )

    def _recipe_state(
        self, adapters: Dict[str, torch.Tensor], optimizer: Dict[str, Any], rng: List[Any], end_of_epoch: bool
    ) -> Dict[str, Any]:
        return {
            **self._progress_state(end_of_epoch),
            "adapter": adapters,
            "optimizer": optimizer,
            "rng": rng[0],
            "rng_per_rank": rng,
            "world_size": self.world_size,
        }

    def save_checkpoint(self, epoch: int, end_of_epoch: bool = True, full: bool = True) -> None:
        """Saves the recipe state, the adapter (PEFT) and optionally the merged model. Collective.

        Only the adapters are gathered unless the merged model is written.

        Args:
            epoch (int): current epoch (0-based).
            end_of_epoch (bool): called at the end of ``epoch``.
            full (bool): also write the merged model (unless ``save_adapter_weights_only``).
        """
        start = time.perf_counter()
        save_merged = full and not self._save_adapter_weights_only
        state_dict = get_full_state_dict(self._model, adapter_weights_only=not save_merged)
        optimizer = self._full_optimizer_state()
        rng: List[Any] = [None] * self.world_size
        dist.all_gather_object(rng, rng_state(self._device))
        if self._is_rank_zero:
            adapters = {k: state_dict[k] for k in self._adapter_keys}
            self._last_checkpoint = self._checkpointer.save(
                GatheredModelView(self._model, self._exportable(state_dict)),
                step=self.global_step,
                adapter_config=self._lora.adapter_config(self._pruning),
                save_merged=save_merged,
                dtype=self._dtype,
            )
            # Last: the recipe state commits the checkpoint.
            self._checkpointer.save_recipe_state(self._recipe_state(adapters, optimizer, rng, end_of_epoch))
            log.info(f"Checkpoint saved to {self._last_checkpoint} in {time.perf_counter() - start:.1f} s.")
        del state_dict
        dist.barrier()

    # -------------------------------------------------------------------------------------------- cross-rank hooks

    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(value, self._device)

    def _reduce_grads(self) -> None:
        all_reduce_grads(self._replicated_params)

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self._trainable_params, max_norm=max_norm)

    def _memory_metrics(self) -> Dict[str, float]:
        return gather_memory_stats(self._device)


class _WeightHolder:
    """Gives a bare tensor the ``.weight`` that torchtune's LoRA init functions expect."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


def _like_param(value: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """A full optimizer-state tensor laid out like ``param``: this rank's shard for a DTensor param."""
    if isinstance(param, DTensor):
        local = param.to_local()
        return distribute_tensor(value.to(local.device), param.device_mesh, param.placements, src_data_rank=None)
    return value.to(param.device)


@torch.no_grad()
def _init_dora_magnitude(module: DoRALinear) -> None:
    """DoRA's initial magnitude (row norms of ``W0 + scaling * B A``) on a sharded or unsharded module.

    Rows are sharded alike for the weight, ``lora_b`` and ``magnitude`` (dim 0), so each rank computes its rows
    from its own NF4 shard; ``lora_a`` (sharded on its rank dim) is gathered.
    """
    if not isinstance(module.magnitude, DTensor):
        module.initialize_dora_magnitude()
        return
    dtype = module.magnitude.dtype
    weight = module.weight.to_local()
    base = dequantize_nf4(weight, dtype) if module._quantize_base else weight.to(dtype)
    lora_a = module.lora_a.weight.full_tensor().to(dtype)
    lora_b = module.lora_b.weight.to_local().to(dtype)
    norms = torch.linalg.norm(base + module.scaling * (lora_b @ lora_a), dim=1)
    module.magnitude.to_local().copy_(norms)


def _run(cfg: DictConfig) -> None:
    recipe = QLoRAFinetuneRecipeDistributed(cfg=cfg)
    init_distributed(recipe._device, recipe._process_group_timeout_s)
    try:
        recipe.setup(cfg=cfg)
        recipe.train()
        recipe.cleanup()
    finally:
        destroy_distributed()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run --nproc_per_node N recipes/qlora_finetune_distributed.py --config <yaml> [k=v ...]``."""
    if int(os.environ.get("RANK", "0")) == 0:
        config.log_config(recipe_name="QLoRAFinetuneRecipeDistributed", cfg=cfg)
    _run(cfg)


if __name__ == "__main__":
    sys.exit(recipe_main())

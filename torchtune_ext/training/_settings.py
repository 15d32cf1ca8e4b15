"""A QLoRA recipe's settings, read from its config and checked once (:class:`RecipeSettings`), the LoRA settings of
its model (for the PEFT adapter config), and the dtypes derived from the base checkpoint."""

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig
from torchtune import utils
from torchtune.modules.peft import get_lora_module_names

from torchtune_ext._dtype import parse_dtype
from torchtune_ext.checkpoint import parse_keep_last_n
from torchtune_ext.config import recipe_setting
from torchtune_ext.memory import device_profile
from torchtune_ext.modules.vocab_pruning import VocabPruning, parse_vocab_pruning
from torchtune_ext.training._activations import check_activation_offloading
from torchtune_ext.training._precision import default_adapter_dtype

#: the settings that are the config's value (or the schema's default) as it is.
_AS_CONFIGURED = (
    "batch_size",
    "log_every_n_steps",
    "gradient_accumulation_steps",
    "clip_grad_norm",
    "epochs",
    "max_steps_per_epoch",
    "stop_after_step",
    "save_every_n_steps",
    "run_val_every_n_steps",
    "max_validation_steps",
    "resume_from_checkpoint",
    "save_adapter_weights_only",
    "merge_base",
    "enable_activation_checkpointing",
    "tiled_mlp_tokens",
    "frozen_dtype",
    "merged_dtype",
    "collate_fn",
    "compile",
)


@dataclass(frozen=True)
class RecipeSettings:
    """The settings both QLoRA recipes take, read from the config and checked once, before anything is built: each
    key's default and allowed values are those of the config schema (``torchtune_ext.config.RECIPE_SCHEMA``).

    Attributes:
        dry_run (bool): estimate the memory only (the configured device need not be on this machine).
        device (torch.device): the training device.
        dtype (torch.dtype): the compute dtype.
        adapter_dtype (torch.dtype): the LoRA/DoRA params' dtype (fp32 masters under fp16).
        batch_size (int): samples per micro-batch, per rank.
        log_every_n_steps (int): metrics every that many steps.
        gradient_accumulation_steps (int): micro-batches per optimizer step.
        clip_grad_norm (Optional[float]): the gradient norm's limit; None: no clipping.
        epochs (int): epochs to train.
        max_steps_per_epoch (Optional[int]): optimizer steps per epoch at most.
        stop_after_step (Optional[int]): end the run after this step, with a resumable checkpoint.
        save_every_n_steps (Optional[int]): resumable checkpoints within an epoch.
        run_val_every_n_steps (Optional[int]): the validation loss every that many steps.
        max_validation_steps (Optional[int]): validation batches at most.
        resume_from_checkpoint (bool): continue the run saved in the output folder.
        overwrite_output_dir (bool): replace another run's checkpoints in the output folder.
        save_adapter_weights_only (bool): never write the merged model.
        keep_last_n (Optional[int]): step folders kept; None: all.
        merge_every_epoch (bool): the merged model at every epoch's end, not only the last.
        merge_base (str): ``nf4`` or ``original`` (:data:`torchtune_ext.checkpoint.MERGE_BASES`).
        enable_activation_checkpointing (bool): activation checkpointing per decoder layer.
        enable_activation_offloading (bool): saved activations in pinned host memory (CUDA).
        tiled_mlp_tokens (Optional[int]): tokens per tile of the tiled MLPs; None: untiled.
        max_seq_len (Optional[int]): ``tokenizer.max_seq_len``: the RoPE cache's length, the dry run's padded length.
        frozen_dtype (Optional[str]): ``frozen_dtype`` as named (None: from the checkpoint's, when it is known).
        merged_dtype (Optional[str]): ``merged_dtype`` as named (None: the checkpoint's).
        collate_fn (str): the collate function's dotted path.
        compile (bool): ``torch.compile`` the model and loss.
        vocab_pruning (Optional[Dict[str, Any]]): the ``vocab_pruning`` section as read; None: off.
    """

    dry_run: bool
    device: torch.device
    dtype: torch.dtype
    adapter_dtype: torch.dtype
    batch_size: int
    log_every_n_steps: int
    gradient_accumulation_steps: int
    clip_grad_norm: Optional[float]
    epochs: int
    max_steps_per_epoch: Optional[int]
    stop_after_step: Optional[int]
    save_every_n_steps: Optional[int]
    run_val_every_n_steps: Optional[int]
    max_validation_steps: Optional[int]
    resume_from_checkpoint: bool
    overwrite_output_dir: bool
    save_adapter_weights_only: bool
    keep_last_n: Optional[int]
    merge_every_epoch: bool
    merge_base: str
    enable_activation_checkpointing: bool
    enable_activation_offloading: bool
    tiled_mlp_tokens: Optional[int]
    max_seq_len: Optional[int]
    frozen_dtype: Optional[str]
    merged_dtype: Optional[str]
    collate_fn: str
    compile: bool
    vocab_pruning: Optional[Dict[str, Any]]

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "RecipeSettings":
        """
        Args:
            cfg (DictConfig): the recipe config (already checked by ``torchtune_ext.config.check_config``).

        Returns:
            RecipeSettings: the settings.

        Raises:
            ConfigError: on a non-positive count, an unknown ``merge_base`` or ``vocab_pruning`` setting.
            ValueError: on an unknown dtype, or ``enable_activation_offloading`` off CUDA.
            RuntimeError: on bf16 where the device does not support it.
            ConfigError: on bf16 where ``device_profile`` (or ``compute_capability``) names a card without it, or an
                unknown profile, in a dry run and a real run alike.
        """
        setting = functools.partial(recipe_setting, cfg)
        dry_run = bool(setting("dry_run"))
        device = torch.device(setting("device")) if dry_run else utils.get_device(device=setting("device"))
        dtype = parse_dtype(setting("dtype"), None if dry_run else device)
        # the card the config is for (device_profile, or device_memory_gb + compute_capability): its limits apply to
        # the run as to its dry run
        profile = device_profile(setting("device_profile"), setting("device_memory_gb"), setting("compute_capability"))
        if profile is not None:
            profile.check_dtype(dtype)
        adapter_dtype = default_adapter_dtype(dtype, setting("adapter_dtype"))
        configured = {name: setting(name) for name in _AS_CONFIGURED}
        keep_last_n = parse_keep_last_n(setting("keep_last_n_checkpoints"))
        offloading = setting("enable_activation_offloading")
        if not dry_run:
            check_activation_offloading(offloading, device)
        return cls(
            dry_run=dry_run,
            device=device,
            dtype=dtype,
            adapter_dtype=adapter_dtype,
            keep_last_n=keep_last_n,
            overwrite_output_dir=bool(setting("overwrite_output_dir")),
            merge_every_epoch=bool(setting("merge_every_epoch")),
            enable_activation_offloading=offloading,
            max_seq_len=setting("tokenizer.max_seq_len"),
            vocab_pruning=parse_vocab_pruning(setting("vocab_pruning")),
            **configured,
        )


@dataclass(frozen=True)
class LoRASettings:
    """The LoRA settings of a ``model:`` config section, for the PEFT adapter config.

    Args:
        rank (int): LoRA rank.
        alpha (float): LoRA alpha.
        dropout (float): LoRA dropout.
        use_dora (bool): DoRA.
        attn_modules (Tuple[str, ...]): ``lora_attn_modules``.
        apply_lora_to_mlp (bool): LoRA on the MLP.
        apply_lora_to_output (bool): LoRA on the output projection.
    """

    rank: int
    alpha: float
    dropout: float
    use_dora: bool
    attn_modules: Tuple[str, ...]
    apply_lora_to_mlp: bool
    apply_lora_to_output: bool

    @classmethod
    def from_config(cls, cfg_model: DictConfig) -> "LoRASettings":
        """
        Args:
            cfg_model (DictConfig): the ``model`` section (a torchtune_ext QLoRA builder's args).

        Returns:
            LoRASettings: its LoRA settings.
        """
        return cls(
            rank=cfg_model.lora_rank,
            alpha=cfg_model.lora_alpha,
            dropout=cfg_model.get("lora_dropout", 0.0),
            use_dora=cfg_model.get("use_dora", False),
            attn_modules=tuple(cfg_model.lora_attn_modules),
            apply_lora_to_mlp=cfg_model.get("apply_lora_to_mlp", False),
            apply_lora_to_output=cfg_model.get("apply_lora_to_output", False),
        )

    def adapter_config(self, pruning: Optional[VocabPruning] = None) -> Dict[str, Any]:
        """The ``adapter_config`` argument of ``QLoRAHFCheckpointer.save``.

        Args:
            pruning (Optional[VocabPruning]): the model's vocab pruning, if any. When its rows train, the adapter
                also carries them as PEFT trainable tokens (``embed_tokens``, and ``lm_head`` when untied).

        Returns:
            Dict[str, Any]: the config.
        """
        config: Dict[str, Any] = dict(
            target_modules=get_lora_module_names(
                list(self.attn_modules), self.apply_lora_to_mlp, self.apply_lora_to_output
            ),
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            use_dora=self.use_dora,
        )
        if pruning is not None and pruning.trainable:
            kept: List[int] = pruning.kept_ids.tolist()
            config["trainable_token_indices"] = {"embed_tokens": kept, **({} if pruning.tied else {"lm_head": kept})}
        return config


def frozen_weights_dtype(
    name: Optional[str], dtype: torch.dtype, hf_config: Dict[str, Any], what: str = "frozen_dtype"
) -> torch.dtype:
    """The storage dtype of the frozen weights that are not NF4 (token embedding, untied output projection).

    Args:
        name (Optional[str]): the config's ``frozen_dtype`` (fp32, bf16, fp16); None: the checkpoint's own dtype
            when it is 16-bit and the compute dtype is fp32 (a T4 stores bf16 but has no bf16 compute: the upcast
            per use is exact, at half the memory), else the compute dtype.
        dtype (torch.dtype): the compute dtype.
        hf_config (Dict[str, Any]): the base checkpoint's ``config.json``.
        what (str): the config key, for errors.

    Returns:
        torch.dtype: the storage dtype.
    """
    if name is not None:
        return parse_dtype(name, what=what)
    stored = parse_dtype(hf_config.get("dtype") or hf_config.get("torch_dtype"), what="config.json dtype")
    return stored if dtype == torch.float32 and stored in (torch.bfloat16, torch.float16) else dtype


def dtype_or_checkpoints(name: Optional[str], hf_config: Dict[str, Any], what: str = "merged_dtype") -> torch.dtype:
    """``merged_dtype`` (the merged export's dtype): the named dtype, or by default the base
    checkpoint's own, so that an fp32 run on a 16-bit checkpoint exports a 16-bit model.

    Args:
        name (Optional[str]): fp32, bf16, fp16 or None.
        hf_config (Dict[str, Any]): the base checkpoint's ``config.json`` (bf16 if it names no dtype).
        what (str): the config key, for errors.

    Returns:
        torch.dtype: the dtype.
    """
    if name is not None:
        return parse_dtype(name, what=what)
    return parse_dtype(hf_config.get("dtype") or hf_config.get("torch_dtype") or "bf16", what="config.json dtype")

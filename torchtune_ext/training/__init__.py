"""Training: what the recipe file (``recipes/qlora_finetune_single_device.py``, for any world size) builds on and
calls: the setup pieces, the step's pieces, checkpoints, resume and the summary (:class:`QLoRARecipe`), compute dtypes
and fp16 loss scaling, interrupts that save, memory and throughput metrics, and the config settings it reads."""

from torchtune_ext._dtype import DTYPES, is_bf16_supported, parse_dtype

# torchtune.training re-exports its distributed state-dict helpers; ours live in torchtune_ext.distributed.
from torchtune_ext.distributed import get_full_state_dict
from torchtune_ext.training._activations import activation_offloading, check_activation_offloading
from torchtune_ext.training._allocator import EXPANDABLE_SEGMENTS, use_expandable_segments
from torchtune_ext.training._builders import build_dataset, build_qlora_model, build_tokenizer
from torchtune_ext.training._data import pad_batch_, shifted_labels
from torchtune_ext.training._dry_run import RECIPE_ALLOWANCE
from torchtune_ext.training._export import check_run_folders, export_merged, merge_command
from torchtune_ext.training._interrupt import InterruptGuard, resume_command
from torchtune_ext.training._loss import token_mean_loss
from torchtune_ext.training._metrics import (
    MemoryPeaks,
    Throughput,
    format_memory_stats,
    gather_memory_stats,
    memory_stats,
    peak_rss_bytes,
    rss_bytes,
)
from torchtune_ext.training._nonfinite import NonFiniteError, NonFiniteGuard, check_base_finite
from torchtune_ext.training._oom import DeviceOutOfMemoryError, out_of_memory_error
from torchtune_ext.training._precision import (
    DistributedLossScaler,
    LossScaler,
    check_param_dtypes,
    default_adapter_dtype,
)
from torchtune_ext.training._recipe import QLoRARecipe
from torchtune_ext.training._rng import rng_state, set_rng_state
from torchtune_ext.training._settings import (
    LoRASettings,
    RecipeSettings,
    dtype_or_checkpoints,
    frozen_weights_dtype,
)
from torchtune_ext.training._setup import launched_world_size_and_rank
from torchtune_ext.training._summary import progress_note

__all__ = [
    "DTYPES",
    "DeviceOutOfMemoryError",
    "RECIPE_ALLOWANCE",
    "DistributedLossScaler",
    "InterruptGuard",
    "LoRASettings",
    "LossScaler",
    "NonFiniteError",
    "NonFiniteGuard",
    "QLoRARecipe",
    "RecipeSettings",
    "Throughput",
    "activation_offloading",
    "build_dataset",
    "build_qlora_model",
    "build_tokenizer",
    "check_activation_offloading",
    "check_base_finite",
    "check_param_dtypes",
    "check_run_folders",
    "default_adapter_dtype",
    "export_merged",
    "format_memory_stats",
    "dtype_or_checkpoints",
    "frozen_weights_dtype",
    "gather_memory_stats",
    "get_full_state_dict",
    "is_bf16_supported",
    "launched_world_size_and_rank",
    "memory_stats",
    "merge_command",
    "out_of_memory_error",
    "pad_batch_",
    "parse_dtype",
    "peak_rss_bytes",
    "progress_note",
    "resume_command",
    "rng_state",
    "rss_bytes",
    "set_rng_state",
    "shifted_labels",
    "token_mean_loss",
    "EXPANDABLE_SEGMENTS",
    "MemoryPeaks",
    "use_expandable_segments",
]

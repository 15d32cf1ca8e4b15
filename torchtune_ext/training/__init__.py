"""Training: the QLoRA recipe both recipes run (setup, loop, checkpoints, resume, summary), compute dtypes and fp16
loss scaling, memory and throughput metrics, and the config settings the recipes read."""

from torchtune_ext._dtype import DTYPES, is_bf16_supported, parse_dtype
from torchtune_ext.training._activations import activation_offloading, check_activation_offloading
from torchtune_ext.training._metrics import (
    Throughput,
    format_memory_stats,
    gather_memory_stats,
    memory_stats,
    peak_rss_bytes,
    rss_bytes,
)
from torchtune_ext.training._precision import (
    DistributedLossScaler,
    LossScaler,
    check_param_dtypes,
    default_adapter_dtype,
)
from torchtune_ext.training._recipe import RECIPE_ALLOWANCE, QLoRARecipe
from torchtune_ext.training._settings import (
    LoRASettings,
    build_dataset,
    build_qlora_model,
    build_tokenizer,
    frozen_weights_dtype,
    positive_int,
    rng_state,
    set_rng_state,
    shifted_labels,
)

__all__ = [
    "DTYPES",
    "RECIPE_ALLOWANCE",
    "DistributedLossScaler",
    "LoRASettings",
    "LossScaler",
    "QLoRARecipe",
    "Throughput",
    "activation_offloading",
    "build_dataset",
    "build_qlora_model",
    "build_tokenizer",
    "check_activation_offloading",
    "check_param_dtypes",
    "default_adapter_dtype",
    "format_memory_stats",
    "frozen_weights_dtype",
    "gather_memory_stats",
    "is_bf16_supported",
    "memory_stats",
    "parse_dtype",
    "peak_rss_bytes",
    "positive_int",
    "rng_state",
    "rss_bytes",
    "set_rng_state",
    "shifted_labels",
]

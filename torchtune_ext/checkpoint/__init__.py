"""HF / PEFT checkpoint I/O: stream a base HF checkpoint into a (sharded) QLoRA model, write PEFT adapters, merged
HF models and resumable recipe state, atomically; random-weight HF checkpoints of real shapes for tests and
benchmarks."""

from torchtune_ext.checkpoint._atomic import atomic_directory, atomic_save, check_writable, remove_stale_temporaries
from torchtune_ext.checkpoint._checkpointer import (
    ADAPTER_DIRNAME,
    MERGE_BASES,
    MERGED_DIRNAME,
    RECIPE_STATE_DIRNAME,
    SAFETENSORS_INDEX,
    QLoRAHFCheckpointer,
    resolve_checkpoint_files,
)
from torchtune_ext.checkpoint._hf import (
    SUPPORTED_MODEL_TYPES,
    HFConverter,
    hf_dtype_fields,
    llama3_2_hf_config,
    peft_adapter_config,
    qwen2_hf_config,
    read_hf_config,
)
from torchtune_ext.checkpoint._load import LOAD_CHUNK_BYTES, load_base_
from torchtune_ext.checkpoint._random import write_random_hf_checkpoint
from torchtune_ext.checkpoint._retention import (
    DEFAULT_KEEP_LAST_N,
    DiskPlan,
    count_saves,
    merge_at_epoch_end,
    parse_keep_last_n,
    plan_disk,
    remove_old_checkpoints,
    step_folders,
)

__all__ = [
    "DEFAULT_KEEP_LAST_N",
    "DiskPlan",
    "count_saves",
    "merge_at_epoch_end",
    "parse_keep_last_n",
    "plan_disk",
    "remove_old_checkpoints",
    "step_folders",
    "ADAPTER_DIRNAME",
    "LOAD_CHUNK_BYTES",
    "MERGED_DIRNAME",
    "MERGE_BASES",
    "QLoRAHFCheckpointer",
    "RECIPE_STATE_DIRNAME",
    "SAFETENSORS_INDEX",
    "SUPPORTED_MODEL_TYPES",
    "HFConverter",
    "atomic_directory",
    "atomic_save",
    "check_writable",
    "hf_dtype_fields",
    "llama3_2_hf_config",
    "load_base_",
    "peft_adapter_config",
    "qwen2_hf_config",
    "read_hf_config",
    "remove_stale_temporaries",
    "resolve_checkpoint_files",
    "write_random_hf_checkpoint",
]

"""HF / PEFT checkpoint I/O: stream a base HF checkpoint into a (sharded) QLoRA model, write PEFT adapters, merged
HF models and resumable recipe state, atomically; one run per output folder (a lock); random-weight HF checkpoints
of real shapes for tests and benchmarks."""

from torchtune_ext.checkpoint._adapter import (
    PeftAdapter,
    check_adapter_fits,
    read_adapter_state,
    read_peft_adapter,
)
from torchtune_ext.checkpoint._atomic import atomic_directory, atomic_save, check_writable, remove_stale_temporaries
from torchtune_ext.checkpoint._checkpointer import (
    ADAPTER_DIRNAME,
    MERGE_BASES,
    MERGED_DIRNAME,
    RECIPE_STATE_DIRNAME,
    QLoRAHFCheckpointer,
    base_keys,
    resolve_checkpoint_files,
)
from torchtune_ext.checkpoint._from_gguf import (
    hf_checkpoint_from_gguf,
    smollm2_135m_instruct_checkpoint,
    smollm2_135m_instruct_gguf,
)
from torchtune_ext.checkpoint._hf import (
    SAFETENSORS_INDEX,
    SUPPORTED_MODEL_TYPES,
    HFConverter,
    decoder_hf_config,
    hf_dtype_fields,
    hf_rope_parameters,
    is_adapter_key,
    llama3_2_hf_config,
    peft_adapter_config,
    qwen2_hf_config,
    read_hf_config,
)
from torchtune_ext.checkpoint._load import LOAD_CHUNK_BYTES, load_base_
from torchtune_ext.checkpoint._lock import (
    OutputDirInUseError,
    OutputDirLock,
    check_output_dir,
    claim_output_dir,
    on_rank_zero,
)
from torchtune_ext.checkpoint._random import write_random_hf_checkpoint
from torchtune_ext.checkpoint._recipe_state import (
    DataPosition,
    RecipeState,
    UnsafeRecipeStateError,
    plain_rng_state,
    previous_path,
)
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
from torchtune_ext.checkpoint._run_identity import RunIdentity
from torchtune_ext.checkpoint._safetensors import iter_tensors as iter_safetensors
from torchtune_ext.checkpoint._safetensors import read_header as read_safetensors_header
from torchtune_ext.checkpoint._validate import check_checkpoint_matches
from torchtune_ext.checkpoint._writes import WriteError, check_writable_folders, format_bytes, free_bytes

__all__ = [
    "base_keys",
    "format_bytes",
    "free_bytes",
    "hf_checkpoint_from_gguf",
    "smollm2_135m_instruct_checkpoint",
    "smollm2_135m_instruct_gguf",
    "is_adapter_key",
    "iter_safetensors",
    "read_safetensors_header",
    "DEFAULT_KEEP_LAST_N",
    "DiskPlan",
    "count_saves",
    "merge_at_epoch_end",
    "parse_keep_last_n",
    "plan_disk",
    "remove_old_checkpoints",
    "step_folders",
    "ADAPTER_DIRNAME",
    "DataPosition",
    "LOAD_CHUNK_BYTES",
    "MERGED_DIRNAME",
    "MERGE_BASES",
    "QLoRAHFCheckpointer",
    "RECIPE_STATE_DIRNAME",
    "RecipeState",
    "RunIdentity",
    "SAFETENSORS_INDEX",
    "SUPPORTED_MODEL_TYPES",
    "UnsafeRecipeStateError",
    "WriteError",
    "HFConverter",
    "OutputDirInUseError",
    "OutputDirLock",
    "PeftAdapter",
    "atomic_directory",
    "atomic_save",
    "check_checkpoint_matches",
    "check_output_dir",
    "check_adapter_fits",
    "check_writable",
    "check_writable_folders",
    "claim_output_dir",
    "decoder_hf_config",
    "hf_dtype_fields",
    "hf_rope_parameters",
    "llama3_2_hf_config",
    "load_base_",
    "on_rank_zero",
    "peft_adapter_config",
    "plain_rng_state",
    "previous_path",
    "qwen2_hf_config",
    "read_adapter_state",
    "read_hf_config",
    "read_peft_adapter",
    "remove_stale_temporaries",
    "resolve_checkpoint_files",
    "write_random_hf_checkpoint",
]

"""NF4 tensors: torchao's ``NF4Tensor`` storage, made and read by the project's exact and faster codec.

Everything that creates or decodes an NF4Tensor in torchtune_ext goes through here (the layers in
``torchtune_ext.modules``, the state-dict tooling in ``torchtune_ext.distributed``, the checkpoint loader). Importing
it lets FSDP2's ``fully_shard`` shard any NF4 weight over any world size (``UnevenNF4Tensor``).
"""

from torchtune_ext._compat import NF4Tensor, to_nf4
from torchtune_ext.nf4._codec import (
    NF4_BLOCK_SIZE,
    NF4_SCALER_BLOCK_SIZE,
    NF4_SHARDED_TENSORS,
    cache_nf4_decoding_tables,
    check_float_dtype,
    check_nf4_shape,
    decode_nf4_,
    decode_whole_nf4,
    dequantize_nf4,
    dequantize_nf4_scalers,
    nf4_even_world_sizes,
    nf4_from_inner,
    nf4_n_blocks,
    nf4_scaler_block_size,
    nf4_scaler_mean,
    quantize_nf4,
)
from torchtune_ext.nf4._cpu_kernels import (
    cpu_kernels_available,
    cpu_kernels_off,
    cpu_kernels_unavailable_reason,
    dense16_mv,
    dense16_mv_supports,
    nf4_mv,
    nf4_mv_supports,
)
from torchtune_ext.nf4._uneven import (
    UnevenNF4Tensor,
    dequantize_shard_rows,
    nf4_groups_per_rank,
    nf4_shard_groups,
    nf4_uneven_groups,
    quantize_nf4_shard,
)

__all__ = [
    "NF4Tensor",
    "UnevenNF4Tensor",
    "NF4_BLOCK_SIZE",
    "NF4_SCALER_BLOCK_SIZE",
    "NF4_SHARDED_TENSORS",
    "cache_nf4_decoding_tables",
    "check_float_dtype",
    "check_nf4_shape",
    "cpu_kernels_available",
    "cpu_kernels_off",
    "cpu_kernels_unavailable_reason",
    "decode_nf4_",
    "decode_whole_nf4",
    "dequantize_nf4",
    "dequantize_nf4_scalers",
    "dequantize_shard_rows",
    "dense16_mv",
    "dense16_mv_supports",
    "nf4_even_world_sizes",
    "nf4_from_inner",
    "nf4_groups_per_rank",
    "nf4_shard_groups",
    "nf4_uneven_groups",
    "nf4_mv",
    "nf4_mv_supports",
    "nf4_n_blocks",
    "nf4_scaler_block_size",
    "nf4_scaler_mean",
    "quantize_nf4",
    "quantize_nf4_shard",
    "to_nf4",
]

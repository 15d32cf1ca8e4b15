"""Building blocks: the forked NF4 linear, LoRA/DoRA layers with an explicit compute dtype, vocab pruning, and the
decoder whose chunked output stays fast on CPU."""

from torchtune_ext.modules.low_precision import (
    FrozenNF4Linear,
    LinearNF4,
    dequantize_nf4,
    linear_nf4,
    quantize_nf4,
    to_nf4_frozen,
)
from torchtune_ext.modules.peft import DoRALinear, LoRALinear
from torchtune_ext.modules.transformer import ContiguousChunksTransformerDecoder, use_contiguous_chunks_
from torchtune_ext.modules.vocab_pruning import (
    PrunedOutput,
    VocabPruning,
    all_reduce_replicated_grads_,
    collect_token_ids,
    export_full_vocab_state_dict,
    get_vocab_pruning,
    load_kept_ids,
    prune_state_dict,
    prune_vocab_,
    save_kept_ids,
    validate_kept_ids,
    vocab_state_dict,
)

__all__ = [
    "ContiguousChunksTransformerDecoder",
    "DoRALinear",
    "FrozenNF4Linear",
    "LinearNF4",
    "LoRALinear",
    "PrunedOutput",
    "VocabPruning",
    "all_reduce_replicated_grads_",
    "collect_token_ids",
    "dequantize_nf4",
    "export_full_vocab_state_dict",
    "get_vocab_pruning",
    "linear_nf4",
    "load_kept_ids",
    "prune_state_dict",
    "prune_vocab_",
    "quantize_nf4",
    "save_kept_ids",
    "to_nf4_frozen",
    "use_contiguous_chunks_",
    "validate_kept_ids",
    "vocab_state_dict",
]

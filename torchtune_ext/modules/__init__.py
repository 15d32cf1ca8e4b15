"""Building blocks: the forked NF4 linear, LoRA/DoRA layers with an explicit compute dtype, vocab pruning, and the
decoder whose chunked output stays fast on CPU. NF4 tensors themselves: ``torchtune_ext.nf4``."""

from torchtune_ext.modules.loss import LinearCrossEntropyLoss, linear_cross_entropy
from torchtune_ext.modules.low_precision import (
    FrozenEmbedding,
    FrozenLinear,
    FrozenNF4Linear,
    FrozenTiedLinear,
    LinearNF4,
    cached_nf4_scales,
    dense_state_dict_post_hook,
    frozen_linear,
    linear_nf4,
)
from torchtune_ext.modules.peft import DoRALinear, LoRALinear, init_lora_weights_
from torchtune_ext.modules.rope import hf_rope_scaling, share_rope_
from torchtune_ext.modules.transformer import (
    ContiguousChunksTransformerDecoder,
    TiledFeedForward,
    tile_mlp_,
    use_contiguous_chunks_,
)
from torchtune_ext.modules.vocab_pruning import (
    PrunedOutput,
    VocabPruning,
    collect_token_ids,
    export_full_vocab_state_dict,
    get_vocab_pruning,
    is_vocab_key,
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
    "FrozenEmbedding",
    "FrozenLinear",
    "FrozenNF4Linear",
    "FrozenTiedLinear",
    "LinearCrossEntropyLoss",
    "LinearNF4",
    "LoRALinear",
    "PrunedOutput",
    "TiledFeedForward",
    "VocabPruning",
    "cached_nf4_scales",
    "collect_token_ids",
    "dense_state_dict_post_hook",
    "export_full_vocab_state_dict",
    "frozen_linear",
    "get_vocab_pruning",
    "init_lora_weights_",
    "linear_cross_entropy",
    "is_vocab_key",
    "linear_nf4",
    "load_kept_ids",
    "prune_state_dict",
    "prune_vocab_",
    "save_kept_ids",
    "hf_rope_scaling",
    "share_rope_",
    "tile_mlp_",
    "use_contiguous_chunks_",
    "validate_kept_ids",
    "vocab_state_dict",
]

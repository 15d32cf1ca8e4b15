"""Building blocks: the forked NF4 linear and LoRA/DoRA layers with an explicit compute dtype."""

from torchtune_ext.modules.low_precision import (
    FrozenNF4Linear,
    LinearNF4,
    dequantize_nf4,
    linear_nf4,
    quantize_nf4,
    to_nf4_frozen,
)
from torchtune_ext.modules.peft import DoRALinear, LoRALinear

__all__ = [
    "DoRALinear",
    "FrozenNF4Linear",
    "LinearNF4",
    "LoRALinear",
    "dequantize_nf4",
    "linear_nf4",
    "quantize_nf4",
    "to_nf4_frozen",
]

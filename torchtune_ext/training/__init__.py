"""Training utilities: state dicts of sharded, quantized, mixed-precision models."""

from torchtune_ext.training._state_dict import get_full_state_dict, get_model_state_dict
from torchtune_ext.training._state_dict_load import load_full_state_dict

__all__ = [
    "get_full_state_dict",
    "get_model_state_dict",
    "load_full_state_dict",
]

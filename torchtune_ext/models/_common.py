"""What the model families' builders (SmolLM2, Qwen3, Gemma 2, Phi) share: their sized builders, and the output
projection tied to the token embedding."""

from functools import partial
from typing import Any, Callable

from torchtune.modules import TiedLinear, TransformerDecoder


def sized_builder(
    builder: Callable[..., TransformerDecoder], name: str, doc: str, **defaults: Any
) -> Callable[..., TransformerDecoder]:
    """``builder`` with one size's architecture and LoRA rank 8, alpha 16 as defaults (a config may still set any of
    them): a ``functools.partial`` named ``name``, documented by ``doc``, in ``builder``'s module.

    Args:
        builder (Callable[..., TransformerDecoder]): a family's ``lora_*`` builder.
        name (str): the sized builder's name (``lora_qwen3_0_6b``).
        doc (str): its docstring.
        **defaults: the architecture's arguments.

    Returns:
        Callable[..., TransformerDecoder]: the sized builder.
    """
    sized = partial(builder, lora_rank=8, lora_alpha=16, **defaults)
    sized.__name__ = sized.__qualname__ = name
    sized.__module__ = builder.__module__
    sized.__doc__ = doc
    return sized


def check_no_lora_on_tied_output(apply_lora_to_output: bool, tied: bool, model: str) -> None:
    """
    Args:
        apply_lora_to_output (bool): the config's ``model.apply_lora_to_output``.
        tied (bool): whether the output projection is the token embedding.
        model (str): the model, as the message names it.

    Raises:
        ValueError: if both are set, naming the key and the fix.
    """
    if apply_lora_to_output and tied:
        raise ValueError(
            f"model.apply_lora_to_output=True: {model}'s output projection is tied to the token embedding and "
            "cannot take LoRA; set model.apply_lora_to_output=False."
        )


def tie_output_(model: TransformerDecoder) -> TransformerDecoder:
    """Makes ``model``'s output projection its token embedding (torchtune's ``TiedLinear``, as ``lora_llama3_2``
    ties it).

    Args:
        model (TransformerDecoder): the model, changed in place.

    Returns:
        TransformerDecoder: ``model``.
    """
    del model.output  # a module until now; torchtune's TiedLinear is a plain object holding the embedding
    model.output = TiedLinear(model.tok_embeddings)
    return model

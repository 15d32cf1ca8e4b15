"""torchtune's ``TransformerDecoder`` with a chunked output that projects contiguous chunks.

Why this is a fork: torchtune's ``chunked_output`` splits the last hidden state ``[b, s, d]`` along the sequence,
which gives non-contiguous views when ``b > 1``. torch's matmul then runs the output projection as a ``bmm`` over
the (vocab x dim) weight expanded to the batch, and on CPU the bf16 ``bmm`` copies that weight on every call
(timings: BENCHMARKS.md, "Measurements behind design choices"). A contiguous copy of a chunk costs
``b * s / n * d`` values, nothing next to the logits.

:class:`TiledFeedForward` (``tile_mlp_``) trains long sequences' MLPs a tile of tokens at a time.

The decoder also has torchtune's later ``skip_output_layer`` switch (after 0.6.1): when set (by
:meth:`torchtune_ext.modules.LinearCrossEntropyLoss.set_model_output`), the model returns its last hidden state
after the final norm, and the loss projects it chunk by chunk without ever holding the logits. Parameters,
state-dict keys and every other method are torchtune's.
"""

from typing import List, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchtune.modules import FeedForward, TransformerDecoder


class ContiguousChunksTransformerDecoder(TransformerDecoder):
    """A :class:`torchtune.modules.TransformerDecoder` whose ``chunked_output`` projects contiguous chunks.

    The QLoRA builders give their models this class (see :func:`use_contiguous_chunks_`).
    """

    #: return the last hidden state (after the final norm) instead of logits; a class attribute, so that the class
    #: swap of :func:`use_contiguous_chunks_` needs no new instance state.
    skip_output_layer: bool = False

    def unembed(self, h: torch.Tensor):
        """
        Args:
            h (torch.Tensor): the last layer's output, ``[b, seq_len, embed_dim]``.

        Returns:
            the normed hidden state with ``skip_output_layer``, else torchtune's logits (chunked or not).
        """
        if self.skip_output_layer:
            return self.norm(h)
        return super().unembed(h)

    def chunked_output(self, last_hidden_state: torch.Tensor) -> List[torch.Tensor]:
        """
        Args:
            last_hidden_state (torch.Tensor): the decoder's last hidden state, ``[b, seq_len, embed_dim]``.

        Returns:
            List[torch.Tensor]: ``num_output_chunks`` outputs of shape ``[b, seq_len / num_chunks, out_dim]``.
        """
        return [self.output(chunk.contiguous()) for chunk in last_hidden_state.chunk(self.num_output_chunks, dim=1)]


def use_contiguous_chunks_(model: TransformerDecoder) -> TransformerDecoder:
    """Makes a torchtune ``TransformerDecoder`` (built by any torchtune builder) a
    :class:`ContiguousChunksTransformerDecoder`, in place: the subclass adds no state, so only the instance's class
    changes (as ``fully_shard`` does when it wraps a module).

    Args:
        model (TransformerDecoder): the model; a subclass of it other than this one is left as it is.

    Returns:
        TransformerDecoder: ``model``.
    """
    if type(model) is TransformerDecoder:
        model.__class__ = ContiguousChunksTransformerDecoder
    return model


class TiledFeedForward(FeedForward):
    """A :class:`torchtune.modules.FeedForward` that, while training, runs long sequences a tile of tokens at a time,
    each tile under its own activation checkpoint (the tiled MLP of long-context training).

    The MLP is per token, so tiling changes no result; what it changes is memory: the MLP's intermediates (``w1``,
    ``w3``, their activation and product: four ``hidden_dim``-wide tensors, 3.5x the model dim each for Llama) exist
    for one tile at a time, in forward and in backward, instead of for the whole sequence, at the cost of one more
    forward of the MLP. With per-layer activation checkpointing that is what bounds a long sequence's memory. Set
    :attr:`tile_tokens` (``tile_mlp_``); None runs torchtune's ``forward``.
    """

    tile_tokens: Optional[int] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): ``[b, seq_len, dim]``.

        Returns:
            torch.Tensor: ``[b, seq_len, dim]``.
        """
        tile = self.tile_tokens
        if tile is None or not torch.is_grad_enabled() or x.shape[-2] <= tile:
            return super().forward(x)
        mlp = super().forward
        return torch.cat([checkpoint(mlp, part, use_reentrant=False) for part in x.split(tile, dim=-2)], dim=-2)


def tile_mlp_(model: nn.Module, tile_tokens: int) -> None:
    """Makes every torchtune ``FeedForward`` of ``model`` a :class:`TiledFeedForward` that trains ``tile_tokens``
    tokens at a time (the class swap adds no parameters: state-dict keys are unchanged).

    Args:
        model (nn.Module): the model (before activation checkpointing wraps its layers).
        tile_tokens (int): tokens per tile.

    Raises:
        ValueError: if ``tile_tokens`` is not positive.
    """
    if tile_tokens < 1:
        raise ValueError(f"tiled_mlp_tokens={tile_tokens} must be a positive number of tokens (or null: no tiling).")
    for module in model.modules():
        if type(module) in (FeedForward, TiledFeedForward):
            module.__class__ = TiledFeedForward
            module.tile_tokens = tile_tokens

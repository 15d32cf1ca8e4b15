"""torchtune's ``TransformerDecoder`` with a chunked output that projects contiguous chunks.

Why this is a fork: torchtune's ``chunked_output`` splits the last hidden state ``[b, s, d]`` along the sequence,
which gives non-contiguous views when ``b > 1``. torch's matmul then runs the output projection as a ``bmm`` over
the (vocab x dim) weight expanded to the batch, and on CPU the bf16 ``bmm`` copies that weight on every call:
measured on torch 2.13 with a 128256x2048 output and ``[2, 8, 2048]`` chunks, 4.7 s per chunk in bf16 (29 ms for a
contiguous chunk) and 0.99 s in fp32 (0.11 s), so a Llama-3.2-1B QLoRA step on CPU took 67 s in bf16 instead of a
few. A contiguous copy of a chunk costs ``b * s / n * d`` values, nothing next to the logits. Only ``chunked_output``
changes; parameters, state-dict keys and every other method are torchtune's.
"""

from typing import List

import torch
from torchtune.modules import TransformerDecoder


class ContiguousChunksTransformerDecoder(TransformerDecoder):
    """A :class:`torchtune.modules.TransformerDecoder` whose ``chunked_output`` projects contiguous chunks.

    The QLoRA builders give their models this class (see :func:`use_contiguous_chunks_`).
    """

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

"""The decoder fork: chunked output from contiguous chunks, otherwise torchtune's decoder."""

from typing import Callable, List

import pytest
import torch
from torchtune.modules import TransformerDecoder

from torchtune_ext.models import qlora_tiny_llama, qlora_tiny_qwen
from torchtune_ext.modules import ContiguousChunksTransformerDecoder


class _Recording:
    """Stands in for the (tied) output projection and records the inputs it gets."""

    def __init__(self, projection: Callable[[torch.Tensor], torch.Tensor]):
        self.projection, self.inputs = projection, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return self.projection(x)


def _last_hidden(model: TransformerDecoder, tokens: torch.Tensor) -> torch.Tensor:
    h = model.tok_embeddings(tokens)
    for layer in model.layers:
        h = layer(h)
    return model.norm(h)


@pytest.mark.parametrize("builder", [qlora_tiny_llama, qlora_tiny_qwen], ids=["llama", "qwen"])
def test_qlora_models_project_contiguous_chunks_with_torchtunes_values(builder):
    torch.manual_seed(0)
    model = builder(["q_proj", "v_proj"], dtype=torch.float32, device="cpu")
    assert type(model) is ContiguousChunksTransformerDecoder and isinstance(model, TransformerDecoder)
    tokens = torch.randint(0, model.tok_embeddings.num_embeddings, (3, 32))
    with torch.no_grad():
        full = model(tokens)
        model.set_num_output_chunks(4)
        recording = _Recording(model.output)
        model.output = recording
        ours: List[torch.Tensor] = model(tokens)
        model.output = recording.projection
        theirs = TransformerDecoder.chunked_output(model, _last_hidden(model, tokens))  # torchtune's own method
    assert len(ours) == len(theirs) == 4
    assert len(recording.inputs) == 4 and all(x.is_contiguous() for x in recording.inputs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(ours, dim=1), full, rtol=1e-5, atol=1e-5)

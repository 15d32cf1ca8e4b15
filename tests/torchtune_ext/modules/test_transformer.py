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


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_gives_the_same_loss_and_gradients(checkpointing):
    """The MLP is per token: running it a tile of tokens at a time (each tile checkpointed) changes nothing."""
    from torchtune import modules, training
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from torchtune_ext.modules import TiledFeedForward, tile_mlp_

    grads = []
    for tile in (None, 16):
        model = qlora_tiny_llama(["q_proj", "v_proj"], apply_lora_to_mlp=True, dtype=torch.float32, device="cpu")
        with torch.no_grad():
            for name, param in get_adapter_params(model).items():
                if "lora_b" in name:
                    param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
        set_trainable_params(model, get_adapter_params(model))
        if tile is not None:
            keys = list(model.state_dict(keep_vars=True))
            tile_mlp_(model, tile)
            assert list(model.state_dict(keep_vars=True)) == keys  # a class swap: the same parameters and keys
            assert all(type(layer.mlp) is TiledFeedForward for layer in model.layers)
        if checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        tokens = torch.randint(0, 512, (2, 50), generator=torch.Generator().manual_seed(2))  # 50 = 3 tiles + 2
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, reference), (tiled_loss, tiled) = grads
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=0)
    assert tiled.keys() == reference.keys() and reference
    for name in reference:
        torch.testing.assert_close(tiled[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)

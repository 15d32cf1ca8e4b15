"""Decoding projects only the last position: its logits equal the last row of the full uncached forward's,
and a model whose training loss left ``skip_output_layer`` set decodes the same tokens (and keeps the switch)."""

import torch
from torchtune.modules.peft import get_adapter_params

from torchtune_ext.generation import Generator, SamplingSettings
from torchtune_ext.models import qlora_tiny_llama


class _IdsTokenizer:
    eos_id = 2

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def _model():
    torch.manual_seed(0)
    model = qlora_tiny_llama(["q_proj", "v_proj"], apply_lora_to_mlp=True, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_b" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return model.eval().requires_grad_(False)


def _prompt(length: int = 17):
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def test_last_position_logits_equal_the_full_forward_s_last_row():
    model = _model()
    ids = _prompt()
    reference = model(ids)[:, -1]
    generator = Generator(model, _IdsTokenizer(), torch.float32, torch.device("cpu"))
    length = ids.shape[1]
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=length)
    try:
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None]
        logits = generator._last_logits(ids, torch.arange(length)[None], causal)
    finally:
        model.reset_caches()
    assert logits.shape == reference.shape == (1, model.output.tied_module.weight.shape[0])
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert not model.skip_output_layer


def test_a_model_left_returning_hidden_states_decodes_the_same_tokens():
    model = _model()
    generator = Generator(model, _IdsTokenizer(), torch.float32, torch.device("cpu"))
    settings = SamplingSettings(max_new_tokens=12, ignore_eos=True)
    prompt = _prompt()[0].tolist()
    uncached = SamplingSettings(max_new_tokens=12, ignore_eos=True, use_cache=False)
    expected = generator.generate(prompt, uncached).tokens
    model.skip_output_layer = True  # as LinearCrossEntropyLoss leaves the model it trains
    assert generator.generate(prompt, settings).tokens == expected
    assert generator.generate(prompt, uncached).tokens == expected
    assert model.skip_output_layer
    assert len(expected) == 12

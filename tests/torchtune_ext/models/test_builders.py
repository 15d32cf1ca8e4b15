"""QLoRA builders against torchtune's matching ``lora_*`` builders (one builder per family in the fast lane, the others
in the slow lane)."""

import pytest
import torch
from conftest import family_marks
from torch import nn
from torchtune.modules import TiedLinear
from torchtune.modules.peft import DoRALinear as TorchtuneDoRALinear
from torchtune.modules.peft import LoRALinear as TorchtuneLoRALinear
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.training import set_default_dtype

import torchtune_ext.models as models
from torchtune_ext.models import QLORA_BUILDERS
from torchtune_ext.modules import DoRALinear, LoRALinear
from torchtune_ext.nf4 import NF4Tensor

ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
TIED = {
    models.qlora_llama3_2_1b,
    models.qlora_llama3_2_3b,
    models.qlora_qwen2_5_0_5b,
    models.qlora_qwen2_5_1_5b_instruct,
    models.qlora_qwen2_5_3b,
    models.qlora_tiny_llama,
    models.qlora_tiny_qwen,
    models.qlora_smollm2_135m,
    models.qlora_smollm2_360m,
    models.qlora_smollm2_1_7b,
    models.qlora_qwen3_0_6b,
    models.qlora_qwen3_1_7b,
    models.qlora_qwen3_4b,
    models.qlora_gemma2_2b,
    models.qlora_gemma2_9b,
    models.qlora_gemma2_27b,
}
CASES = [
    pytest.param(ours, QLORA_BUILDERS[ours], use_dora, id=f"{ours.__name__}{'-dora' if use_dora else ''}",
                 marks=family_marks(ours))
    for ours, use_dora in [(ours, False) for ours in QLORA_BUILDERS] + [
        (models.qlora_llama3_2_1b, True), (models.qlora_qwen2_5_0_5b, True), (models.qlora_mistral_7b, True),
        (models.qlora_qwen3_8b, True),
    ]
]  # fmt: skip


def _is_adapter(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name or name.endswith(".magnitude")


@pytest.mark.parametrize("ours, theirs, use_dora", CASES)
def test_builder_matches_torchtune(ours, theirs, use_dora):
    kwargs = dict(apply_lora_to_mlp=True, apply_lora_to_output=ours not in TIED, lora_rank=8, use_dora=use_dora)
    model = ours(ATTN, dtype=torch.bfloat16, adapter_dtype=torch.float32, **kwargs)
    with set_default_dtype(torch.bfloat16), torch.device("meta"):
        reference = theirs(ATTN, quantize_base=False, **kwargs)
    output = getattr(reference.output, "projection", reference.output)  # Gemma 2: logit capping around it
    assert isinstance(output, TiedLinear) == (ours in TIED)

    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    assert {n: p.shape for n, p in params.items()} == {n: p.shape for n, p in ref_params.items()}
    assert sum(p.numel() for p in params.values()) == sum(p.numel() for p in ref_params.values())
    assert all(p.is_meta for p in params.values())

    # Every torchtune LoRA/DoRA linear is ours; every frozen base linear in the layers is NF4 in the compute dtype.
    lora_cls = DoRALinear if use_dora else LoRALinear
    assert not any(isinstance(m, (TorchtuneLoRALinear, TorchtuneDoRALinear)) for m in model.modules())
    ref_lora = {n for n, m in reference.named_modules() if isinstance(m, (TorchtuneLoRALinear, TorchtuneDoRALinear))}
    assert ref_lora == {n for n, m in model.named_modules() if isinstance(m, lora_cls)}
    for name, module in model.layers.named_modules():
        if isinstance(module, (nn.Linear, LoRALinear)) and not name.endswith(("lora_a", "lora_b")):
            assert isinstance(module.weight, NF4Tensor), name
            assert module.weight.dtype == torch.bfloat16 and not module.weight.requires_grad, name
    nf4 = {n for n, p in params.items() if isinstance(p, NF4Tensor)}
    layer_weights = {n for n, p in params.items() if n.startswith("layers.") and p.dim() == 2 and not _is_adapter(n)}
    assert layer_weights <= nf4
    assert nf4 - layer_weights == ({"output.weight"} if ours not in TIED else set())

    adapters = get_adapter_params(model)
    assert set(adapters) == {n for n in params if _is_adapter(n)} and adapters
    assert all(p.dtype == torch.float32 for p in adapters.values())
    set_trainable_params(model, adapters)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)
    assert all(p.dtype == torch.bfloat16 for n, p in params.items() if n not in adapters)


# Not DoRA on Qwen: torchtune's DoRALinear scales the q/k/v biases by the magnitude (its own merge does not; ours
# follows the merge, see test_peft.py).
@pytest.mark.parametrize(
    "ours, use_dora",
    [(models.qlora_tiny_llama, False), (models.qlora_tiny_llama, True), (models.qlora_tiny_qwen, False)],
    ids=["tiny_llama", "tiny_llama-dora", "tiny_qwen"],
)
def test_tiny_builder_matches_torchtune_qlora(ours, use_dora):
    """Same NF4 params as torchtune's ``quantize_base=True`` model and, with our weights loaded, the same logits."""
    kwargs = dict(apply_lora_to_mlp=True, use_dora=use_dora)
    model = ours(ATTN, dtype=torch.float32, device="cpu", seed=0, **kwargs)
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if ".lora_b." in name:
                param.normal_(0, 0.02)
    with set_default_dtype(torch.float32):
        reference = QLORA_BUILDERS[ours](ATTN, quantize_base=True, **kwargs)
    ref_nf4 = {n for n, p in reference.named_parameters() if isinstance(p, NF4Tensor)}
    assert ref_nf4 == {n for n, p in model.named_parameters() if isinstance(p, NF4Tensor)}
    # The live NF4 params, assigned (state_dict() is dense, as torchtune's; loading dense weights would re-quantize
    # them; copying into torchtune's NF4Tensors would re-quantize in its 256-block scale groups).
    reference.load_state_dict(model.state_dict(keep_vars=True), strict=True, assign=True)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-4, atol=1e-5)


def test_builder_errors_before_building():
    with pytest.raises(ValueError, match="dtype=torch.int32 is not a floating-point dtype"):
        models.qlora_tiny_llama(["q_proj"], dtype=torch.int32)

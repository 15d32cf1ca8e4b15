"""The merged model in transformers, as saved: in the dtype it was saved in, and ``merge_base="original"`` equal to
PEFT's adapter on the original base. Runs with whichever transformers the environment has: CI runs it with 5.x
(.venv) and 4.57 (.venv-oldest), the two that read ``config.json``'s dtype differently.

The base checkpoint is written the way transformers 5 writes one (``config.json`` names ``dtype``, no
``torch_dtype``), in bf16: a merged config that kept the base's ``dtype`` next to our ``torch_dtype`` loaded an fp32
merged model as bf16 in transformers 5.
"""

import json
from pathlib import Path

import pytest
import torch
from _hf_runner import hf_logits
from conftest import TINY_ADAPTER_CONFIG, tiny_trained_state

from torchtune_ext.data import write_tiny_checkpoint

pytestmark = [pytest.mark.integration_test, pytest.mark.stack]

# fp32 logits of ~2.5: both sides compute base + (alpha / rank) * B @ A in another order (see test_hf_peft_interop).
ATOL, RTOL = 2e-5, 1e-5


def _transformers5_base(folder: Path) -> Path:
    write_tiny_checkpoint(folder, family="llama", dtype="bf16", seed=4)
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = config.pop("torch_dtype")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One trained-looking model (random non-zero lora_B), saved as fp32/bf16/fp16 merged models and merged onto
    the original weights; the HF side's logits and reports."""
    tmp = tmp_path_factory.mktemp("merged_dtypes")
    base = _transformers5_base(tmp / "base")
    model, checkpointer, state = tiny_trained_state(base, tmp / "out", "llama")
    folders = {}
    for step, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        folders[dtype] = checkpointer.save(state, step, TINY_ADAPTER_CONFIG, save_merged=True, dtype=dtype) / "merged"
    original = checkpointer.save(state, 9, TINY_ADAPTER_CONFIG, True, torch.float32, merge_base="original")
    input_ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    runs = [{"name": str(dtype), "model": str(folder), "dtype": "auto"} for dtype, folder in folders.items()]
    runs += [
        {"name": "merged_original", "model": str(original / "merged")},
        {"name": "peft_on_original", "model": str(base), "adapter": str(original / "adapter")},
    ]
    logits, report = hf_logits(input_ids, runs, tmp / "hf")
    with torch.no_grad():
        ours = model(input_ids).float()
    return logits, report, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merged_model_loads_in_the_dtype_it_was_saved_in(saved, dtype):
    logits, report, ours = saved
    assert report[str(dtype)]["dtype"] == str(dtype), report[str(dtype)]
    if dtype == torch.float32:
        torch.testing.assert_close(logits[str(dtype)], ours, atol=ATOL, rtol=RTOL)


def test_merge_base_original_is_the_adapter_on_the_original_base(saved):
    """``merge_base="original"`` gives PEFT's model (the original base + the adapter), not the trained NF4 model;
    the gap between the two is the NF4 rounding of the base."""
    logits, _, ours = saved
    torch.testing.assert_close(logits["merged_original"], logits["peft_on_original"], atol=ATOL, rtol=RTOL)
    gap = (logits["merged_original"] - ours).abs()
    print(f"merge_base original vs nf4 (the trained model): max |logit gap| {gap.max():.3e}, mean {gap.mean():.3e}")
    assert gap.max() > 100 * ATOL

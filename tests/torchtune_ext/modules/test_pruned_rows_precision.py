"""Vocab-pruned rows trained in fp32 on a bf16 base go into the PEFT adapter in fp32 (as the LoRA weights keep
their training precision); peft loads them, and the merged rows (ours and peft's) are the trained rows cast once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchtune_ext.data import write_tiny_checkpoint
from torchtune_ext.modules import export_full_vocab_state_dict

pytestmark = pytest.mark.integration_test

ROOT = Path(__file__).resolve().parents[3]
TUNE = Path(sys.executable).parent / "tune"
ROWS_KEY = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"

# transformers + peft in a fresh process (nothing of ours imported): load the bf16 base, the adapter, merge.
_PEFT_SIDE = """
import sys, torch, transformers
from peft import PeftModel
base, adapter, out = sys.argv[1:]
dtype_arg = "torch_dtype" if int(transformers.__version__.split(".")[0]) < 5 else "dtype"
model = transformers.AutoModelForCausalLM.from_pretrained(base, **{dtype_arg: torch.bfloat16})
peft_model = PeftModel.from_pretrained(model, adapter)
delta = dict(peft_model.named_parameters())[
    "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"]
merged = peft_model.merge_and_unload()
torch.save({"delta_dtype": str(delta.dtype), "embedding": merged.get_input_embeddings().weight.detach()}, out)
"""


def test_export_keeps_fp32_rows_over_a_bf16_base():
    base = {"tok_embeddings.weight": torch.randn(10, 4).to(torch.bfloat16)}
    rows = torch.randn(3, 4) * 1e-3 + 1  # not representable in bf16
    full = export_full_vocab_state_dict({"tok_embeddings.weight": rows}, base, [7, 0, 4])["tok_embeddings.weight"]
    assert full.dtype == torch.float32
    assert torch.equal(full[[7, 0, 4]], rows)
    others = [i for i in range(10) if i not in (7, 0, 4)]
    assert torch.equal(full[others], base["tok_embeddings.weight"][others].float())


def test_recipe_adapter_carries_fp32_rows_and_peft_merges_them_cast_once(tmp_path):
    base = write_tiny_checkpoint(tmp_path / "base", family="llama", dtype="bf16", seed=0)
    out = tmp_path / "run"
    cmd = [
        str(TUNE), "run", "recipes/qlora_finetune_single_device.py",
        "--config", str(ROOT / "configs" / "tiny" / "qlora_single_device.yaml"),
        f"output_dir={out}", f"checkpointer.checkpoint_dir={base}", "generate_base_checkpoint.dtype=bf16",
        "dtype=bf16", "vocab_pruning.enabled=True", "max_steps_per_epoch=2", "batch_size=4",
        "gradient_accumulation_steps=1", "run_val_every_n_steps=null", "optimizer.lr=1e-2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]

    state = torch.load(out / "recipe_state" / "recipe_state.pt", map_location="cpu", weights_only=False)
    kept = torch.as_tensor(state["kept_ids"], dtype=torch.long)
    trained = next(v for k, v in state["adapter"].items() if k.endswith("weight") and v.shape[0] == len(kept))
    assert trained.dtype == torch.float32
    step = out / "step_2"
    rows = load_file(step / "adapter" / "adapter_model.safetensors")[ROWS_KEY]
    assert rows.dtype == torch.float32 and torch.equal(rows, trained)
    assert not torch.equal(rows, rows.to(torch.bfloat16).float())  # the check could fail: fp32 precision is kept
    merged = {k: v for f in (step / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(merged["model.embed_tokens.weight"][kept], trained.to(torch.bfloat16))
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == {"embed_tokens": kept.tolist()}

    peft_out = tmp_path / "peft.pt"
    side = subprocess.run(
        [sys.executable, "-c", _PEFT_SIDE, str(base), str(step / "adapter"), str(peft_out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert side.returncode == 0, side.stderr[-6000:]
    peft = torch.load(peft_out, weights_only=False)
    assert peft["delta_dtype"] == "torch.float32"
    assert torch.equal(peft["embedding"][kept], trained.to(torch.bfloat16))

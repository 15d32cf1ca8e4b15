"""The base load walks the model once and reads the checkpoint in bounded chunks: any chunk size gives the same model
as torchtune's loader path (one tensor per chunk), and the model's parameter map is built once per load."""

import pytest
import torch

from torchtune_ext.checkpoint import QLoRAHFCheckpointer, load_base_
from torchtune_ext.data import write_tiny_checkpoint
from torchtune_ext.distributed import _state_dict_load
from torchtune_ext.models import qlora_tiny_qwen
from torchtune_ext.nf4 import NF4Tensor, dequantize_nf4

LORA = dict(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base") / "qwen", family="qwen", dtype="bf16", seed=5)


def _load(base, tmp_path, chunk_bytes):
    model = qlora_tiny_qwen(**LORA, dtype=torch.bfloat16, device="meta")
    checkpointer = QLoRAHFCheckpointer(str(base), str(tmp_path / "out"), "QWEN2")
    checkpointer.validate(model)
    load_base_(model, checkpointer, torch.device("cpu"), chunk_bytes=chunk_bytes)
    return model, checkpointer


def _dense(value):
    return dequantize_nf4(value) if isinstance(value, NF4Tensor) else value


@pytest.mark.parametrize("chunk_bytes", [1, 4096, 1 << 30])
def test_any_chunk_size_loads_the_same_model(base, tmp_path, chunk_bytes, monkeypatch):
    walks = []
    walk = _state_dict_load.model_entries
    monkeypatch.setattr(_state_dict_load, "model_entries", lambda *a, **k: walks.append(1) or walk(*a, **k))
    model, checkpointer = _load(base, tmp_path, chunk_bytes)
    assert len(walks) == 1  # one key -> parameter map, whatever the number of chunks
    n_chunks = len(checkpointer.chunk_plan(chunk_bytes))
    assert n_chunks > 1 if chunk_bytes <= 4096 else n_chunks == 1

    reference, _ = _load(base, tmp_path, 0)  # one tensor per chunk
    base_keys = [k for k in reference.state_dict() if "lora_" not in k]
    got, expected = model.state_dict(), reference.state_dict()
    for key in base_keys:
        assert type(got[key]) is type(expected[key]), key
        assert torch.equal(_dense(got[key]), _dense(expected[key])), key
    # An independent reference for a dense tensor: the file's own bytes.
    assert torch.equal(got["tok_embeddings.weight"], checkpointer.read_tensor("tok_embeddings.weight"))

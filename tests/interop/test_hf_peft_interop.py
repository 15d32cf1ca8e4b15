"""Our exported checkpoints in transformers and peft, in the environment we train in (see ``_hf_runner.py``).

Cases: the tiny Llama-style model (q/k rows permuted between torchtune and HF, Llama 3 RoPE scaling, tied
embeddings), the same with DoRA (magnitudes follow the q/k permutation), the tiny Qwen-style model (q/k/v biases,
no permutation, tied embeddings), all through the single-device recipe, and the Llama-style model through the
distributed recipe (2 gloo ranks) with vocab pruning, whose export must have the full vocabulary again, and an
untied Llama-style model with vocab pruning (pruned ``lm_head`` rows, exported as PEFT trainable tokens). Each
recipe trains a few fp32 steps with LoRA on every attention and MLP projection and saves the PEFT adapter and the
merged model. Then:

- reference: our QLoRA model in fp32, its NF4 base loaded from the base checkpoint and its adapters (and pruned
  rows) from the recipe state (torchtune keys, not the exported files), on fixed token ids;
- transformers' ``AutoModelForCausalLM`` on the merged folder gives the same logits;
- ``peft.PeftModel.from_pretrained`` puts the adapter on the base the adapter was trained on, the NF4 base
  dequantized (our checkpointer's merged export before training, adapters zero), and gives the same logits.

Tolerance: 2e-5 absolute + 1e-5 relative on logits of magnitude ~2.5. Both sides compute the same fp32 function,
dequantized NF4 base + (alpha / rank) * B @ A, differing only in the order of fp32 operations (merged matrix
vs. a separate low-rank path, HF's rotate-half RoPE on permuted rows vs. torchtune's interleaved RoPE), which
measures 1e-6 to 6e-6 here. The adapter changes the logits by ~1, dropping the Llama 3 RoPE scaling from
``config.json`` by ~1.5e-3 at these 128 positions, un-permuting the q/k lora_B by ~1.5e-2, so wrong keys,
permutations, configs or scales fail.

The adapter on the original, unquantized base (the one ``adapter_config.json`` names, as users load it) cannot
match exactly: that base differs from the NF4 one by the quantization error QLoRA trains around.
"""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import pytest
import torch
from _hf_runner import ROOT, hf_logits
from conftest import run_recipe_in_process
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file

pytestmark = [pytest.mark.integration_test, pytest.mark.stack]

TUNE = Path(sys.executable).parent / "tune"
STEPS = 3
SEQ_LEN = 128
ATOL, RTOL = 2e-5, 1e-5
RUN_TIMEOUT_S = 300


@dataclass(frozen=True)
class Case:
    """A recipe run to export from: recipe, config, overrides, processes, whether it prunes the vocabulary."""

    recipe: str
    config: str
    overrides: Tuple[str, ...] = ()
    nproc: int = 0
    vocab_pruned: bool = False


_SINGLE = ("recipes/qlora_finetune_single_device.py", "configs/tiny/qlora_single_device.yaml")
_DISTRIBUTED = ("recipes/qlora_finetune_distributed.py", "configs/tiny/qlora_distributed.yaml")
CASES: Dict[str, Case] = {
    "llama": Case(*_SINGLE),
    "llama_dora": Case(*_SINGLE, ("model.use_dora=True",)),
    "qwen": Case(
        *_SINGLE,
        (
            "generate_base_checkpoint.family=qwen",
            "model._component_=torchtune_ext.models.qlora_tiny_qwen",
            "checkpointer.model_type=QWEN2",
        ),
    ),
    "llama_vocab_pruned": Case(
        *_DISTRIBUTED, ("vocab_pruning.enabled=True", "process_group_timeout_s=60"), nproc=2, vocab_pruned=True
    ),
    # An untied output (as Llama 3.1 8B): the pruned lm_head rows train too and export as lm_head trainable tokens.
    "llama_untied_vocab_pruned": Case(
        *_SINGLE,
        (
            "vocab_pruning.enabled=True",
            "model.tie_word_embeddings=False",
            "generate_base_checkpoint.tie_word_embeddings=False",
        ),
        vocab_pruned=True,
    ),
}


@dataclass
class Export:
    """One case's recipe run, exported folders, our logits and transformers' / peft's."""

    case: Case
    run_dir: Path
    base_dir: Path
    cfg: DictConfig
    ours: torch.Tensor
    ours_untrained: torch.Tensor
    kept_ids: Optional[torch.Tensor]
    hf: Dict[str, torch.Tensor]
    report: Dict[str, Any]

    @property
    def adapter_dir(self) -> Path:
        return self.run_dir / f"step_{STEPS}" / "adapter"

    @property
    def merged_dir(self) -> Path:
        return self.run_dir / f"step_{STEPS}" / "merged"

    def on_ours_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits restricted to our model's outputs (the kept ids, in order, when pruned)."""
        return logits if self.kept_ids is None else logits[..., self.kept_ids]


def _train(case: Case, out: Path, base: Path) -> DictConfig:
    """A few fp32 steps at full LR from step 1 (no warmup), so lora_B is clearly non-zero."""
    args = [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",
        "dtype=fp32",
        f"max_steps_per_epoch={STEPS}",
        "lr_scheduler.num_warmup_steps=0",
        "dataset.num_samples=256",
        "dataset_val.num_samples=16",
        "run_val_every_n_steps=null",
        "tokenizer.max_seq_len=48",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs",
        *case.overrides,
    ]
    if case.nproc:
        result = subprocess.run(
            [str(TUNE), "run", "--nproc_per_node", str(case.nproc), case.recipe, "--config", case.config, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert result.returncode == 0, f"recipe run failed (rc {result.returncode}):\n{result.stderr[-6000:]}"
    else:
        run_recipe_in_process(ROOT / case.recipe, ["--config", case.config, *args], cwd=ROOT)
    return OmegaConf.merge(OmegaConf.load(ROOT / case.config), OmegaConf.from_dotlist(args))


@torch.no_grad()
def _ours(cfg: DictConfig, run_dir: Path, input_ids: torch.Tensor, kept_ids: Optional[torch.Tensor]):
    """Our fp32 QLoRA model's logits before and after training, and the dequantized base folder.

    The NF4 base comes from the base checkpoint through our streaming loader; the trained adapters (and pruned
    rows) from the recipe state in torchtune keys. Saving the merged model while the adapters are still zero
    writes the dequantized NF4 base: the base the adapter was trained on.
    """
    from torchtune import config

    from torchtune_ext.checkpoint import QLoRAHFCheckpointer, load_base_
    from torchtune_ext.distributed import get_full_state_dict
    from torchtune_ext.models import init_adapters_
    from torchtune_ext.modules import prune_vocab_

    device = torch.device("cpu")
    model = config.instantiate(cfg.model, dtype=torch.float32, adapter_dtype=torch.float32, device="meta")
    checkpointer = QLoRAHFCheckpointer(
        cfg.checkpointer.checkpoint_dir, str(run_dir / "dequantized"), cfg.checkpointer.model_type
    )
    checkpointer.validate(model)
    load_base_(model, checkpointer, device)
    init_adapters_(model, device)
    model.eval()
    untrained = model(input_ids)
    # Only the merged folder of this save is used; the adapter config does not matter for it.
    adapter_config = dict(
        target_modules=["q_proj"], rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha, dropout=0.0, use_dora=False
    )
    state = get_full_state_dict(model, keep_nf4=True, cpu_offload=False)
    dequantized = checkpointer.save(state, 0, adapter_config, save_merged=True, dtype=torch.float32) / "merged"

    if kept_ids is not None:
        prune_vocab_(model, kept_ids, dtype=torch.float32)
    state = torch.load(run_dir / "recipe_state" / "recipe_state.pt", map_location="cpu", weights_only=False)
    params = dict(model.named_parameters())
    assert set(state["adapter"]) <= set(params), sorted(set(state["adapter"]) - set(params))[:4]
    for name, value in state["adapter"].items():
        params[name].copy_(value)
    return model(input_ids), untrained, dequantized


@pytest.fixture(scope="module", params=list(CASES))
def export(request, tmp_path_factory) -> Export:
    case = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    run_dir, base_dir = tmp / "run", tmp / "base"
    cfg = _train(case, run_dir, base_dir)

    generator = torch.Generator().manual_seed(0)
    kept_ids = None
    if case.vocab_pruned:
        kept_ids = torch.load(run_dir / "recipe_state" / "recipe_state.pt", weights_only=False)["kept_ids"]
        kept_ids = torch.as_tensor(kept_ids, dtype=torch.long)
        input_ids = kept_ids[torch.randint(0, len(kept_ids), (2, SEQ_LEN), generator=generator)]
    else:
        vocab_size = load_file(base_dir / "model.safetensors")["model.embed_tokens.weight"].shape[0]
        input_ids = torch.randint(0, vocab_size, (2, SEQ_LEN), generator=generator)
    ours, untrained, dequantized = _ours(cfg, run_dir, input_ids, kept_ids)

    adapter, merged = run_dir / f"step_{STEPS}" / "adapter", run_dir / f"step_{STEPS}" / "merged"
    runs = [
        {"name": "merged", "model": str(merged)},
        {"name": "peft", "model": str(dequantized), "adapter": str(adapter)},
        {"name": "peft_recorded_base", "model": None, "adapter": str(adapter)},
        {"name": "original_base", "model": str(base_dir)},
    ]
    hf, report = hf_logits(input_ids, runs, tmp / "hf")
    return Export(case, run_dir, base_dir, cfg, ours, untrained, kept_ids, hf, report)


def test_adapter_is_trained_and_changes_the_logits(export):
    adapter = load_file(export.adapter_dir / "adapter_model.safetensors")
    lora_b = {k: v for k, v in adapter.items() if k.endswith("lora_B.weight")}
    num_layers = OmegaConf.load(export.base_dir / "config.json").num_hidden_layers
    per_layer = len(export.cfg.model.lora_attn_modules) + 3 * bool(export.cfg.model.apply_lora_to_mlp)
    assert len(lora_b) == num_layers * per_layer, sorted(lora_b)
    assert all(v.abs().max() > 0 for v in lora_b.values()), "some lora_B are zero: the checks could not fail"
    # The adapter moves the logits by far more than the tolerance, so a dropped or misplaced adapter fails.
    changed = (export.ours - export.on_ours_vocab(export.ours_untrained)).abs().max()
    assert changed > 1000 * ATOL
    # Vocab pruning trains the kept embedding rows: the adapter carries them as PEFT trainable tokens.
    indices = OmegaConf.to_container(OmegaConf.load(export.adapter_dir / "adapter_config.json")).get(
        "trainable_token_indices"
    )
    if export.kept_ids is None:
        assert indices is None
    else:
        assert _tied(export) == ("model.tie_word_embeddings=False" not in export.case.overrides)
        modules = ["embed_tokens"] + ([] if _tied(export) else ["lm_head"])
        assert indices == {name: export.kept_ids.tolist() for name in modules}
        hidden_size = OmegaConf.load(export.base_dir / "config.json").hidden_size
        for name in modules:
            prefix = "base_model.model." + ("model." if name == "embed_tokens" else "")
            rows = adapter[f"{prefix}{name}.token_adapter.trainable_tokens_delta"]
            assert rows.shape == (len(export.kept_ids), hidden_size)
            assert rows.abs().max() > 0


def _tied(export: Export) -> bool:
    return OmegaConf.load(export.base_dir / "config.json").tie_word_embeddings


def test_merged_folder_is_a_plain_full_vocabulary_hf_checkpoint(export):
    names = {p.name for p in export.merged_dir.iterdir()}
    assert not {n for n in names if n.startswith("adapter_")}, names  # transformers would apply them again
    index = OmegaConf.to_container(OmegaConf.load(export.merged_dir / "model.safetensors.index.json"))
    shards = set(index["weight_map"].values())
    assert shards and shards <= names and "config.json" in names
    report, base = export.report["merged"], export.report["original_base"]
    assert report["tied"] == base["tied"] == _tied(export) and report["dtype"] == "torch.float32"
    assert report["vocab_size"] == base["vocab_size"]
    if export.kept_ids is not None:
        assert len(export.kept_ids) < base["vocab_size"]


def test_merged_model_in_transformers_matches_ours(export):
    torch.testing.assert_close(export.on_ours_vocab(export.hf["merged"]), export.ours, atol=ATOL, rtol=RTOL)


def test_peft_adapter_on_the_dequantized_base_matches_ours(export):
    torch.testing.assert_close(export.on_ours_vocab(export.hf["peft"]), export.ours, atol=ATOL, rtol=RTOL)


def test_peft_adapter_on_the_recorded_base(export):
    """The base that ``adapter_config.json`` names is the one we trained from; the adapter on it (loaded strictly)
    moves transformers' logits the way it moves ours. Not equal: the unquantized base differs from the NF4 base
    the adapter was trained on (on this random-init model by ~0.3 in the logits, about as much as the adapter
    moves them), so the two adapter effects differ by ~20%; a misplaced adapter differs by ~100% or more."""
    assert Path(export.report["peft_recorded_base"]["folder"]).resolve() == export.base_dir.resolve()
    hf_effect = export.on_ours_vocab(export.hf["peft_recorded_base"] - export.hf["original_base"])
    our_effect = export.ours - export.on_ours_vocab(export.ours_untrained)
    assert (hf_effect - our_effect).norm() < 0.5 * our_effect.norm()

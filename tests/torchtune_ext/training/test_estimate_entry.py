"""The memory estimate takes the recipe whose step it runs: the library's ``QLoRARecipe`` has no step (the recipe
file holds it), so estimating it fails at once with an error that names the class to estimate, and that class
estimates."""

import pytest
from omegaconf import DictConfig, OmegaConf

import torchtune_ext.training._dry_run as dry_run
from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipe
from torchtune_ext.training import QLoRARecipe

TINY_CONFIG = "configs/tiny/qlora_single_device.yaml"
THE_FIX = r"from recipes\.qlora_finetune_single_device import QLoRAFinetuneRecipe"


def _cfg() -> DictConfig:
    """The tiny config's dry run, without a checkpoint (a bf16 one is assumed)."""
    overrides = ["dry_run=True", "checkpointer.checkpoint_dir=/nonexistent/torchtune_ext_estimate_entry"]
    return OmegaConf.merge(OmegaConf.load(TINY_CONFIG), OmegaConf.from_dotlist(overrides))


def test_the_library_class_is_refused_before_anything_is_built(monkeypatch):
    cfg = _cfg()
    for name in ("build_qlora_model", "dry_run_target"):
        monkeypatch.setattr(dry_run, name, lambda *a, name=name: pytest.fail(f"{name} ran for a recipe without a step"))
    recipe = QLoRARecipe(cfg)
    missing = r"\(no forward_backward or optimizer_step\)"
    with pytest.raises(TypeError, match=rf"^QLoRARecipe has no training step to estimate {missing}.*{THE_FIX}"):
        recipe.memory_estimator(cfg)
    with pytest.raises(TypeError, match=rf"^QLoRARecipe has no training step .*{THE_FIX}"):
        recipe.dry_run(cfg)


def test_a_copy_without_its_update_is_told_which_method_is_missing():
    class HalfCopied(QLoRARecipe):
        def forward_backward(self, batch):
            raise AssertionError("not run")

    cfg = _cfg()
    with pytest.raises(TypeError, match=r"^HalfCopied has no training step to estimate \(no optimizer_step\)"):
        HalfCopied(cfg).memory_estimator(cfg)


def test_the_class_the_error_names_estimates():
    cfg = _cfg()
    estimate = QLoRAFinetuneRecipe(cfg).memory_estimator(cfg).estimate(1, 32)
    assert (estimate.batch_size, estimate.seq_len) == (1, 32)
    assert estimate.peak_bytes > 0

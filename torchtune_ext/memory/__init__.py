"""Know before you start whether it fits: the peak device memory of a QLoRA training step, without a GPU.

:class:`MemoryEstimator` runs a recipe's own training step
(forward on padded sequences, loss, backward, optimizer step) on fake CPU tensors of a model built on the meta
device, counts every storage the ops create and free, and reports the peak as ``torch.cuda.max_memory_allocated``
would, with a breakdown at the peak and allowances for what torch's allocator does not count.

The model, its set-up, the loss, the optimizer and the step are all arguments, and the set-up and step are
required: an estimate runs a recipe's own code, never an imitation of it. The step lives in the recipe file, so the
estimate takes the recipe (the file's class, or a copy's) as an argument: :func:`recipe_step_estimator` runs its
``forward_backward`` / ``optimizer_step`` on its own copy of the recipe (a subclass's overrides included), never
rewriting the live recipe, and :func:`per_rank_dry_run` takes the class to build each rank's. The recipe file's
class hands its own over in ``memory_estimator(cfg)``: the model built from the config's ``model:`` section on meta,
prepared as for training (trainable adapters, activation checkpointing, the loss, activation offloading as
:class:`OffloadedActivations`), and the file's step with its configured optimizer, so that its settings (16-bit
frozen weights under fp32, a loss that never holds the logits, activation offloading) show in the estimate without
changes here. The library's ``torchtune_ext.training.QLoRARecipe`` has no step: estimating it raises a ``TypeError``
that names the class to estimate (:func:`check_recipe_step`). From the command line, ``dry_run=True`` prints it::

    tune run recipes/qlora_finetune_single_device.py --config configs/llama3_1/8B_qlora_single_device.yaml \
        dry_run=True dtype=fp32 device_memory_gb=15

or from Python in a clone (after a ``pip install`` the file is ``torchtune_ext.recipes.qlora_finetune_single_device``;
``dry_run=True`` skips the checks of a device this machine does not have)::

    from omegaconf import OmegaConf
    from recipes.qlora_finetune_single_device import QLoRAFinetuneRecipe

    cfg = OmegaConf.merge(OmegaConf.load("configs/llama3_1/8B_qlora_single_device.yaml"),
                          OmegaConf.from_dotlist(["dry_run=True", "dtype=fp32", "enable_activation_offloading=True"]))
    estimator = QLoRAFinetuneRecipe(cfg).memory_estimator(cfg)
    print(estimator.estimate(batch_size=1, seq_len=2048))
    estimator.max_seq_len_that_fits(16)  # GiB

Passing ``model=`` (a real model materialized from the same ``model:`` section) runs the same step on real CPU
tensors, counted the same way: the estimate's validation. torchtune's own recipe, the peer the benchmarks compare
against, is here as :func:`torchtune_qlora_model`, :func:`torchtune_setup`, :func:`torchtune_train_step` and
``adamw_factory(trainable_only=False)``; :class:`TorchtuneStep` is its set-up and step with its activation offloading
(the output head kept on the device) and packed batches (``input_pos`` and a flex attention ``BlockMask``)::

    from torchtune.models.llama3_1 import lora_llama3_1_8b

    model = torchtune_qlora_model(lora_llama3_1_8b, torch.bfloat16, lora_attn_modules=["q_proj", "v_proj"])
    estimator = MemoryEstimator(model, train_step=torchtune_train_step, setup=torchtune_setup,
                                optimizer_factory=adamw_factory(trainable_only=False))

Host reads of fake values in a step (``.item()``, ``bool()``, ``float()``) return placeholders (True, 1, 0.0).
"""

from torchtune_ext.memory._compiled import compile_for_estimate, compiled_setup, materialized_nodes
from torchtune_ext.memory._devices import DEFAULT_HEADROOM, PROFILES, DeviceProfile, device_profile, fits_line
from torchtune_ext.memory._dry_run import (
    DryRunTarget,
    HostMemory,
    RankHost,
    collect_rank_hosts,
    dry_run_target,
    fit_report,
    host_report,
    host_total,
    loading_bytes,
    longest_fitting_seq_len,
    pinned_bytes,
    process_bytes,
)
from torchtune_ext.memory._estimate import GIB, DeviceAllowance, MemoryEstimate
from torchtune_ext.memory._estimator import MemoryEstimator
from torchtune_ext.memory._fake import accelerator_code_path, to_fake_model
from torchtune_ext.memory._offload import OffloadedActivations
from torchtune_ext.memory._per_rank import dry_run_world_size, fake_process_group, per_rank_dry_run
from torchtune_ext.memory._recipe_step import RecipeStep, check_recipe_step, recipe_step_estimator
from torchtune_ext.memory._steps import (
    OptimizerFactory,
    Setup,
    TorchtuneStep,
    TrainStep,
    adamw_factory,
    flex_or_sdpa_attention,
    packed_batch,
    torchtune_qlora_model,
    torchtune_setup,
    torchtune_train_step,
)
from torchtune_ext.memory._tracker import CATEGORIES, LiveStorageTracker, TrackerResult, count_as_host
from torchtune_ext.memory._workspace import flex_attention_backward_workspace, pinned_block_bytes

__all__ = [
    "pinned_bytes",
    "host_total",
    "host_report",
    "collect_rank_hosts",
    "compile_for_estimate",
    "compiled_setup",
    "materialized_nodes",
    "RankHost",
    "CATEGORIES",
    "DEFAULT_HEADROOM",
    "GIB",
    "PROFILES",
    "DeviceAllowance",
    "DeviceProfile",
    "DryRunTarget",
    "HostMemory",
    "LiveStorageTracker",
    "MemoryEstimate",
    "MemoryEstimator",
    "OffloadedActivations",
    "OptimizerFactory",
    "RecipeStep",
    "Setup",
    "TorchtuneStep",
    "TrainStep",
    "TrackerResult",
    "flex_or_sdpa_attention",
    "packed_batch",
    "accelerator_code_path",
    "check_recipe_step",
    "adamw_factory",
    "count_as_host",
    "flex_attention_backward_workspace",
    "fake_process_group",
    "device_profile",
    "dry_run_world_size",
    "dry_run_target",
    "fit_report",
    "fits_line",
    "loading_bytes",
    "per_rank_dry_run",
    "longest_fitting_seq_len",
    "pinned_block_bytes",
    "process_bytes",
    "recipe_step_estimator",
    "to_fake_model",
    "torchtune_qlora_model",
    "torchtune_setup",
    "torchtune_train_step",
]

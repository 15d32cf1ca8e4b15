"""QLoRA fine-tuning on N ranks with FSDP2: ``recipes/qlora_finetune_single_device.py`` under torchtune's
distributed name.

That file is the whole recipe, for any world size (one device without a launcher, FSDP2 on every rank under one);
this entry point runs it by path (not by import: a recipe never imports another, which would load one file under two
module names) and asks for a launcher::

    tune run --nproc_per_node 2 recipes/qlora_finetune_distributed.py --config configs/tiny/qlora_distributed.yaml
    tune run --nproc_per_node 8 recipes/qlora_finetune_distributed.py --config configs/llama3_1/8B_qlora.yaml

``dry_run=True`` needs no launcher: it estimates each of ``world_size`` ranks (default 2) in one process. To hack
the recipe, copy the file that holds it (``tune-ext cp qlora_finetune_distributed my_recipe.py`` copies it too).
"""

import runpy
import sys
from pathlib import Path

from omegaconf import DictConfig

from torchtune_ext.config import exit_on_config_error, parse, recipe_setting
from torchtune_ext.distributed import launched_world_size

_RECIPE = runpy.run_path(str(Path(__file__).with_name("qlora_finetune_single_device.py")))
QLoRAFinetuneRecipeDistributed = _RECIPE["QLoRAFinetuneRecipe"]


@exit_on_config_error("qlora_finetune_distributed")  # a config error: one line, exit code 2
@parse  # torchtune's config.parse, with overrides whose value holds "="
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run --nproc_per_node N recipes/qlora_finetune_distributed.py --config <yaml> [k=v ...]``."""
    if not recipe_setting(cfg, "dry_run"):
        launched_world_size()  # started by a launcher, else an error that says how
    _RECIPE["main"](cfg, distributed=True)


if __name__ == "__main__":
    sys.exit(recipe_main())

"""Evaluation with EleutherAI's lm-eval harness of the model as it trained (the base checkpoint streamed into NF4 plus
the run's PEFT LoRA adapter folder) or of a merged HF folder (``merged_dir=``, e.g. ``tune-ext merge``'s output), in
fp32, fp16 or bf16 on the configured device::

    tune run recipes/eleuther_eval.py --config configs/tiny/eleuther_eval.yaml tasks=[<task>] include_path=<dir>
    tune run recipes/eleuther_eval.py --config configs/llama3_2/1B_eleuther_eval.yaml \
        adapter_dir=<run>/step_N/adapter tasks=[arc_easy,hellaswag] limit=200
    tune-ext run eleuther_eval --config llama3_2/1B_eleuther_eval merged_dir=<merged folder> dtype=fp16

Any lm-eval task (``tasks``; local task YAMLs from ``include_path``), ``num_fewshot``, ``limit``; the results table
is printed and ``output_file`` gets lm-eval's results JSON with every sample's scores. Needs the ``eval`` extra
(``pip install 'torchtune_ext[eval]'``). A missing or mismatched adapter fails before any weight is read.
"""

import sys

from omegaconf import DictConfig
from torchtune import config

from torchtune_ext.config import exit_on_config_error, parse
from torchtune_ext.evaluation import run_eleuther_eval


@exit_on_config_error("eleuther_eval")  # a config error: one line, exit code 2
@parse  # torchtune's config.parse, with overrides whose value holds "=" (prompt="2+2=?")
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run recipes/eleuther_eval.py --config <yaml> [key=value ...]``."""
    config.log_config(recipe_name="EleutherEvalRecipe", cfg=cfg)
    run_eleuther_eval(cfg)


if __name__ == "__main__":
    sys.exit(recipe_main())

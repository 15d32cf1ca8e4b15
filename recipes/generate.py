"""Generation with the model as it trained: the base checkpoint streamed into NF4 plus the run's PEFT LoRA adapter
(or one that PEFT or Unsloth wrote for a supported model), in fp32, fp16 or bf16, with KV caches::

    tune run recipes/generate.py --config configs/tiny/generation.yaml
    tune run recipes/generate.py --config configs/llama3_2/1B_generation.yaml adapter_dir=<run>/step_N/adapter \
        prompt="Write a haiku about GPUs" temperature=0.7 top_p=0.9 seed=0
    tune-ext generate --config tiny/generation prompts_file=prompts.jsonl answers_file=answers.jsonl
    tune-ext chat --config tiny/generation

Greedy (``temperature=0``, the default) or sampled (``temperature``, ``top_k``, ``top_p``, ``seed``) decoding for
``max_new_tokens`` at most, stopping at EOS or at one of ``stop`` (strings; the answer is cut before them). String
prompts go through the tokenizer's chat template (``chat=True``, default) or are encoded as they are
(``chat=False``); a JSONL ``prompts_file`` holds ``{"prompt": ...}`` or ``{"messages": [...]}`` per line (its
prompts replace the config's ``prompt``) and ``answers_file`` gets one record per prompt. Prints tokens/s and the
peak memory. ``dry_run=True`` prints the weights' and the KV caches' memory at the longest length without loading
anything (nor an adapter: the LoRA shape is ``model:``'s). A missing or mismatched adapter (rank, alpha, target
modules, another base model's shapes) and every bad setting fail before any weight is read: one line naming the
key, exit code 2. A command-line value may hold ``=`` (``prompt="2+2=?"``).
"""

import sys

from omegaconf import DictConfig
from torchtune import config

from torchtune_ext.config import exit_on_config_error, parse
from torchtune_ext.generation import run_generation


@exit_on_config_error("generate")  # a config error: one line, exit code 2
@parse  # torchtune's config.parse, with overrides whose value holds "=" (prompt="2+2=?")
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run recipes/generate.py --config <yaml> [key=value ...]``."""
    config.log_config(recipe_name="GenerationRecipe", cfg=cfg)
    run_generation(cfg)


if __name__ == "__main__":
    sys.exit(recipe_main())

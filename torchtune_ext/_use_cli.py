"""``tune-ext generate`` / ``tune-ext chat`` / ``tune-ext merge``: use what a run trained (added to ``tune-ext`` by
``torchtune_ext.cli``)::

    tune-ext generate --config tiny/generation prompt="Reverse: lamp"
    tune-ext chat --config llama3_2/1B_generation adapter_dir=<run>/step_N/adapter
    tune-ext merge --base <hf dir> --adapter <adapter dir> --output <dir> [--merged-dtype bf16] [--merge-base nf4]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Dict

from omegaconf import OmegaConf

DEFAULT_GENERATION_CONFIG = "tiny/generation"


def add_subcommands(subparsers: argparse._SubParsersAction, config_path: Callable[[str], Path]) -> None:
    """Adds ``generate``, ``chat`` and ``merge`` to the ``tune-ext`` parser.

    Args:
        subparsers (argparse._SubParsersAction): the parser's subcommands.
        config_path (Callable[[str], Path]): a config name of ``tune-ext ls`` or a file -> the YAML file.
    """
    helps: Dict[str, str] = {
        "generate": "Answer prompts with the model as it trained (NF4 base + adapter): recipes/generate.py.",
        "chat": "Chat with the model as it trained (the tokenizer's chat template), on the terminal.",
    }
    for mode, text in helps.items():
        sub = subparsers.add_parser(mode, help=text, description=text)
        sub.add_argument("--config", default=DEFAULT_GENERATION_CONFIG, help="a generation config (name or file)")
        sub.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. prompt='...' temperature=0.7")
        sub.set_defaults(func=lambda args, mode=mode: _generate(args, mode, config_path))
    merge = subparsers.add_parser(
        "merge",
        help="Merge a LoRA adapter (ours or PEFT's) into its HF base, shard by shard, without a GPU.",
        description="Merge a LoRA adapter (ours or PEFT's) into its HF base, shard by shard, without a GPU. The "
        "merged folder carries the base's tokenizer and generation config files.",
    )
    merge.add_argument("--base", required=True, help="the base HF model folder (config.json + *.safetensors)")
    merge.add_argument("--adapter", required=True, help="the adapter folder (adapter_config.json + safetensors)")
    merge.add_argument("--output", required=True, help="the merged model's folder (written atomically)")
    merge.add_argument("--merged-dtype", choices=["fp32", "bf16", "fp16"], help="default: the base's own dtype")
    merge.add_argument(
        "--merge-base",
        choices=["nf4", "original"],
        default="nf4",
        help="nf4 (default): onto the NF4-dequantized base, the model as trained; original: onto the base's weights",
    )
    merge.add_argument(
        "--compute-dtype",
        choices=["fp32", "bf16", "fp16"],
        help="the dtype the adapter trained in (the NF4 quantization of --merge-base nf4); default: the base's dtype",
    )
    merge.add_argument("--max-shard-size-mb", type=int, default=4096)
    merge.set_defaults(func=_merge)


def _generate(args: argparse.Namespace, mode: str, config_path: Callable[[str], Path]) -> None:
    from torchtune_ext.generation import run_generation

    cfg = OmegaConf.merge(
        OmegaConf.load(config_path(args.config)), OmegaConf.from_dotlist([*args.overrides, f"mode={mode}"])
    )
    run_generation(cfg)


def _merge(args: argparse.Namespace) -> None:
    from torchtune_ext.export import merge_adapter

    output = merge_adapter(
        args.base,
        args.adapter,
        args.output,
        merged_dtype=args.merged_dtype,
        merge_base=args.merge_base,
        compute_dtype=args.compute_dtype,
        max_shard_size_mb=args.max_shard_size_mb,
    )
    print(
        f"Merged model written to {output}\nNext:\n"
        f'  generate:             transformers.pipeline("text-generation", model={str(output)!r})\n'
        f"  evaluate:             tune-ext run eleuther_eval --config <model>/<size>_eleuther_eval merged_dir={output} "
        "tasks=[...]\n"
        f"  llama.cpp / Ollama:   tune-ext export gguf --model {output} --output {output}.gguf"
    )

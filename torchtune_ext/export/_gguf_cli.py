"""``tune-ext export gguf``: the command line of :func:`torchtune_ext.export.export_gguf`."""

from __future__ import annotations

import argparse

from torchtune_ext.export._gguf import GGUF_TYPES, export_gguf


def add_export_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``export gguf --model <merged HF dir> --output model.gguf --type f16|q8_0|q4_k_m|... [--tokenizer <dir>]``.

    Args:
        subparsers (argparse._SubParsersAction): ``tune-ext``'s subcommands.
    """
    export = subparsers.add_parser("export", help="Export a merged model (GGUF for llama.cpp / Ollama).")
    export.set_defaults(func=lambda args: export.print_help())
    formats = export.add_subparsers(title="formats")
    gguf = formats.add_parser(
        "gguf",
        help="One .gguf file (Llama and Qwen 2 families), tokenizer included.",
        description="Writes a merged HF folder as a GGUF file with llama.cpp's `gguf` package (installed with "
        "torchtune_ext), the metadata llama.cpp's convert_hf_to_gguf.py writes. Vectors and norms stay F32. q4_0, "
        "q5_0 and the k-quants are the f16 file quantized by llama.cpp's quantizer (pip install llama-cpp-python, or "
        "make llama-cpp).",
    )
    gguf.add_argument("--model", required=True, help="the merged HF folder (config.json + *.safetensors)")
    gguf.add_argument("--output", required=True, help="the .gguf file to write")
    gguf.add_argument("--type", default="f16", choices=list(GGUF_TYPES), help="the matrices' type (default: f16)")
    gguf.add_argument(
        "--tokenizer", default=None, help="folder (or file) with tokenizer.model / tokenizer.json; default: --model"
    )
    gguf.set_defaults(func=_export_gguf)


def _export_gguf(args: argparse.Namespace) -> None:
    try:  # a bad flag is a ConfigError: `tune-ext` prints its line and exits 2
        path = export_gguf(args.model, args.output, args.type, args.tokenizer)
    except ImportError as e:  # a missing extra: the install command
        raise SystemExit(f"tune-ext export gguf: {e}") from e
    print(
        f"Wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.type})\nNext:\n"
        f'  llama.cpp: llama-cli -m {path} -p "..."\n'
        f"  Ollama:    a Modelfile with FROM {path.resolve()}, then ollama create <name> -f Modelfile (docs/gguf.md)"
    )

#!/usr/bin/env bash
# Fill ./gpu_wheels/ (git-ignored; or $DEST) with exactly the wheels the lent GPU machine lacks, for its platform
# (CPython $PYTHON_VERSION, default 3.12; manylinux x86_64), plus this project's own wheel. Run here, on the CPU
# machine, before the one device call; bench/gpu.sh installs them there with
# `pip install --no-index --find-links gpu_wheels --no-deps --target`.
#
# What that machine has (the device tool's notes, KINDS.md's package list): Python 3.12, torch 2.11 (CUDA 13) +
# triton, transformers, peft, safetensors, sentencepiece, tiktoken, tensorboard, psutil, pillow, xxhash, pyyaml,
# tqdm, huggingface-hub, fsspec, pyarrow, pandas. What it lacks is WHEELS below: torchtune and what its import chain
# needs (torchdata, datasets and its dill / multiprocess, kagglehub, blobfile), a torchao that runs beside torch
# 2.11, omegaconf 2.4 (which needs no antlr: 2.3 needs antlr4-python3-runtime 4.9, an sdist only), and gguf (ours).
# bench/gpu_rehearsal.sh installs the same list (for this machine's Python) into a target that has only what the
# lent machine has, and runs bench/gpu.sh there: a missing wheel fails its imports.
#
#   bash bench/gpu_wheels.sh && echo then: run(command="bash bench/gpu.sh", carry=["gpu_wheels"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-gpu_wheels}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
WHEELS=(
  torchtune==0.6.1 torchao==0.18.0 omegaconf==2.4.0 torchdata==0.11.0 "datasets>=4,<6" dill multiprocess
  kagglehub kagglesdk blobfile pycryptodomex gguf
)
rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DEST" "${WHEELS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
# setuptools' build warnings go to a log; shown only if the build fails. Build isolation: any Python with pip builds
# it (pyproject.toml needs setuptools>=77; a venv with PyPI's torch 2.11 has an older one).
"$PY" -m pip wheel --quiet --no-deps -w "$DEST" . 2>/tmp/gpu_wheels_build.log ||
  { cat /tmp/gpu_wheels_build.log >&2; exit 1; }
ls -1 "$DEST"
du -sh "$DEST"

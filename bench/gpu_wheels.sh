#!/usr/bin/env bash
# Fill ./gpu_wheels/ (git-ignored) with exactly the wheels the lent GPU machine lacks, for its platform
# (CPython 3.12, manylinux x86_64), plus this project's own wheel. Run here, on the CPU machine, before the one
# device call; bench/gpu.sh installs them there with `pip install --no-index --no-deps --target`.
#
# What that machine has (the device tool's notes): Python 3.12, torch 2.11 (CUDA 13) + triton, transformers, peft,
# safetensors, sentencepiece, tiktoken, tensorboard, pyarrow, pandas. What it lacks is listed in WHEELS below
# (torchtune and everything its import chain needs, a torchao that runs beside torch 2.11, omegaconf 2.4 which
# needs no antlr, psutil and Pillow which torchtune imports). About 13 MB in all; a device call carries 64 MiB.
#
#   bash bench/gpu_wheels.sh && echo then: run(command="bash bench/gpu.sh", carry=["gpu_wheels"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=gpu_wheels
WHEELS=(
  torchtune==0.6.1 torchao==0.18.0 omegaconf==2.4.0 torchdata==0.11.0 "datasets>=4,<6" dill multiprocess xxhash
  kagglehub kagglesdk blobfile pycryptodomex psutil pillow
)
rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DEST" "${WHEELS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
# setuptools' build warnings go to a log; shown only if the build fails.
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DEST" . 2>/tmp/gpu_wheels_build.log ||
  { cat /tmp/gpu_wheels_build.log >&2; exit 1; }
ls -1 "$DEST"
du -sh "$DEST"
echo 'next: run(command="bash bench/gpu.sh", carry=["gpu_wheels"], timeout_s=540)'

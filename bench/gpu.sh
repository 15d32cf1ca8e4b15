#!/usr/bin/env bash
# The one prepared GPU check (the device tool lends 15 minutes of GPU time in all, machine start included): it
# finishes in under 8 minutes (BUDGET seconds; every step has its own `timeout` and the steps stop at the budget), so
# a second try fits. On this CPU machine first:
#
#   bash bench/gpu_wheels.sh      # ./gpu_wheels: the ~16 MB of wheels the GPU machine lacks, plus ours
#   run(command="bash bench/gpu.sh", carry=["gpu_wheels"], timeout_s=540)
#
# There (Python 3.12 at python3, torch 2.11 CUDA, transformers/peft; no registry) it installs the wheels into
# $SITE with `pip install --no-index --no-deps --target` and runs everything with that machine's python3; a generated
# sitecustomize adds $SITE as a site dir, so the `.pth` start-up hook of torchtune_ext runs as in a pip install.
# All output is teed into $OUT/gpu_bench.txt (the folder the device call returns).
#
# Steps, most valuable first: the memory estimate (dry run's) against the measured peak (allocated and reserved) of
# our recipe's step at 2048 tokens (fp32/bf16/fp16) and at 16384 with activation offloading and the tiled MLP; the
# 1B-shaped QLoRA recipe, ours vs torchtune's (tokens/s, peak; seed 001's figure: fp32 ~20% above bf16); NF4
# dequant and linear fwd+bwd vs torchao and dense; the tiny recipe vs torchtune's; the streamed 1B load; generation;
# the 1.5B-shaped load onto the GPU against the read of its file (issue 25: right after the memory steps); last, the
# compiled estimate against compiled steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_bench.txt") 2>&1
BUDGET=${BUDGET:-450}
START=$SECONDS
SITE=${SITE:-/tmp/gpu_site}
CACHE=${CACHE:-/tmp/torchtune_ext_bench}
STEPS=${STEPS:-20}
mkdir -p "$CACHE"

section() { echo; echo "=================== $* ($(date +%T), $((SECONDS - START)) s used of $BUDGET)"; }
# step <max seconds> <command...>: runs it under `timeout`, cut to what is left of the budget; skipped when none is.
step() {
  local max=$1 left=$((BUDGET - (SECONDS - START)))
  shift
  if [ "$left" -lt 15 ]; then echo "SKIPPED (budget spent): $*"; return 0; fi
  [ "$max" -gt "$left" ] && max=$left
  timeout -k 5 "$max" "$@"
  local rc=$?
  [ $rc -eq 0 ] || echo "STEP FAILED rc=$rc (124: timed out after ${max}s): $*"
}

section "install the carried wheels into $SITE"
if [ -d gpu_wheels ]; then
  rm -rf "$SITE" && mkdir -p "$SITE/_boot"
  python3 -m pip install --quiet --no-index --no-deps --target "$SITE" gpu_wheels/*.whl ||
    for whl in gpu_wheels/*.whl; do python3 -m zipfile -e "$whl" "$SITE"; done
  printf 'import site\nsite.addsitedir("%s")\n' "$SITE" > "$SITE/_boot/sitecustomize.py"
  export PYTHONPATH="$SITE/_boot${PYTHONPATH:+:$PYTHONPATH}"
  PY=${PY:-python3}
else
  PY=${PY:-.venv/bin/python}  # a machine with this project's venv
fi
TUNE="$PY -m torchtune._cli.tune"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY -c "import torch, torchao, torchtune, torchtune_ext, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'); print('torchao', torchao.__version__, 'torchtune', torchtune.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" ||
  { echo "imports failed: nothing else can run"; exit 1; }

section "memory: estimate vs measured peak, our recipe's step, 1B-shaped, 2048 tokens (fp32, bf16, fp16)"
step 110 $PY bench/gpu_memory.py --seq 2048 --steps 3 --settings fp32,bf16,fp16 --cache "$CACHE"
section "memory: 16384 tokens with activation offloading + tiled MLP (bf16, fp32)"
step 110 $PY bench/gpu_memory.py --seq 16384 --steps 2 --settings bf16+offload+tiled,fp32+offload+tiled --cache "$CACHE"
section "Qwen2.5-1.5B-shaped load onto the GPU: load / read of its file (issue 25's 1.5x; writes 3.1 GB once)"
step 90 $PY bench/load_scaling.py --device cuda --skip-small --cache "$CACHE/load_scaling"

CKPT="$CACHE/random_qlora_llama3_2_1b"  # written by bench/gpu_memory.py above
DATA="tokenizer._component_=torchtune_ext.data.tiny_tokenizer ~tokenizer.path tokenizer.max_seq_len=512
      dataset._component_=torchtune_ext.data.tiny_instruct_dataset ~dataset.packed batch_size=8
      gradient_accumulation_steps=1 epochs=1 max_steps_per_epoch=$STEPS log_every_n_steps=1
      metric_logger._component_=torchtune.training.metric_logging.StdoutLogger ~metric_logger.log_dir"
metrics() { tr '\r' '\n' | grep -E "^Step|Error|error|peak|tokens" | tail -4; }
for dtype in bf16 fp32 fp16; do
  section "1B-shaped QLoRA recipe, ours, dtype=$dtype ($STEPS steps, batch 8 x <=512 tokens)"
  step 50 $TUNE run recipes/qlora_finetune_single_device.py --config configs/llama3_2/1B_qlora_single_device.yaml \
    checkpointer.checkpoint_dir="$CKPT" checkpointer.checkpoint_files=[model.safetensors] \
    output_dir="$CACHE/ours_1b_$dtype" dtype=$dtype device=cuda $DATA > "$OUT/ours_1b_$dtype.log" 2>&1
  metrics < "$OUT/ours_1b_$dtype.log"
done
for dtype in bf16 fp32; do  # torchtune's recipe rejects fp16
  section "1B-shaped QLoRA, torchtune's lora_finetune_single_device, dtype=$dtype"
  step 50 $TUNE run lora_finetune_single_device --config llama3_2/1B_qlora_single_device \
    checkpointer.checkpoint_dir="$CKPT" checkpointer.checkpoint_files=[model.safetensors] \
    output_dir="$CACHE/torchtune_1b_$dtype" dtype=$dtype device=cuda $DATA > "$OUT/torchtune_1b_$dtype.log" 2>&1
  metrics < "$OUT/torchtune_1b_$dtype.log"
done

section "peers: our step and generation vs PEFT + bitsandbytes NF4 and PEFT LoRA (SmolLM2-135M), ratios"
step 150 $PY bench/peers.py --device cuda --shapes 135m --steps 8 --repeats 1 --prompts 8 --new-tokens 16 --cache "$CACHE"
section "NF4 dequant/quantize and linear fwd+bwd (ours vs torchao vs dense)"
step 40 $PY bench/nf4_dequant.py --device cuda --quick
step 50 $PY bench/nf4_linear.py --device cuda --quick
section "tiny recipe: ours vs torchtune (fp32, bf16)"
step 60 $PY bench/recipe.py --device cuda --dtypes fp32,bf16 --steps 40 --repeats 1
if [ -f configs/tiny/generation.yaml ]; then
  section "generation: the tiny model as it trained (NF4 + adapter), tokens/s"
  step 40 $TUNE run recipes/generate.py --config configs/tiny/generation.yaml device=cuda
fi
section "1B-shaped streamed load: ours vs torchtune (bf16; writes its own checkpoint)"
step 90 $PY bench/load.py --dtypes bf16 --cache "$CACHE"
section "memory: compile=True, the compiled estimate vs measured (bf16 2048; fp16 16384 with offloading)"
step 120 $PY bench/gpu_memory.py --seq 2048 --steps 3 --settings bf16+compile --cache "$CACHE"
step 120 $PY bench/gpu_memory.py --seq 16384 --steps 2 --settings fp16+offload+compile --cache "$CACHE"
section "done"

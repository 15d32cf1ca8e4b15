#!/usr/bin/env bash
# One prepared GPU check for a session that has the device tool (15 minutes of GPU time in all): it must finish in
# under 8 minutes. Run from the repo root on the GPU machine, with the venv carried (`carry: [".venv"]`) or built:
#
#   bash bench/gpu.sh 2>&1 | tee $OUT/gpu_bench.txt
#
# It prints, side by side in each run: the memory estimate (dry_run's) against the measured peak of our recipe's step,
# with activation offloading and the tiled MLP on CUDA; NF4 dequant/quantize and linear fwd+bwd vs torchao and dense on CUDA, the tiny
# recipe vs torchtune's recipe (tokens/s, CUDA peak), the streamed 1B load vs torchtune's, and a Llama-3.2-1B-shaped
# random-weight QLoRA run of our recipe and torchtune's in fp32, bf16 and fp16 (torchtune: fp32/bf16 only, it
# rejects fp16) with peak memory and tokens/s. Seed 001's figure to compare: fp32 QLoRA peaks ~20% above bf16.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TUNE=${TUNE:-.venv/bin/tune}
CACHE=${CACHE:-/tmp/torchtune_ext_bench}
STEPS=${STEPS:-20}
mkdir -p "$CACHE"
nvidia-smi --query-gpu=name,memory.total --format=csv || true

section() { echo; echo "=================== $* ($(date +%T))"; }

section "nf4 dequant/quantize (ours vs torchao)"
timeout 60 $PY bench/nf4_dequant.py --device cuda --quick
section "nf4 linear fwd+bwd (ours vs torchao vs dense)"
timeout 120 $PY bench/nf4_linear.py --device cuda --reps 3 --min-time 0.2
section "tiny recipe: ours vs torchtune (fp32, bf16)"
timeout 120 $PY bench/recipe.py --device cuda --dtypes fp32,bf16 --steps 40 --repeats 1
section "1B-shaped streamed load: ours vs torchtune (bf16)"
timeout 150 $PY bench/load.py --dtypes bf16 --cache "$CACHE"

CKPT="$CACHE/llama3_2_1b_random_bf16"
DATA="tokenizer._component_=torchtune_ext.data.tiny_tokenizer ~tokenizer.path tokenizer.max_seq_len=512
      dataset._component_=torchtune_ext.data.tiny_instruct_dataset ~dataset.packed batch_size=8
      gradient_accumulation_steps=1 epochs=1 max_steps_per_epoch=$STEPS log_every_n_steps=1
      metric_logger._component_=torchtune.training.metric_logging.StdoutLogger ~metric_logger.log_dir"
# per-step metrics (loss, tokens_per_second, peak memory) of the last steps
metrics() { tr '\r' '\n' | grep -E "^Step|Error|error" | tail -4; }
for dtype in fp32 bf16 fp16; do
  section "1B-shaped QLoRA, ours, dtype=$dtype"
  timeout 150 $TUNE run recipes/qlora_finetune_single_device.py --config configs/llama3_2/1B_qlora_single_device.yaml \
    checkpointer.checkpoint_dir="$CKPT" output_dir="$CACHE/ours_1b_$dtype" dtype=$dtype device=cuda $DATA \
    2>&1 | metrics
done
for dtype in fp32 bf16; do
  section "1B-shaped QLoRA, torchtune lora_finetune_single_device, dtype=$dtype"
  timeout 150 $TUNE run lora_finetune_single_device --config llama3_2/1B_qlora_single_device \
    checkpointer.checkpoint_dir="$CKPT" checkpointer.checkpoint_files=[model.safetensors] \
    output_dir="$CACHE/torchtune_1b_$dtype" dtype=$dtype device=cuda $DATA \
    2>&1 | metrics
done
section "memory estimate vs measured, our recipe's step (1B-shaped; offloading and tiled MLP need CUDA)"
timeout 200 $PY bench/gpu_memory.py --seq 2048 --steps 3
timeout 200 $PY bench/gpu_memory.py --seq 16384 --steps 2 --settings bf16+offload+tiled,fp32+offload+tiled
section "done"

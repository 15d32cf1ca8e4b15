#!/usr/bin/env bash
# The one prepared GPU check. The device tool lends 15 minutes of GPU time in all, the machine's start (1-2 min)
# included, so there is one try: the steps run most valuable first, and their time limits add up to under the
# budget (BUDGET, 460 s: with the install, the whole run stays under 8 minutes). On this CPU machine first:
#
#   bash bench/gpu_wheels.sh      # ./gpu_wheels: the wheels the GPU machine lacks (torchtune, torchao, ...) + ours
#   run(command="bash bench/gpu.sh", carry=["gpu_wheels"], timeout_s=540)
#
# There (Python 3.12 at python3, torch 2.11 CUDA, transformers/peft; no registry) it installs the wheels into $SITE
# with `pip install --no-index --find-links gpu_wheels --no-deps --target` and runs everything with that machine's
# python3; a generated sitecustomize adds $SITE as a site dir, so the `.pth` start-up hook of torchtune_ext runs as
# in a pip install. The run reads and writes nothing of the clone's git-ignored folders (outputs/ never travels):
# every checkpoint and output goes to $CACHE. `bash bench/gpu_rehearsal.sh` runs this same file on the CPU at tiny
# sizes (SIZE=tiny DEVICE=cpu) in a target that holds only what the lent machine has plus the same wheels.
#
# Output: $OUT/gpu_bench.txt (the folder the device call returns), one file: every step's output (progress bars
# left out), then a SUMMARY with each step's status and time, and the last lines of every failed step's log.
#
# Steps (limit in seconds at SIZE=full; 451 in all, the budget 460):
#   0. the wheels installed, the imports checked                                                                   40
#   1. memory, the T4 dtypes: estimate vs measured peak of our recipe's step on the Llama-3.2-1B-shaped config at
#      2048 tokens, fp16 and fp32, with the fused AdamW the configs ship (fp16: the loss scaler's scale and skips) 90
#   2. memory with activation offloading (+ tiled MLP) at 16384 tokens, fp16 and fp32                             70
#   3-4. the 1B-shaped recipe end to end (`tune run`, fused AdamW), fp16 then fp32: loss, scale, tokens/s, peak     76
#   5. the 1B-shaped load onto the GPU, ours vs torchtune's recipe set-up (time, GPU and host peak)              40
#   6-7. the tiny default trained, then answering with its adapter (the generation recipe)                        35
#   8. the tiny recipe, ours vs torchtune's lora_finetune_single_device (fp32, bf16; the rehearsal: fp32)        30
#   9-10. NF4 dequantization and linear fwd+bwd, ours vs torchao vs dense                                          35
#   11. compile=True: the compiled estimate vs measured (bf16, 2048)                                             35
# Not here (no time left in one try): the 1.5B-shaped load against its file's read (bench/load_scaling.py --device
# cuda), the 1B recipe against torchtune's, and bench/peers.py (bitsandbytes is not on that machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
BUDGET=${BUDGET:-460}
LIMIT_SCALE=${LIMIT_SCALE:-1}  # the rehearsal's CPU runs each step slower: every limit times this
SIZE=${SIZE:-full}             # full (the GPU run) | tiny (the rehearsal)
DEVICE=${DEVICE:-cuda}
SITE=${SITE:-/tmp/gpu_site}
CACHE=${CACHE:-/tmp/torchtune_ext_bench}
LOGS=${LOGS:-/tmp/gpu_logs}
WHEELS=${WHEELS:-gpu_wheels}
mkdir -p "$OUT" "$CACHE"
rm -rf "$LOGS" && mkdir -p "$LOGS"

if [ "$SIZE" = tiny ]; then
  CONFIG=configs/tiny/qlora_single_device.yaml SEQ=64 LONG_SEQ=256 TRAIN_STEPS=4 VS_STEPS=8 VS_DTYPES=fp32
  NF4="--quick --shape 512x256 --dtypes bf16"
  CKPT="$CACHE/random_qlora_tiny_llama"
  DATA="batch_size=4 gradient_accumulation_steps=1 run_val_every_n_steps=null"
else
  CONFIG=configs/llama3_2/1B_qlora_single_device.yaml SEQ=2048 LONG_SEQ=16384 TRAIN_STEPS=12 VS_STEPS=20
  VS_DTYPES=fp32,bf16 NF4=--quick
  CKPT="$CACHE/random_qlora_llama3_2_1b"
  DATA="tokenizer._component_=torchtune_ext.data.tiny_tokenizer ~tokenizer.path tokenizer.max_seq_len=512
        dataset._component_=torchtune_ext.data.tiny_instruct_dataset ~dataset.packed batch_size=8
        gradient_accumulation_steps=1"
fi
LOG_TO_STDOUT="log_every_n_steps=1 metric_logger._component_=torchtune.training.metric_logging.StdoutLogger
               ~metric_logger.log_dir"
START=$SECONDS
SUMMARY=()
FAILED=()

section() { echo; echo "=================== $* ($(date +%T), $((SECONDS - START)) s used of $BUDGET)"; }
# A step's log without progress bars (tqdm's carriage-return updates), its last 40 lines.
show() { tr '\r' '\n' < "$1" | grep -vE 'it/s\]|s/it\]|^\s*$' | tail -n 40; }

# step <name> <limit seconds> <command...>: runs it under `timeout` (the limit times LIMIT_SCALE, cut to what is left
# of the budget; skipped when under 15 s are left), its output into $LOGS/<name>.log, shown here, its status kept for
# the summary.
step() {
  local name=$1 limit=$(($2 * LIMIT_SCALE)) left=$((BUDGET - (SECONDS - START))) began=$SECONDS rc
  shift 2
  section "$name"
  if [ "$left" -lt 15 ]; then
    echo "SKIPPED (budget spent): $*"
    SUMMARY+=("SKIPPED  $name (budget spent)")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  [ "$1" = bash ] || echo "\$ $*"
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  show "$LOGS/$name.log"
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("ok       $name ($((SECONDS - began)) s of $limit)")
  else
    local why="rc=$rc"
    [ "$rc" -eq 124 ] && why="timed out after $limit s"
    echo "STEP FAILED: $name ($why)"
    SUMMARY+=("FAILED   $name ($why, $((SECONDS - began)) s)")
    FAILED+=("$name")
  fi
}

summary() {
  section "SUMMARY ($SIZE sizes on $DEVICE)"
  printf '%s\n' "${SUMMARY[@]}"
  local name
  for name in "${FAILED[@]}"; do
    echo
    echo "--- last lines of $name:"
    tr '\r' '\n' < "$LOGS/$name.log" | grep -v '^\s*$' | tail -n 20
  done
  echo "$((${#SUMMARY[@]} - ${#FAILED[@]})) ok or skipped, ${#FAILED[@]} failed; $((SECONDS - START)) s"
}

install_wheels() {
  rm -rf "$SITE" && mkdir -p "$SITE/_boot"
  python3 -m pip install --quiet --no-index --find-links "$WHEELS" --no-deps --no-compile --target "$SITE" \
    "$WHEELS"/*.whl || return 1
  printf 'import site\nsite.addsitedir("%s")\n' "$SITE" > "$SITE/_boot/sitecustomize.py"
}

check_imports() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: none"
  PYTHONSAFEPATH=1 $PY -c "import torch, torchao, torchtune, torchtune_ext, transformers, peft, omegaconf
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
print('torchao', torchao.__version__, 'torchtune', torchtune.__version__, 'omegaconf', omegaconf.__version__,
      'transformers', transformers.__version__, 'peft', peft.__version__)
print('torchtune_ext from', torchtune_ext.__file__)"
}

# tune_run <name> <limit> <recipe> <config> <overrides...>: `tune run` on $DEVICE. PYTHONSAFEPATH: the clone's
# torchtune_ext/ in the working directory must not shadow the installed wheel (it lacks torchtune_ext.configs).
tune_run() {
  local name=$1 limit=$2 recipe=$3 config=$4
  shift 4
  step "$name" "$limit" env PYTHONSAFEPATH=1 $PY -m torchtune._cli.tune run "$recipe" --config "$config" \
    device="$DEVICE" "$@"
}

main() {
  if [ -d "$WHEELS" ]; then
    export SITE WHEELS
    step install_wheels 20 bash -c "$(declare -f install_wheels); install_wheels"
    export PYTHONPATH="$SITE/_boot${PYTHONPATH:+:$PYTHONPATH}"
    PY=${PY:-python3}
  else
    PY=${PY:-.venv/bin/python} # a machine with this project's venv
  fi
  export PY
  step imports 20 bash -c "$(declare -f check_imports); check_imports"
  if [ ${#FAILED[@]} -gt 0 ]; then
    echo "the set-up failed: nothing else can run"
    return
  fi
  # fused AdamW, as the real configs ship it (the tiny one does not say)
  local memory="$PY bench/gpu_memory.py --config $CONFIG --cache $CACHE --device $DEVICE --override optimizer.fused=True"
  step memory_t4_dtypes 90 $memory --seq $SEQ --steps 3 --settings fp16,fp32
  step memory_offload 70 $memory --seq $LONG_SEQ --steps 2 --settings fp16+offload+tiled,fp32+offload+tiled
  local dtype
  for dtype in fp16 fp32; do # $CKPT: the random checkpoint bench/gpu_memory.py wrote
    tune_run "recipe_$dtype" 38 recipes/qlora_finetune_single_device.py "$CONFIG" checkpointer.checkpoint_dir="$CKPT" \
      checkpointer.checkpoint_files=[model.safetensors] output_dir="$CACHE/recipe_$dtype" dtype=$dtype epochs=1 \
      max_steps_per_epoch=$TRAIN_STEPS optimizer.fused=True $DATA $LOG_TO_STDOUT
  done
  local model=1b
  [ "$SIZE" = tiny ] && model=tiny
  step load 40 $PY bench/load.py --model $model --device "$DEVICE" --dtypes bf16 --cache "$CACHE"
  tune_run tiny_train 20 recipes/qlora_finetune_single_device.py configs/tiny/qlora_single_device.yaml \
    checkpointer.checkpoint_dir="$CACHE/tiny_base" output_dir="$CACHE/tiny_qlora" overwrite_output_dir=True \
    epochs=1 max_steps_per_epoch=20 run_val_every_n_steps=null
  tune_run generation 15 recipes/generate.py configs/tiny/generation.yaml \
    checkpointer.checkpoint_dir="$CACHE/tiny_base" adapter_dir="$CACHE/tiny_qlora/step_20/adapter" \
    output_dir="$CACHE/tiny_generation"
  step recipe_vs_torchtune 30 $PY bench/recipe.py --device "$DEVICE" --dtypes $VS_DTYPES --steps $VS_STEPS --repeats 1 \
    --base "$CACHE/tiny_base"
  step nf4_dequant 15 $PY bench/nf4_dequant.py --device "$DEVICE" $NF4
  step nf4_linear 20 $PY bench/nf4_linear.py --device "$DEVICE" $NF4
  step memory_compile 35 $memory --seq $SEQ --steps 3 --settings bf16+compile
}

# One subshell for both (the summary reads main's arrays); the pipeline waits for tee, so the file is complete.
{
  main
  summary
} 2>&1 | tee "$OUT/gpu_bench.txt"

#!/bin/bash
# Qwen-Image-20B LoRA (rank 64) reference setting at full size (random weights and embeddings,
# 4 prompts x 8 images, 4 micro-batches, true CFG, 512 px, 10 steps), colocated on one GPU whose
# memory is capped to an 80 GB card's (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.51 of an H200's
# 139 GiB = the 71 GiB that 0.95 of an H100 gives), in one call:
#   fp8_base:     model.rollout_precision=fp8 + model.lora_base_precision=fp8 (one e4m3 base)
#   bf16:         the bf16 colocated baseline
#   fp8_rollout:  FP8 rollouts over a bf16 base (two copies; expected not to fit the cap)
# `$1`: output directory (default $OUT); further arguments: which runs (default all three).
#   bash benchmarks/fp8_base_1gpu.sh /tmp/out fp8_base bf16
set -o pipefail
out=${1:-$OUT}
mkdir -p "$out"
runs=("${@:2}")
[ ${#runs[@]} -eq 0 ] && runs=(fp8_base bf16 fp8_rollout)
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.51}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export PYTHONUNBUFFERED=1
common=(--mode=system --config=configs/qwenimage.py --config.model.random_init=True --config.data.random_embeddings=True
        --config.rl.prompts_per_iteration=4 --config.rl.group_size=8 --config.runtime.micro_batches=4
        --config.rl.lora_merge_for_sampling=False --modes=colocated --warmup_iterations=1 --iterations=2)
for run in "${runs[@]}"; do
  case $run in
    fp8_base) extra=(--config.model.rollout_precision=fp8 --config.model.lora_base_precision=fp8) ;;
    bf16) extra=() ;;
    fp8_rollout) extra=(--config.model.rollout_precision=fp8 --config.runtime.check_memory=False) ;;
    *) echo "unknown run: $run"; exit 2 ;;
  esac
  echo "=== $run ($(date -u +%T))"
  timeout -s ABRT ${RUN_TIMEOUT:-280} python3 launch/bench.py "${common[@]}" "${extra[@]}" --workdir=/tmp/w_$run \
    --out="$out/system_qwenimage_1gpu_80gb_$run.json" 2>&1 | grep -v "Unable to initialize backend\|checkpoint_manager" \
    | tail -25 | tee "$out/log_$run.txt"
done

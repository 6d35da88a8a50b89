#!/bin/bash
# Qwen-Image-20B LoRA (rank 64) reference setting at full size (random weights and embeddings,
# 8 images per prompt, 4 micro-batches, true CFG, 512 px, 10 steps), one process, one call:
# colocated on every GPU, then the full mode (gap+tsp+tag+tcss) on R rollout GPUs and the rest
# training, then any further modes given with --modes in the extra flags.
#   $1: rollout GPUs of the full mode   $2: bf16 | fp8 (FP8 rollouts over an FP8 LoRA base)
#   $3: prompts per iteration           $4: output directory (default $OUT); further: bench flags
#   bash benchmarks/lora_pair.sh 1 fp8 4 /tmp/out        # 2 GPUs: 1 + 1, 32 images
#   bash benchmarks/lora_pair.sh 2 bf16 8 /tmp/out       # 4 GPUs: 2 + 2, 64 images
# CUDA_VISIBLE_DEVICES limits the GPUs (two 2-GPU pairs can share a 4-GPU machine).
set -o pipefail
rollout=${1:?rollout GPUs}
precision=${2:?bf16 or fp8}
prompts=${3:?prompts per iteration}
out=${4:-$OUT}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export PYTHONUNBUFFERED=1
if [ -n "$CUDA_VISIBLE_DEVICES" ]; then
  gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | wc -l)
else
  gpus=$(nvidia-smi -L | wc -l)
fi
args=(--mode=system --config=configs/qwenimage.py --config.model.random_init=True --config.data.random_embeddings=True
      --config.rl.prompts_per_iteration=$prompts --config.rl.group_size=8 --config.runtime.micro_batches=4
      --config.runtime.rollout_devices=$rollout --config.runtime.train_devices=0
      --config.rl.lora_merge_for_sampling=False --modes=colocated,gap+tsp+tag+tcss
      --warmup_iterations=1 --iterations=2 --workdir=/tmp/w_pair_${rollout}_${precision}_${gpus})
case $precision in
  bf16) ;;
  fp8) args+=(--config.model.rollout_precision=fp8 --config.model.lora_base_precision=fp8) ;;
  *) echo "unknown precision: $precision"; exit 2 ;;
esac
name=system_qwenimage_${gpus}x_${rollout}_$((gpus - rollout))_${precision}_pair
python3 launch/bench.py "${args[@]}" "${@:5}" --out="$out/$name.json" 2>&1 \
  | grep -v "Unable to initialize backend\|checkpoint_manager\|checkpoint_handler\|checkpointer.py" | tee "$out/log_$name.txt"

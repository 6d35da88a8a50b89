#!/bin/bash
# Qwen-Image-20B full fine-tuning at full size (random weights and embeddings) on a 4-GPU host:
# the peers' setting (no CFG, 512 px, 10 steps, lr 3e-5), FSDP train rules, 8 prompts x 8 images
# per iteration. `$1`: 'colocated' (all 4 GPUs), 'disagg' (gap+tsp+tag+tcss, 1 rollout GPU
# with FP8 rollout weights, 3 train GPUs), 'pair' (both modes in one process, one after the
# other, bf16 rollout weights: the same-call comparison) or 'two_processes' (gap+tsp+tag+tcss
# with 2 rollout + 2 train GPUs as two processes of 2 GPUs each, a rollout host and a train
# host, on this one machine; compare with `pair ... --config.runtime.rollout_devices=2
# --config.runtime.train_devices=0`). Further arguments are bench flags. The memory plan is not enforced
# (runtime.check_memory=False): the run measures what it predicts. Writes under $2 (default
# $OUT): the system bench JSON and XLA's compiled memory of the transformer programs.
#   bash benchmarks/full_ft_4gpu.sh colocated /tmp/out
set -o pipefail
which=${1:?colocated, disagg, pair or two_processes}
out=${2:-$OUT}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export PYTHONUNBUFFERED=1
args=(--mode=system --config=configs/qwenimage.py --config.model.random_init=True --config.data.random_embeddings=True
      --config.rl.lora_rank=0 "--config.sharding.train_rules=(('activation_batch','data'),('embed','data'))"
      --config.sampling.cfg_scale=1.0 --config.rl.learning_rate=3e-5
      --config.rl.prompts_per_iteration=8 --config.rl.group_size=8 --config.runtime.micro_batches=4
      --config.runtime.check_memory=False --warmup_iterations=1 --iterations=2 --matmul_size=0
      --workdir=/tmp/w_$which)
case $which in
  colocated) args+=(--modes=colocated) ;;
  disagg) args+=(--modes=gap+tsp+tag+tcss --config.runtime.rollout_devices=1 --config.runtime.train_devices=3
                 --config.model.rollout_precision=fp8) ;;
  pair) args+=(--modes=colocated,gap+tsp+tag+tcss --config.runtime.rollout_devices=1 --config.runtime.train_devices=3) ;;
  two_processes) args+=(--modes=gap+tsp+tag+tcss --config.runtime.rollout_devices=2 --config.runtime.train_devices=0
                        --config.runtime.distributed=True) ;;
  *) echo "unknown: $which"; exit 2 ;;
esac
if [ "$which" = two_processes ]; then  # process 0 holds GPUs 0,1 (the rollout role), process 1 GPUs 2,3
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$((2 * i)),$((2 * i + 1)) JAX_COORDINATOR_ADDRESS=127.0.0.1:${PORT:-23456} JAX_NUM_PROCESSES=2 \
      JAX_PROCESS_ID=$i python3 launch/bench.py "${args[@]}" "${@:3}" --out="$out/system_$which.json" 2>&1 \
      | grep -v "Unable to initialize backend\|checkpoint_manager\|checkpoint_handler\|checkpointer.py" > "$out/log_${which}_$i.txt" &
  done
  wait
  exit
fi
python3 benchmarks/compiled_memory.py --memory_out="$out/programs_$which.json" --out="$out/system_$which.json" \
  "${args[@]}" "${@:3}" 2>&1 | grep -v "Unable to initialize backend" | tee "$out/log_$which.txt"

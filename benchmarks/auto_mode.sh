#!/bin/bash
# runtime.mode='auto' against the best measured mode: Qwen-Image-20B LoRA (random weights and
# embeddings, the lora_pair.sh setting) on every visible GPU. First the system bench measures
# colocated and every disaggregated mode (each at the role split and micro-batches given), then a
# training run of runtime.mode='auto' chooses a mode before the run, re-ranks every mode from its
# first iterations' measured costs (one line: "runtime.mode='auto' re-ranked ...") and may switch.
# Done when the auto run's samples/s, over its iterations after the choice is final (the first of
# a new mode, which compiles, left out), is within 3% of the best mode the bench measured: the
# last line prints both and the ratio.
#   $1: rollout GPUs of the bench's disaggregated modes   $2: prompts per iteration
#   $3: output directory (default $OUT); further: flags for both launchers' --config
#   bash benchmarks/auto_mode.sh 1 4 /tmp/out      # 2 GPUs: 32 images
#   bash benchmarks/auto_mode.sh 2 8 /tmp/out      # 4 GPUs: 64 images
set -o pipefail
rollout=${1:?rollout GPUs}
prompts=${2:?prompts per iteration}
out=${3:-$OUT}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export PYTHONUNBUFFERED=1
config=(--config=configs/qwenimage.py --config.model.random_init=True --config.data.random_embeddings=True
        --config.rl.prompts_per_iteration=$prompts --config.rl.group_size=8 --config.rl.lora_merge_for_sampling=False
        "${@:4}")
quiet="Unable to initialize backend\|checkpoint_manager\|checkpoint_handler\|checkpointer.py"
bench=$out/system_auto_reference.json
python3 launch/bench.py --mode=system "${config[@]}" --config.runtime.micro_batches=4 \
  --config.runtime.rollout_devices=$rollout --config.runtime.train_devices=0 \
  --modes=colocated,disagg_sync,gap,gap+tsp,gap+tsp+tag,gap+tsp+tag+tcss --warmup_iterations=1 --iterations=2 \
  --workdir=/tmp/w_auto_bench --out="$bench" 2>&1 | grep -v "$quiet" | tee "$out/log_auto_bench.txt" || exit 1
rm -rf /tmp/w_auto_train
python3 launch/train.py "${config[@]}" --config.runtime.mode=auto --config.train.iterations=10 \
  --config.train.eval_every=0 --config.train.image_every=0 --config.train.checkpoint_every=0 \
  --workdir=/tmp/w_auto_train 2>&1 | grep -v "$quiet" | tee "$out/log_auto_train.txt" || exit 1
cp /tmp/w_auto_train/metrics.jsonl "$out/metrics_auto_train.jsonl"
python3 - "$bench" /tmp/w_auto_train/metrics.jsonl <<'EOF'
import json, statistics, sys
modes = json.load(open(sys.argv[1]))["modes"]
best = max(modes, key=lambda m: modes[m]["samples_per_s"])
rows = [json.loads(line) for line in open(sys.argv[2])]
final = rows[-1]["mode"]
first = next(i for i, r in enumerate(rows) if r["mode"] == final)
timed = rows[max(first + 1, 3):]  # the choice is final by iteration 4 (runtime.auto_rerank_after)
rate = statistics.mean(r["samples_per_s"] for r in timed)
print(f"auto ran {final} (from iteration {first + 1}): {rate:.3f} samples/s over iterations "
      f"{timed[0]['step']}-{timed[-1]['step']}; the bench's best, {best}: {modes[best]['samples_per_s']:.3f}; "
      f"ratio {rate / modes[best]['samples_per_s']:.3f} (done when >= 0.97)")
EOF

#!/bin/bash
# SD3.5-Medium and Wan2.2-TI2V-5B at full size (random weights) on a 4-GPU host, in one call:
# three jobs at once, each on its own GPUs (CUDA_VISIBLE_DEVICES), every step under one deadline
# for the whole script (BUDGET_S, default 415 s from the start; `timeout -s ABRT`, so Python's
# faulthandler prints where a step stood when it was stopped).
#   GPU 0:    tests/test_sd3.py's full-size SD3.5-M forward against diffusers (fp32), then the
#             system bench colocated on that GPU.
#   GPUs 1,2: the system bench on 2 GPUs: gap+tsp+tag+tcss (1 rollout + 1 train GPU) first, then
#             colocated (the JSON is written after each mode, so a cut run keeps the full mode).
#   GPU 3:    tests/test_wan22.py's full-size TI2V-5B forward against diffusers (fp32, per-token
#             timesteps), then the model bench of TI2V-5B (forward and LoRA fwd+bwd at the config's
#             480x832, 33 frames, batch 2, remat 'full'), the diffusers module timed on the same card.
# System benches: configs/sd35.py (Flow-GRPO's SD3.5-M recipe) at random weights and embeddings,
# 4 prompts x 8 images (the recipe: 48 x 24) in 4 micro-batches, 1 warm-up + 2 timed iterations.
# One warm-up is the bench's least that compiles before timing; the elastic full mode adds 1 to 3
# of its own while its split settles (app/bench/system.py). Cut so that the full mode's compile
# and warm-ups fit the call: half the images of the 2-GPU colocated row of benchmarks/README.md
# (8 prompts x 8), and the full mode runs before colocated.
# Writes under $1 (default $OUT), at most 8 files: the three JSONs, traces.tar.gz (the system
# runs' traces) and one short log per job.
#   bash benchmarks/sd35_wan22_4gpu.sh /tmp/out
#   TINY=1 bash benchmarks/sd35_wan22_4gpu.sh /tmp/out    # the same steps at :tiny sizes on CPU
set -o pipefail
source "$(dirname "$0")/deadline.sh"  # open_out, start_deadline, step, pack_results, noise
open_out "${1:-$OUT}" "usage: bash benchmarks/sd35_wan22_4gpu.sh OUT_DIR"
start_deadline 415

if [ -n "$TINY" ]; then
  export JAX_PLATFORMS=cpu
  sd35=configs/sd35.py:tiny
  sizes=(--config.rl.prompts_per_iteration=2 --config.rl.group_size=4 --config.runtime.micro_batches=2)
  wan=(--variant=tiny --batch=1 --height=64 --width=64 --frames=5 --repeats=2)
  test_platforms=cpu
  devices() { export XLA_FLAGS="--xla_force_host_platform_device_count=$1"; }
else
  sd35=configs/sd35.py
  sizes=(--config.rl.prompts_per_iteration=4 --config.rl.group_size=8 --config.runtime.micro_batches=4)
  wan=(--variant=ti2v-5b --batch=2 --height=480 --width=832 --frames=33 --repeats=5)
  test_platforms=cuda,cpu
  devices() { :; }
fi
system=(--mode=system --config=$sd35 --config.model.random_init=True --config.data.random_embeddings=True "${sizes[@]}"
        --warmup_iterations=1 --iterations=2)

gpu0() {
  local log=$out/log_gpu0_sd35m_1gpu.txt
  export CUDA_VISIBLE_DEVICES=0; devices 1
  JAX_PLATFORMS=$test_platforms XLA_PYTHON_CLIENT_PREALLOCATE=false \
    step "$log" 240 0 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_sd3.py -k full_size
  step "$log" 0 0 python3 launch/bench.py "${system[@]}" --modes=colocated --workdir=/tmp/w_sd35_1 \
    --out="$out/system_sd35m_1gpu_colocated.json"
}

gpu12() {
  local log=$out/log_gpu12_sd35m_2gpu.txt
  export CUDA_VISIBLE_DEVICES=1,2; devices 2
  step "$log" 0 0 python3 launch/bench.py "${system[@]}" --modes=gap+tsp+tag+tcss,colocated \
    --config.runtime.rollout_devices=1 --config.runtime.train_devices=0 --workdir=/tmp/w_sd35_2 \
    --out="$out/system_sd35m_2gpu_full_colocated.json"
}

gpu3() {
  local log=$out/log_gpu3_wan22_ti2v5b.txt
  export CUDA_VISIBLE_DEVICES=3; devices 1
  JAX_PLATFORMS=$test_platforms XLA_PYTHON_CLIENT_PREALLOCATE=false \
    step "$log" 200 0 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_wan22.py -k full_size
  step "$log" 0 0 python3 launch/bench.py --mode=model --family=wan22 "${wan[@]}" --what=forward,lora_fwd_bwd \
    --lora_rank=32 --remat_policy=full --warmup=1 --peer --out="$out/model_wan22_ti2v5b_lora_peer.json"
}

( gpu0 ) & ( gpu12 ) & ( gpu3 ) &
wait

# At most 8 files come back: the traces in one archive, each log cut to its start and end.
pack_results "$out"
ls -l "$out"
grep -h "^===\|samples/s\|rel err\|passed\|failed\|skipped\|wrote\|median\|error" "$out"/log_*.txt | cut -c1-300

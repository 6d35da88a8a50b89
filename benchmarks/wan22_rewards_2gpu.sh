#!/bin/bash
# Wan2.2's RL iteration and the ImageReward and HPSv2.1 rewards at full size (random weights) on a
# 2-GPU host, in one call: two jobs at once, one per GPU (CUDA_VISIBLE_DEVICES), every step under
# one deadline for the whole script (BUDGET_S, default 480 s from the start; `timeout -s ABRT`, so
# Python's faulthandler prints where a step stood when it was stopped).
#   GPU 0: (on the host CPUs meanwhile) randomly initialised ImageReward and HPS v2.1 models in the
#          files their users download (benchmarks/random_reward_checkpoints.py: the image-reward
#          package's ImageReward-v1.0 state dict, open_clip's ViT-H-14), converted with the
#          converter CLIs as a user would (convert/image_reward_to_orbax.py, convert/clip_to_orbax.py);
#          on the GPU: tests/test_image_reward.py's and tests/test_clip.py's full-size parity of our
#          models against the packages' (fp32, -m gpu -k full_size); then configs/sd35.py's system
#          bench colocated on that GPU with the reward image_reward, then hpsv2, each named by
#          --config.reward.weights and its converted checkpoint by --config.reward.options (the
#          reward's cost is the JSON's modes.colocated.costs.reward).
#   GPU 1: configs/wan22.py's system bench colocated on that GPU, for each of WAN_VARIANTS:
#          ti2v_5b (Wan2.2-TI2V-5B at the recipe's 480x832, 33 frames, 20 steps, 19 trained, each
#          prompt's videos from a drawn first frame, data.first_frames='synthetic': the TI2V path)
#          and t2v_a14b (the two 14B experts, FP8 rollouts over an FP8 LoRA base, 9 frames at 480x832,
#          1 prompt x 2, 2 units per gradient chunk, one
#          update per batch, 1 warm-up + 1 timed iteration; it needs about 300 s of the deadline, so
#          it runs in a call of its own: `JOBS=gpu1 WAN_VARIANTS=t2v_a14b BUDGET_S=540`).
#   pair:  after both jobs, Wan2.2-TI2V-5B's full mode gap+tsp+tag+tcss on both GPUs (1 rollout +
#          1 train GPU), when 240 s are left (a call of its own: `JOBS=pair BUDGET_S=540`).
# System benches: random weights and embeddings, 1 warm-up + 2 timed iterations (the least that
# compiles before timing). SD3.5-M: 4 prompts x 8 images in 4 micro-batches (the 1-GPU row of
# benchmarks/README.md, so the rewards' cost compares with it). TI2V-5B: 2 prompts x 2 videos in 2
# micro-batches (the recipe: 16 x 4), 19 training units per gradient chunk.
# Writes under $1 (default $OUT), at most 8 files: the system JSONs, traces.tar.gz (the system
# runs' traces) and one short log per GPU job (the pair's steps in GPU 1's).
#   bash benchmarks/wan22_rewards_2gpu.sh /tmp/out
#   TINY=1 bash benchmarks/wan22_rewards_2gpu.sh /tmp/out    # the same steps at :tiny sizes on CPU
#   JOBS=gpu1 GPU1=0 bash benchmarks/wan22_rewards_2gpu.sh /tmp/out    # GPU 1's job on a 1-GPU host
set -o pipefail
source "$(dirname "$0")/deadline.sh"  # open_out, start_deadline, step, pack_results, noise
open_out "${1:-$OUT}" "usage: bash benchmarks/wan22_rewards_2gpu.sh OUT_DIR"
jobs=" ${JOBS:-gpu0 gpu1 pair} "
wan_variants=${WAN_VARIANTS:-ti2v_5b t2v_a14b}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # convert/ imports digen_jax
sources=/tmp/reward_sources  # the random reference models, as downloaded
converted=/tmp/reward_checkpoints  # their conversions: one folder per reward

if [ -n "$TINY" ]; then
  export JAX_PLATFORMS=cpu
  start_deadline 3600  # CPU: every step runs, whatever it takes
  sd35=configs/sd35.py:tiny
  wan_config=(configs/wan22.py:tiny configs/wan22.py:tiny_a14b)
  wan_chunk=6  # the tiny recipe trains 3 steps: 2 samples x 3 per micro-batch
  a14b_chunk=$wan_chunk
  a14b_size=()
  size=tiny
  convert_ir=(--variant=tiny)
  convert_hps=(--variant=tiny '--config_overrides={"hidden_act": "gelu"}')
  test_platforms=cpu
  tests=(-m "not gpu" -k "score_matches_the_package or hpsv2_matches_open_clip or hpsv2_architecture")
  devices() { export XLA_FLAGS="--xla_force_host_platform_device_count=$1"; }
else
  start_deadline 480
  sd35=configs/sd35.py
  wan_config=(configs/wan22.py:ti2v_5b configs/wan22.py:t2v_a14b)
  wan_chunk=19  # 2 videos x 19 trained steps per micro-batch
  # One H200 holds the two experts once, in e4m3, for sampling and as the LoRA base (the memory
  # plan: 142.4 GiB per device with a bf16 base beside the FP8 rollout copy, 111.6 usable).
  a14b_size=(--config.sampling.num_frames=9 --config.model.lora_base_precision=fp8)
  # 2 units per gradient chunk: at 19, XLA could not bring the training program below 317 GiB
  # (docs/known_issues.md).
  a14b_chunk=2
  size=full
  convert_ir=()
  convert_hps=(--variant=ViT-H-14)
  test_platforms=cuda,cpu
  tests=(-m gpu -k full_size)
  devices() { :; }
fi
random=(--config.model.random_init=True --config.data.random_embeddings=True --warmup_iterations=1)
sd35_system=(--mode=system --config=$sd35 "${random[@]}" --config.rl.prompts_per_iteration=4
             --config.rl.group_size=8 --config.runtime.micro_batches=4 --iterations=2)
ti2v_system=(--mode=system --config=${wan_config[0]} "${random[@]}" --config.data.first_frames=synthetic
             --config.rl.prompts_per_iteration=2 --config.rl.group_size=2 --config.runtime.micro_batches=2
             --config.rl.grad_chunk_size=$wan_chunk --iterations=2)
a14b_system=(--mode=system --config=${wan_config[1]} "${random[@]}" "${a14b_size[@]}"
             --config.model.rollout_precision=fp8 --config.rl.prompts_per_iteration=1 --config.rl.group_size=2
             --config.runtime.micro_batches=1 --config.rl.num_updates_per_batch=1
             --config.rl.grad_chunk_size=$a14b_chunk --iterations=1)

# The random reference models and their conversions, on the host CPUs only.
reward_checkpoints() {
  local log=$1
  export CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu
  rm -rf "$sources" "$converted"
  step "$log" 240 0 python3 benchmarks/random_reward_checkpoints.py --size=$size --out=$sources &&
    step "$log" 240 0 python3 convert/image_reward_to_orbax.py --checkpoint=$sources/ImageReward.pt "${convert_ir[@]}" \
      --tokenizer_dir=$sources/bert_tokenizer --out=$converted/image_reward &&
    step "$log" 240 0 python3 convert/clip_to_orbax.py --open_clip_checkpoint=$sources/HPS_v2.1.pt "${convert_hps[@]}" \
      --tokenizer_dir=$sources/clip_tokenizer --out=$converted/hpsv2
}

# reward_bench LOG RESERVE_S MIN_S NAME: SD3.5-M colocated on this job's GPU, scored by reward NAME.
reward_bench() {
  local log=$1 reserve=$2 min=$3 name=$4
  step "$log" $reserve $min python3 launch/bench.py "${sd35_system[@]}" --modes=colocated \
    "--config.reward.weights={'$name': 1.0}" "--config.reward.options={'$name': {'checkpoint_dir': '$converted/$name'}}" \
    --workdir=/tmp/w_sd35_$name --out="$out/system_sd35m_1gpu_$name.json"
}

gpu0() {
  local log=$out/log_gpu0_rewards.txt convert_log=$out/convert.txt
  rm -f "$convert_log"
  ( reward_checkpoints "$convert_log" ) &
  local converting=$!
  export CUDA_VISIBLE_DEVICES=0; devices 1
  JAX_PLATFORMS=$test_platforms XLA_PYTHON_CLIENT_PREALLOCATE=false \
    step "$log" 240 0 python3 -m pytest -q -s -p no:cacheprovider "${tests[@]}" tests/test_image_reward.py tests/test_clip.py
  wait $converting
  local converted_ok=$?
  cat "$convert_log" >> "$log" && rm -f "$convert_log"
  if [ $converted_ok -ne 0 ]; then
    echo "=== no converted reward checkpoints: the reward benches are skipped" >> "$log"
    return
  fi
  reward_bench "$log" 100 0 image_reward
  reward_bench "$log" 0 60 hpsv2
}

gpu1() {
  local log=$out/log_gpu1_wan22.txt
  export CUDA_VISIBLE_DEVICES=${GPU1:-1}; devices 1
  for variant in $wan_variants; do
    case $variant in
      ti2v_5b) step "$log" 0 0 python3 launch/bench.py "${ti2v_system[@]}" --modes=colocated --workdir=/tmp/w_wan22_5b \
                 --out="$out/system_wan22_ti2v5b_1gpu_colocated.json" ;;
      t2v_a14b) step "$log" 0 300 python3 launch/bench.py "${a14b_system[@]}" --modes=colocated \
                  --workdir=/tmp/w_wan22_a14b --out="$out/system_wan22_a14b_1gpu_9f_fp8_colocated.json" ;;
      *) echo "=== unknown WAN_VARIANTS entry $variant (ti2v_5b, t2v_a14b)" >> "$log" ;;
    esac
  done
}

pair() {
  local log=$out/log_gpu1_wan22.txt  # after gpu1's steps: two logs, at most 8 files
  export CUDA_VISIBLE_DEVICES=0,1; devices 2
  step "$log" 0 240 python3 launch/bench.py "${ti2v_system[@]}" --modes=gap+tsp+tag+tcss \
    --config.runtime.rollout_devices=1 --config.runtime.train_devices=0 --workdir=/tmp/w_wan22_5b_2 \
    --out="$out/system_wan22_ti2v5b_2gpu_full.json"
}

[[ $jobs == *" gpu0 "* ]] && ( gpu0 ) &
[[ $jobs == *" gpu1 "* ]] && ( gpu1 ) &
wait
[[ $jobs == *" pair "* ]] && ( pair )

# At most 8 files come back: the traces in one archive, each log cut to its start and end.
pack_results "$out"
ls -l "$out"
grep -h "^===\|samples/s\|rel err\|passed\|failed\|skipped\|wrote\|median\|error" "$out"/log_*.txt | cut -c1-300

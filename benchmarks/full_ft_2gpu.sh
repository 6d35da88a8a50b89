#!/bin/bash
# FLUX.1-dev-12B full fine-tuning at full size (random weights and embeddings) on a 2-GPU host, in
# two calls (`$1`); every step under one deadline for the whole script (BUDGET_S, default 540 s
# from the start; `timeout -s ABRT`, so Python's faulthandler prints where a step stood).
#
#   pair:   configs/flux_full.py (the peers' full fine-tuning recipe: FSDP train rules, no CFG,
#           512 px, 10 steps, lr 3e-5) through benchmarks/compiled_memory.py (launch/bench.py
#           --mode=system with XLA's compiled memory of every transformer program set against the
#           memory plan per role): gap+tsp+tag+tcss with 1 rollout + 1 train GPU first, then
#           colocated on both (the JSONs are written after each mode and each program, so a cut
#           run keeps what it finished). 2 prompts x 8 images in 2 micro-batches, 1 warm-up + 1
#           timed iteration per mode; the full mode's split fixed at the simulator's pick (no
#           trainer rollouts, 1 micro-batch prefetched) so that no settling iterations are added.
#           One train GPU cannot hold the recipe's state (bf16 weights, gradient sum and EMA,
#           float32 Adam moments: 155 GiB before activations, launch/simulate.py): both modes run
#           with the Adam moments in pinned host memory (runtime.offload_optimizer), in bf16
#           (rl.optimizer_state_dtype=param), and without the EMA (rl.ema=False), the plan's
#           train role then 96.0 GiB of 111.6 usable. Expect about 450-540 s with an empty
#           compilation cache (compiles of 100-250 s per mode).
#   one:    the pair's colocated mode on a 1-GPU host (the same recipe, sizes and offloaded bf16
#           moments), 1 warm-up + 2 timed iterations, the host's memory logged every 5 s (the
#           initial weights' host copy and the moments' pinned buffers share it). About 250-350 s.
#   resume: launch/train.py, FLUX.1-dev LoRA (configs/flux.py, rank 64) colocated on both GPUs,
#           2 prompts x 4 images, 3 iterations, a checkpoint after each (1 kept): an
#           uninterrupted run; the same command killed with SIGKILL once checkpoint 1 is written,
#           then rerun: its metrics rows (every figure but the timings) and its final checkpoint's
#           checksums (the ones each checkpoint's meta item holds of every array of the train
#           state) must equal the uninterrupted run's; the comparison exits non-zero otherwise.
#           LoRA, not full fine-tuning: a full FLUX state is 66.5 GiB on disk at its smallest
#           (bf16 weights and moments, no EMA), and orbax writes a checkpoint before it deletes
#           the one before, so a run checkpointing every iteration holds two (133 GiB) on a
#           128 GiB disk. Extra arguments go to train.py (`--config.rl.lora_rank=0 ...` on a
#           larger disk, or fewer blocks: --config.model.num_layers / num_single_layers; RESUME_CONFIG=configs/flux_full.py
#           for the full fine-tuning recipe). XLA's deterministic ops and XLA's attention are on (DETERMINISTIC=0 turns them off).
#           Expect about 250-350 s with an empty cache.
# Further arguments ($3...) go to the bench (pair) or to train.py (resume).
# Writes under $2 (default $OUT), at most 8 files per call:
#   pair:   simulate_flux_full_h200x2.txt (the simulator's predictions and memory plans of both
#           layouts), system_flux_full_2gpu_pair.json, compiled_memory_flux_full_2gpu_pair.json,
#           traces.tar.gz, log_pair.txt
#   one:    system_flux_full_1gpu.json, compiled_memory_flux_full_1gpu.json, traces.tar.gz, log_one.txt
#   resume: resume_check.json (the verdict and both runs' rows and checksums), log_resume.txt
#   bash benchmarks/full_ft_2gpu.sh pair /tmp/out
#   TINY=1 bash benchmarks/full_ft_2gpu.sh resume /tmp/out   # the same steps at :tiny sizes on 2 CPU devices
set -o pipefail
source "$(dirname "$0")/deadline.sh"  # open_out, start_deadline, step, pack_results, noise
which=${1:?pair, one or resume}
open_out "${2:-$OUT}" "usage: bash benchmarks/full_ft_2gpu.sh pair|one|resume OUT_DIR [FLAGS...]"
start_deadline 540
log=$out/log_$which.txt
: > "$log"

if [ -n "$TINY" ]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=2"
  size=:tiny
  pair_sizes=(--config.rl.prompts_per_iteration=2 --config.rl.group_size=4 --config.runtime.micro_batches=2)
  # Tiny iterations take a fraction of a second: more of them leave the kill after checkpoint 1 time to land.
  resume_sizes=(--config.train.iterations=6)  # :tiny's 2 prompts x 2 samples
else
  size=
  pair_sizes=(--config.rl.prompts_per_iteration=2 --config.rl.group_size=8 --config.runtime.micro_batches=2)
  # 2 updates per iteration (configs/flux.py), each of 4 samples x 5 trained steps, in 2 gradient chunks.
  resume_sizes=(--config.rl.prompts_per_iteration=2 --config.rl.group_size=4 --config.runtime.micro_batches=2
                --config.rl.grad_chunk_size=10 --config.train.iterations=3)
  # Each process runs the programs the first one compiled (autotuned once) and XLA's deterministic
  # kernels: the runs' arithmetic is the same in every process.
  export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
  # XLA's attention, not cuDNN's: with deterministic ops on, XLA stopped compiling the training
  # step's cuDNN flash-attention backward (IndexError: absl::container_internal::raw_hash_map<>::at,
  # jax 0.11.2 on an H200); without them the resumed rows differ from iteration 1 on (the
  # backward's reductions are not deterministic).
  if [ "$which" = resume ] && [ "${DETERMINISTIC:-1}" = 1 ]; then
    export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_deterministic_ops=true"
    resume_sizes+=(--config.model.attention_impl=xla)
  fi
fi

pair() {
  local full=(--config.runtime.offload_optimizer=True --config.rl.optimizer_state_dtype=param --config.rl.ema=False)
  # The simulator first (no devices): its predictions and the memory plans of both layouts.
  local sim=$out/simulate_flux_full_h200x2.txt
  # At the GPU call's sizes, in TINY mode too (it reads no weights).
  local sizes=(--config=configs/flux_full.py --config.rl.prompts_per_iteration=2 --config.rl.group_size=8 --pool=h200:2
               --micro_batches=2)
  JAX_PLATFORMS=cpu python3 launch/simulate.py "${sizes[@]}" > "$sim.recipe" 2>&1
  JAX_PLATFORMS=cpu python3 launch/simulate.py "${sizes[@]}" "${full[@]}" 2>&1 | grep -v "^$" > "$sim"
  { echo; echo "The recipe (float32 moments on the devices, the EMA):"; grep -v "^$" "$sim.recipe"; } >> "$sim"
  rm -f "$sim.recipe"
  step "$log" 0 0 python3 benchmarks/compiled_memory.py --memory_out="$out/compiled_memory_flux_full_2gpu_pair.json" \
    --mode=system --config=configs/flux_full.py$size --config.model.random_init=True --config.data.random_embeddings=True \
    "${pair_sizes[@]}" "${full[@]}" --config.runtime.check_memory=False \
    --modes=gap+tsp+tag+tcss,colocated --config.runtime.rollout_devices=1 --config.runtime.train_devices=0 \
    --config.runtime.tag_microbatches=0 --config.runtime.prefetch_microbatches=1 \
    --warmup_iterations=1 --iterations=1 --matmul_size=0 --workdir=/tmp/w_flux_full_2gpu \
    --out="$out/system_flux_full_2gpu_pair.json" "$@"
  local rc=$?
  python3 - "$out/compiled_memory_flux_full_2gpu_pair.json" >> "$log" 2>&1 <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no compiled memory: {e}")
size = lambda gib: f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB"  # noqa: E731
for r in d["roles"]:
    xla = f"{size(r['xla_gib'])} ({r['xla_program']}), plan / XLA {r['ratio']:.3f}, within {d['tolerance']:.0%}: " \
          f"{r['within_tolerance']}" if "xla_gib" in r else "no program recorded"
    print(f"memory: {r['mode']} {r['role']}: plan {size(r['plan_gib'])} (+ {size(r['plan_sync_buffers_gib'])} sync "
          f"buffers), XLA {xla}")
EOF
  return $rc
}

one() {
  # Colocated on a 1-GPU host: the same recipe and sizes as `pair`, with the host's memory logged
  # every 5 s (the moments' pinned buffers and the initial weights' host copy share it).
  local full=(--config.runtime.offload_optimizer=True --config.rl.optimizer_state_dtype=param --config.rl.ema=False)
  (while sleep 5; do echo "host: $(free -g | awk '/^Mem/ {print $3 " GiB used, " $7 " GiB available of " $2}')"; done) >> "$log" &
  local monitor=$!
  step "$log" 0 0 python3 benchmarks/compiled_memory.py --memory_out="$out/compiled_memory_flux_full_1gpu.json" \
    --mode=system --config=configs/flux_full.py$size --config.model.random_init=True --config.data.random_embeddings=True \
    "${pair_sizes[@]}" "${full[@]}" --config.runtime.check_memory=False --modes=colocated \
    --warmup_iterations=1 --iterations=2 --matmul_size=0 --workdir=/tmp/w_flux_full_1gpu \
    --out="$out/system_flux_full_1gpu.json" "$@"
  local rc=$?
  kill $monitor
  echo "host memory peak: $(grep '^host: ' "$log" | sort -n -k2 | tail -n 1 | cut -c7-)" >> "$log"
  return $rc
}

resume() {
  local a=/tmp/w_ft2_uninterrupted b=/tmp/w_ft2_killed
  rm -rf "$a" "$b"
  local cmd=(python3 launch/train.py --config=${RESUME_CONFIG:-configs/flux.py}$size --config.model.random_init=True
             --config.data.random_embeddings=True "${resume_sizes[@]}" --config.train.checkpoint_every=1
             --config.train.keep_checkpoints=1 --config.train.image_every=0 --config.runtime.check_memory=False "$@")
  local iterations
  iterations=$(printf '%s\n' "${cmd[@]}" | sed -n 's/^--config.train.iterations=//p' | tail -n 1)
  step "$log" 200 0 "${cmd[@]}" --workdir=$a || return
  # The uninterrupted run's final checksums, then its checkpoints go (a full fine-tuning
  # checkpoint would not fit the disk twice).
  python3 - "$a" "$iterations" > "$a/final_checksums.json" <<'EOF' || return
import json, os, sys
workdir, n = sys.argv[1], sys.argv[2]
meta = json.load(open(os.path.join(workdir, "checkpoints", n, "meta", "metadata")))
json.dump({"step": int(n), "checksums": meta["checksums"]}, sys.stdout)
EOF
  rm -rf "$a/checkpoints"

  # The same command, killed with SIGKILL once checkpoint 1 and its metrics row are written.
  local limit=$(( deadline - SECONDS - 100 ))
  echo "=== $(date -u +%T) limit ${limit} s, SIGKILL after checkpoint 1: ${cmd[*]} --workdir=$b" >> "$log"
  "${cmd[@]}" --workdir=$b > "$b.log" 2>&1 &
  local pid=$! start=$SECONDS killed=
  while kill -0 $pid 2>/dev/null; do
    if [ -d "$b/checkpoints/1" ] && [ -s "$b/metrics.jsonl" ]; then
      kill -9 $pid && killed="after checkpoint 1"
      break
    fi
    if [ $(( SECONDS - start )) -ge $limit ]; then
      kill -ABRT $pid && killed="at its limit"
      break
    fi
    sleep 0.05
  done
  wait $pid
  local rc=$?
  grep -v "$noise" "$b.log" >> "$log"
  echo "=== rc $rc after $(( SECONDS - start )) s (killed ${killed:-never}); checkpoints: $(ls "$b/checkpoints" 2>/dev/null | tr '\n' ' ')metrics rows: $(wc -l < "$b/metrics.jsonl")" >> "$log"
  if [ "$killed" != "after checkpoint 1" ] || [ -d "$b/checkpoints/$iterations" ]; then
    echo "the run was not killed mid-run after checkpoint 1" >> "$log"
    return 1
  fi
  step "$log" 0 0 "${cmd[@]}" --workdir=$b || return

  python3 - "$a" "$b" "$iterations" "$out/resume_check.json" >> "$log" 2>&1 <<'EOF'
"""The resumed run against the uninterrupted one: every metrics row's figures but the timings,
and the final checkpoint's checksums, bit for bit."""
import json, os, sys
a, b, n, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
TIMINGS = {"seconds", "samples_per_s", "samples_per_s_per_device", "bubble_frac", "dispatch_frac"}
def rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS and not k.endswith("_s")} for line in f]
ra, rb = rows(a), rows(b)
final = json.load(open(os.path.join(a, "final_checksums.json")))["checksums"]
meta = json.load(open(os.path.join(b, "checkpoints", str(n), "meta", "metadata")))["checksums"]
diff_rows = [(x.get("step"), sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))) for x, y in zip(ra, rb) if x != y]
diff_sums = sorted(f"{item}{leaf}" for item in set(final) | set(meta)
                   for leaf in set(final.get(item, {})) | set(meta.get(item, {}))
                   if final.get(item, {}).get(leaf) != meta.get(item, {}).get(leaf))
result = {
    "steps": [[r.get("step") for r in ra], [r.get("step") for r in rb]],
    "rows_equal": ra == rb, "rows_differ": diff_rows,
    "checksums_equal": final == meta, "leaves": sum(len(v) for v in final.values()), "leaves_differ": diff_sums[:20],
    "compared": sorted(ra[0]) if ra else [], "uninterrupted_rows": ra, "resumed_rows": rb,
}
result["equal"] = result["rows_equal"] and result["checksums_equal"] and [r.get("step") for r in rb] == list(range(1, n + 1))
json.dump(result, open(path, "w"), indent=1)
print(f"resume: metrics rows {result['steps'][1]} equal: {result['rows_equal']} {diff_rows[:3]}; final checkpoint "
      f"{n}: {result['leaves']} checksums equal: {result['checksums_equal']} {diff_sums[:3]}; EQUAL: {result['equal']}")
sys.exit(0 if result["equal"] else 1)
EOF
  local rc=$?
  rm -rf "$b/checkpoints"
  return $rc
}

case $which in
  pair) pair "${@:3}" ;;
  one) one "${@:3}" ;;
  resume) resume "${@:3}" ;;
  *) echo "unknown: $which (pair, one or resume)"; exit 2 ;;
esac
rc=$?

# The traces in one archive, each log cut to its start and end.
pack_results "$out" 60 240
ls -l "$out"
grep -h "^===\|samples/s\|compiled memory\|memory:\|resume:\|rel err\|wrote\|rror\|Traceback" "$log" | cut -c1-400
echo "exit $rc"
exit $rc

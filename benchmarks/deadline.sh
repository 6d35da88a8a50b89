# Shell helpers of the GPU benchmark scripts that run every step under one deadline for the
# whole call (sd35_wan22_4gpu.sh, wan22_rewards_2gpu.sh, full_ft_2gpu.sh). Sourced, not run:
#   source "$(dirname "$0")/deadline.sh"
# It gives:
#   open_out DIR USAGE            out=DIR, made and absolute, and the working directory the
#                                 repository root; prints USAGE and exits 2 when DIR is empty
#   noise                         grep pattern of the lines left out of the logs (JAX's backend
#                                 probes, orbax's checkpointing chatter, XLA's slow-compile alarms,
#                                 blank lines)
#   start_deadline DEFAULT_S      deadline=BUDGET_S (default DEFAULT_S) seconds from now; no core
#                                 dumps (an aborted step holds tens of GB), Python unbuffered with
#                                 its faulthandler on, JAX's compilation cache in
#                                 JAX_COMPILATION_CACHE_DIR (default /tmp/jax_cache)
#   step LOG RESERVE_S MIN_S CMD...
#                                 CMD under the deadline less RESERVE_S (kept for the later steps),
#                                 `timeout -s ABRT` (Python's faulthandler prints where the step
#                                 stood), its output but the noise appended to LOG between
#                                 `=== HH:MM:SS limit N s: CMD` and `=== rc RC after N s` lines;
#                                 skipped when less than MIN_S (at least 20) would be left.
#                                 Returns CMD's status: 124 when stopped at its limit or skipped.
#   pack_results OUT [HEAD TAIL]  OUT's ./*_traces folders into OUT/traces.tar.gz, and each
#                                 OUT/log_*.txt over HEAD + TAIL lines (default 40 + 160) cut to
#                                 its first HEAD and last TAIL lines: the calls bring back few files.

noise="Unable to initialize backend\|checkpoint_manager\|checkpoint_handler\|checkpointer.py\|absl::InitializeLog\|slow_operation_alarm\|Very slow compile\|event_tracking.py\|async_io_engine.py\|array_metadata_store.py\|jax_array_handlers.py\|^\*\*\*\*\|^$"

bench_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

open_out() {
  [ -n "$1" ] || { echo "$2"; exit 2; }
  mkdir -p "$1" && out=$(cd "$1" && pwd) || exit 2
  cd "$bench_root" || exit 2
}

start_deadline() {
  deadline=$(( SECONDS + ${BUDGET_S:-$1} ))
  ulimit -c 0
  export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
}

step() {
  local log=$1 reserve=$2 min=$3; shift 3
  local limit=$(( deadline - SECONDS - reserve )) start=$SECONDS rc
  [ "$min" -ge 20 ] || min=20
  if [ $limit -lt $min ]; then
    echo "=== skipped (${limit} s left, it needs ${min}): $*" >> "$log"
    return 124
  fi
  echo "=== $(date -u +%T) limit ${limit} s: $*" >> "$log"
  timeout -s ABRT -k 15 $limit "$@" 2>&1 | grep --line-buffered -v "$noise" >> "$log"
  rc=${PIPESTATUS[0]}  # 124: stopped at its limit
  echo "=== rc $rc after $(( SECONDS - start )) s" >> "$log"
  return $rc
}

pack_results() {
  local out=$1 head=${2:-40} tail=${3:-160} traces log lines
  traces=$(cd "$out" && ls -d ./*_traces 2>/dev/null)
  if [ -n "$traces" ]; then
    (cd "$out" && tar czf traces.tar.gz $traces && rm -rf $traces)
  fi
  for log in "$out"/log_*.txt; do
    [ -f "$log" ] || continue
    lines=$(wc -l < "$log")
    # Over HEAD + TAIL + 1: a log cut once (HEAD + TAIL lines and the mark) is not cut again.
    if [ "$lines" -gt $(( head + tail + 1 )) ]; then
      { head -n "$head" "$log"; echo "[... $(( lines - head - tail )) lines cut ...]"; tail -n "$tail" "$log"; } > "$log.cut"
      mv "$log.cut" "$log"
    fi
  done
}

#!/usr/bin/env bash
# Cold sequential reads of a mounted model.safetensors (a fresh daemon each time, no disk
# tier) against the FUSE ceiling: examples/memfs serving the same bytes from /dev/shm.
# Variants are mount options, after variables for the daemon's environment and BIN=PATH
# (another cawsfs binary, e.g. a build before a change); rounds interleave every variant;
# medians, memfs/variant and the daemon's CPU seconds per pass.
#
#   scripts/bench-cold-read.sh ARCHIVE ROUNDS 'LABEL=[BIN=PATH] [VAR=VALUE ...] MOUNT OPTIONS' ...
#   e.g. scripts/bench-cold-read.sh w2k.cawsf 5 'cpu=--device cpu' 'pt8=--device cpu --prefetch-threads 8'
#
# CAWSFS_BIN (default target/release/cawsfs), MEMFS_BIN (default target/release/examples/memfs).
# docs/CUDA.md has the figures it made on a GPU machine.
set -euo pipefail
BIN="${CAWSFS_BIN:-target/release/cawsfs}"
MEMFS="${MEMFS_BIN:-target/release/examples/memfs}"
A=$1 ROUNDS=$2
shift 2
W=$(mktemp -d)
SHM=/dev/shm/bench-cold-read.$$
mkdir -p "$W/mnt" "$SHM"
trap 'fusermount3 -u "$W/mnt" 2>/dev/null || true; rm -rf "$W" "$SHM"' EXIT
"$BIN" export "$A" --format safetensors -o "$SHM/model.safetensors" --device cpu >/dev/null
now() { date +%s.%N; }
timed_cat() { local t0 t1; t0=$(now); cat "$1" >/dev/null; t1=$(now); awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.4f", b - a }'; }
memfs() {
  "$MEMFS" "$SHM/model.safetensors" "$W/mnt" >/dev/null &
  local pid=$!
  for _ in $(seq 100); do [ -e "$W/mnt/model.safetensors" ] && break; sleep 0.05; done
  echo "memfs $(timed_cat "$W/mnt/model.safetensors")"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  fusermount3 -u "$W/mnt" 2>/dev/null || umount "$W/mnt" 2>/dev/null || true
}
cold() { # LABEL '[VAR=VALUE ...] OPTIONS' (variables in the daemon's environment)
  local label=$1 envs=() opts=() tok bin=$BIN
  for tok in $2; do
    if [ ${#opts[@]} -eq 0 ] && [[ $tok == BIN=* ]]; then bin=${tok#BIN=}
    elif [ ${#opts[@]} -eq 0 ] && [[ $tok == *=* && $tok != -* ]]; then envs+=("$tok"); else opts+=("$tok"); fi
  done
  env "${envs[@]}" "$bin" mount "$A" "$W/mnt" --no-disk-cache "${opts[@]}" >"$W/out" 2>"$W/err" \
    || { echo "mount failed ($label): $(tail -1 "$W/err")" >&2; exit 1; }
  local t pid
  pid=$(grep -o '(pid [0-9]*' "$W/out" | grep -o '[0-9]*')
  t=$(timed_cat "$W/mnt/model.safetensors")
  # The daemon's CPU seconds (user, system) for the pass: how much work a chunk costs,
  # apart from how long the reader waited for it.
  local cpu
  cpu=$(awk -v hz="$(getconf CLK_TCK)" '{ printf "cpu %.2f user %.2f sys", $14 / hz, $15 / hz }' "/proc/$pid/stat")
  echo "$label $t $cpu $("$bin" stat "$W/mnt" | grep -o 'hits [0-9]* (prefetch [0-9]*)  misses [0-9]*')" \
    "load mean $("$bin" stat "$W/mnt" --json | python3 -c 'import json, sys; print(round(json.load(sys.stdin)["cache"].get("load_latency_us", {}).get("mean", 0)))') us"
  "$bin" umount "$W/mnt" >/dev/null
}
for _ in $(seq "$ROUNDS"); do
  memfs
  for v in "$@"; do cold "${v%%=*}" "${v#*=}"; done
done | tee "$W/log"
python3 - "$W/log" <<'PY'
import collections, statistics, sys
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    p = line.split()
    try:
        t[p[0]].append(float(p[1]))
    except (ValueError, IndexError):
        continue
cpu = collections.defaultdict(list)
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) > 6 and p[2] == "cpu":
        cpu[p[0]].append(float(p[3]) + float(p[5]))
m = statistics.median(t["memfs"])
for k, v in t.items():
    c = f"  daemon cpu {statistics.median(cpu[k]):.2f} s" if cpu[k] else ""
    print(f"{k:16} median {statistics.median(v):.4f} s  memfs/this {m / statistics.median(v):.3f}"
          f"  ({' '.join(f'{x:.3f}' for x in v)}){c}")
PY

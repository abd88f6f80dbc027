#!/usr/bin/env bash
# The GPU checks (issue 17, docs/CUDA.md): run where a CUDA GPU is; `.ci/run` never runs
# them (CI has no GPU), and the project's own tests need none.
#
#   scripts/test-cuda.sh [--bench N] SOURCE...
#
# Each SOURCE (a GGUF file or a Hugging Face directory) is converted to every archive
# kind (.cawsf NDSQ, .cawsf passthrough, delta f16 and int8 bases, npy-dir int8 and int4,
# .cawsf NDSQ with scalar R: 4 bits alone, and 3 bits under a rank-300 L with outliers,
# which also takes the kernels' U staging past one shared-memory piece);
# for each archive `cawsfs device-check` reconstructs every tensor on the CPU and on the
# GPU and compares the bytes (with --bench N, times both per codec), and the virtual
# files are exported with --device cpu and --device cuda and compared with cmp. A
# Hugging Face SOURCE is also exported as GGUF in every ggml type the views produce, and
# each of those re-imported as a passthrough archive and checked: the GPU's ggml
# dequantizers against the CPU's. Then the end-to-end export and, where /dev/fuse
# works, cold mount reads, CPU against GPU, interleaved.
#
# CAWSFS_BIN names the binary (default target/release/cawsfs), WORK the scratch
# directory; EXPORTS=0 skips the export comparisons, GGML=0 the ggml types and KINDS
# ("ndsq.cawsf delta ...") picks archive kinds (for a large source measured for speed);
# MEMFS_BIN (examples/memfs) adds the FUSE ceiling.
# Prints one line per check; exits non-zero if any byte differs.
set -uo pipefail
BIN="${CAWSFS_BIN:-target/release/cawsfs}"
BENCH=0
if [ "${1:-}" = "--bench" ]; then
  BENCH="$2"
  shift 2
fi
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$WORK"
fails=0
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }
say() { printf '%s\n' "$*"; }
fail() {
  say "FAIL: $*"
  fails=$((fails + 1))
}

check_archive() { # ARCHIVE LABEL
  local a="$1" label="$2"
  if ! timeout 600 "$BIN" device-check "$a" --bench "$BENCH"; then
    fail "device-check $label"
  fi
  [ "${EXPORTS:-1}" = 1 ] || return 0
  local views=("--format safetensors" "--format safetensors --dtype f32" "--format gguf")
  for v in "${views[@]}"; do
    # shellcheck disable=SC2086
    timeout 600 "$BIN" export "$a" $v -o "$WORK/x.cpu" --device cpu >/dev/null 2>"$WORK/err" \
      || { fail "export $label $v (cpu): $(tail -1 "$WORK/err")"; continue; }
    # shellcheck disable=SC2086
    timeout 600 "$BIN" export "$a" $v -o "$WORK/x.gpu" --device cuda >/dev/null 2>"$WORK/err" \
      || { fail "export $label $v (cuda): $(tail -1 "$WORK/err")"; continue; }
    local n
    n=$(cmp -l "$WORK/x.cpu" "$WORK/x.gpu" 2>/dev/null | wc -l)
    if [ "$n" = 0 ] && cmp -s "$WORK/x.cpu" "$WORK/x.gpu"; then
      say "identical: $label export $v ($(stat -c %s "$WORK/x.gpu") bytes)"
    else
      fail "$label export $v: $n bytes differ"
    fi
  done
}

for src in "$@"; do
  name=$(basename "$src")
  name="${name%.gguf}"
  declare -a kinds=(
    "ndsq.cawsf|--pq-dim 2"
    "bpw.cawsf|"
    "pass.cawsf|--passthrough *"
    "delta|--to delta"
    "delta-int8|--to delta --base-dtype int8"
    "npy8|--to npy-dir"
    "npy4|--to npy-dir --bits 4"
    "sq4.cawsf|--sq-bits 4 --rank 0 --outlier-q 1"
    "sqlr.cawsf|--sq-bits 3 --sq-group 64 --rank 300"
  )
  for k in "${kinds[@]}"; do
    ext="${k%%|*}"
    opts="${k#*|}"
    case " ${KINDS:-${kinds[*]%%|*}} " in *" $ext "*) ;; *) continue ;; esac
    out="$WORK/$name.$ext"
    t0=$(now)
    set -f
    # shellcheck disable=SC2086
    if ! timeout 900 "$BIN" convert "$src" -o "$out" $opts >/dev/null 2>"$WORK/err"; then
      set +f
      fail "convert $name $opts: $(tail -1 "$WORK/err")"
      continue
    fi
    set +f
    say "converted $name -> $ext in $(since "$t0") s"
    check_archive "$out" "$name.$ext"
  done
  if [ -d "$src" ] && [ "${GGML:-1}" = 1 ]; then
    # Every ggml type the views write, re-imported as passthrough: the dequantizers.
    for ty in q8_0 q6_k q5_k q5_1 q5_0 q4_k q4_1 q4_0 q3_k q2_k f16 bf16 f32; do
      g="$WORK/$name.$ty.gguf"
      if ! timeout 600 "$BIN" export "$WORK/$name.pass.cawsf" --format gguf --gguf-type "$ty" \
        -o "$g" --device cpu >/dev/null 2>"$WORK/err"; then
        say "skipped $ty: $(tail -1 "$WORK/err")"
        continue
      fi
      if ! timeout 600 "$BIN" convert "$g" -o "$g.cawsf" --passthrough '*' >/dev/null 2>"$WORK/err"; then
        fail "convert $g: $(tail -1 "$WORK/err")"
        continue
      fi
      timeout 600 "$BIN" device-check "$g.cawsf" --bench "$BENCH" || fail "device-check $name.$ty"
      rm -f "$g" "$g.cawsf"
    done
  fi
done

# The fallback: every third GPU batch made to fail; the bytes must not change, and the
# log says so (one line per failure).
if [ "$#" -gt 0 ]; then
  name=$(basename "$1")
  name="${name%.gguf}"
  a="$WORK/$name.ndsq.cawsf"
  if [ -e "$a" ]; then
    "$BIN" export "$a" --format safetensors -o "$WORK/f.cpu" --device cpu >/dev/null 2>&1
    CAWSFS_CUDA_FAIL_EVERY=3 "$BIN" export "$a" --format safetensors -o "$WORK/f.gpu" \
      --device cuda >/dev/null 2>"$WORK/f.err"
    warned=$(grep -c "GPU reconstruction failed, computed on the CPU instead: CUDA: injected" "$WORK/f.err")
    if cmp -s "$WORK/f.cpu" "$WORK/f.gpu" && [ "$warned" -gt 0 ]; then
      say "identical with every third GPU batch failed: $name ($warned fallback lines)"
    else
      fail "fallback: $name export differs or no fallback logged ($warned lines)"
    fi
    # Every batch failing: after 8 in a row the GPU rests (batches go to the CPU
    # untried), so a dead GPU costs a handful of failed batches, not one per read.
    CAWSFS_CUDA_FAIL_EVERY=1 "$BIN" export "$a" --format safetensors -o "$WORK/f.gpu" \
      --device cuda >/dev/null 2>"$WORK/f.err"
    failed=$(grep -c "GPU reconstruction failed" "$WORK/f.err")
    rested=$(grep -c "reconstructing on the CPU for 1 s" "$WORK/f.err")
    if cmp -s "$WORK/f.cpu" "$WORK/f.gpu" && [ "$rested" = 1 ] && [ "$failed" -le 32 ]; then
      say "identical with every GPU batch failed: $name ($failed failed batches, then the GPU rested)"
    else
      fail "breaker: $name export differs, or $failed failed batches and $rested rests logged"
    fi
    rm -f "$WORK/f.cpu" "$WORK/f.gpu"
  fi
fi

# Residency under a tiny --vram-budget (entries evicted, or too large to keep and sent
# with each batch) and four concurrent readers of a GPU mount: bytes as the CPU's.
if [ "$#" -gt 0 ] && [ -e /dev/fuse ]; then
  name=$(basename "$1")
  name="${name%.gguf}"
  mkdir -p "$WORK/mnt"
  for ext in ndsq.cawsf delta npy8; do
    a="$WORK/$name.$ext"
    [ -e "$a" ] || continue
    timeout 600 "$BIN" device-check "$a" --vram-budget 64KiB | tail -1 || fail "device-check $name.$ext with a 64 KiB budget"
    "$BIN" export "$a" --format safetensors -o "$WORK/c.cpu" --device cpu >/dev/null 2>&1
    if ! "$BIN" mount "$a" "$WORK/mnt" --no-disk-cache --device cuda --vram-budget 64KiB \
      --threads 8 --prefetch-threads 4 --cache-size 32MiB >/dev/null 2>"$WORK/err"; then
      fail "mount $name.$ext: $(tail -1 "$WORK/err")"
      continue
    fi
    for i in 1 2 3 4; do cat "$WORK/mnt/model.safetensors" >"$WORK/c.$i" & done
    wait
    for i in 1 2 3 4; do
      cmp -s "$WORK/c.$i" "$WORK/c.cpu" || fail "$name.$ext: mount reader $i differs from the CPU's export"
    done
    say "mount readers, 64 KiB budget, $name.$ext: $("$BIN" stat "$WORK/mnt" | grep '^device')"
    "$BIN" umount "$WORK/mnt"
    rm -f "$WORK"/c.*
  done
fi

# End to end: export of the first source's NDSQ archive, CPU and GPU interleaved.
if [ "$#" -gt 0 ] && [ "$BENCH" -gt 0 ]; then
  name=$(basename "$1")
  name="${name%.gguf}"
  for a in "$WORK/$name.ndsq.cawsf" "$WORK/$name.delta" "$WORK/$name.npy8"; do
    [ -e "$a" ] || continue
    for r in 1 2 3; do
      for dev in cpu cuda; do
        t0=$(now)
        "$BIN" export "$a" --format safetensors -o "$WORK/e.$dev" --device "$dev" >/dev/null 2>&1
        say "export-time $(basename "$a") $dev round $r: $(since "$t0") s"
      done
    done
  done
  # Cold mount reads (fresh daemon, no disk tier) where FUSE works here.
  a="$WORK/$name.ndsq.cawsf"
  mkdir -p "$WORK/mnt"
  if [ -e /dev/fuse ] && [ -e "$a" ]; then
    for r in 1 2 3; do
      for dev in cpu cuda; do
        if ! "$BIN" mount "$a" "$WORK/mnt" --no-disk-cache --device "$dev" 2>"$WORK/err"; then
          say "mount failed ($dev): $(tail -1 "$WORK/err")"
          break 2
        fi
        t0=$(now)
        cat "$WORK/mnt/model.safetensors" >/dev/null
        dt=$(since "$t0")
        size=$(stat -c %s "$WORK/mnt/model.safetensors")
        say "cold-read $dev round $r: $size bytes in $dt s"
        "$BIN" stat "$WORK/mnt" | grep '^device' || true
        "$BIN" umount "$WORK/mnt"
      done
    done
    if [ -n "${MEMFS_BIN:-}" ]; then
      cp "$WORK/e.cpu" /dev/shm/memfs.bin 2>/dev/null || true
      for r in 1 2 3; do
        "$MEMFS_BIN" /dev/shm/memfs.bin "$WORK/mnt" &
        pid=$!
        for _ in $(seq 50); do [ -e "$WORK/mnt/memfs.bin" ] && break; sleep 0.1; done
        t0=$(now)
        cat "$WORK/mnt/memfs.bin" >/dev/null
        say "memfs-read round $r: $(stat -c %s /dev/shm/memfs.bin) bytes in $(since "$t0") s"
        kill $pid
        wait $pid 2>/dev/null
        fusermount3 -u "$WORK/mnt" 2>/dev/null || fusermount -u "$WORK/mnt" 2>/dev/null || umount "$WORK/mnt" 2>/dev/null
      done
      rm -f /dev/shm/memfs.bin
    fi
  else
    say "no /dev/fuse: mount reads not measured"
  fi
fi

if [ "$fails" -gt 0 ]; then
  say "test-cuda: $fails checks failed"
  exit 1
fi
say "test-cuda: every check passed"

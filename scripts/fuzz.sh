#!/usr/bin/env bash
# Fuzz every parser of untrusted bytes with AFL++ through cargo-afl, on stable Rust
# (docs/RELIABILITY.md, "Fuzzing").
#
#   scripts/fuzz.sh [--ci] [SECONDS] [TARGET...]
#
# Installs cargo-afl (pinned) under ~/.cache/cawsfs/cargo-afl when missing, builds the
# targets of fuzz/ with AFL instrumentation, regenerates the seed corpus from archives
# the converters write (fuzz/corpus/, not committed), then runs each target for SECONDS
# (default 60; --ci: 20) and prints per target: executions, exec/s, crashes, hangs.
# Exits 1 when any target saved a crash; the crashing inputs are kept in
# fuzz/out/TARGET/default/crashes/. Targets: all by default (see fuzz/Cargo.toml).
#
# Environment: FUZZ_NICE (default 19), FUZZ_TIMEOUT_MS (per-execution hang limit, default
# 2000), CARGO_AFL_ROOT (where cargo-afl is installed, default ~/.cache/cawsfs/cargo-afl).
set -euo pipefail

AFL_VERSION=0.18.2
ALL_TARGETS=(cawsf delta npydir npy_header gguf safetensors hf_json routing control)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
FUZZ=$ROOT/fuzz
CI=0
SECS=
TARGETS=()
for a in "$@"; do
    case $a in
        --ci) CI=1 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        ''|*[!0-9]*) TARGETS+=("$a") ;;
        *) SECS=$a ;;
    esac
done
if [ -z "$SECS" ]; then
    if [ $CI = 1 ]; then SECS=20; else SECS=60; fi
fi
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL_TARGETS[@]}")
for t in "${TARGETS[@]}"; do
    [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || { echo "unknown target $t (${ALL_TARGETS[*]})" >&2; exit 2; }
done
NICE=${FUZZ_NICE:-19}

# cargo-afl, pinned: the one on PATH if it is this version, else the cached install.
AFL_ROOT=${CARGO_AFL_ROOT:-$HOME/.cache/cawsfs/cargo-afl}
afl_ok() { cargo afl --version 2>/dev/null | grep -q "$AFL_VERSION"; }
if ! afl_ok; then
    export PATH=$AFL_ROOT/bin:$PATH
    if ! afl_ok; then
        echo "== installing cargo-afl $AFL_VERSION into $AFL_ROOT"
        nice -n "$NICE" cargo install "cargo-afl@$AFL_VERSION" --locked --root "$AFL_ROOT"
    fi
fi

cd "$FUZZ"
echo "== building fuzz targets (cargo afl build)"
nice -n "$NICE" cargo afl build --locked --quiet
BIN=${CARGO_TARGET_DIR:-$FUZZ/target}/debug

echo "== seed corpus"
rm -rf corpus
nice -n "$NICE" "$BIN/gen_seeds" corpus

printf '\n%-12s %12s %9s %8s %6s %6s\n' target executions exec/s seconds crashes hangs
FAILED=()
for t in "${TARGETS[@]}"; do
    out=out/$t
    rm -rf "$out"
    mkdir -p out
    # -V: stop after SECS; no UI; AFL_NO_AFFINITY: the cores are shared.
    if ! AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_SKIP_CPUFREQ=1 AFL_NO_UI=1 \
        AFL_NO_AFFINITY=1 \
        nice -n "$NICE" cargo afl fuzz -V "$SECS" -t "${FUZZ_TIMEOUT_MS:-2000}" \
        -i "corpus/$t" -o "$out" "$BIN/$t" >"out/$t.log" 2>&1; then
        echo "$t: afl-fuzz failed, see fuzz/out/$t.log:" >&2
        tail -n 15 "out/$t.log" >&2
        FAILED+=("$t")
        continue
    fi
    stats=$out/default/fuzzer_stats
    get() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$stats"; }
    crashes=$(find "$out/default/crashes" -type f -name 'id:*' 2>/dev/null | wc -l)
    hangs=$(find "$out/default/hangs" -type f -name 'id:*' 2>/dev/null | wc -l)
    printf '%-12s %12s %9s %8s %6s %6s\n' "$t" "$(get execs_done)" "$(get execs_per_sec)" \
        "$(get run_time)" "$crashes" "$hangs"
    [ "$crashes" = 0 ] || FAILED+=("$t")
done

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${FAILED[*]} (inputs in fuzz/out/TARGET/default/crashes/; replay: fuzz/target/debug/TARGET < FILE)" >&2
    exit 1
fi
echo "no crashes"

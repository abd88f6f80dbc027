#!/usr/bin/env bash
# Fuzz every parser of untrusted bytes with AFL++ through cargo-afl, on stable Rust
# (docs/RELIABILITY.md, "Fuzzing").
#
#   scripts/fuzz.sh [--ci] [SECONDS] [TARGET...]
#   scripts/fuzz.sh --long SECONDS [--force] [TARGET...]
#
# Installs cargo-afl (pinned) under ~/.cache/cawsfs/cargo-afl when missing, builds the
# targets of fuzz/ with AFL instrumentation, regenerates the seed corpus from archives
# the converters write (fuzz/corpus/, not committed), then runs each target for SECONDS
# (default 60; --ci: 20) and prints per target: executions, exec/s, crashes, hangs.
# Exits 1 when any target saved a crash; the crashing inputs are kept in
# fuzz/out/TARGET/default/crashes/. Targets: all by default (see fuzz/Cargo.toml).
#
# --long: a resumable campaign per target in $FUZZ_LONG_DIR/TARGET (default
# ~/.cache/cawsfs/fuzz-long, outside the repository): each target in turn, one at a
# time, runs SECONDS more (resuming its queue when the campaign exists, seeding it from
# fuzz/corpus when not), then its cumulative executions, crashes, hangs and the cawsfs
# commits it has run against are printed (FUZZ_LONG_DIR/TARGET/sessions: one line per
# session). A target with >= 10 M executions and 0 crashes is done and skipped unless
# --force. Default order: cheapest first. SIGINT/SIGTERM stop the running target
# cleanly (its session is recorded; the next run resumes it) and end the run.
# `scripts/fuzz.sh --long 0` only prints the state of every campaign.
#
# Environment: FUZZ_NICE (default 19), FUZZ_TIMEOUT_MS (per-execution hang limit, default
# 2000), CARGO_AFL_ROOT (where cargo-afl is installed, default ~/.cache/cawsfs/cargo-afl),
# FUZZ_LONG_DIR, FUZZ_LONG_GOAL (executions that make a target done, default 10000000).
set -euo pipefail

AFL_VERSION=0.18.2
ALL_TARGETS=(cawsf delta npydir npy_header gguf safetensors hf_json routing control imatrix)
# --long's default order: cheapest executions first.
LONG_ORDER=(control routing npy_header imatrix cawsf delta npydir hf_json safetensors gguf)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
FUZZ=$ROOT/fuzz
CI=0
LONG=0
FORCE=0
SECS=
TARGETS=()
for a in "$@"; do
    case $a in
        --ci) CI=1 ;;
        --long) LONG=1 ;;
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        ''|*[!0-9]*) TARGETS+=("$a") ;;
        *) SECS=$a ;;
    esac
done
if [ $LONG = 1 ] && [ -z "$SECS" ]; then
    echo "--long needs SECONDS (per target)" >&2; exit 2
fi
if [ -z "$SECS" ]; then
    if [ $CI = 1 ]; then SECS=20; else SECS=60; fi
fi
if [ ${#TARGETS[@]} = 0 ]; then
    if [ $LONG = 1 ]; then TARGETS=("${LONG_ORDER[@]}"); else TARGETS=("${ALL_TARGETS[@]}"); fi
fi
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

LONG_DIR=${FUZZ_LONG_DIR:-$HOME/.cache/cawsfs/fuzz-long}
GOAL=${FUZZ_LONG_GOAL:-10000000}

# A key of an AFL fuzzer_stats file ($1: file, $2: key), empty when absent.
stat_of() { [ -f "$1" ] && awk -F' *: *' -v k="$2" '$1 == k { print $2 }' "$1" || true; }

# The cumulative state of the campaign of target $1 (its sessions file: one line per
# session, "UTC-date commit seconds executions execs_done-after").
long_sum() { # $1 target, $2 column of its sessions file
    local f=$LONG_DIR/$1/sessions
    if [ -f "$f" ]; then awk -v c="$2" '{ n += $c } END { print n + 0 }' "$f"; else echo 0; fi
}
long_total() { long_sum "$1" 4; }
long_count() {
    local d=$LONG_DIR/$1/afl/default/$2
    if [ -d "$d" ]; then find "$d" -type f -name 'id:*' | wc -l; else echo 0; fi
}
long_commits() {
    local f=$LONG_DIR/$1/sessions
    [ ! -f "$f" ] || awk '!seen[$2]++ { printf "%s%s", sep, $2; sep = " " }' "$f"
}
long_report() {
    printf '\n%-12s %12s %7s %6s %6s %-6s %s\n' target executions seconds crashes hangs state commits
    for t in "${TARGETS[@]}"; do
        local n c h st secs
        n=$(long_total "$t")
        secs=$(long_sum "$t" 3)
        c=$(long_count "$t" crashes)
        h=$(long_count "$t" hangs)
        if [ ! -d "$LONG_DIR/$t/afl" ]; then st=new
        elif [ "$c" != 0 ]; then st=CRASH
        elif [ "$n" -ge "$GOAL" ]; then st=done
        else st=open; fi
        printf '%-12s %12s %7s %6s %6s %-6s %s\n' "$t" "$n" "$secs" "$c" "$h" "$st" "$(long_commits "$t")"
    done
    echo "(campaigns in $LONG_DIR; done = >= $GOAL executions and 0 crashes)"
}
if [ $LONG = 1 ] && [ "$SECS" = 0 ]; then
    long_report
    exit 0
fi

cd "$FUZZ"
echo "== building fuzz targets (cargo afl build)"
nice -n "$NICE" cargo afl build --locked --quiet
BIN=${CARGO_TARGET_DIR:-$FUZZ/target}/debug
FAILED=()

echo "== seed corpus"
rm -rf corpus
nice -n "$NICE" "$BIN/gen_seeds" corpus

if [ $LONG = 1 ]; then
    COMMIT=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
    if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        COMMIT=$COMMIT+dirty
    fi
    STOP=0
    AFL_PID=
    on_signal() {
        STOP=1
        # afl-fuzz runs in its own session (setsid): signal its process group; it stops
        # cleanly on SIGINT (queue and stats written, resumable).
        [ -z "$AFL_PID" ] || kill -INT -- "-$AFL_PID" 2>/dev/null || true
    }
    trap on_signal INT TERM
    for t in "${TARGETS[@]}"; do
        [ $STOP = 0 ] || break
        dir=$LONG_DIR/$t
        n=$(long_total "$t")
        c=$(long_count "$t" crashes)
        if [ $FORCE = 0 ] && [ "$n" -ge "$GOAL" ] && [ "$c" = 0 ]; then
            echo "== $t: done ($n executions, 0 crashes), skipped (--force runs it)"
            continue
        fi
        mkdir -p "$dir"
        stats=$dir/afl/default/fuzzer_stats
        if [ -f "$stats" ]; then
            input=-
            echo "== $t: resuming ($n executions so far), $SECS s"
            # afl-fuzz writes fastresume.bin as it exits; a session killed before this
            # script recorded it may have left it cut short, and resuming from that
            # aborts ("Short read from queue data"). Resume the slow way instead.
            fast=$dir/afl/default/fastresume.bin
            if [ -f "$fast" ] && { [ ! -f "$dir/sessions" ] || [ "$fast" -nt "$dir/sessions" ]; }; then
                mv "$fast" "$fast.unrecorded"
                echo "   $t: the last session was not recorded (killed?): its fastresume.bin set aside, the queue calibrated again"
            fi
        else
            rm -rf "$dir/afl"
            input=corpus/$t
            echo "== $t: new campaign from fuzz/corpus/$t, $SECS s"
        fi
        # -E: stop at the goal (afl-fuzz counts executions over resumes too).
        limit=()
        [ $FORCE = 1 ] || limit=(-E "$GOAL")
        before=$(stat_of "$stats" execs_done)
        started=$(date +%s)
        # AFL_AUTORESUME: resume rather than refuse a used output directory.
        AFL_AUTORESUME=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_SKIP_CPUFREQ=1 \
            AFL_NO_UI=1 AFL_NO_AFFINITY=1 \
            setsid nice -n "$NICE" cargo afl fuzz -V "$SECS" "${limit[@]}" -t "${FUZZ_TIMEOUT_MS:-2000}" \
            -i "$input" -o "$dir/afl" "$BIN/$t" >>"$dir/afl.log" 2>&1 &
        AFL_PID=$!
        rc=0
        wait "$AFL_PID" || rc=$?
        # A signal interrupts `wait`, not afl-fuzz: wait for it to write its stats.
        while kill -0 "$AFL_PID" 2>/dev/null; do wait "$AFL_PID" || rc=$?; done
        AFL_PID=
        secs=$(($(date +%s) - started))
        after=$(stat_of "$stats" execs_done)
        if [ -z "$after" ]; then
            echo "$t: afl-fuzz failed (rc $rc), see $dir/afl.log:" >&2
            tail -n 15 "$dir/afl.log" >&2
            FAILED+=("$t")
            continue
        fi
        # AFL++ carries execs_done over a resume; count only this session's.
        added=$((after - ${before:-0}))
        [ "$added" -ge 0 ] || added=$after
        if [ $STOP = 0 ] && [ "$rc" != 0 ] && [ "$added" = 0 ]; then
            echo "$t: afl-fuzz stopped at once (rc $rc), see $dir/afl.log:" >&2
            tail -n 8 "$dir/afl.log" >&2
            FAILED+=("$t")
            continue
        fi
        echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $COMMIT $secs $added $after" >>"$dir/sessions"
        c=$(long_count "$t" crashes)
        echo "   $t: +$added executions in $secs s ($(stat_of "$stats" execs_per_sec)/s this session), crashes $c"
        [ "$c" = 0 ] || FAILED+=("$t")
    done
    trap - INT TERM
    long_report
    if [ ${#FAILED[@]} -gt 0 ]; then
        echo "FAILED: ${FAILED[*]} (why: above; crashes are kept in $LONG_DIR/TARGET/afl/default/crashes/, replay: fuzz/target/debug/TARGET < FILE)" >&2
        exit 1
    fi
    exit 0
fi

printf '\n%-12s %12s %9s %8s %6s %6s\n' target executions exec/s seconds crashes hangs
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

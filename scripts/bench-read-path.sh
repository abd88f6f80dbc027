#!/usr/bin/env bash
# Compare the archive read path of two cawsfs binaries: full `export --format gguf`
# (every block read, checked and decoded) of the test model as .cawsf and as npy-dir
# (plain .npy, where blocks used to be borrowed from a mapping with no copy), archives
# in the page cache, runs interleaved A B A B..., medians and the ratio B/A.
# Usage: scripts/bench-read-path.sh BIN_A BIN_B [ROUNDS]
set -euo pipefail
A=$(realpath "$1")
B=$(realpath "$2")
ROUNDS=${3:-7}
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
MODEL=$(ls ~/.cache/cawsfs/models/*.gguf | head -n 1)
WORK=$(mktemp -d /tmp/bench-read-path.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
"$B" convert "$MODEL" -o "$WORK/m.cawsf" >/dev/null
# Each binary its own npy-dir (cawsfs.json versions may differ; the .npy files do not).
"$A" convert "$MODEL" --to npy-dir -o "$WORK/npy-a" >/dev/null
"$B" convert "$MODEL" --to npy-dir -o "$WORK/npy-b" >/dev/null
OUT=/dev/shm/bench-read-path.gguf
python3 - "$A" "$B" "$ROUNDS" "$WORK" "$OUT" <<'EOF'
import statistics, subprocess, sys, time
a, b, rounds, work, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
print(f"A = {a}\nB = {b}\n{rounds} rounds, interleaved, export --format gguf to /dev/shm")
for name, arch in [("cawsf", f"{work}/m.cawsf"), ("npy-dir", f"{work}/npy-X")]:
    times = {a: [], b: []}
    for i in range(rounds + 1):
        for binary in (a, b) if i % 2 == 0 else (b, a):
            t = time.perf_counter()
            src = arch.replace("npy-X", "npy-a" if binary == a else "npy-b")
            subprocess.run([binary, "export", src, "--format", "gguf", "-o", out],
                           check=True, stdout=subprocess.DEVNULL)
            if i > 0:  # the first round warms the page cache
                times[binary].append(time.perf_counter() - t)
    ma, mb = statistics.median(times[a]), statistics.median(times[b])
    print(f"{name:8} A {ma:.3f} s  B {mb:.3f} s  B/A {mb / ma:.3f}")
EOF
rm -f "$OUT"

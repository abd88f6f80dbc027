#!/usr/bin/env bash
# Peak anonymous memory (RssAnon) of the mount daemon with a 16 MiB cache while the test
# model's model.gguf and model.safetensors are read sequentially, then 3 000 random
# preads (4 KiB, 64 KiB, 1 MiB). Extra mount options go in $EXTRA.
# Usage: scripts/bench-rss.sh [BIN]     e.g. EXTRA="--threads 1 --prefetch-threads 1"
set -euo pipefail
cd "$(dirname "$0")/.."
B=$(realpath "${1:-target/release/cawsfs}")
scripts/setup.sh >/dev/null
MODEL=$(ls ~/.cache/cawsfs/models/*.gguf | head -n 1)
W=$(mktemp -d /tmp/bench-rss.XXXXXX)
trap 'rm -rf "$W"' EXIT
"$B" convert "$MODEL" -o "$W/a.cawsf" >/dev/null
mkdir "$W/m"
# shellcheck disable=SC2086
out=$("$B" mount "$W/a.cawsf" "$W/m" --cache-size 16MiB --no-disk-cache ${EXTRA:-})
pid=$(echo "$out" | grep -o 'pid [0-9]*' | cut -d' ' -f2)
sleep 3  # past the trim after setup
idle=$(awk '/RssAnon/{print $2}' "/proc/$pid/status")
(
    peak=0
    while [ -e "/proc/$pid" ]; do
        a=$(awk '/RssAnon/{print $2}' "/proc/$pid/status" 2>/dev/null || true)
        if [ -n "$a" ] && [ "$a" -gt "$peak" ]; then peak=$a; echo "$peak" > "$W/peak"; fi
        sleep 0.01
    done
) &
cat "$W/m/model.gguf" "$W/m/model.safetensors" > /dev/null
python3 - "$W/m/model.safetensors" <<'PY'
import os, random, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
n = os.fstat(fd).st_size
r = random.Random(1)
for _ in range(3000):
    os.pread(fd, r.choice([4096, 65536, 1 << 20]), r.randrange(n))
PY
"$B" umount "$W/m" >/dev/null
wait
echo "idle RssAnon $((idle / 1024)) MiB; peak RssAnon $(($(cat "$W/peak") / 1024)) MiB with a 16 MiB cache (${EXTRA:-default threads})"

#!/usr/bin/env bash
# Convert the test model to every archive kind and setting the refactors must keep
# byte-identical, export every view of each, and print one "sha256  name" line per file.
# Two binaries are identical in what they write when their outputs diff clean:
#   scripts/archive-digests.sh OLD_BIN /tmp/old > old.txt
#   scripts/archive-digests.sh NEW_BIN /tmp/new > new.txt && diff old.txt new.txt
set -euo pipefail
bin="$(realpath "$1")"; out="$2"
here="$(cd "$(dirname "$0")" && pwd)"
model="$("$here/fetch-test-model.sh")"
rm -rf "$out"; mkdir -p "$out"; cd "$out"
run() { "$bin" "$@" >/dev/null 2>"$out/last.log" || { cat "$out/last.log" >&2; exit 1; }; }
# Explicit settings, not the default (which changed from PQ to --bpw 5 on 2026-11-27).
run convert "$model" -o cawsf-pq.cawsf --threads 2 --pq-dim 2
run convert "$model" -o cawsf-bpw5.cawsf --threads 2 --bpw 5
run convert "$model" -o cawsf-lz4.cawsf --compression lz4 --rank 2 --pq-dim 4
run convert "$model" -o cawsf-exact.cawsf --passthrough "*"
run convert "$model" --to delta -o delta-r8.cawsd --rank 8
run convert "$model" --to delta -o delta-int8.cawsd --rank 4 --bases 2 --base-dtype int8
run convert "$model" --to npy-dir -o npy-int8 --bits 8
run convert "$model" --to npy-dir -o npy-int4z --bits 4 --zstd
for a in cawsf-pq.cawsf cawsf-bpw5.cawsf cawsf-lz4.cawsf cawsf-exact.cawsf delta-r8.cawsd delta-int8.cawsd npy-int8 npy-int4z; do
  run export "$a" --format gguf -o "$a.f16.gguf"
  run export "$a" --format safetensors -o "$a.safetensors" --dtype bf16
  run export "$a" --format hf-dir -o "$a.hf"
done
find . -type f ! -name last.log -print0 | sort -z | xargs -0 sha256sum

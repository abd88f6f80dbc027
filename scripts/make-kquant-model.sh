#!/usr/bin/env bash
# Make a small random-weight llama model (Hugging Face directory) whose every 2-D tensor
# has rows of a multiple of 256 values, so K-quants apply without fallbacks, with the test
# model's tokenizer (scripts/make-kquant-model.py says the shape). Cached outside the repo;
# deterministic (fixed seed) and idempotent; prints the directory. With the argument `1b`,
# a 1.17 B-parameter model of the same kind instead (2.3 GB; the disk-tier benchmark's).
# The cawsfs binary used to export the tokenizer is $CAWSFS_BIN, else this checkout's
# release build (built if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${CAWSFS_CACHE:-$HOME/.cache/cawsfs}"
# Bump the suffix when the shape or seed in make-kquant-model.py changes.
shape="${1:-k256}"
case "$shape" in
  k256) OUT="$CACHE/models/llama-k256-random-v1" ;;
  1b) OUT="$CACHE/models/llama-1b-random-v1" ;;
  *) echo "make-kquant-model.sh: unknown shape '$shape' (k256, 1b)" >&2; exit 2 ;;
esac
if [ ! -s "$OUT/model.safetensors" ]; then
  if [ -n "${CAWSFS_BIN:-}" ]; then
    exe="$CAWSFS_BIN"
  else
    cargo build --release --quiet >&2
    exe="${CARGO_TARGET_DIR:-target}/release/cawsfs"
  fi
  gguf=$(scripts/fetch-test-model.sh)
  mkdir -p "$CACHE/models"
  tmp=$(mktemp -d "$CACHE/models/.kquant.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  # The tokenizer files as cawsfs derives them from the GGUF; the weights are not used.
  "$exe" convert "$gguf" -o "$tmp/src.cawsf" --passthrough '*' >/dev/null
  "$exe" export "$tmp/src.cawsf" --format hf-dir -o "$tmp/src-hf" >/dev/null
  python3 scripts/make-kquant-model.py "$tmp/src-hf" "$tmp/model" "$shape"
  rm -rf "$OUT"
  mv "$tmp/model" "$OUT"
fi
echo "$OUT"

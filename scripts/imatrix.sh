#!/usr/bin/env bash
# One command from a model to an importance matrix for `cawsfs convert --imatrix`
# (docs/IMATRIX.md): llama.cpp's llama-imatrix over calibration text, on the model itself
# when it is a GGUF file, else on an F16 GGUF exported from a bit-exact archive of it.
# Usage: scripts/imatrix.sh SRC OUT [TEXT_FILE...]
#   SRC   a Hugging Face directory or a .gguf file (what `cawsfs convert` takes)
#   OUT   the importance matrix to write (GGUF)
#   TEXT  calibration text; default: the licenses Debian's base-files ships that
#         scripts/quality.sh does not score (Artistic BSD CC0-1.0 LGPL-3 MPL-1.1).
# CHUNKS (default 10) chunks of 512 tokens are used.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,11p' "$0" >&2; exit 2; }
src=$(realpath "$1") out=$(realpath -m "$2")
shift 2
texts=()
for t in "$@"; do texts+=("$(realpath "$t")"); done
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=$(scripts/build-llama-cpp.sh)
cawsfs=./target/release/cawsfs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ${#texts[@]} -eq 0 ]; then
  for t in Artistic BSD CC0-1.0 LGPL-3 MPL-1.1; do texts+=("/usr/share/common-licenses/$t"); done
fi
cat "${texts[@]}" > "$work/calib.txt"
if [ -f "$src" ]; then
  model=$src
else
  "$cawsfs" convert "$src" -o "$work/exact.cawsf" --passthrough '*' >/dev/null
  "$cawsfs" export "$work/exact.cawsf" --format gguf --gguf-type f16 -o "$work/model.gguf" >/dev/null
  rm -f "$work/exact.cawsf"
  model=$work/model.gguf
fi
"$bin/llama-imatrix" -m "$model" -f "$work/calib.txt" -c 512 --chunks "${CHUNKS:-10}" \
  -t "$(nproc)" -o "$out" > "$work/imatrix.log" 2>&1 || { tail -n 20 "$work/imatrix.log" >&2; exit 1; }
echo "$out"

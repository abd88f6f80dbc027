#!/usr/bin/env bash
# The table of docs/IMATRIX.md ("Measured"): NDSQ archives of the test model with and
# without an importance matrix, beside llama-quantize's types with and without the same
# matrix, each as bits per weight, perplexity, mean KLD and same-top-1 against the F16
# reference over docs/QUALITY.md's text (4096 scored tokens).
# Usage: scripts/bench-imatrix.sh [OUT.md]   (default: print the table)
set -euo pipefail
set -f  # flags hold `*` patterns; never glob them
cd "$(dirname "$0")/.."
out=${1:-/dev/stdout}
cargo build --release --quiet
model=$(scripts/fetch-test-model.sh)
bin=$(scripts/build-llama-cpp.sh)
cawsfs=./target/release/cawsfs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
texts=(GPL-3 GPL-2 LGPL-2.1 Apache-2.0 MPL-2.0 GFDL-1.3)
for t in "${texts[@]}"; do cat "/usr/share/common-licenses/$t"; done > "$work/text.txt"
ctx=(-c 512 --chunks 16 -t "$(nproc)")
weights=$(python3 -c "import gguf,sys; print(sum(int(t.n_elements) for t in gguf.GGUFReader(sys.argv[1]).tensors))" "$model")
im=$work/smol.imatrix.gguf
CHUNKS=10 scripts/imatrix.sh "$model" "$im" >/dev/null

"$cawsfs" convert "$model" -o "$work/exact.cawsf" --passthrough '*' >/dev/null
"$cawsfs" export "$work/exact.cawsf" --format gguf --gguf-type f16 -o "$work/ref.gguf" >/dev/null
"$cawsfs" export "$work/exact.cawsf" --format gguf --gguf-type f32 -o "$work/ref32.gguf" >/dev/null
"$bin/llama-perplexity" -m "$work/ref.gguf" -f "$work/text.txt" "${ctx[@]}" \
  --kl-divergence-base "$work/ref.kld" > "$work/ref.log" 2>&1

# "| LABEL | IMATRIX | BPW | ppl | KLD ± | top-1 |" of GGUF $1.
row() {
  "$bin/llama-perplexity" -m "$1" --kl-divergence-base "$work/ref.kld" --kl-divergence "${ctx[@]}" \
    > "$work/kld.log" 2>&1
  scripts/kld-log.py "$work/kld.log" "| $2 | $3 | $4 | {ppl:.3f} | {kld:.4f} ± {kld_err:.4f} | {top1:.2f} |"
}
{
  echo "| stored as | importance matrix | bits/weight | perplexity | mean KLD | same top-1 % |"
  echo "|---|---|---|---|---|---|"
  for setting in "default|" "\`--pq-dim 2 --rank 0\`|--pq-dim 2 --rank 0" \
                 "\`--pq-dim 2 --rank 32\`|--pq-dim 2 --rank 32" "\`--pq-dim 4 --rank 16\`|--pq-dim 4 --rank 16"; do
    label=${setting%%|*} args=${setting#*|}
    for with in — yes; do
      extra=()
      [ "$with" = yes ] && extra=(--imatrix "$im")
      # shellcheck disable=SC2086 # $args is a list of flags
      "$cawsfs" convert "$model" -o "$work/a.cawsf" $args "${extra[@]}" >/dev/null
      bpw=$(python3 -c "import os,sys; print(f'{os.path.getsize(sys.argv[1])*8/$weights:.3f}')" "$work/a.cawsf")
      "$cawsfs" export "$work/a.cawsf" --format gguf --gguf-type f16 -o "$work/v.gguf" >/dev/null
      row "$work/v.gguf" "NDSQ $label" "$with" "$bpw"
    done
  done
  for ty in Q4_0 IQ4_XS Q3_K_M Q4_K_M; do
    for with in — yes; do
      extra=()
      [ "$with" = yes ] && extra=(--imatrix "$im")
      "$bin/llama-quantize" "${extra[@]}" "$work/ref32.gguf" "$work/q.gguf" "$ty" > "$work/q.log" 2>&1
      bpw=$(python3 -c "import gguf,sys; r=gguf.GGUFReader(sys.argv[1]); print(f'{sum(int(t.n_bytes) for t in r.tensors)*8/$weights:.3f}')" "$work/q.gguf")
      row "$work/q.gguf" "llama-quantize $ty" "$with" "$bpw"
    done
  done
} > "$out"

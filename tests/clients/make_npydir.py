"""Write a Squish npy-dir (seed 002 §4) from a Hugging Face model directory with numpy
alone — no cawsfs code — so the tests can check that cawsfs mounts directories written by
other tools. Also dequantizes such a directory the way Squish's loader does.

    python3 tests/clients/make_npydir.py HF_DIR OUT_DIR

Layout written (as Squish's convert_weights.py / save_int4_npy_dir / squish_entropy do):
  manifest.json                 {original_name: safe_key}, safe_key = name with '.' → '__'
  tensors/{sk}__shape.npy       int64 original shape
  1-D tensors, embeddings       {sk}__pt.npy   float16 (integer tensors in their own dtype)
  attention projections, and    {sk}__q.npy int8 [n, c] + {sk}__s.npy float32 [n]
  other architectures' matrices
  MLP projections               {sk}__q4.npy uint8 [n, c/2] + {sk}__s4.npy float32 [n, c/64]
                                (low nibble = even column, nibble = q + 7, q in [-7, 7])
  layer 0 q_proj                both int8 and int4 (the int4 files take priority)
  every file of layer 1 and the embedding: replaced by a one-frame .npy.zst
  config.json and tokenizer files copied beside manifest.json
"""
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import zstandard
from safetensors.numpy import load_file

GROUP = 64
SIDE_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.txt"]


def safe_key(name):
    return name.replace(".", "__")


def int8_rows(w):
    s = (np.abs(w).max(axis=1) / 127.0).astype(np.float32)
    s[s == 0] = 1.0
    q = np.clip(np.round(w / s[:, None]), -127, 127).astype(np.int8)
    return q, s


def int4_groups(w):
    n, c = w.shape
    g = w.reshape(n, c // GROUP, GROUP)
    s = (np.abs(g).max(axis=2) / 7.0).astype(np.float32)
    s[s == 0] = 1.0
    q = np.clip(np.round(g / s[:, :, None]), -7, 7).astype(np.int8).reshape(n, c)
    u = (q + 7).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8), s


def save(tdir, name, arr, zst):
    path = tdir / f"{name}.npy"
    np.save(path, arr)
    if zst:
        data = path.read_bytes()
        (tdir / f"{name}.npy.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
        path.unlink()


def write(hf_dir, out):
    hf_dir, out = Path(hf_dir), Path(out)
    tdir = out / "tensors"
    tdir.mkdir(parents=True)
    weights = load_file(str(hf_dir / "model.safetensors"))
    manifest = {}
    for name in sorted(weights):
        sk = safe_key(name)
        manifest[name] = sk
        zst = ".layers.1." in name or "embed_tokens" in name
        save(tdir, f"{sk}__shape", np.array(weights[name].shape, dtype=np.int64), zst)
        if weights[name].dtype.kind in "iub":
            # Integer ids and masks (BERT's position_ids) as they are.
            save(tdir, f"{sk}__pt", weights[name], zst)
            continue
        w = weights[name].astype(np.float32)
        if w.ndim < 2 or "embed_tokens" in name:
            save(tdir, f"{sk}__pt", w.astype(np.float16), zst)
            continue
        if ".mlp." in name or name.endswith("layers.0.self_attn.q_proj.weight"):
            p, s = int4_groups(w)
            save(tdir, f"{sk}__q4", p, zst)
            save(tdir, f"{sk}__s4", s, zst)
        if ".self_attn." in name or ".mlp." not in name:
            # Attention, and every other architecture's matrices, as int8 rows.
            q, s = int8_rows(w)
            save(tdir, f"{sk}__q", q, zst)
            save(tdir, f"{sk}__s", s, zst)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (out / ".squish_int4_ready").touch()
    for f in SIDE_FILES:
        if (hf_dir / f).is_file():
            shutil.copy(hf_dir / f, out / f)


def load(tdir, name):
    p = tdir / f"{name}.npy"
    if p.exists():
        return np.load(p)
    data = zstandard.ZstdDecompressor().decompress((tdir / f"{name}.npy.zst").read_bytes())
    return np.load(io.BytesIO(data))


def exists(tdir, name):
    return (tdir / f"{name}.npy").exists() or (tdir / f"{name}.npy.zst").exists()


def dequantize_dir(out):
    """{name: float32 array}: Squish's priority (int4, int8, passthrough) and formulas."""
    out = Path(out)
    tdir = out / "tensors"
    res = {}
    for name, sk in json.loads((out / "manifest.json").read_text()).items():
        if exists(tdir, f"{sk}__q4"):
            p, s = load(tdir, f"{sk}__q4"), load(tdir, f"{sk}__s4")
            lo = (p & 0x0F).astype(np.float32) - 7
            hi = (p >> 4).astype(np.float32) - 7
            q = np.empty((p.shape[0], p.shape[1] * 2), np.float32)
            q[:, 0::2], q[:, 1::2] = lo, hi
            w = q * np.repeat(s, q.shape[1] // s.shape[1], axis=1)
        elif exists(tdir, f"{sk}__q"):
            w = load(tdir, f"{sk}__q").astype(np.float32) * load(tdir, f"{sk}__s")[:, None]
        else:
            w = load(tdir, f"{sk}__pt")
            w = w if w.dtype.kind in "iub" else w.astype(np.float32)
        res[name] = w.reshape(tuple(load(tdir, f"{sk}__shape")))
    return res


if __name__ == "__main__":
    write(sys.argv[1], sys.argv[2])

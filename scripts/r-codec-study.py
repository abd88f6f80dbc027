#!/usr/bin/env python3
"""Relative error of candidate R (residual) codecs against llama.cpp's quantizers, per tensor.

  scripts/r-codec-study.py REF32.gguf QUANT.gguf [TENSOR ...]

A study for issue 13 (NDSQ fidelity), not a product path: numpy re-implementations of
the residual coder's choices, run on real tensors. REF32.gguf is the test model's F32
export (`cawsfs convert MODEL --passthrough '*'`, then `cawsfs export --format gguf
--gguf-type f32`); QUANT.gguf is the same file through `llama-quantize` (e.g. Q4_K_S).
For each tensor: ||W - What|| / ||W|| of
- QUANT's own type (dequantized with the gguf package),
- plain: rank-4 SVD, then one k-means codebook of 256 centroids on 2-element
  sub-vectors of the residual (today's NDSQ without S and D),
- gG: the same after dividing each group of G columns of the residual by its RMS, with
  the group scale refitted by least squares after assignment and stored as f16,
- g32s8: as g32 with 8-bit group scales relative to the row's largest.
Deterministic (numpy rng seeded 0); a few minutes for the default four tensors.
"""

import sys

import gguf
import numpy as np
from gguf import quants

DEFAULT = ["blk.5.attn_q.weight", "blk.5.ffn_down.weight", "blk.5.attn_v.weight",
           "blk.20.ffn_up.weight"]
rng = np.random.default_rng(0)


def kmeans(x, k=256, iters=12):
    c = x[rng.choice(len(x), k, replace=False)].copy()
    for _ in range(iters):
        a = ((x ** 2).sum(1)[:, None] - 2 * x @ c.T + (c ** 2).sum(1)[None]).argmin(1)
        for j in range(k):
            m = a == j
            if m.any():
                c[j] = x[m].mean(0)
    a = ((x ** 2).sum(1)[:, None] - 2 * x @ c.T + (c ** 2).sum(1)[None]).argmin(1)
    return c, a


def low_rank(w, r):
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vt[:r]


def pq_plain(r):
    c, a = kmeans(r.reshape(-1, 2))
    return c[a].reshape(r.shape)


def pq_group(r, g, scale_bits=16):
    rows, cols = r.shape
    grp = r.reshape(rows, cols // g, g)
    s = np.sqrt((grp ** 2).mean(2, keepdims=True)) + 1e-12
    c, a = kmeans((grp / s).reshape(-1, 2))
    q = c[a].reshape(grp.shape)
    s = (grp * q).sum(2, keepdims=True) / ((q ** 2).sum(2, keepdims=True) + 1e-20)
    if scale_bits == 16:
        s = s.astype(np.float16).astype(np.float32)
    else:
        top = np.abs(s).max(1, keepdims=True)
        s = np.round(s / top * 127) / 127 * top
    return (q * s).reshape(rows, cols)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    ref = {t.name: t for t in gguf.GGUFReader(sys.argv[1]).tensors}
    quant = {t.name: t for t in gguf.GGUFReader(sys.argv[2]).tensors}
    for name in sys.argv[3:] or DEFAULT:
        w = np.array(ref[name].data, dtype=np.float32)
        l = low_rank(w, 4)
        r = w - l
        err = lambda what: np.linalg.norm(w - what) / np.linalg.norm(w)
        q = quant[name]
        wq = quants.dequantize(q.data, q.tensor_type).reshape(w.shape)
        print(f"{name} {w.shape[0]}x{w.shape[1]}: {q.tensor_type.name} {err(wq):.4f}, "
              f"plain {err(l + pq_plain(r)):.4f}, g32 {err(l + pq_group(r, 32)):.4f}, "
              f"g64 {err(l + pq_group(r, 64)):.4f}, g16 {err(l + pq_group(r, 16)):.4f}, "
              f"g32s8 {err(l + pq_group(r, 32, 8)):.4f}", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Measure what the delta kind (docs/DELTA.md) assumes, independently of cawsfs: how
similar each layer's projection weights are to the previous layer's and to the mean of
all layers, and how fast the singular values of W and of W − mean decay.

Usage: scripts/delta-analysis.py MODEL.gguf [--bases K]   (prints Markdown tables)

Weights are the GGUF's dequantized values (gguf-py). Row permutations (llama.cpp's
rotary reordering of Q/K) are the same in every layer, so cosines and singular values
are unaffected by them.
"""
import argparse
import sys

import gguf
import numpy as np

TYPES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
THRESHOLDS = [0.05, 0.1, 0.2, 0.3]


def cos(a, b):
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))


def tail_ranks(s, norm_w):
    """Smallest r with sqrt(sum_{i>=r} s_i^2) / ||W|| <= t, for each threshold."""
    tail = np.sqrt(np.concatenate([np.cumsum((s ** 2)[::-1])[::-1], [0.0]]))
    return [int(np.argmax(tail / norm_w <= t)) for t in THRESHOLDS]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    args = ap.parse_args()
    r = gguf.GGUFReader(args.model)
    src = {t.name: t for t in r.tensors}
    n_layers = max(int(n.split(".")[1]) for n in src if n.startswith("blk.")) + 1

    def load(ty, layer):
        t = src[f"blk.{layer}.{ty}.weight"]
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)

    print(f"model {args.model}: {n_layers} layers\n")
    print("| type | shape | cos(W_i, W_i-1) mean | max abs | cos(W_i, mean) mean | ‖W−mean‖/‖W‖ mean |"
          " rank for 5/10/20/30% of W | of W−mean | full rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    by_range = {}
    energy = {}
    for ty in TYPES:
        ws = [load(ty, l) for l in range(n_layers)]
        mean = sum(ws) / n_layers
        prev = [cos(ws[i], ws[i - 1]) for i in range(1, n_layers)]
        to_mean = [cos(w, mean) for w in ws]
        resid = [np.linalg.norm(w - mean) / np.linalg.norm(w) for w in ws]
        rk_w, rk_r = [], []
        e_w, e_r = [], []
        for w in ws:
            nw = np.linalg.norm(w)
            s_w = np.linalg.svd(w, compute_uv=False)
            s_r = np.linalg.svd(w - mean, compute_uv=False)
            rk_w.append(tail_ranks(s_w, nw))
            rk_r.append(tail_ranks(s_r, nw))
            # Energy captured by the top 64 singular values.
            e_w.append(float((s_w[:64] ** 2).sum() / (s_w ** 2).sum()))
            e_r.append(float((s_r[:64] ** 2).sum() / (s_r ** 2).sum()))
        energy[ty] = (np.mean(e_w), np.mean(e_r))
        for i, (p, m) in enumerate(zip([None] + prev, to_mean)):
            key = (ty, "0-9" if i < 10 else "10-19" if i < 20 else "20-29")
            by_range.setdefault(key, []).append((p, m))
        rw = np.mean(rk_w, axis=0)
        rr = np.mean(rk_r, axis=0)
        print(f"| {ty} | {ws[0].shape[0]}×{ws[0].shape[1]} | {np.mean(prev):.4f} | {np.max(np.abs(prev)):.4f} |"
              f" {np.mean(to_mean):.4f} | {np.mean(resid):.4f} |"
              f" {'/'.join(f'{x:.0f}' for x in rw)} | {'/'.join(f'{x:.0f}' for x in rr)} | {min(ws[0].shape)} |")
        sys.stdout.flush()
    print("\n| type | layers | cos(W_i, W_i-1) mean | cos(W_i, mean) mean |")
    print("|---|---|---|---|")
    for (ty, rg), v in by_range.items():
        p = [x for x, _ in v if x is not None]
        print(f"| {ty} | {rg} | {np.mean(p):.4f} | {np.mean([m for _, m in v]):.4f} |")
    print("\n| type | energy in top 64 singular values of W | of W−mean |")
    print("|---|---|---|")
    for ty, (a, b) in energy.items():
        print(f"| {ty} | {a:.3f} | {b:.3f} |")


if __name__ == "__main__":
    main()

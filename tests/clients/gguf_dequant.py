#!/usr/bin/env python3
"""Reference data for tests/gguf_import.rs, produced with the `gguf` Python package.

  gguf_dequant.py synth <dir>
      For each ggml type, writes <dir>/<TYPE>.bin (raw blocks) and <dir>/<TYPE>.f32
      (gguf.quants.dequantize of them, little-endian f32), and <dir>/synth.gguf holding
      every <TYPE>.bin as tensor "t.<TYPE>" (GGUFWriter). Blocks are random bytes with
      finite f16 scales (every bit pattern of the quants is exercised) and, for the
      types gguf can quantize, also quantize()d random floats ("<TYPE>_q", with the
      floats in <TYPE>_q.src.f32).
  gguf_dequant.py real <model.gguf> <dir> <tensor>...
      Writes <dir>/<tensor>.f32: the tensor dequantized by gguf, in GGUF (ggml) order.
  gguf_dequant.py read <file.gguf>
      Opens a file with gguf.GGUFReader and prints its metadata and tensor infos as
      JSON (one object), so Rust can check the reader accepts what Rust wrote.
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

# Byte offsets of the f16 scale fields within one block, per type.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ2_S": [0], "IQ2_XXS": [0],
    "IQ2_XS": [0], "IQ1_S": [0],
    # IQ1_M's f16 scale is the top nibbles of its four u16 sub-block scale words.
    "IQ1_M": [],
}
QUANTIZABLE = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
ROWS, COLS = 4, 512


def random_blocks(rng, name):
    qt = T[name]
    be, bb = gguf.GGML_QUANT_SIZES[qt]
    n_blocks = ROWS * COLS // be
    if name == "F32":
        return rng.standard_normal(ROWS * COLS).astype("<f4").view(np.uint8)
    if name == "F16":
        return (rng.standard_normal(ROWS * COLS) * 4).astype("<f2").view(np.uint8)
    if name == "BF16":
        # Any pattern but NaN: numpy and ggml both shift the bits, but keep it simple.
        v = rng.integers(0, 1 << 16, ROWS * COLS, dtype=np.uint16)
        v[(v & 0x7F80) == 0x7F80] &= 0xBFFF
        return v.astype("<u2").view(np.uint8)
    b = rng.integers(0, 256, (n_blocks, bb), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        scale = (rng.standard_normal(n_blocks) * 0.05).astype("<f2")
        b[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    if name == "IQ1_M":
        # Bit 14 of that f16 (bit 6 of the last scale byte) clear: finite, below 2.
        b[:, 55] &= 0xBF
    return b.reshape(-1)


def synth(out):
    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(os.path.join(out, "synth.gguf"), "llama")
    cases = {}
    for name in ["F32", "F16", "BF16"] + list(F16_FIELDS):
        cases[name] = random_blocks(rng, name)
    for name in QUANTIZABLE:
        x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        # A zero block and a block with a single nonzero value exercise the d == 0
        # and amax paths of the quantizers.
        x[0, :32] = 0.0
        x[1, :32] = 0.0
        x[1, 5] = -3.0
        cases[name + "_q"] = gguf.quants.quantize(x, T[name]).reshape(-1)
        x.astype("<f4").tofile(os.path.join(out, name + "_q.src.f32"))
    for case, blocks in cases.items():
        qt = T[case.removesuffix("_q")]
        # quantize() returns float16 for F16; look at every case as raw bytes.
        blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1)
        row_bytes = blocks.size // ROWS
        y = gguf.quants.dequantize(blocks.reshape(ROWS, row_bytes), qt)
        y = np.asarray(y, dtype="<f4").reshape(-1)
        assert y.size == ROWS * COLS, (case, y.shape)
        blocks.tofile(os.path.join(out, case + ".bin"))
        y.tofile(os.path.join(out, case + ".f32"))
        w.add_tensor("t." + case, blocks.reshape(ROWS, row_bytes), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(" ".join(cases))


def real(model, out, names):
    r = gguf.GGUFReader(model)
    by_name = {t.name: t for t in r.tensors}
    for n in names:
        t = by_name[n]
        y = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        np.asarray(y, dtype="<f4").reshape(-1).tofile(os.path.join(out, n + ".f32"))


def jsonable(v):
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8")
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, list):
        return [jsonable(x) for x in v]
    return v


def read(path):
    r = gguf.GGUFReader(path)
    kv = {}
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        kv[f.name] = {"type": [int(t) for t in f.types], "value": jsonable(f.contents())}
    tensors = [
        {"name": t.name, "ne": [int(x) for x in t.shape], "type": int(t.tensor_type),
         "offset": int(t.data_offset), "n_bytes": int(t.n_bytes)}
        for t in r.tensors
    ]
    print(json.dumps({"kv": kv, "tensors": tensors, "alignment": int(r.alignment)}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "synth":
        synth(sys.argv[2])
    elif cmd == "real":
        real(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif cmd == "read":
        read(sys.argv[2])
    else:
        sys.exit(f"unknown command {cmd}")

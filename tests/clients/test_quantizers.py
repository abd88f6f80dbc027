"""cawsfs's ggml quantizers (src/gguf/quantize.rs) against ggml itself: the same f32
values go through `examples/quantize_rows` and through `ggml_quantize_chunk` of the
llama.cpp build's libggml-base.so (no importance matrix, as `llama-quantize` without
`--imatrix`), and the bytes must be identical. Inputs are chosen to hit every branch
and rounding edge: gaussians of many scales, heavy tails, zeros of both signs,
constants, outliers, subnormals, values beyond f16's range and near f32's, exact
rounding ties, and real weights of the test model."""
import ctypes
import os
import subprocess

import numpy as np
import pytest
import gguf
from gguf import GGMLQuantizationType as T

from conftest import ROOT, run

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
ROW = 256  # every type's block size divides it
ROWS_PER_CASE = 128


@pytest.fixture(scope="module")
def ggml(llama_bin):
    lib = ctypes.CDLL(str(llama_bin / "libggml-base.so"))
    f = lib.ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def quantize(name, x):
        x = np.ascontiguousarray(x, dtype="<f4").reshape(-1)
        assert x.size % ROW == 0
        be, bb = gguf.GGML_QUANT_SIZES[T[name]]
        out = np.zeros(x.size // be * bb, np.uint8)
        n = f(int(T[name]), x.ctypes.data, out.ctypes.data, 0, x.size // ROW, ROW, None)
        assert n == out.size
        return out.tobytes()

    return quantize


@pytest.fixture(scope="module")
def ours():
    run(["cargo", "build", "--release", "--quiet", "--example", "quantize_rows"], cwd=ROOT)
    exe = ROOT / os.environ.get("CARGO_TARGET_DIR", "target") / "release" / "examples" / "quantize_rows"
    assert exe.is_file(), exe

    def quantize(name, x):
        x = np.ascontiguousarray(x, dtype="<f4").reshape(-1)
        p = subprocess.run([exe, name], input=x.tobytes(), capture_output=True)
        assert p.returncode == 0, p.stderr.decode()
        return p.stdout

    quantize.exe = exe
    return quantize


def real_weights(model_gguf, n):
    """`n` values of real weights: rows of the test model's Q4_1 matrices and its Q8_0
    embedding, dequantized by gguf-py (values on each block's grid: a requantization
    edge case of its own)."""
    r = gguf.GGUFReader(model_gguf)
    parts, have = [], 0
    for t in r.tensors:
        if t.tensor_type not in (T.Q4_1, T.Q8_0) or have >= n:
            continue
        rows = np.asarray(t.data)[:16]
        v = gguf.quants.dequantize(rows, t.tensor_type).reshape(-1).astype(np.float32)
        parts.append(v)
        have += v.size
    v = np.concatenate(parts)[:n]
    return v[: v.size // ROW * ROW]


def cases(rng, real):
    """{name: float32 array of shape (rows, ROW)}."""
    n = ROWS_PER_CASE * ROW
    g = lambda: rng.standard_normal(n)  # noqa: E731
    c = {}
    for s in [1e-30, 1e-7, 0.02, 1.0, 300.0, 1e5, 1e30]:
        c[f"gauss*{s:g}"] = g() * s
    c["student-t(2)"] = rng.standard_t(2, n) * 0.05
    c["student-t(1)"] = rng.standard_t(1, n)  # Cauchy: enormous spread within blocks
    c["zeros"] = np.zeros(n)
    z = np.zeros(n)
    z[rng.random(n) < 0.5] = -0.0
    c["signed zeros"] = z
    c["constant rows"] = np.repeat(rng.choice([1.0, -1.0, 0.5, -3.25, 1e-20, 7e4, -2e-39], n // 32), 32)
    v = g() * 0.02
    v[np.arange(0, n, 32) + rng.integers(0, 32, n // 32)] *= 1e4
    c["one outlier per block"] = v
    v = g() * 0.02
    v[np.arange(0, n, 256) + rng.integers(0, 256, n // 256)] = rng.choice([-1, 1], n // 256) * 50.0
    c["one outlier per superblock"] = v
    c["subnormal"] = g() * 1e-40
    c["tiny mixed"] = g() * np.exp(rng.uniform(np.log(1e-45), np.log(1e-36), n))
    c["near f16 max"] = rng.uniform(-1, 1, n) * 65504.0
    c["beyond f16 max"] = g() * 1e6
    c["near f32 max"] = rng.uniform(-1, 1, n) * 3.4e38
    c["all negative"] = -np.abs(g())
    c["all positive"] = np.abs(g()) + 0.1
    c["sparse"] = g() * (rng.random(n) < 0.1)
    # Rounding ties: small integer and half-integer grids, scaled by powers of two, so
    # quantized values land on .5 in every type's arithmetic.
    for k, step in enumerate([0.5, 0.25, 1.0, 1 / 3]):
        q = rng.integers(-40, 41, n) * step
        c[f"grid {step:g}"] = q * 2.0 ** rng.integers(-8, 8, n // 32).repeat(32)
    ends = rng.integers(-20, 21, n)
    ends[::32] = 8 * rng.choice([-1, 1], n // 32)
    c["grid q4_0 ties"] = ends + 0.5 * (rng.random(n) < 0.5)
    ends = rng.integers(-127, 128, n).astype(np.float64)
    ends[::32] = 127
    c["grid q8_0 ties"] = ends + 0.5 * (rng.random(n) < 0.3)
    # Any finite bit pattern (NaN and infinities have a test of their own).
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    c["uniform bits"] = np.where(np.isfinite(bits), bits, np.float32(1.0))
    c["real weights"] = real
    out = {}
    for name, v in c.items():
        v = np.asarray(v).astype(np.float32)
        assert np.isfinite(v).all(), name
        out[name] = v.reshape(-1, ROW)
    return out


@pytest.fixture(scope="module")
def inputs(model_gguf):
    rng = np.random.default_rng(20240607)
    return cases(rng, real_weights(model_gguf, 64 * 1024 * 4))


def first_difference(name, x, a, b):
    be, bb = gguf.GGML_QUANT_SIZES[T[name]]
    a, b = np.frombuffer(a, np.uint8).reshape(-1, bb), np.frombuffer(b, np.uint8).reshape(-1, bb)
    bad = np.nonzero((a != b).any(axis=1))[0]
    i = bad[0]
    return (f"{len(bad)} of {len(a)} blocks differ; first: block {i}\n"
            f"  input {x.reshape(-1, be)[i].tolist()}\n  ggml  {a[i].tolist()}\n  ours  {b[i].tolist()}")


@pytest.mark.parametrize("name", TYPES)
def test_identical_to_ggml(name, ggml, ours, inputs):
    total = 0
    for case, x in inputs.items():
        want, got = ggml(name, x), ours(name, x)
        assert len(want) == len(got), (case, len(want), len(got))
        if want != got:
            pytest.fail(f"{name} {case}: " + first_difference(name, x, want, got), pytrace=False)
        total += x.size
    be = gguf.GGML_QUANT_SIZES[T[name]][0]
    print(f"{name}: {total // be} blocks identical over {len(inputs)} input kinds")


# Byte offsets of the f16 super-scales of the K-quants.
SUPER_SCALES = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


@pytest.mark.parametrize("name", TYPES)
def test_nan_and_infinity(name, ggml, ours):
    """NaN (quiet, signalling, with payloads) and ±inf among ordinary values. Identical
    bytes, with one exception C leaves open: where a K-quant's f16 super-scale
    overflowed (an infinity in the block), an input NaN meets a NaN the arithmetic
    made, and which of the two an x86 instruction passes on depends on how the compiler
    ordered its operands (gcc's order differs between elements of one unrolled loop).
    The levels of the NaN elements may differ there: such blocks must still decode to
    the same values wherever the input is not NaN."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, ROW)).astype(np.float32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA5A5A5, 0xFFFFFFFF], np.uint32).view(np.float32)
    specials = np.concatenate([nans, np.array([np.inf, -np.inf], np.float32)])
    for r in range(256):
        k = rng.integers(1, 5)
        x[r, rng.integers(0, ROW, k)] = rng.choice(specials, k)
    x[-8:] = rng.choice(specials, (8, ROW))  # blocks of nothing else
    x[-16:-8] = rng.choice(specials[-2:], (8, ROW))  # infinities only
    want, got = ggml(name, x), ours(name, x)
    if want == got:
        return
    be, bb = gguf.GGML_QUANT_SIZES[T[name]]
    a = np.frombuffer(want, np.uint8).reshape(-1, bb)
    b = np.frombuffer(got, np.uint8).reshape(-1, bb)
    xb = x.reshape(-1, be)
    bad = np.nonzero((a != b).any(axis=1))[0]
    for i in bad:
        scales = [np.frombuffer(a[i, o:o + 2].tobytes(), "<f2")[0] for o in SUPER_SCALES.get(name, [])]
        with np.errstate(invalid="ignore", over="ignore"):
            da, db = gguf.quants.dequantize(a[i], T[name]), gguf.quants.dequantize(b[i], T[name])
        same = (da == db) | (np.isnan(da) & np.isnan(db))
        ok = (np.isnan(xb[i]).any() and not np.isfinite(scales).all()
              and (same | np.isnan(xb[i])).all())
        if not ok:
            pytest.fail(f"{name}: " + first_difference(name, x, want, got), pytrace=False)
    print(f"{name}: {len(bad)} of {len(a)} blocks differ, each only where a NaN met a NaN")


def test_bad_input(ours):
    for args, data, msg in [
        (["Q4_K"], np.zeros(255, np.float32).tobytes(), "whole number"),
        (["Q8_0"], b"\0\0\0", "f32"),
        (["IQ2_XS"], b"", "not a type"),
        (["Q8_1"], b"", "not a type"),
        ([], b"", "usage"),
    ]:
        p = subprocess.run([ours.exe, *args], input=data, capture_output=True)
        assert p.returncode == 2, (args, p.returncode)
        err = p.stderr.decode()
        assert msg in err and err.count("\n") == 1, err

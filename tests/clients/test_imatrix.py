"""Importance-aware NDSQ (docs/IMATRIX.md) with llama.cpp's own importance matrix: made
by `scripts/imatrix.sh` (llama-imatrix over calibration text Debian ships), given to
`cawsfs convert --imatrix`, it lowers the KL-divergence from the F16 reference that
llama.cpp measures on other text; bad files are one-line errors naming the file."""
import os
import struct

import pytest

from conftest import ROOT, SETTINGS, convert, kld, kld_base, run, run_status


@pytest.fixture(scope="module")
def imatrix(model_gguf, shelf):
    out = shelf / "smol.imatrix.gguf"
    env = dict(os.environ, CHUNKS="6")
    run([ROOT / "scripts" / "imatrix.sh", model_gguf, out], env=env)
    return out


def test_importance_matrix_lowers_the_kl_divergence(cawsfs, archives, imatrix, llama_bin, model_gguf, work):
    # PQ: the matrix weighs its k-means and assignment, L's SVD and S's selection.
    base = kld_base(cawsfs, archives, llama_bin, work)
    weighted = work / "im.cawsf"
    report, stdout = convert(cawsfs, model_gguf, weighted, "--imatrix", imatrix, *SETTINGS["pq"])
    # Every coded matrix has an entry (PQ keeps the tied embedding whole).
    assert report["imatrix"]["weighted"] == 210 and report["imatrix"]["unweighted"] == [], report["imatrix"]
    assert "210 coded tensors weighted, 0 without an entry" in stdout, stdout
    # The same size as unweighted PQ.
    plain_report = archives["pq"][1]
    assert abs(report["bits_per_weight"] - plain_report["bits_per_weight"]) < 0.02
    got = {}
    for name, archive in [("plain", archives["pq"][0]), ("imatrix", weighted)]:
        g = work / f"{name}.gguf"
        run([cawsfs, "export", archive, "--format", "gguf", "--gguf-type", "f16", "-o", g])
        got[name] = kld(llama_bin, base, g)
        g.unlink()
    print("mean KLD", got)
    # Measured 0.2756 -> 0.1177 over 4096 tokens (docs/IMATRIX.md).
    assert got["imatrix"] < 0.6 * got["plain"], got
    run([cawsfs, "verify", weighted])


def test_importance_matrix_lowers_the_kl_divergence_at_a_bpw_target(cawsfs, archives, imatrix, llama_bin, model_gguf, work):
    # With a budget to share, the matrix also decides which tensors get the bits: scaled
    # so that a column of median importance counts 1 (docs/CODECS.md), never letting a
    # few massive-activation columns make ffn_down look cheap to starve.
    # Contexts of 256 tokens: at 128 both land at ~0.08 with twice the spread (measured
    # on GPL-3: 0.077 ± 0.004 plain, 0.080 ± 0.007 weighted; at 256 0.064 and 0.038).
    base = kld_base(cawsfs, archives, llama_bin, work, ctx=256)
    # NDSQ's scalar groups (`--bpw-codec sq`, the default before ggml types): on this
    # model's Q4_1 layers the ggml plan keeps nearly every layer's own bytes.
    sq = ["--bpw", "5", "--bpw-codec", "sq"]
    weighted, plain = work / "bpw5-imatrix.cawsf", work / "bpw5.cawsf"
    report, _ = convert(cawsfs, model_gguf, weighted, *sq, "--imatrix", imatrix)
    assert 4.85 < report["bits_per_weight"] <= 5.0, report["bits_per_weight"]
    convert(cawsfs, model_gguf, plain, *sq)
    got = {}
    for name, a in [("plain", plain), ("imatrix", weighted)]:
        g = work / f"bpw5-{name}.gguf"
        run([cawsfs, "export", a, "--format", "gguf", "--gguf-type", "f16", "-o", g])
        got[name] = kld(llama_bin, base, g, ctx=256)
        g.unlink()
    print("mean KLD at --bpw 5", got)
    # Measured over 4096 tokens: 0.0656 -> 0.0362 (0.0794 when weighted errors were
    # scaled to mean importance).
    assert got["imatrix"] < 0.8 * got["plain"], got


def legacy(entries):
    """llama.cpp's legacy imatrix format: [(name, ncall, values)]."""
    b = struct.pack("<i", len(entries))
    for name, ncall, values in entries:
        b += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, len(values))
        b += struct.pack(f"<{len(values)}f", *values)
    return b


def test_bad_importance_matrices_are_one_line_errors(cawsfs, model_gguf, imatrix, work):
    cases = {}
    half = work / "half.imatrix.gguf"
    half.write_bytes(imatrix.read_bytes()[: imatrix.stat().st_size // 2])
    cases["truncated"] = (half, "past the end")
    cases["a model"] = (model_gguf, "not an importance matrix")
    names = work / "names.dat"
    names.write_bytes(legacy([("encoder.layer.0.query.weight", 1, [1.0] * 576)]))
    cases["foreign names"] = (names, "none of its 1 entries names a tensor this model codes")
    other = work / "other.dat"
    other.write_bytes(legacy([("blk.0.attn_q.weight", 1, [1.0] * 64)]))
    cases["another model"] = (other, "has 64 values but the tensor has 576 input columns")
    cut = work / "cut.dat"
    cut.write_bytes(legacy([("blk.0.attn_q.weight", 1, [1.0] * 576)])[:-7])
    cases["truncated legacy"] = (cut, "truncated")
    garbage = work / "garbage.dat"
    garbage.write_bytes(bytes(range(256)) * 16)
    cases["garbage"] = (garbage, "not an importance matrix")
    cases["missing"] = (work / "nothing.dat", "No such file")
    cases["directory"] = (work, "not a regular file")
    for what, (path, needle) in cases.items():
        out = work / f"{what}.cawsf"
        p = run_status([cawsfs, "convert", model_gguf, "-o", out, "--imatrix", path])
        err = p.stderr.strip()
        assert p.returncode != 0 and len(err.splitlines()) == 1, (what, err)
        assert str(path) in err and needle in err and "panicked" not in err, (what, err)
        assert not out.exists(), what
    # Only the .cawsf kind fits NDSQ: elsewhere the flag is refused, not ignored.
    p = run_status([cawsfs, "convert", model_gguf, "-o", work / "x", "--to", "npy-dir", "--imatrix", imatrix])
    assert p.returncode != 0 and "--imatrix" in p.stderr, p.stderr

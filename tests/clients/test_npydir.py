"""The npy-dir (Squish) archive kind end to end on the real test model: convert with
int8 / int4 / int4+zstd, verify, inspect, numpy reads the files, mount (byte-identical to
`cawsfs export`), llama.cpp and safetensors read the mount; a directory written by an
independent numpy script (tests/clients/make_npydir.py) mounts and matches numpy's own
dequantization; corrupt, truncated and malformed files give clear errors and EIO."""
import errno
import io
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard
from safetensors.numpy import load_file

from conftest import PROMPT, TEXT, convert, convert_each, llama_generate, run, run_status
from test_mount import Mount

sys.path.insert(0, str(Path(__file__).parent))
import make_npydir  # noqa: E402

NPY_SETTINGS = {"int8": ["--bits", "8"], "int4": ["--bits", "4"], "int4z": ["--bits", "4", "--zstd"]}
Q_PROJ = "model.layers.3.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def npy_dirs(cawsfs, model_gguf, shelf):
    path_of = lambda n: shelf / f"smol-{n}.npydir"  # noqa: E731
    made = convert_each(cawsfs, model_gguf, NPY_SETTINGS, path_of, "--to", "npy-dir")
    return {name: (path, report) for name, (path, report, _) in made.items()}


@pytest.fixture(scope="module")
def foreign(cawsfs, model_gguf, shelf):
    """A Squish npy-dir written by numpy alone from an HF export of an exact archive."""
    exact = shelf / "npy-exact.cawsf"
    run([cawsfs, "convert", model_gguf, "-o", exact, "--passthrough", "*"])
    hf = shelf / "npy-exact-hf"
    run([cawsfs, "export", exact, "--format", "hf-dir", "-o", hf])
    d = shelf / "squish-foreign"
    run([sys.executable, Path(__file__).parent / "make_npydir.py", hf, d])
    return d


def quantized(report):
    return [t for t in report["tensors"] if not t["codec"].startswith("passthrough")]


def perplexity(llama_bin, gguf_path):
    p = run([llama_bin / "llama-perplexity", "-m", gguf_path, "-f", TEXT, "-c", "128", "--chunks", "12",
             "-t", str(min(4, os.cpu_count() or 1))])
    line = [l for l in (p.stdout + p.stderr).splitlines() if "Final estimate: PPL =" in l][-1]
    return float(line.split("PPL =")[1].split()[0])


def test_convert_verify_inspect(cawsfs, npy_dirs):
    figures = {}
    for name, (path, report) in npy_dirs.items():
        p = run([cawsfs, "verify", path])
        assert "ok (npy-dir" in p.stdout and "note:" not in p.stdout, p.stdout
        info = json.loads(run([cawsfs, "inspect", path, "--json"]).stdout)
        assert info["kind"] == "npy-dir"
        assert len(info["tensors"]) == len(report["tensors"]) == 272
        codecs = {t["name"]: t["codec"] for t in info["tensors"]}
        want = {"int8": "int8", "int4": "int4(g=64)", "int4z": "int4(g=64)+zstd"}[name]
        assert codecs[Q_PROJ] == want, codecs[Q_PROJ]
        assert codecs["model.embed_tokens.weight"].startswith("passthrough(f16)")
        assert codecs["model.norm.weight"].startswith("passthrough(f16)")
        # inspect shows the conversion's relative errors.
        rel = {t["name"]: t["rel_err"] for t in info["tensors"]}
        assert rel[Q_PROJ] == pytest.approx(next(t["rel_err"] for t in report["tensors"] if t["name"] == Q_PROJ), rel=1e-12)
        q = quantized(report)
        assert len(q) == 210
        bpw = sum(t["bytes"] for t in q) * 8 / sum(np.prod(t["shape"]) for t in q)
        figures[name] = (report["archive_bytes"], round(bpw, 3), round(report["mean_rel_err"], 5),
                         round(report["max_rel_err"], 5))
        text = run([cawsfs, "inspect", path]).stdout
        assert "model.layers.29.mlp.down_proj.weight" in text
    print("npy-dir (bytes, quantized bpw, mean rel_err, max rel_err)", figures)
    assert 8.0 < figures["int8"][1] < 8.1 and figures["int8"][2] < 0.012, figures
    assert 4.45 < figures["int4"][1] < 4.55 and 0.05 < figures["int4"][2] < 0.15, figures
    assert figures["int4z"][1] < figures["int4"][1] and figures["int4z"][2] == figures["int4"][2], figures


def test_numpy_reads_the_files(npy_dirs):
    """np.load reads what the converter wrote; headers are exactly np.save's; framed
    .npy.zst files decompress (across frames) to the plain file's bytes."""
    sk = make_npydir.safe_key(Q_PROJ)
    plain, zst = npy_dirs["int4"][0] / "tensors", npy_dirs["int4z"][0] / "tensors"
    manifest = json.loads((npy_dirs["int8"][0] / "manifest.json").read_text())
    assert manifest[Q_PROJ] == sk
    q8 = npy_dirs["int8"][0] / "tensors" / f"{sk}__q.npy"
    q = np.load(q8)
    s = np.load(q8.with_name(f"{sk}__s.npy"))
    assert q.dtype == np.int8 and q.shape == (576, 576) and s.dtype == np.float32 and s.shape == (576,)
    assert np.abs(q).max() == 127 and q.min() >= -127
    assert list(np.load(q8.with_name(f"{sk}__shape.npy"))) == [576, 576]
    for f in (q8, plain / f"{sk}__q4.npy", plain / f"{sk}__s4.npy"):
        buf = io.BytesIO()
        np.save(buf, np.load(f))
        assert buf.getvalue() == f.read_bytes(), f
    p4 = np.load(plain / f"{sk}__q4.npy")
    assert p4.dtype == np.uint8 and p4.shape == (576, 288)
    assert np.load(plain / f"{sk}__s4.npy").shape == (576, 9)
    assert ((p4 & 0x0F) <= 14).all() and ((p4 >> 4) <= 14).all()
    for f in ("__q4", "__s4"):
        with open(zst / f"{sk}{f}.npy.zst", "rb") as fh:
            data = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True).read()
        assert data == (plain / f"{sk}{f}.npy").read_bytes()
    # The zstd CLI (Debian's zstd, installed by scripts/setup.sh) reads every frame.
    z = subprocess.run(["zstd", "-d", "-c", zst / f"{sk}__q4.npy.zst"], capture_output=True, check=True)
    assert z.stdout == (plain / f"{sk}__q4.npy").read_bytes()


def test_deterministic(cawsfs, npy_dirs, model_gguf, work):
    path, _ = npy_dirs["int4z"]
    again = work / "again.npydir"
    convert(cawsfs, model_gguf, again, "--to", "npy-dir", "--threads", "1", *NPY_SETTINGS["int4z"])
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        assert (path / f).read_bytes() == (again / f).read_bytes(), f


def exported_dir(cawsfs, archive, d):
    run([cawsfs, "export", archive, "--format", "hf-dir", "-o", d])
    run([cawsfs, "export", archive, "--format", "gguf", "-o", d / "model.gguf"])
    return d


@pytest.mark.parametrize("setting", ["int8", "int4z"])
def test_mount_equals_export_and_clients_read_it(cawsfs, npy_dirs, llama_bin, work, setting):
    path, report = npy_dirs[setting]
    ref = exported_dir(cawsfs, path, work / f"exp-{setting}")
    m = Mount(cawsfs, path, work / f"mnt-{setting}", "--cache-size", "256MiB")
    try:
        names = sorted(os.listdir(m.mp))
        assert names == sorted(os.listdir(ref)), names
        for f in names:
            assert subprocess.run(["cmp", m.mp / f, ref / f]).returncode == 0, f
        text, _ = llama_generate(llama_bin, m.mp / "model.gguf")
        assert text.startswith(PROMPT), text
        assert "Paris" in text[len(PROMPT):], text
        st = load_file(str(m.mp / "model.safetensors"))
        assert len(st) == 272
        # The int8 view equals numpy's dequantization of the written files (f16 of q·s).
        if setting == "int8":
            sk = make_npydir.safe_key(Q_PROJ)
            t = path / "tensors"
            w = np.load(t / f"{sk}__q.npy").astype(np.float32) * np.load(t / f"{sk}__s.npy")[:, None]
            np.testing.assert_array_equal(st[Q_PROJ].astype(np.float32), w.astype(np.float16).astype(np.float32))
    finally:
        m.close()


def test_perplexity(cawsfs, npy_dirs, llama_bin, model_gguf, work):
    """int8 keeps the original's perplexity; int4 (symmetric, 15 levels) costs more."""
    ppl = {"original": perplexity(llama_bin, model_gguf)}
    for setting in ("int8", "int4z"):
        out = work / f"ppl-{setting}.gguf"
        run([cawsfs, "export", npy_dirs[setting][0], "--format", "gguf", "-o", out])
        ppl[setting] = perplexity(llama_bin, out)
    print("npy-dir perplexity", ppl)
    assert abs(ppl["int8"] - ppl["original"]) < 0.03 * ppl["original"], ppl
    assert ppl["int8"] < ppl["int4z"] < 1.6 * ppl["original"], ppl


def test_foreign_squish_dir(cawsfs, foreign, llama_bin, work):
    p = run([cawsfs, "verify", foreign])
    assert "ok (npy-dir" in p.stdout and "no checksums" in p.stdout, p.stdout
    info = json.loads(run([cawsfs, "inspect", foreign, "--json"]).stdout)
    codecs = {t["name"]: t["codec"] for t in info["tensors"]}
    assert codecs["model.layers.0.self_attn.q_proj.weight"] == "int4(g=64)"  # int4 before int8
    assert codecs["model.layers.1.self_attn.q_proj.weight"] == "int8+zstd"
    assert codecs["model.layers.1.mlp.up_proj.weight"] == "int4(g=64)+zstd"
    assert codecs["model.embed_tokens.weight"] == "passthrough(f16)+zstd"
    ref = exported_dir(cawsfs, foreign, work / "exp-foreign")
    want = make_npydir.dequantize_dir(foreign)
    m = Mount(cawsfs, foreign, work / "mnt-foreign", "--cache-size", "128MiB")
    try:
        for f in os.listdir(ref):
            assert subprocess.run(["cmp", m.mp / f, ref / f]).returncode == 0, f
        st = load_file(str(m.mp / "model.safetensors"))
        assert set(st) == set(want)
        for name, w in want.items():
            assert st[name].dtype == np.float16, name
            np.testing.assert_array_equal(st[name], w.astype(np.float16), err_msg=name)
        text, _ = llama_generate(llama_bin, m.mp / "model.gguf")
        assert text.startswith(PROMPT) and "Paris" in text[len(PROMPT):], text
    finally:
        m.close()


def data_offset(npy_path):
    b = npy_path.read_bytes()[:12]
    return 10 + struct.unpack("<H", b[8:10])[0] if b[6] == 1 else 12 + struct.unpack("<I", b[8:12])[0]


def copy_of(src, dst):
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def test_corrupt_block_fails_verify_and_gives_eio(cawsfs, npy_dirs, work):
    path, _ = npy_dirs["int8"]
    name = "model.layers.10.mlp.up_proj.weight"
    sk = make_npydir.safe_key(name)
    bad = copy_of(path, work / "npy-corrupt")
    f = bad / "tensors" / f"{sk}__q.npy"
    # Row block 3 of [1536, 576] int8 with 56 rows per block starts at row 168.
    pos = data_offset(f) + 170 * 576 + 5
    data = bytearray(f.read_bytes())
    data[pos] ^= 0x01
    f.write_bytes(data)
    p = run_status([cawsfs, "verify", bad])
    assert p.returncode != 0
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and f"{sk}__q.npy" in err and name in err and "block 3" in err, err
    # The mount serves everything but the bytes of that block: EIO there.
    ref = exported_dir(cawsfs, path, work / "exp-int8")
    st_path = ref / "model.safetensors"
    hdr_len = struct.unpack("<Q", st_path.read_bytes()[:8])[0]
    hdr = json.loads(st_path.read_bytes()[8:8 + hdr_len])
    base = 8 + hdr_len
    m = Mount(cawsfs, bad, work / "mnt-corrupt", "--cache-size", "64MiB")
    try:
        fd = os.open(m.mp / "model.safetensors", os.O_RDONLY)
        try:
            row = 576 * 2
            bad_off = base + hdr[name]["data_offsets"][0] + 170 * row
            with pytest.raises(OSError) as e:
                os.pread(fd, 4096, bad_off)
            assert e.value.errno == errno.EIO
            ok_name = "model.layers.11.mlp.up_proj.weight"
            ok_off = base + hdr[ok_name]["data_offsets"][0]
            ref_bytes = st_path.read_bytes()
            assert os.pread(fd, 1 << 20, ok_off) == ref_bytes[ok_off:ok_off + (1 << 20)]
            # Rows of the same tensor far from the bad block (other cache chunks) still read.
            good_off = base + hdr[name]["data_offsets"][1] - 4096
            assert os.pread(fd, 4096, good_off) == ref_bytes[good_off:good_off + 4096]
        finally:
            os.close(fd)
        assert m.stat()["cache"]["bytes_served"] > 0  # the daemon is still serving
        log = open(m.socket.replace(".sock", ".log")).read()
        assert name in log and f"{sk}__q.npy" in log and "panicked" not in log, log[-2000:]
    finally:
        m.close()


def test_bad_dirs_give_one_line_errors(cawsfs, npy_dirs, foreign, work):
    sk = make_npydir.safe_key(Q_PROJ)

    def truncate(d):
        f = d / "tensors" / f"{sk}__q.npy"
        f.write_bytes(f.read_bytes()[:-100])
        return f"{sk}__q.npy", "truncated"

    def fortran(d):
        f = d / "tensors" / f"{sk}__q.npy"
        f.write_bytes(f.read_bytes().replace(b"'fortran_order': False", b"'fortran_order': True ", 1))
        return f"{sk}__q.npy", "Fortran"

    def manifest(d):
        (d / "manifest.json").write_text('{"model.norm.weight": ')
        return "manifest.json", "not valid JSON"

    def zst_truncate(d):
        f = next((d / "tensors").glob("*layers__1__self_attn__q_proj__weight__q.npy.zst"))
        f.write_bytes(f.read_bytes()[:-7])
        return f.name, "zstd"

    def missing(d):
        (d / "tensors" / f"{sk}__s.npy").unlink()
        return f"{sk}__s.npy", "No such file"

    cases = [(npy_dirs["int8"][0], truncate), (npy_dirs["int8"][0], fortran), (npy_dirs["int8"][0], manifest),
             (npy_dirs["int8"][0], missing), (foreign, truncate), (foreign, fortran), (foreign, zst_truncate),
             (foreign, manifest)]
    for i, (src, edit) in enumerate(cases):
        d = copy_of(src, work / f"npy-bad-{i}")
        what, why = edit(d)
        for verb in (["verify", d], ["inspect", d], ["mount", d, work / f"mnt-bad-{i}"]):
            if verb[0] == "mount":
                (work / f"mnt-bad-{i}").mkdir(exist_ok=True)
            p = run_status([cawsfs, *verb])
            assert p.returncode != 0, (edit.__name__, verb)
            err = p.stderr.strip()
            assert len(err.splitlines()) == 1 and what in err and why in err, (edit.__name__, err)
            assert "panicked" not in err
        assert not os.path.ismount(work / f"mnt-bad-{i}")
    # A directory without manifest.json is not an archive.
    p = run_status([cawsfs, "inspect", work])
    assert p.returncode != 0 and "manifest.json" in p.stderr


def test_options_of_other_kinds_are_refused(cawsfs, model_gguf, work):
    """An option the chosen kind would silently ignore is refused in one line naming it
    and the kinds it is for; nothing is written."""
    out = work / "refused.out"
    cases = [
        (["--to", "npy-dir", "--max-rel-err", "0.1"], "--to npy-dir does not take --max-rel-err (for delta)"),
        (["--to", "npy-dir", "--rank", "8", "--compression", "lz4"],
         "--rank (for cawsf, delta), --compression (for cawsf, delta)"),
        (["--bits", "4"], "--to cawsf does not take --bits (for npy-dir)"),
        (["--to", "delta", "--zstd", "--seed", "3"], "--to delta does not take --seed (for cawsf), --zstd (for npy-dir)"),
    ]
    for args, needle in cases:
        p = run_status([cawsfs, "convert", model_gguf, "-o", out, *args])
        err = p.stderr.strip()
        assert p.returncode != 0 and len(err.splitlines()) == 1 and needle in err, (args, err)
        assert not out.exists()

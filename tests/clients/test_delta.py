"""The delta kind (Base + U·Vᵀ) end to end on the real test model (SmolLM2-135M Q4_1):
convert at a fixed rank and at an error bound, verify, inspect, determinism, mount
(byte-identical to export), llama.cpp and safetensors reading the mount, perplexity,
corrupt and truncated archives."""
import json
import os
import shutil
import subprocess

import gguf
import numpy as np
import pytest
from safetensors import safe_open

from conftest import PROMPT, convert, convert_each, corrupt_block, llama_generate, pread_eio_offsets, run, run_status
from test_cawsf import perplexity
from test_mount import FILES, Mount

# "r64": the seed's rank for every matrix. "e01": per matrix the smallest rank whose
# stored reconstruction is within 1% relative error — the high-quality setting: on this
# model truncated SVD errors hurt far more than quantization noise of the same size
# (docs/DELTA.md: 5% already multiplies perplexity by 18).
DELTA_SETTINGS = {
    "r64": ["--rank", "64"],
    "e01": ["--max-rel-err", "0.01"],
}
# Perplexity over conftest.TEXT (llama-perplexity -c 128 --chunks 12), measured before
# these bounds were set (docs/DELTA.md): original 23.55, e01 27.23, r64 1.3e9.
E01_PPL_MAX_RATIO = 1.5
R64_PPL_MIN_RATIO = 20.0


@pytest.fixture(scope="module")
def deltas(cawsfs, model_gguf, shelf):
    path_of = lambda n: shelf / f"smol-{n}.cawsd"  # noqa: E731
    return convert_each(cawsfs, model_gguf, DELTA_SETTINGS, path_of, "--to", "delta")


@pytest.fixture(scope="module")
def delta_exports(cawsfs, deltas, shelf):
    """`cawsfs export` of every layout of each delta archive: the reference bytes."""
    out = {}
    for name, (path, _, _) in deltas.items():
        d = shelf / f"delta-ref-{name}"
        run([cawsfs, "export", path, "--format", "hf-dir", "-o", d])
        run([cawsfs, "export", path, "--format", "gguf", "-o", d / "model.gguf"])
        out[name] = d
    return out


def test_convert_verify_inspect(cawsfs, deltas):
    for name, (path, report, stdout) in deltas.items():
        p = run([cawsfs, "verify", path])
        assert "ok (delta" in p.stdout, p.stdout
        info = json.loads(run([cawsfs, "inspect", path, "--json"]).stdout)
        assert info["kind"] == "delta"
        kinds = sorted(s["kind"] for s in info["sections"])
        assert kinds == ["BLOB_INDEX", "DATA", "META", "ROUTING"], kinds
        tensors = {t["name"]: t for t in info["tensors"]}
        assert len(tensors) == 272
        delta = [t for t in info["tensors"] if t["codec"].startswith("delta(")]
        # The seven projections of 30 layers are deltas; embeddings and norms passthrough.
        assert len(delta) == 210 == len(report["matrices"]), name
        assert tensors["model.embed_tokens.weight"]["codec"] == "passthrough(q8_0)"
        for m in report["matrices"]:
            t = tensors[m["name"]]
            assert t["rel_err"] == pytest.approx(m["rel_err"], abs=1e-12)
            assert f"r={m['rank']}," in t["codec"]
            assert t["bytes"] == m["bytes"]
            assert m["cos_base"] > 0 and (m["cos_prev"] is None) == (m["layer"] == 0)
        assert report["archive_bytes"] == os.path.getsize(path)
        text = run([cawsfs, "inspect", path]).stdout
        assert "model.layers.29.mlp.down_proj.weight" in text and "delta(r=" in text
        # The convert report prints every matrix and a per-type summary.
        assert "cos_prev" in stdout and "per type" in stdout and "q_proj" in stdout
    r64 = deltas["r64"][1]
    assert {m["rank"] for m in r64["matrices"]} == {64}
    e01 = deltas["e01"][1]
    assert e01["unreachable"] == 0
    assert max(m["rel_err"] for m in e01["matrices"]) <= 0.01
    assert e01["max_rel_err"] <= 0.01 < 0.5 < r64["mean_rel_err"]
    # Smallest rank meeting the bound: ranks differ per matrix.
    assert len({m["rank"] for m in e01["matrices"]}) > 20
    print({k: (rep["archive_bytes"], round(rep["bits_per_weight"], 3), round(rep["mean_rel_err"], 4),
               round(rep["max_rel_err"], 4)) for k, (_, rep, _) in deltas.items()})


def test_adjacent_layers_are_measured(deltas):
    """The seed assumes adjacent layers' weights are similar; the report measures it.
    On SmolLM2-135M they are not (docs/DELTA.md): adjacent cosines near 0, and each
    layer's cosine with the 30-layer mean near 1/sqrt(30), as for unrelated matrices."""
    ms = deltas["r64"][1]["matrices"]
    prev = [m["cos_prev"] for m in ms if m["cos_prev"] is not None]
    assert len(prev) == 7 * 29
    assert abs(np.mean(prev)) < 0.05, np.mean(prev)
    base = np.mean([m["cos_base"] for m in ms])
    assert 0.1 < base < 0.3, base
    # The base alone explains almost nothing: ‖W − B̂‖/‖W‖ close to 1.
    assert np.mean([m["base_rel_err"] for m in ms]) > 0.9


def test_deterministic(cawsfs, deltas, model_gguf, work):
    path, _, _ = deltas["r64"]
    again = work / "again.cawsd"
    convert(cawsfs, model_gguf, again, "--to", "delta", "--threads", "1", *DELTA_SETTINGS["r64"])
    assert again.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("setting", list(DELTA_SETTINGS))
def test_mounted_files_equal_export(cawsfs, deltas, delta_exports, work, setting):
    m = Mount(cawsfs, deltas[setting][0], work / f"mnt-delta-{setting}", "--cache-size", "256MiB")
    try:
        assert sorted(os.listdir(m.mp)) == sorted(FILES)
        for f in FILES:
            ref = delta_exports[setting] / f
            assert subprocess.run(["cmp", m.mp / f, ref]).returncode == 0, f
    finally:
        m.close()


def test_llama_cpp_and_safetensors_read_the_mount(cawsfs, deltas, delta_exports, llama_bin, model_gguf, work):
    path, report, _ = deltas["e01"]
    m = Mount(cawsfs, path, work / "mnt-delta-llama", "--cache-size", "512MiB")
    try:
        text, _ = llama_generate(llama_bin, m.mp / "model.gguf")
        print("e01:", repr(text))
        assert text.startswith(PROMPT) and len(text[len(PROMPT):].split()) >= 5, text
        ref, _ = llama_generate(llama_bin, delta_exports["e01"] / "model.gguf")
        assert text == ref
        # safetensors reads every tensor from the mount, equal to the export.
        with safe_open(str(m.mp / "model.safetensors"), "np") as a, \
                safe_open(str(delta_exports["e01"] / "model.safetensors"), "np") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            assert len(list(a.keys())) == 272
            for k in a.keys():
                np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k))
            # The reported error is the error of what is served: v_proj needs no rotary
            # permutation, so it compares directly with the source's dequantized Q4_1.
            src = {t.name: t for t in gguf.GGUFReader(str(model_gguf)).tensors}
            for layer in (0, 17):
                name = f"model.layers.{layer}.self_attn.v_proj.weight"
                t = src[f"blk.{layer}.attn_v.weight"]
                w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(192, 576).astype(np.float64)
                got = a.get_tensor(name).astype(np.float64)
                err = np.linalg.norm(w - got) / np.linalg.norm(w)
                want = next(x["rel_err"] for x in report["matrices"] if x["name"] == name)
                assert abs(err - want) < 2e-3, (name, err, want)
        ppl_mount = perplexity(llama_bin, m.mp / "model.gguf")
    finally:
        m.close()
    ppl = {"original": perplexity(llama_bin, model_gguf), "e01": ppl_mount}
    r64 = work / "delta-r64.gguf"
    shutil.copy(delta_exports["r64"] / "model.gguf", r64)
    ppl["r64"] = perplexity(llama_bin, r64)
    print("perplexity", ppl)
    assert ppl["e01"] < E01_PPL_MAX_RATIO * ppl["original"], ppl
    assert ppl["r64"] > R64_PPL_MIN_RATIO * ppl["original"], ppl


def test_corrupt_block_is_named_and_eio_only_there(cawsfs, deltas, delta_exports, work):
    path, _, _ = deltas["r64"]
    name = "model.layers.10.mlp.up_proj.weight"
    bad = work / "corrupt.cawsd"
    corrupt_block(cawsfs, path, bad, name, 3)
    p = run_status([cawsfs, "verify", bad])
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert f"block 3 of tensor {name}" in last and "XXH3-64" in last, p.stderr
    e = run_status([cawsfs, "export", bad, "--format", "safetensors", "-o", work / "bad.safetensors"])
    assert e.returncode != 0 and name in e.stderr and "panicked" not in e.stderr, e.stderr
    assert not (work / "bad.safetensors").exists()

    m = Mount(cawsfs, bad, work / "mnt-delta-bad", "--cache-size", "64MiB")
    try:
        fname = "model.safetensors"
        failed = pread_eio_offsets(m.mp / fname, (delta_exports["r64"] / fname).read_bytes())
        assert 1 <= len(failed) <= 2, failed
        log = open(m.socket.replace(".sock", ".log")).read()
        assert name in log and "block 3" in log, log[-2000:]
    finally:
        m.close()


def test_bad_archives_give_one_line_errors(cawsfs, deltas, work):
    path, _, _ = deltas["r64"]
    data = path.read_bytes()
    cases = {
        "truncated": (data[: len(data) // 2], "truncated"),
        "header_only": (data[:100], "truncated"),
        "version": (data[:8] + (7).to_bytes(4, "little") + data[12:], "unsupported delta archive version 7"),
        "dtype": (data[:20] + bytes([9]) + data[21:], "base dtype"),
    }
    mp = work / "mnt-delta-err"
    mp.mkdir(exist_ok=True)
    for what, (blob, needle) in cases.items():
        bad = work / f"{what}.cawsd"
        bad.write_bytes(blob)
        for verb in (["verify", bad], ["inspect", bad], ["mount", bad, mp],
                     ["export", bad, "--format", "gguf", "-o", work / "x.gguf"]):
            p = run_status([cawsfs, *verb])
            assert p.returncode != 0, (what, verb)
            err = p.stderr.strip()
            assert len(err.splitlines()) == 1 and str(bad) in err and needle in err, (what, err)
            assert "panicked" not in err


def test_bad_sources_and_options(cawsfs, model_gguf, work):
    trunc = work / "trunc-delta.gguf"
    trunc.write_bytes(model_gguf.read_bytes()[: 5 << 20])
    out = work / "trunc.cawsd"
    p = run_status([cawsfs, "convert", trunc, "--to", "delta", "-o", out])
    err = p.stderr.strip()
    assert p.returncode != 0 and len(err.splitlines()) == 1 and "trunc-delta.gguf" in err, err
    # Neither the archive nor a temporary file beside it (trunc.cawsd.XXXXXX.tmp) is left.
    assert not list(work.glob("trunc.cawsd*")), list(work.glob("trunc.cawsd*"))
    for bad in (["--bases", "0"], ["--max-rel-err", "nan"]):
        p = run_status([cawsfs, "convert", model_gguf, "--to", "delta", *bad, "-o", out])
        assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not out.exists()
    # Delta-only options are refused for .cawsf rather than ignored.
    p = run_status([cawsfs, "convert", model_gguf, "--max-rel-err", "0.1", "-o", work / "x.cawsf"])
    assert p.returncode != 0 and "delta" in p.stderr

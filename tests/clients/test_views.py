"""What `model.gguf` serves (`--gguf-type`): the source's own blocks bit-exact
(`source`, and `auto` where the archive stores them), single quantized types
byte-identical to llama.cpp's `llama-quantize`, and `auto`'s per-tensor choice, read by
llama.cpp through the mount."""
import json
import os
import re
from pathlib import Path

import gguf
import pytest

from conftest import TEXT, llama_generate, run, run_status
from test_mount import Mount

PROMPTS = [
    "The capital of France is",
    "Here is a short Python function that reverses a string:",
    "Once upon a time, in a small village by the sea,",
]


def tensors(path):
    """{name: (ggml type id, data bytes)} of a GGUF file."""
    r = gguf.GGUFReader(str(path))
    return {t.name: (int(t.tensor_type), bytes(t.data.tobytes())) for t in r.tensors}


def perplexity_lines(llama_bin, path):
    """llama-perplexity's per-chunk and final lines, the part that depends on the weights."""
    p = run([llama_bin / "llama-perplexity", "-m", path, "-f", TEXT, "-c", "128", "--chunks", "16",
             "-t", str(min(4, os.cpu_count() or 1))])
    out = p.stdout + p.stderr
    chunks = re.findall(r"\[(\d+)\](\d+\.\d+)", out)
    final = re.findall(r"Final estimate: PPL = [0-9.]+ \+/- [0-9.]+", out)
    assert len(chunks) == 16 and len(final) == 1, out[-2000:]
    return chunks, final


def test_source_view_is_the_original_file(cawsfs, archives, model_gguf, llama_bin, work):
    """The all-passthrough archive mounted with `--gguf-type source`: every tensor has the
    original file's type and bytes, and llama.cpp produces the same greedy tokens (64, three
    prompts) and the same perplexity output as on the original file."""
    m = Mount(cawsfs, archives["exact"][0], work / "mnt-source", "--gguf-type", "source")
    try:
        served = m.mp / "model.gguf"
        orig, view = tensors(model_gguf), tensors(served)
        assert orig.keys() == view.keys()
        for name, (ty, data) in orig.items():
            assert view[name][0] == ty, name
            assert view[name][1] == data, name
        for prompt in PROMPTS:
            want, _ = llama_generate(llama_bin, model_gguf, prompt, n=64)
            got, _ = llama_generate(llama_bin, served, prompt, n=64)
            assert got == want, (prompt, got, want)
        assert perplexity_lines(llama_bin, served) == perplexity_lines(llama_bin, model_gguf)
    finally:
        m.close()


def test_auto_view_keeps_stored_blocks_and_shrinks_the_rest(cawsfs, archives, model_gguf, llama_bin, work):
    """The default archive under the default view: the tensors it stores bit-exact (the
    norms; on this model the --bpw 5 plan rounds most layers into ggml(q4_1), which
    finds their own grid, in planes) are served as the original's bytes; the matrices
    it rounded into ggml types are served as their stored type, as `inspect` says; the
    file is far smaller than the F16 view and llama.cpp answers."""
    path, _ = archives["default"]
    plan = json.loads(run([cawsfs, "inspect", path, "--json"]).stdout)
    assert plan["gguf_view"] == "auto"
    by_gguf = {t["gguf"]["name"]: t for t in plan["tensors"] if t["gguf"]}
    f16 = work / "auto-f16.gguf"
    run([cawsfs, "export", path, "--format", "gguf", "--gguf-type", "f16", "-o", f16])
    m = Mount(cawsfs, path, work / "mnt-auto")
    try:
        served = m.mp / "model.gguf"
        view, orig = tensors(served), tensors(model_gguf)
        exact = lambda t: t["codec"].startswith("passthrough")
        # Rounded into Q4_1 without error: the layers' own grid found, their bytes.
        stored = [n for n, t in by_gguf.items() if t["gguf"]["stored"]
                  and (exact(t) or (t["codec"] == "ggml(q4_1)" and t["rel_err"] == 0.0))]
        coded = [n for n, t in by_gguf.items() if not exact(t)]
        assert len(stored) > 150 and len(coded) > 200, (len(stored), len(coded))
        # Compared as booleans: pytest's diff of two mismatched tensors would take hours.
        same = [n for n in stored if view[n] == orig[n]]
        assert same == stored, sorted(set(stored) - set(same))[:5]
        for name, (ty, _) in view.items():
            want = by_gguf[name]["gguf"]["type"]
            assert gguf.GGMLQuantizationType(ty).name.lower() == want, name
            if name in coded:
                assert want not in ("f16", "f32", "bf16"), name
                if by_gguf[name]["codec"].startswith("ggml("):
                    assert by_gguf[name]["codec"] == f"ggml({want})", name
        size = served.stat().st_size
        assert size < 0.6 * f16.stat().st_size, (size, f16.stat().st_size)
        # The demo's prompt, which the original file answers so too.
        prompt = "The Eiffel Tower is located in the city of"
        text, _ = llama_generate(llama_bin, served, prompt, n=8)
        assert "Paris" in text[len(prompt):], text
    finally:
        m.close()


def test_bad_view_names_are_one_line_errors(cawsfs, archives, work):
    path, _ = archives["default"]
    for cmd in (["inspect", path], ["export", path, "--format", "gguf", "-o", work / "x.gguf"],
                ["mount", path, work]):
        p = run_status([cawsfs, *cmd, "--gguf-type", "q4_kx"])
        assert p.returncode != 0
        first = p.stderr.strip().splitlines()[0]
        assert "q4_kx" in first and "valid: auto, source" in first and "q8_0" in first, p.stderr
        assert "panicked" not in p.stderr


# Single-type views and the llama-quantize file type that makes the same file with --pure.
PURE = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k": "Q5_K_S", "q5_1": "Q5_1", "q5_0": "Q5_0",
        "q4_k": "Q4_K_S", "q4_1": "Q4_1", "q4_0": "Q4_0", "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL"}
MIXES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M"}


@pytest.fixture(scope="module")
def lossy(cawsfs, archives, shelf):
    """Default (NDSQ) archives of the test model and of the 256-multiple random model
    (scripts/make-kquant-model.sh, where K types do not fall back), with their F32 views:
    the input llama-quantize is given."""
    hf = run([Path(__file__).resolve().parents[2] / "scripts" / "make-kquant-model.sh"],
             env={**os.environ, "CAWSFS_BIN": str(cawsfs)}).stdout.strip().splitlines()[-1]
    k256 = shelf / "views-k256.cawsf"
    if not k256.exists():
        run([cawsfs, "convert", hf, "-o", k256])
    out = {}
    for name, path in (("smol", archives["default"][0]), ("k256", k256)):
        f32 = shelf / f"views-{name}-f32.gguf"
        if not f32.exists():
            run([cawsfs, "export", path, "--format", "gguf", "--gguf-type", "f32", "-o", f32])
        out[name] = (path, f32)
    return out


@pytest.mark.parametrize("model", ["smol", "k256"])
def test_quantized_views_are_llama_quantize_byte_for_byte(cawsfs, llama_bin, lossy, work, model):
    """Every single-type view and two mixes of a lossy archive: every tensor's type and
    bytes equal what llama-quantize (no imatrix) makes from the archive's F32 view."""
    path, f32 = lossy[model]
    threads = str(min(4, os.cpu_count() or 1))
    cases = [(v, [f"{t}", "--pure"]) for v, t in PURE.items()] + [(v, [t]) for v, t in MIXES.items()]
    kinds = set()
    for view, (ftype, *pure) in cases:
        ref, ours = work / f"lq-{model}-{view}.gguf", work / f"ours-{model}-{view}.gguf"
        run([llama_bin / "llama-quantize", *pure, f32, ref, ftype, threads])
        run([cawsfs, "export", path, "--format", "gguf", "--gguf-type", view, "-o", ours])
        want, got = tensors(ref), tensors(ours)
        assert want.keys() == got.keys(), view
        for name, (ty, data) in want.items():
            assert got[name][0] == ty, (model, view, name, got[name][0], ty)
            assert got[name][1] == data, (model, view, name)
            kinds.add(ty)
        ref.unlink()
        ours.unlink()
    # The K types themselves were compared, not only their 32-block fallbacks.
    k = {int(gguf.GGMLQuantizationType[t]) for t in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")}
    assert k <= kinds, kinds


def test_fallbacks_are_logged_per_tensor(cawsfs, archives, work):
    """A type the test model's 576-wide rows cannot hold falls back per tensor, one line
    each in the mount log, and the view serves the fallback type."""
    path, _ = archives["default"]
    m = Mount(cawsfs, path, work / "mnt-q4k", "--gguf-type", "q4_k")
    try:
        log = Path(m.socket).with_suffix(".log").read_text()
        lines = [l for l in log.splitlines() if "not a whole number of q4_k blocks" in l]
        assert any("blk.0.attn_q.weight" in l and "served as q5_0" in l for l in lines), log[-2000:]
        view = tensors(m.mp / "model.gguf")
        q5_0 = int(gguf.GGMLQuantizationType.Q5_0)
        assert len(lines) == sum(1 for ty, _ in view.values() if ty == q5_0)
        assert view["blk.0.ffn_down.weight"][0] == int(gguf.GGMLQuantizationType.Q4_K)
    finally:
        m.close()


@pytest.mark.parametrize("kind,args", [("npy-dir", ["--bits", "4"]), ("delta", ["--rank", "64"])])
def test_every_archive_kind_serves_the_views(cawsfs, model_gguf, llama_bin, work, kind, args):
    """npy-dir and delta archives serve quantized views too: a single type and a mix
    byte-identical to llama-quantize on their F32 view, and the mounted auto view equal
    to its export, with the type auto chose for each tensor."""
    path = work / f"views-{kind}"
    if not path.exists():
        run([cawsfs, "convert", model_gguf, "--to", kind, "-o", path, *args])
    f32 = work / f"views-{kind}-f32.gguf"
    run([cawsfs, "export", path, "--format", "gguf", "--gguf-type", "f32", "-o", f32])
    threads = str(min(4, os.cpu_count() or 1))
    for view, lq in (("q4_0", ["--pure", "Q4_0"]), ("q4_k_m", ["Q4_K_M"])):
        ref, ours = work / f"lq-{kind}-{view}.gguf", work / f"ours-{kind}-{view}.gguf"
        run([llama_bin / "llama-quantize", *lq[:-1], f32, ref, lq[-1], threads])
        run([cawsfs, "export", path, "--format", "gguf", "--gguf-type", view, "-o", ours])
        assert tensors(ref) == tensors(ours), (kind, view)
        ref.unlink()
        ours.unlink()
    f32.unlink()
    auto = work / f"auto-{kind}.gguf"
    run([cawsfs, "export", path, "--format", "gguf", "-o", auto])
    plan = json.loads(run([cawsfs, "inspect", path, "--json"]).stdout)
    want = {t["gguf"]["name"]: t["gguf"]["type"] for t in plan["tensors"] if t["gguf"]}
    m = Mount(cawsfs, path, work / f"mnt-{kind}")
    try:
        served = m.mp / "model.gguf"
        assert served.read_bytes() == auto.read_bytes()
        got = {n: gguf.GGMLQuantizationType(ty).name.lower() for n, (ty, _) in tensors(served).items()}
        assert got == want
        assert any(t not in ("f16", "f32", "bf16") for t in got.values()), got
    finally:
        m.close()
        auto.unlink()

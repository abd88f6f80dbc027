"""cawsfs's port of llama-quantize's per-tensor type choice (src/layout/preset.rs) against
llama-quantize itself, for every preset cawsfs offers, on two models: the real test model
(SmolLM2-135M, 576 wide, tied embeddings: most K-quant targets fall back) and the
256-multiple random model of scripts/make-kquant-model.sh (untied, GQA 4: the K-quant
path proper). Both are exported as all-F32 GGUFs, the input llama-quantize expects.

llama-quantize's `--dry-run` runs the same type choice without writing a file and logs
each tensor's target type and each fallback's wanted type; its log is compared for every
preset. One preset per model is also really quantized and read back with `gguf`, which
checks that the log says what the file holds.

The port is reached through examples/preset_types.rs until the mount serves preset views."""
import os
import re
import subprocess

import gguf
import pytest

from conftest import ROOT, run

PRESETS = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S",
           "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"]
# Really quantized (the rest are dry runs): the headline mix on the fallback-heavy model,
# the mix with the most distinct types on the K-quant model.
WRITTEN = {"smol": "Q4_K_M", "k256": "Q3_K_M"}
THREADS = str(min(4, os.cpu_count() or 1))

# "[  12/ 272] blk.0.attn_q.weight - [ 576, 576, 1, 1], type = f32, size = … (q5_0)" in a
# dry run, "type = f32, converting to q5_0 .. size = …" in a real one; a tensor left as it
# is names no second type.
TENSOR_LINE = re.compile(
    r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+), "
    r"(?:converting to (\w+) \.\. )?size =.*?(?:\((\w+)\))?$")
# "warning: blk.0.attn_q.weight - ncols 576 not divisible by 256 (required for type q4_K) …"
FALLBACK_LINE = re.compile(r"^warning: (\S+)\s+- ncols\s+\d+ not divisible by\s+\d+ \(required for type\s+(\w+)\)")


@pytest.fixture(scope="module")
def preset_types_bin(cawsfs):
    run(["cargo", "build", "--release", "--quiet", "--example", "preset_types"], cwd=ROOT)
    exe = ROOT / os.environ.get("CARGO_TARGET_DIR", "target") / "release" / "examples" / "preset_types"
    assert exe.is_file(), exe
    return exe


def f32_gguf(cawsfs, src, work, name):
    """`src` (GGUF or HF directory) → exact archive → all-F32 model.gguf."""
    archive, out = work / f"presets-{name}.cawsf", work / f"presets-{name}-f32.gguf"
    if not out.exists():
        run([cawsfs, "convert", src, "-o", archive, "--passthrough", "*"])
        run([cawsfs, "export", archive, "--format", "gguf", "--gguf-type", "f32", "-o", out])
    return out


@pytest.fixture(scope="module")
def models(cawsfs, model_gguf, shelf):
    hf = run([ROOT / "scripts" / "make-kquant-model.sh"], env={**os.environ, "CAWSFS_BIN": str(cawsfs)})
    return {
        "smol": f32_gguf(cawsfs, model_gguf, shelf, "smol"),
        "k256": f32_gguf(cawsfs, hf.stdout.strip().splitlines()[-1], shelf, "k256"),
    }


def ours(exe, preset, path):
    """{name: (type, wanted or None)} from the port."""
    out = {}
    for line in run([exe, preset, path]).stdout.splitlines():
        f = line.split()
        out[f[0]] = (f[1], f[2] if len(f) > 2 else None)
    return out


def from_log(log):
    """{name: (type, wanted or None)} from llama-quantize's log; unquantized tensors keep
    their (F32) input type."""
    types, wanted = {}, {}
    for line in log.splitlines():
        if m := TENSOR_LINE.match(line):
            types[m[1]] = (m[3] or m[4] or m[2]).upper()
        elif m := FALLBACK_LINE.match(line):
            wanted[m[1]] = m[2].upper()
    return {n: (t, wanted.get(n)) for n, t in types.items()}


def quantize(llama_bin, src, preset, out=None):
    args = [src, out, preset] if out else ["--dry-run", src, preset]
    p = run([llama_bin / "llama-quantize", *args, THREADS])
    return from_log(p.stdout + p.stderr)


@pytest.mark.parametrize("model", ["smol", "k256"])
def test_every_preset_matches_llama_quantize(llama_bin, models, preset_types_bin, model):
    path = models[model]
    n_tensors = len(gguf.GGUFReader(path).tensors)
    for preset in PRESETS:
        want = quantize(llama_bin, path, preset)
        assert len(want) == n_tensors, (preset, len(want))
        got = ours(preset_types_bin, preset, path)
        diff = {n: (want[n], got.get(n)) for n in want if want[n] != got.get(n)}
        assert not diff and set(got) == set(want), (model, preset, diff)


@pytest.mark.parametrize("model", ["smol", "k256"])
def test_written_file_holds_the_logged_types(llama_bin, models, preset_types_bin, model, work):
    preset = WRITTEN[model]
    out = work / f"presets-{model}-{preset}.gguf"
    logged = quantize(llama_bin, models[model], preset, out)
    held = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert held == {n: t for n, (t, _) in logged.items()}
    assert held == {n: t for n, (t, _) in ours(preset_types_bin, preset, models[model]).items()}
    out.unlink()


def test_models_exercise_the_rules(models, preset_types_bin):
    """The two models cover what the comparison is meant to cover: fallbacks from every
    K type on 576-wide rows, none on the 256-multiple model, tied and untied output."""
    smol = ours(preset_types_bin, "Q4_K_M", models["smol"])
    assert smol["token_embd.weight"] == ("Q8_0", None) and "output.weight" not in smol
    assert smol["blk.0.attn_v.weight"] == ("Q8_0", "Q6_K")
    assert smol["blk.1.attn_q.weight"] == ("Q5_0", "Q4_K")
    assert smol["blk.0.ffn_down.weight"] == ("Q6_K", None)
    k256 = ours(preset_types_bin, "Q4_K_M", models["k256"])
    assert all(w is None for _, w in k256.values())
    assert k256["output.weight"] == ("Q6_K", None) and k256["token_embd.weight"] == ("Q4_K", None)
    assert [k256[f"blk.{i}.attn_v.weight"][0] for i in range(8)] == \
        ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]

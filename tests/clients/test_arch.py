"""Any architecture transformers can load: tiny random BERT, GPT-2, Qwen3, Gemma2, Phi3,
OPT and Llama (with a SentencePiece vocabulary) models, and mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE), made by scripts/make-arch-models.py (f32, f16 and bf16 sources, one of them
sharded), and the real all-MiniLM-L6-v2 (an int64 `position_ids` among its tensors),
converted exactly and with the default codec, mounted, and read back by transformers."""
import contextlib
import gc
import json
import os
import re

import pytest
import torch
from safetensors.torch import load, load_file

from conftest import PROMPT, ROOT, TEXT, run, run_status

ARCHS = ["bert", "gpt2", "qwen3", "gemma2", "phi3", "opt", "llama-spm", "phi3-long",
         "mixtral", "qwen2moe", "qwen3moe", "olmoe"]
# Mixtures of experts: model.gguf stacks each layer's experts into one 3-D tensor.
MOE_ARCHS = ["mixtral", "qwen2moe", "qwen3moe", "olmoe"]
# The architectures whose mount serves model.gguf too (not OPT: llama.cpp has none).
GGUF_ARCHS = ["qwen3", "phi3", "gemma2", "bert", "gpt2", "llama-spm", "phi3-long", *MOE_ARCHS]
# The architectures whose GGUF files import.
GGUF_IMPORT_ARCHS = ["qwen3", "phi3", "gemma2", "gpt2", "llama-spm", "bert", *MOE_ARCHS]
# The default codec (about 5 bits per weight) may add at most this multiple of the
# output error that plain 4-bit round-to-nearest (groups of 32, like Q4_0) adds to the
# same matrices. Measured 0.80-1.07 on these models: random Gaussian weights are the
# case a fitted grid gains least on.
RTN4_FACTOR = 1.25


@pytest.fixture(scope="module")
def arch_models():
    out = run(["python3", ROOT / "scripts" / "make-arch-models.py", *ARCHS]).stdout.split()
    return dict(zip(ARCHS, map(os.path.abspath, out)))


@pytest.fixture(scope="module")
def minilm():
    return run([ROOT / "scripts" / "fetch-minilm.sh"]).stdout.strip()


@pytest.fixture(scope="module")
def converted(cawsfs, arch_models, minilm, shelf):
    """{(model, setting): archive} for every model, exactly and with the default codec."""
    out = {}
    for name, src in [*arch_models.items(), ("minilm", minilm)]:
        for setting, args in (("exact", ["--passthrough", "*"]), ("default", [])):
            path = shelf / f"{name}-{setting}.cawsf"
            run([cawsfs, "convert", src, "-o", path, *args])
            out[name, setting] = path
    return out


@contextlib.contextmanager
def mounted(cawsfs, archive, mp, *args):
    mp.mkdir(parents=True, exist_ok=True)
    out = run([cawsfs, "mount", archive, mp, *args]).stdout
    log = re.search(r"log (\S+)\)", out).group(1)
    try:
        yield mp, log
    finally:
        run([cawsfs, "umount", mp])


def forward(model_dir, name, rtn4=False):
    """Last hidden states (encoder) or logits (causal LM) for fixed token ids; with
    `rtn4`, of the model whose coded matrices are rounded to 4 bits first."""
    import transformers as tf
    auto = tf.AutoModel if name in ("bert", "minilm") else tf.AutoModelForCausalLM
    # f32 whatever the checkpoint's dtype, so sources of different dtypes compare.
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    if rtn4:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2 and p.shape[0] >= 8 and p.shape[1] % 32 == 0:
                    p.copy_(round_to_nearest_4bit(p.float()).to(p.dtype))
    ids = torch.tensor([[1, 17, 300, 42, 999, 5, 77, 512]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    out = out.last_hidden_state if name in ("bert", "minilm") else out.logits
    # The model's parameters may map the (mounted) file: let them go before an unmount.
    del model
    gc.collect()
    return out


def round_to_nearest_4bit(w):
    """Q4_0's rounding: groups of 32 along a row, scale = the value of largest
    magnitude / -8, codes -8..7."""
    g = w.reshape(-1, 32)
    big = g.gather(1, g.abs().argmax(1, keepdim=True))
    d = big / -8
    q = torch.where(d == 0, torch.zeros_like(g), (g / d).round().clamp(-8, 7))
    return (q * d).reshape(w.shape)


def source_tensors(src):
    got = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(src, f)))
    return got


@pytest.mark.parametrize("name", ARCHS + ["minilm"])
def test_exact_conversion_serves_the_source(cawsfs, converted, arch_models, minilm, work, name):
    src = arch_models.get(name, minilm)
    archive = converted[name, "exact"]
    export = work / "export.safetensors"
    run([cawsfs, "export", archive, "--format", "safetensors", "-o", export])
    has_gguf = name in GGUF_ARCHS or name == "minilm"
    with mounted(cawsfs, archive, work / "m") as (mp, log):
        files = sorted(os.listdir(mp))
        assert "model.safetensors" in files and "config.json" in files, files
        # A GGUF view only for an architecture llama.cpp's names are known for.
        assert ("model.gguf" in files) == has_gguf, files
        mounted_bytes = (mp / "model.safetensors").read_bytes()
        assert mounted_bytes == export.read_bytes()
        # Every source tensor, with its dtype (int64 position_ids too), bit for bit.
        want = source_tensors(src)
        # From bytes: a mapping of the mounted file would keep the mount busy.
        got = load(mounted_bytes)
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        # The side files the source has (config, generation config, tokenizer ...).
        for f in os.listdir(src):
            if f.endswith(".json") and f != "model.safetensors.index.json":
                assert (mp / f).read_bytes() == open(os.path.join(src, f), "rb").read(), f
        assert torch.equal(forward(mp, name), forward(src, name))
        lines = [l for l in open(log) if "no model.gguf" in l]
        assert len(lines) == (not has_gguf), lines


@pytest.mark.parametrize("name", ARCHS)
def test_default_codec_within_its_bound(cawsfs, converted, arch_models, work, name):
    archive = converted[name, "default"]
    report = json.loads(run([cawsfs, "inspect", archive, "--json"]).stdout)
    coded = [t for t in report["tensors"] if not t["codec"].startswith("passthrough")]
    assert coded, "the default codes this model's matrices"
    # Integer, 1-D and tiny tensors stay exact.
    for t in report["tensors"]:
        if len(t["shape"]) != 2 or t["shape"][0] < 8:
            assert t["codec"].startswith("passthrough"), t["name"]
    export = work / "export.safetensors"
    run([cawsfs, "export", archive, "--format", "safetensors", "-o", export])
    with mounted(cawsfs, archive, work / "m") as (mp, _):
        assert (mp / "model.safetensors").read_bytes() == export.read_bytes()
        ref = forward(arch_models[name], name).float()
        got = forward(mp, name).float()
    rtn = forward(arch_models[name], name, rtn4=True).float()
    err = ((got - ref).norm() / ref.norm()).item()
    err_rtn = ((rtn - ref).norm() / ref.norm()).item()
    print(f"{name}: relative error {err:.4f}, 4-bit round-to-nearest {err_rtn:.4f}")
    assert 0 < err <= RTN4_FACTOR * err_rtn, (err, err_rtn)


def test_minilm_sentence_embeddings(cawsfs, converted, minilm, work):
    """Mean-pooled sentence embeddings as sentence-transformers makes them: equal from
    the exact archive, close (cosine ≥ 0.98) from the default one."""
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(minilm)
    sents = ["The capital of France is Paris.", "A cat sat on the mat.",
             "Quantum computers use qubits.", "The stock market fell sharply today."]
    x = tok(sents, return_tensors="pt", padding=True)

    def embed(d):
        m = tf.AutoModel.from_pretrained(d).eval()
        with torch.no_grad():
            h = m(**x).last_hidden_state
        mask = x["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)

    ref = embed(minilm)
    for setting in ("exact", "default"):
        with mounted(cawsfs, converted["minilm", setting], work / setting) as (mp, _):
            # The mount's own tokenizer files give the same ids.
            assert tf.AutoTokenizer.from_pretrained(mp)(sents)["input_ids"] == tok(sents)["input_ids"]
            got = embed(mp)
        cos = (got * ref).sum(-1)
        if setting == "exact":
            assert torch.equal(got, ref)
        else:
            assert cos.min() >= 0.98, cos


def test_plain_tensors_keep_their_dtype_in_every_view(cawsfs, converted, work):
    """`--dtype f16` converts weights, never integer tensors."""
    with mounted(cawsfs, converted["minilm", "exact"], work / "m", "--dtype", "f16",
                 "--no-disk-cache") as (mp, _):
        got = load((mp / "model.safetensors").read_bytes())
    assert got["embeddings.position_ids"].dtype == torch.int64
    assert torch.equal(got["embeddings.position_ids"], torch.arange(512).unsqueeze(0))
    assert got["embeddings.word_embeddings.weight"].dtype == torch.float16


def test_no_gguf_view_is_one_line_everywhere(cawsfs, converted, work):
    archive = converted["opt", "exact"]
    text = run([cawsfs, "inspect", archive]).stdout
    assert re.search(r'model\.gguf: not served: .*model type "opt"', text), text[-500:]
    info = json.loads(run([cawsfs, "inspect", archive, "--json"]).stdout)
    assert info["gguf_view"] is None and "opt" in info["gguf_missing"]
    p = run_status([cawsfs, "export", archive, "--format", "gguf", "-o", work / "x.gguf"])
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "opt" in err[0], p.stderr
    assert not (work / "x.gguf").exists()
    # verify checks the views that exist.
    assert "ok" in run([cawsfs, "verify", archive]).stdout


def test_unsupported_dtype_is_one_line(cawsfs, work):
    """A sub-byte dtype (MX F4) names the file, the tensor and the dtype."""
    import struct
    d = work / "f4"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "bert"}')
    header = json.dumps({"w": {"dtype": "F4", "shape": [4, 8], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-len(header) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    p = run_status([cawsfs, "convert", d, "-o", work / "x.cawsf"])
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "model.safetensors" in err[0] and "tensor w" in err[0] \
        and "F4" in err[0], p.stderr


def test_minilm_in_every_archive_kind(cawsfs, minilm, work):
    """The real BERT through a delta archive (exact), cawsfs's own npy-dir (int8) and a
    Squish npy-dir written by numpy alone (tests/clients/make_npydir.py): each mounts,
    keeps the int64 position_ids, and gives sentence embeddings close to the source's."""
    import sys
    import transformers as tf
    kinds = {
        "delta": work / "m.cawsd",
        "npydir": work / "m-npy",
        "foreign": work / "m-squish",
    }
    run([cawsfs, "convert", minilm, "--to", "delta", "-o", kinds["delta"]])
    run([cawsfs, "convert", minilm, "--to", "npy-dir", "-o", kinds["npydir"]])
    run([sys.executable, ROOT / "tests" / "clients" / "make_npydir.py", minilm, kinds["foreign"]])
    ref = forward(minilm, "minilm")
    for kind, archive in kinds.items():
        assert "ok" in run([cawsfs, "verify", archive]).stdout
        with mounted(cawsfs, archive, work / f"mnt-{kind}") as (mp, _):
            got = load((mp / "model.safetensors").read_bytes())
            assert got["embeddings.position_ids"].dtype == torch.int64, kind
            assert torch.equal(got["embeddings.position_ids"], torch.arange(512).unsqueeze(0))
            h = forward(mp, "minilm").float()
        if kind == "delta":
            assert torch.equal(h, ref.float())
            continue
        # The sentence embedding (mean of the hidden states) of 8-bit rows.
        cos = torch.nn.functional.cosine_similarity(h.mean(1), ref.float().mean(1)).item()
        print(f"{kind}: sentence embedding cosine {cos:.5f}")
        assert cos > 0.99, (kind, cos)


def test_sharded_safetensors_view(cawsfs, converted, arch_models, work):
    """Above --safetensors-shard-size the view is Hugging Face's shards and index: the
    mount's equal `export --format hf-dir`'s, every shard within the size (a larger
    tensor alone), and transformers loads them with the source's outputs."""
    import struct
    limit = 1 << 20
    archive = converted["phi3", "exact"]
    exp = work / "hf"
    run([cawsfs, "export", archive, "--format", "hf-dir", "-o", exp,
         "--safetensors-shard-size", "1MiB"])
    with mounted(cawsfs, archive, work / "m", "--safetensors-shard-size", "1MiB") as (mp, _):
        files = sorted(os.listdir(mp))
        shards = [f for f in files if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
        assert len(shards) >= 3 and "model.safetensors" not in files, files
        assert all(f.endswith(f"-of-{len(shards):05}.safetensors") for f in shards)
        index = json.loads((mp / "model.safetensors.index.json").read_text())
        assert (mp / "model.safetensors.index.json").read_bytes() == \
            (exp / "model.safetensors.index.json").read_bytes()
        names = set()
        total = 0
        for f in shards:
            data = (mp / f).read_bytes()
            assert data == (exp / f).read_bytes(), f
            n = struct.unpack("<Q", data[:8])[0]
            header = json.loads(data[8:8 + n])
            header.pop("__metadata__", None)
            size = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in header.values())
            assert size <= limit or len(header) == 1, (f, size)
            total += size
            for k in header:
                assert index["weight_map"][k] == f, k
                names.add(k)
        assert names == set(index["weight_map"]) == set(source_tensors(arch_models["phi3"]))
        assert index["metadata"]["total_size"] == total
        assert torch.equal(forward(mp, "phi3"), forward(arch_models["phi3"], "phi3"))


def llama_last_hidden(llama_bin, gguf, prompt, pooling="last"):
    """llama.cpp's final hidden state of the prompt's last token (after the output
    norm; or pooled as `pooling` says), L2-normalized, and the token ids it read the
    prompt as."""
    # Built with the flush at exit scripts/build-llama-cpp.sh adds: whole JSON.
    p = run([llama_bin / "llama-embedding", "-m", gguf, "-p", prompt, "--pooling", pooling,
             "--embd-normalize", "2", "--embd-output-format", "json", "-t", "2"])
    emb = torch.tensor(json.loads(p.stdout)["data"][0]["embedding"])
    ids = run([llama_bin / "llama-tokenize", "-m", gguf, "-p", prompt, "--ids",
               "--log-disable"]).stdout.strip().splitlines()[-1]
    return emb, json.loads(ids)


def hf_last_hidden(model_dir, prompt, long_rope=False):
    """transformers' final hidden state of the prompt's last token, normalized, and its
    ids. With `long_rope`, a LongRoPE model rotates by its long factors, as llama.cpp
    does at a context beyond the original one (transformers does so only for sequences
    that long)."""
    import transformers as tf
    ids = tf.AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]
    model = tf.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    if long_rope:
        config = model.config
        config.rope_parameters = {**config.rope_parameters,
                                  "short_factor": config.rope_parameters["long_factor"]}
        state = model.state_dict()
        model = tf.AutoModel.from_config(config).eval()
        model.load_state_dict(state)
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    del model
    gc.collect()
    return torch.nn.functional.normalize(h, dim=0), ids


@pytest.mark.parametrize("name", GGUF_ARCHS)
def test_gguf_view_matches_transformers(cawsfs, converted, arch_models, llama_bin, work, name):
    """llama.cpp reads the mounted model.gguf as transformers reads the source: the same
    token ids, and the same final hidden state (an f32 view of the exact archive: to
    float rounding; the default archive's auto view: against the mount's own
    safetensors, within the quantization the view adds)."""
    prompt = open(TEXT).read().split("\n")[5].strip()
    with mounted(cawsfs, converted[name, "exact"], work / "m", "--gguf-type", "f32") as (mp, _):
        emb, ids = llama_last_hidden(llama_bin, mp / "model.gguf", prompt)
    long_rope = name == "phi3-long"
    ref, ref_ids = hf_last_hidden(arch_models[name], prompt, long_rope)
    assert len(ids) > 5 and ids == ref_ids, (ids, ref_ids)
    print(f"{name}: exact archive, f32 view: cosine {(emb @ ref).item():.7f}")
    assert (emb @ ref).item() > 0.99999 and (emb - ref).abs().max() < 1e-3
    with mounted(cawsfs, converted[name, "default"], work / "d") as (mp, _):
        emb, ids = llama_last_hidden(llama_bin, mp / "model.gguf", prompt)
        ref, ref_ids = hf_last_hidden(mp, prompt, long_rope)
    assert ids == ref_ids
    cos = (emb @ ref).item()
    print(f"{name}: default archive, auto view: cosine {cos:.6f}")
    # GPT-2's matrices are served transposed: the codec's grid runs down the served
    # columns, so auto re-quantizes them (a type adding at most ~12 % to their error)
    # where the other architectures get their grid back exactly.
    assert cos > (0.998 if name == "gpt2" else 0.999), cos


@pytest.mark.parametrize("name", GGUF_IMPORT_ARCHS)
def test_gguf_source_of_the_architecture(cawsfs, converted, arch_models, work, name):
    """A GGUF file of the architecture imports: exported, converted back exactly, its
    `source` view is the same file, and the config.json and tokenizer derived from its
    metadata give transformers the source's logits and token ids."""
    import transformers as tf
    gguf = work / "model.gguf"
    run([cawsfs, "export", converted[name, "exact"], "--format", "gguf", "--gguf-type", "f32",
         "-o", gguf])
    archive = work / "from-gguf.cawsf"
    run([cawsfs, "convert", gguf, "-o", archive, "--passthrough", "*"])
    prompt = "The license is free software"
    with mounted(cawsfs, archive, work / "m", "--gguf-type", "source") as (mp, _):
        assert (mp / "model.gguf").read_bytes() == gguf.read_bytes()
        got = forward(mp, name)
        ids = tf.AutoTokenizer.from_pretrained(mp)(prompt)["input_ids"]
    assert torch.equal(got, forward(arch_models[name], name))
    assert ids == tf.AutoTokenizer.from_pretrained(arch_models[name])(prompt)["input_ids"]


def test_minilm_gguf_sentence_embeddings(cawsfs, converted, minilm, llama_bin, work):
    """The real all-MiniLM-L6-v2 through llama.cpp: the mounted model.gguf gives the
    sentence embedding (mean pooling) transformers computes from the source."""
    import transformers as tf
    prompt = "The capital of France is Paris."
    with mounted(cawsfs, converted["minilm", "exact"], work / "m", "--gguf-type", "f32") as (mp, _):
        emb, ids = llama_last_hidden(llama_bin, mp / "model.gguf", prompt, pooling="mean")
    x = tf.AutoTokenizer.from_pretrained(minilm)([prompt], return_tensors="pt")
    assert ids == x["input_ids"][0].tolist()
    model = tf.AutoModel.from_pretrained(minilm).eval()
    with torch.no_grad():
        ref = torch.nn.functional.normalize(model(**x).last_hidden_state[0].mean(0), dim=0)
    print(f"minilm: exact archive, f32 view, mean pooling: cosine {(emb @ ref).item():.7f}")
    assert (emb @ ref).item() > 0.99999, (emb @ ref).item()


def test_unsupported_dtype_in_a_foreign_npydir_is_one_line(cawsfs, work):
    """A Squish npy-dir written by another tool with a dtype no view can serve
    (complex64): every command names the file, the tensor and the dtype."""
    import numpy as np
    d = work / "npy"
    (d / "tensors").mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "bert"}')
    np.save(d / "tensors" / "w__weight__pt.npy", np.zeros((4, 4), dtype=np.complex64))
    np.save(d / "tensors" / "w__weight__shape.npy", np.array([4, 4], dtype=np.int64))
    (d / "manifest.json").write_text(json.dumps({"w.weight": "w__weight"}))
    for verb in (["inspect", d], ["verify", d], ["mount", d, work / "m"]):
        (work / "m").mkdir(exist_ok=True)
        p = run_status([cawsfs, *verb])
        assert p.returncode != 0, verb
        err = p.stderr.strip().splitlines()
        assert len(err) == 1 and "w__weight__pt.npy" in err[0] and "tensor w.weight" in err[0] \
            and "<c8" in err[0], (verb, p.stderr)


def test_a_tokenizer_the_gguf_view_cannot_write_leaves_the_other_views(cawsfs, arch_models, work):
    """A GGUF-mapped architecture whose tokenizer.json is not a byte-level BPE or a
    WordPiece (here a Unigram, as SentencePiece conversions are): no model.gguf, said
    once, and model.safetensors served as ever."""
    import shutil
    src = work / "src"
    shutil.copytree(arch_models["qwen3"], src)
    (src / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["a", -1.0]]}}))
    archive = work / "a.cawsf"
    run([cawsfs, "convert", src, "-o", archive, "--passthrough", "*"])
    assert "model.gguf: not served: " in run([cawsfs, "inspect", archive]).stdout
    assert "ok" in run([cawsfs, "verify", archive]).stdout
    with mounted(cawsfs, archive, work / "m") as (mp, log):
        files = os.listdir(mp)
        assert "model.gguf" not in files and "model.safetensors" in files, files
        assert torch.equal(forward(mp, "qwen3"), forward(arch_models["qwen3"], "qwen3"))
        lines = [l for l in open(log) if "no model.gguf" in l]
        assert len(lines) == 1 and "Unigram" in lines[0], lines


def gguf_fields(path, prefix):
    import gguf
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith(prefix)}


def test_sentencepiece_vocabulary_both_ways(cawsfs, converted, arch_models, llama_bin, work):
    """A SentencePiece vocabulary (Llama 2's kind: tokenizer.model beside tokenizer.json).
    The mounted model.gguf carries the vocabulary llama.cpp's own converter
    (convert_hf_to_gguf.py, from the llama.cpp source the tests build) writes from
    tokenizer.model: tokens, scores, types and special ids; llama.cpp tokenizes with
    both alike. And that converter's file, imported, gives tokenizer files with which
    transformers tokenizes as the source's tokenizer does."""
    import sys
    import transformers as tf
    src = arch_models["llama-spm"]
    root = llama_bin.parent.parent
    ref = work / "ref.gguf"
    run([sys.executable, root / "convert_hf_to_gguf.py", src, "--outfile", ref,
         "--outtype", "f32"], env=dict(os.environ, PYTHONPATH=str(root / "gguf-py")))
    want = gguf_fields(ref, "tokenizer.")
    text = open(TEXT).read()
    # Not starting with a space: llama.cpp and transformers differ there by design (a
    # second U+2581 or not), whatever converted the vocabulary.
    samples = [text[i:i + 400].lstrip() for i in range(0, 30000, 2000)] + [
        "naïve café 東京 🙂 1234567", "a  b\n\n\tc", "</s> special <s>"]
    tokenize = lambda gguf, s: json.loads(run(
        [llama_bin / "llama-tokenize", "-m", gguf, "-p", s, "--ids", "--log-disable"]
    ).stdout.strip().splitlines()[-1])
    with mounted(cawsfs, converted["llama-spm", "exact"], work / "m", "--gguf-type", "f32") as (mp, _):
        got = gguf_fields(mp / "model.gguf", "tokenizer.")
        for k in want:
            # The converter also writes add_sep_token = false, llama.cpp's default.
            if k != "tokenizer.ggml.add_sep_token":
                assert got.get(k) == want[k], k
        assert want["tokenizer.ggml.model"] == "llama"
        for s in samples:
            assert tokenize(mp / "model.gguf", s) == tokenize(ref, s), s
    archive = work / "ref.cawsf"
    run([cawsfs, "convert", ref, "-o", archive, "--passthrough", "*"])
    source = tf.AutoTokenizer.from_pretrained(src)
    with mounted(cawsfs, archive, work / "g") as (mp, _):
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(mp))
        mine = tf.AutoTokenizer.from_pretrained(mp)
        for s in samples + [" a leading space"]:
            assert mine(s)["input_ids"] == source(s)["input_ids"], s
            ids = mine(s)["input_ids"]
            assert mine.decode(ids, skip_special_tokens=True) == \
                source.decode(ids, skip_special_tokens=True), s
        # Not after a special token either (llama.cpp restarts the space prefix there).
        for s in samples[:-1]:
            assert mine(s)["input_ids"] == tokenize(ref, s), s


def test_sentence_transformers_loads_the_mount(cawsfs, converted, minilm, llama_bin, work):
    """all-MiniLM-L6-v2 as sentence-transformers keeps it (modules.json naming
    1_Pooling/): the mount serves that subdirectory, and SentenceTransformer loads the
    mount (and an exported hf-dir) and embeds as it does from the source; model.gguf
    carries the pooling, so llama-embedding mean-pools without being told."""
    from sentence_transformers import SentenceTransformer
    sents = ["The capital of France is Paris.", "Free software respects its users."]

    def embed(path):
        model = SentenceTransformer(str(path), device="cpu")
        out = model.encode(sents, convert_to_tensor=True)
        del model
        gc.collect()
        return out

    want = embed(minilm)
    pooling = open(os.path.join(minilm, "1_Pooling", "config.json"), "rb").read()
    archive = converted["minilm", "exact"]
    with mounted(cawsfs, archive, work / "m", "--gguf-type", "f32") as (mp, _):
        assert "1_Pooling" in os.listdir(mp) and (mp / "1_Pooling").is_dir()
        assert os.listdir(mp / "1_Pooling") == ["config.json"]
        assert (mp / "1_Pooling" / "config.json").read_bytes() == pooling
        assert torch.equal(embed(mp), want)
        p = run([llama_bin / "llama-embedding", "-m", mp / "model.gguf", "-p", sents[0],
                 "--embd-normalize", "2", "--embd-output-format", "json", "-t", "2"])
    emb = torch.tensor(json.loads(p.stdout)["data"][0]["embedding"])
    cos = (emb @ torch.nn.functional.normalize(want[0], dim=0)).item()
    print(f"minilm: llama-embedding with the GGUF's own pooling: cosine {cos:.7f}")
    assert cos > 0.99999, cos
    out = work / "hf"
    run([cawsfs, "export", archive, "--format", "hf-dir", "-o", out])
    assert (out / "1_Pooling" / "config.json").read_bytes() == pooling
    assert torch.equal(embed(out), want)


def test_phi3_longrope_factors_are_gguf_tensors(cawsfs, converted, arch_models, work):
    """A LongRoPE Phi-3 (Phi-3.5's rotary scaling): model.gguf carries its long and short
    factors as the F32 tensors llama.cpp's converter makes of them, and the attention
    factor sqrt(1 + ln(scale) / ln(original context)) (the hidden states above check
    that llama.cpp rotates with them as transformers does)."""
    import gguf
    import math
    config = json.load(open(os.path.join(arch_models["phi3-long"], "config.json")))
    rope = config["rope_parameters"]
    with mounted(cawsfs, converted["phi3-long", "default"], work / "m") as (mp, _):
        r = gguf.GGUFReader(mp / "model.gguf")
        tensors = {t.name: t.data.tolist() for t in r.tensors if t.name.startswith("rope_")}
        attn = r.fields["phi3.rope.scaling.attn_factor"].contents()
        del r
        gc.collect()
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).tolist()
    assert tensors == {"rope_factors_long.weight": f32(rope["long_factor"]),
                       "rope_factors_short.weight": f32(rope["short_factor"])}
    assert attn == pytest.approx(math.sqrt(1 + math.log(256 / 128) / math.log(128)), rel=1e-6)


@pytest.mark.parametrize("name", MOE_ARCHS)
def test_moe_experts_stack_in_every_archive_kind(cawsfs, converted, arch_models, llama_bin,
                                                  work, name):
    """model.gguf of a mixture of experts holds each layer's experts as one 3-D tensor
    (llama.cpp's converter's [hidden, ff, experts] for gate/up, [ff, hidden, experts]
    for down), expert k's values at index k; the router in F32; the expert keys. In
    every archive kind the mounted file is the export's bytes, and llama.cpp generates
    the same tokens from both."""
    import gguf
    src = arch_models[name]
    config = json.load(open(os.path.join(src, "config.json")))
    n_expert = config.get("num_local_experts") or config["num_experts"]
    ff = config.get("moe_intermediate_size") or config["intermediate_size"]
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    # The exact archive's f32 view: the stacks hold the source's experts in order.
    source = load_file(os.path.join(src, "model.safetensors"))

    def expert(l, e, w):
        if name == "mixtral":
            w = {"gate": "w1", "down": "w2", "up": "w3"}[w]
            return source[f"model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"]
        return source[f"model.layers.{l}.mlp.experts.{e}.{w}_proj.weight"]
    with mounted(cawsfs, converted[name, "exact"], work / "x", "--gguf-type", "f32") as (mp, _):
        r = gguf.GGUFReader(mp / "model.gguf")
        arch = r.fields["general.architecture"].contents()
        assert r.fields[f"{arch}.expert_count"].contents() == n_expert
        assert r.fields[f"{arch}.expert_used_count"].contents() == config["num_experts_per_tok"]
        t = {x.name: x for x in r.tensors}
        assert not [n for n in t if "experts" in n or ".ffn_gate." in n], sorted(t)
        for l in range(layers):
            for w, ne in (("gate", [hidden, ff]), ("up", [hidden, ff]), ("down", [ff, hidden])):
                x = t[f"blk.{l}.ffn_{w}_exps.weight"]
                assert list(x.shape) == ne + [n_expert], (l, w, x.shape)
                for e in range(n_expert):
                    got = torch.from_numpy(x.data[e].copy())
                    assert torch.equal(got, expert(l, e, w).float()), (l, w, e)
            router = t[f"blk.{l}.ffn_gate_inp.weight"]
            assert list(router.shape) == [hidden, n_expert]
            assert router.tensor_type == gguf.GGMLQuantizationType.F32
        del r, t, x, router
        gc.collect()
    # The default codec plans a stack's experts as one: one setting for all of them.
    info = json.loads(run([cawsfs, "inspect", converted[name, "default"], "--json"]).stdout)
    codecs = {}
    for t in info["tensors"]:
        if t["gguf"] and "_exps." in t["gguf"]["name"]:
            codecs.setdefault(t["gguf"]["name"], set()).add(t["codec"])
    assert len(codecs) == 3 * layers and all(len(c) == 1 for c in codecs.values()), codecs
    archives = {"cawsf": converted[name, "default"]}
    for kind in ("delta", "npy-dir"):
        archives[kind] = work / f"{name}.{kind}"
        run([cawsfs, "convert", src, "-o", archives[kind], "--to", kind])
    for kind, archive in archives.items():
        export = work / f"{kind}.gguf"
        run([cawsfs, "export", archive, "--format", "gguf", "-o", export])
        with mounted(cawsfs, archive, work / f"m-{kind}") as (mp, _):
            assert (mp / "model.gguf").read_bytes() == export.read_bytes(), kind
            got = greedy(llama_bin, mp / "model.gguf")
        want = greedy(llama_bin, export)
        assert got == want and len(got) > len(PROMPT) + 20, (kind, got, want)


def llama_cpp_convert(llama_bin, src, out):
    """llama.cpp's own convert_hf_to_gguf.py (from the source the tests build) at f32.
    The tiny models' tokenizers are trained here, so the converter does not know their
    pre-tokenizer by its hash: it is told "default", which changes no tensor and no
    architecture key."""
    import sys
    root = llama_bin.parent.parent
    shim = ("import runpy, sys\n"
            "import conversion.base as b\n"
            "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'\n"
            f"sys.argv = ['convert_hf_to_gguf.py', {str(src)!r}, '--outfile', {str(out)!r},"
            " '--outtype', 'f32']\n"
            f"runpy.run_path({str(root / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    run([sys.executable, "-c", shim],
        env=dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{root / 'gguf-py'}"))


@pytest.mark.parametrize("name", MOE_ARCHS)
def test_moe_matches_llama_cpps_converter(cawsfs, converted, arch_models, llama_bin, work,
                                          name):
    """Against llama.cpp's own converter, both ways: the exact archive's f32 model.gguf
    holds the converter's tensors bit for bit under its names, with its expert keys;
    and the converter's file, imported, serves model.safetensors with the source's
    per-expert tensors (values equal: the source's bf16/f16 widened to f32)."""
    import gguf
    import numpy as np
    ref = work / "ref.gguf"
    llama_cpp_convert(llama_bin, arch_models[name], ref)
    r = gguf.GGUFReader(ref)
    arch = r.fields["general.architecture"].contents()
    want = {t.name: t.data.copy() for t in r.tensors}
    want_keys = {k: f.contents() for k, f in r.fields.items() if ".expert_" in k}
    del r
    gc.collect()
    assert any("_exps." in n for n in want) and f"{arch}.expert_count" in want_keys
    with mounted(cawsfs, converted[name, "exact"], work / "x", "--gguf-type", "f32") as (mp, _):
        r = gguf.GGUFReader(mp / "model.gguf")
        got_keys = {k: f.contents() for k, f in r.fields.items() if ".expert_" in k}
        got = {t.name: t for t in r.tensors}
        assert sorted(got) == sorted(want)
        for n, data in want.items():
            assert np.array_equal(got[n].data, data), n
        del r, got
        gc.collect()
    assert got_keys == want_keys
    archive = work / "ref.cawsf"
    run([cawsfs, "convert", ref, "-o", archive, "--passthrough", "*"])
    source = load_file(os.path.join(arch_models[name], "model.safetensors"))
    with mounted(cawsfs, archive, work / "g") as (mp, _):
        served = load((mp / "model.safetensors").read_bytes())
    experts = [n for n in source if ".experts." in n]
    assert len(experts) == 3 * 4 * 2, experts
    assert sorted(served) == sorted(source)
    for n, t in source.items():
        assert torch.equal(served[n].float(), t.float()), n


def greedy(llama_bin, gguf):
    """llama-simple's greedy continuation of PROMPT, as bytes: a random model's tokens
    need not be whole UTF-8 characters, and llama-simple prints each with printf (where
    llama-completion's logger thread may drop the last ones at exit)."""
    return run([llama_bin / "llama-simple", "-m", gguf, "-n", 24, PROMPT], text=False).stdout


def test_moe_pin_infra_pins_all_but_the_experts(cawsfs, converted, work):
    """--pin-infra on a mixture of experts pins every chunk of model.gguf that holds
    attention, norms, routers, the embedding or the output, and no chunk that holds
    experts only: those are left to compete for the cache."""
    import gguf
    archive = converted["mixtral", "default"]
    with mounted(cawsfs, archive, work / "m", "--pin-infra", "--pin-infra-layers", "0") as (mp, _):
        r = gguf.GGUFReader(mp / "model.gguf")
        size = os.path.getsize(mp / "model.gguf")
        stat = json.loads(run([cawsfs, "stat", mp, "--json"]).stdout)
        # gguf-py's ReaderTensor.data_offset is already from the start of the file.
        spans = [(t.data_offset, t.data_offset + t.n_bytes,
                  "_exps." in t.name) for t in r.tensors]
        del r
        gc.collect()
    cs = stat["cache"]["chunk_size"]
    infra = {c for a, b, exp in spans if not exp for c in range(a // cs, (b + cs - 1) // cs)}
    experts_only = {c for a, b, exp in spans if exp
                    for c in range(a // cs, (b + cs - 1) // cs)} - infra
    assert infra and experts_only, (infra, experts_only)
    want = sum(min(cs, size - c * cs) for c in infra)
    assert stat["cache"]["pinned_bytes"] == want, (stat["cache"]["pinned_bytes"], want)


def test_moe_expert_predictor_learns_the_routing_and_keeps_it(cawsfs, converted, work):
    """Reads of model.gguf that route each token's two experts of layer 0 to fixed
    successors in layer 1 teach the mount's predictor, which then queues layer 1's
    experts when layer 0's are read (precision, recall and prefetch hits in stat);
    what it learned is written at unmount, taken back by the next mount, and a
    corrupted file is refused in one log line."""
    import gguf
    archive = converted["mixtral", "default"]
    tier = work / "tier"
    # A cache of a few chunks, so that a token's experts are gone by the time they are
    # used again and prefetches show.
    args = ("--disk-cache", str(tier), "--no-passthrough", "--cache-size", "2MiB",
            "--expert-prefetch", "on")

    def experts_of(mp):
        r = gguf.GGUFReader(mp / "model.gguf")
        n = int(r.fields["llama.expert_count"].parts[-1][0])
        out = {}
        for t in r.tensors:
            m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", t.name)
            if m:
                at, per = t.data_offset, t.n_bytes // n  # from the start of the file
                for e in range(n):
                    out.setdefault((int(m.group(1)), e), []).append((at + e * per, per))
        del r
        gc.collect()
        return n, out

    def route(mp, tokens):
        """Token t uses experts t, t+1 of layer 0 and t+1, t+2 of layer 1 (mod n): their
        gate, up and down matrices read whole, past the page cache, as a client's
        matrix product reads them (a page of each would not count: docs/MOE.md)."""
        n, ext = experts_of(mp)
        fd = os.open(mp / "model.gguf", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for t in range(tokens):
                for layer in (0, 1):
                    for e in ((t + layer) % n, (t + layer + 1) % n):
                        for at, per in ext[layer, e]:
                            assert len(os.pread(fd, per, at)) == per
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return json.loads(run([cawsfs, "stat", mp, "--json"]).stdout)

    with mounted(cawsfs, archive, work / "m", *args) as (mp, _):
        s = route(mp, 80)
    x = s["experts"]
    assert x["prefetch"] and x["files"] >= 1, x
    # Recall counts the first tokens too, before an expert has the 4 steps that make
    # its transitions trusted (about 9 of the 80).
    assert x["precision"] >= 0.9 and x["recall"] >= 0.85, x
    assert x["queued_chunks"] > 0 and s["cache"]["prefetch_hits"] > 0, (x, s["cache"])
    saved = list((tier / "experts").glob("*.xpred"))
    assert len(saved) == 1, saved
    with mounted(cawsfs, archive, work / "m", *args) as (mp, log):
        s = route(mp, 2)
        assert s["experts"]["loaded_steps"] > 0, s["experts"]
        # Learned before: the first token's layer 1 experts were queued (its step,
        # ended by the second token's first read, is scored).
        assert s["experts"]["predicted_read"] == 2, s["experts"]
        assert "learned before loaded" in open(log).read()
    b = bytearray(saved[0].read_bytes())
    b[40] ^= 1
    saved[0].write_bytes(bytes(b))
    with mounted(cawsfs, archive, work / "m", *args) as (mp, log):
        s = route(mp, 1)
        assert s["experts"]["loaded_steps"] == 0, s["experts"]
        lines = [l for l in open(log) if ".xpred" in l]
        assert len(lines) == 1 and "checksum mismatch" in lines[0], lines


def make_qwen2(like, out):
    """A tiny random Qwen2 (q/k/v biases, rope base 10⁶) with `like`'s tokenizer."""
    import shutil
    import transformers as tf
    vocab = json.load(open(os.path.join(like, "config.json")))["vocab_size"]
    torch.manual_seed(2)
    m = tf.Qwen2ForCausalLM(tf.Qwen2Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=False))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(".bias"):  # initialized to zero, which would test nothing
                p.normal_(0, 0.5)
    m.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(like, f), out)
    return out


def test_calibration_statistics_match_transformers(cawsfs, arch_models, work):
    """`cawsfs calibrate` runs the model itself (the pass `convert` makes for error
    feedback, docs/CODECS.md) and gathers the moments of every linear layer's input
    that scripts/calibrate.py gathers with transformers over the same text: Llama (a
    SentencePiece vocabulary), Qwen3 (per-head q/k norms), Qwen2 (q/k/v biases)."""
    from safetensors import safe_open
    models = {n: arch_models[n] for n in ("llama-spm", "qwen3")}
    models["qwen2"] = make_qwen2(arch_models["qwen3"], work / "qwen2")
    for name, src in models.items():
        ours, theirs = work / f"{name}-cawsfs.st", work / f"{name}-torch.st"
        run([cawsfs, "calibrate", src, "-o", ours])
        run([ROOT / "scripts" / "calibrate.py", src, ROOT / "assets" / "calibration.txt", theirs])
        with safe_open(str(ours), "pt") as a, safe_open(str(theirs), "pt") as b:
            ra, rb = (json.loads(f.metadata()["readers"]) for f in (a, b))
            assert ra.keys() == rb.keys() and len(ra) == 7 * 2 + 1, (name, sorted(ra))
            assert a.metadata()["tokens"] == b.metadata()["tokens"] == "4096", name
            for w in ra:
                x, y = a.get_tensor(ra[w]), b.get_tensor(rb[w])
                err = float((x - y).norm() / y.norm())
                assert err < 1e-5, (name, w, err)
    # Fewer tokens than a window (512) asked for: one window of that many.
    few = work / "few.st"
    run([cawsfs, "calibrate", models["llama-spm"], "-o", few, "--tokens", "200"])
    with safe_open(str(few), "pt") as f:
        assert f.metadata()["tokens"] == "200", f.metadata()


def test_an_architecture_without_the_pass_is_converted_without_feedback(cawsfs, arch_models, work):
    p = run_status([cawsfs, "calibrate", arch_models["gemma2"], "-o", work / "g.st"])
    err = p.stderr.strip()
    assert p.returncode != 0 and "no built-in forward pass for architecture gemma2" in err, err
    assert "\n" not in err and not (work / "g.st").exists()
    out = run([cawsfs, "convert", arch_models["gemma2"], "-o", work / "g.cawsf"]).stdout
    assert "error feedback: none (no built-in forward pass for architecture gemma2)" in out, out

#!/usr/bin/env python3
"""The float test model: SmolLM2-135M with its residual stream rotated (docs/QUALITY.md).

No registry ships an unquantized decoder LLM, and the test model's weights lie on Q4_1's
grid, where any codec that can hit that grid looks exact. Rotating the residual stream by a
random orthogonal Q keeps the function (computational invariance) and moves every weight off
any grid:
  - RMSNorm gains are folded into the matrices that read the stream, then set to 1:
    W_q, W_k, W_v, W_gate, W_up <- W diag(g) Q;
  - the matrices that write the stream are rotated back: W_o, W_down <- Q^T W;
  - the embedding E <- E Q, and the output head (tied in the source) untied as
    E diag(g_final) Q.
Writes an F32 GGUF into the cache (idempotent) and prints its path. With --check it also
writes the unrotated model in F32 and prints llama.cpp's mean KL-divergence between the two
(it should be about 1e-6; anything above 1e-4 fails).

Usage: scripts/make-float-model.py [--check] [--out PATH]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import gguf

SEED = 20261207
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("CAWSFS_CACHE", os.path.expanduser("~/.cache/cawsfs"))
DEFAULT_OUT = os.path.join(CACHE, "models", f"SmolLM2-135M-rotated-{SEED}-F32.gguf")

READERS = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
WRITERS = ("attn_output", "ffn_down")


def source_model():
    out = subprocess.run([os.path.join(REPO, "scripts", "fetch-test-model.sh")],
                         check=True, capture_output=True, text=True).stdout.strip()
    return out


def values(t):
    """A tensor's values as float64, numpy shape (rows, cols) as llama.cpp lays it out."""
    a = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(a, dtype=np.float64).reshape(tuple(int(x) for x in reversed(t.shape)))


def orthogonal(n, seed):
    a = np.random.default_rng(seed).standard_normal((n, n))
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))


def copy_fields(reader, writer):
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def write(path, reader, tensors):
    arch = reader.fields["general.architecture"].contents()
    tmp = f"{path}.tmp.{os.getpid()}"
    w = gguf.GGUFWriter(tmp, arch)
    copy_fields(reader, w)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, a in tensors:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def rotated(reader):
    src = {t.name: values(t) for t in reader.tensors}
    n = src["token_embd.weight"].shape[1]
    q = orthogonal(n, SEED)
    out = []
    for t in reader.tensors:
        name, a = t.name, src[t.name]
        m = re.match(r"blk\.(\d+)\.(\w+)\.weight$", name)
        kind = m.group(2) if m else None
        if name == "token_embd.weight":
            a = a @ q
        elif kind in READERS:
            norm = "attn_norm" if kind.startswith("attn") else "ffn_norm"
            a = (a * src[f"blk.{m.group(1)}.{norm}.weight"][None, :]) @ q
        elif kind in WRITERS:
            a = q.T @ a
        elif kind in ("attn_norm", "ffn_norm") or name == "output_norm.weight":
            a = np.ones_like(a)
        elif a.ndim == 2:
            sys.exit(f"{name}: a matrix this script does not know how to rotate")
        out.append((name, a))
        if name == "output_norm.weight":
            if "output.weight" in src:
                sys.exit("the source has an output head; this script expects it tied")
            head = (src["token_embd.weight"] * src[name][None, :]) @ q
            out.append(("output.weight", head))
    return out


def kld(base, other):
    """Mean KL-divergence llama.cpp measures between two GGUFs over two 512-token chunks."""
    bin_dir = subprocess.run([os.path.join(REPO, "scripts", "build-llama-cpp.sh")],
                             check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d:
        text = os.path.join(d, "text.txt")
        with open(text, "w") as f:
            for lic in ("GPL-3", "Apache-2.0"):
                f.write(open(f"/usr/share/common-licenses/{lic}").read())
        ppl = os.path.join(bin_dir, "llama-perplexity")
        common = ["-f", text, "-c", "512", "--chunks", "2", "-t", str(os.cpu_count())]
        kbase = os.path.join(d, "base.kld")
        subprocess.run([ppl, "-m", base, "--kl-divergence-base", kbase, *common],
                       check=True, capture_output=True)
        r = subprocess.run([ppl, "-m", other, "--kl-divergence-base", kbase, "--kl-divergence",
                            *common], check=True, capture_output=True, text=True)
        log = r.stdout + r.stderr
        m = re.search(r"Mean\s+KLD:\s+([-0-9.eE+]+)", log)
        if not m:
            sys.exit("llama-perplexity printed no mean KLD:\n" + log[-2000:])
        return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    reader = gguf.GGUFReader(source_model())
    if not os.path.exists(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        write(args.out, reader, rotated(reader))
    if args.check:
        with tempfile.TemporaryDirectory() as d:
            plain = os.path.join(d, "plain-F32.gguf")
            write(plain, reader, [(t.name, values(t)) for t in reader.tensors])
            k = kld(plain, args.out)
        print(f"mean KLD of the rotated model against the unrotated one: {k:.2e}",
              file=sys.stderr)
        if not k < 1e-4:
            sys.exit(f"{args.out}: not the same function as the source (mean KLD {k})")
    print(args.out)


if __name__ == "__main__":
    main()

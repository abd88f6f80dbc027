#!/usr/bin/env python3
"""How fast llama.cpp runs the default archive's GGUF view of the float model, against
llama-quantize's files of the nearest types measured in the same run (issue 59: the view
at ≥ 0.98 × the tokens/s of the nearest type).

  scripts/bench-float-speed.py [--rounds 5] [--threads N] [--out docs/QUALITY-FLOAT.md]

Cases: the default archive mounted (`model.gguf`; the disk tier on, so after the warm-up
round its opens are passthrough opens of the tier file), the same bytes exported to a
local file, an archive planned from every type cawsfs rounds into, Q4_1, Q5_0 and Q5_1
included (`--bpw-types`, ALL below; the default leaves those out) mounted, and llama-quantize's IQ4_XS, Q3_K_M, Q4_K_M and the 5.0-bit hand mix of
docs/QUALITY-FLOAT.md (IQ4_NL, Q5_0 for attn_q/k/v/output, ffn_down and the output
matrix) of the same float weights. Each round runs every case once, in the same order
(A B C … A B C …), after one warm-up round; medians. Prompt processing from
llama-completion's "prompt eval time" (a 200-token prompt), generation from its
"eval time" (64 tokens, greedy). The cawsfs cases' mean KL-divergence from the model in
F16 is measured as scripts/quality-float.sh measures it. Files live under a temporary
directory on local disk; nothing else should run (say what did).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAWSFS = os.path.join(ROOT, "target", "release", "cawsfs")
PROMPT_FILE = "/usr/share/common-licenses/Apache-2.0"
# Every type, Q5_0/Q5_1/Q4_1 included: less divergence for the bits, but their CPU dot
# products cost more per weight than IQ4_NL's and Q8_0's.
ALL = "iq4_nl,q4_0,q4_1,q5_0,q5_1,q8_0,iq4_xs,iq3_xxs,iq3_s,iq2_s,q2_k,q3_k,q4_k,q5_k,q6_k"
KLD_TEXTS = ["Apache-2.0", "MPL-2.0", "GFDL-1.3"]


def mean_kld(bin_dir, model, base, text, threads):
    """(mean KLD, same top-1 %) of `model` against the base logits, as quality-float.sh."""
    out = subprocess.run([os.path.join(bin_dir, "llama-perplexity"), "-m", model, "--kl-divergence-base", base,
                          "--kl-divergence", "-f", text, "-c", "512", "--chunks", "12", "-t", str(threads)],
                         capture_output=True, text=True)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        sys.exit(f"llama-perplexity on {model} failed: {log[-600:]}")
    return (float(re.search(r"Mean\s+KLD:\s*([-\d.]+)", log)[1]),
            float(re.search(r"Same top p:\s*([\d.]+)", log)[1]))


def sh(*argv):
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{argv[0]} failed: {p.stderr.strip()[-600:]}")
    return p.stdout


def llama_speed(bin_dir, model, threads, prompt):
    """(prompt tokens/s, generation tokens/s) of one llama-completion run."""
    p = subprocess.run([os.path.join(bin_dir, "llama-completion"), "-m", model, "-t", str(threads),
                        "-no-cnv", "--no-warmup", "--temp", "0", "-n", "64", "-c", "1024", "-p", prompt],
                       capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        sys.exit(f"llama-completion on {model} failed: {out[-600:]}")
    pp = float(re.search(r"prompt eval time =.*?([\d.]+) tokens per second", out).group(1))
    tg = float(re.search(r"(?<!prompt )eval time =.*?([\d.]+) tokens per second", out).group(1))
    return pp, tg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", help="docs file whose `speed` section gets the table")
    a = ap.parse_args()
    sh("cargo", "build", "--release", "--quiet")
    bin_dir = sh(os.path.join(ROOT, "scripts", "build-llama-cpp.sh")).strip().splitlines()[-1]
    model = sh(os.path.join(ROOT, "scripts", "make-float-model.py")).strip().splitlines()[-1]
    # About 200 tokens of licence text as the prompt.
    prompt = " ".join(open(PROMPT_FILE).read().split()[:150])
    with tempfile.TemporaryDirectory(dir=os.path.expanduser("~")) as work:
        arc = os.path.join(work, "default.cawsf")
        sh(CAWSFS, "convert", model, "-o", arc)
        alls = os.path.join(work, "all.cawsf")
        sh(CAWSFS, "convert", model, "-o", alls, "--bpw-types", ALL)
        exported = os.path.join(work, "default-view.gguf")
        sh(CAWSFS, "export", arc, "--format", "gguf", "-o", exported)
        quants = {
            "llama-quantize IQ4_XS": ["IQ4_XS"],
            "llama-quantize Q3_K_M": ["Q3_K_M"],
            "llama-quantize Q4_K_M": ["Q4_K_M"],
            "llama-quantize hand mix 5.0": [
                *[x for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down")
                  for x in ("--tensor-type", f"{t}=q5_0")],
                "--output-tensor-type", "q5_0", "IQ4_NL"],
        }
        cases = {}
        for name, args in quants.items():
            out = os.path.join(work, name.split()[-1].replace(".", "") + ".gguf")
            # The types' speed does not depend on an importance matrix; IQ4_XS only
            # warns without one.
            sh(os.path.join(bin_dir, "llama-quantize"), *args[:-1], model, out, args[-1])
            cases[name] = out
        cases["cawsfs default, exported view"] = exported
        mp, mp_all = os.path.join(work, "mnt"), os.path.join(work, "mnt-all")
        os.makedirs(mp)
        os.makedirs(mp_all)
        sh(CAWSFS, "mount", arc, mp)
        sh(CAWSFS, "mount", alls, mp_all)
        try:
            cases["cawsfs default, mounted view"] = os.path.join(mp, "model.gguf")
            cases["cawsfs --bpw-types ALL, mounted view"] = os.path.join(mp_all, "model.gguf")
            text = os.path.join(work, "text.txt")
            with open(text, "w") as f:
                f.write("".join(open(f"/usr/share/common-licenses/{t}").read() for t in KLD_TEXTS))
            ref, base = os.path.join(work, "ref16.gguf"), os.path.join(work, "ref.kld")
            sh(os.path.join(bin_dir, "llama-quantize"), model, ref, "F16")
            sh(os.path.join(bin_dir, "llama-perplexity"), "-m", ref, "-f", text, "-c", "512", "--chunks", "12",
               "-t", a.threads, "--kl-divergence-base", base)
            klds = {n: mean_kld(bin_dir, cases[n], base, text, a.threads)
                    for n in ("cawsfs default, mounted view", "cawsfs --bpw-types ALL, mounted view")}
            sizes = {n: os.path.getsize(p) for n, p in cases.items()}
            got = {n: ([], []) for n in cases}
            for r in range(a.rounds + 1):
                for n, p in cases.items():
                    pp, tg = llama_speed(bin_dir, p, a.threads, prompt)
                    if r > 0:
                        got[n][0].append(pp)
                        got[n][1].append(tg)
                        print(f"round {r} {n:32} pp {pp:8.1f} tg {tg:7.1f}", file=sys.stderr, flush=True)
        finally:
            subprocess.run([CAWSFS, "umount", mp], capture_output=True)
            subprocess.run([CAWSFS, "umount", mp_all], capture_output=True)
            time.sleep(0.5)
    med = {n: (statistics.median(v[0]), statistics.median(v[1])) for n, v in got.items()}
    view = med["cawsfs default, mounted view"]
    lines = [f"Produced by `scripts/bench-float-speed.py` on {time.strftime('%Y-%m-%d', time.gmtime())} "
             f"({os.cpu_count()} cores, llama.cpp with {a.threads} threads, medians of {a.rounds} "
             "interleaved rounds after a warm-up round). **×** columns: the default mounted view's "
             "tokens/s over the row's, then ALL's over the row's. ALL = `--bpw-types " + ALL + "`. "
             "Mean KLD as in the table above.",
             "",
             "| file | MiB | mean KLD | prompt tokens/s | × default | × ALL | generation tokens/s "
             "| × default | × ALL |",
             "|---|---|---|---|---|---|---|---|---|"]
    allv = med["cawsfs --bpw-types ALL, mounted view"]
    for n, (pp, tg) in med.items():
        k = f"{klds[n][0]:.4f}" if n in klds else ""
        lines.append(f"| {n} | {sizes[n] / 2**20:.1f} | {k} | {pp:.1f} | {view[0] / pp:.2f} | "
                     f"{allv[0] / pp:.2f} | {tg:.1f} | {view[1] / tg:.2f} | {allv[1] / tg:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if a.out:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        from docsection import replace_section
        replace_section(a.out, "speed", table)


if __name__ == "__main__":
    main()

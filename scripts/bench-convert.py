#!/usr/bin/env python3
"""Peak RSS, CPU time and weights per CPU-second of `cawsfs convert` at default settings.

  scripts/bench-convert.py [--model DIR|FILE] [--runs 3] [--baseline BIN]
                           [--out docs/QUALITY.md [--section convert]]

The model defaults to the 1.17 B-parameter random llama of `scripts/make-kquant-model.sh
1b` (2.3 GB bf16, made and cached on first use). With --baseline, each run converts with
both binaries, interleaved (this build, baseline, baseline, this build, ...), and the
table gives the ratio of medians. Peak RSS is the child's ru_maxrss (what `time -v`
calls "Maximum resident set size"); the issue's bound is 1 GiB + 4x the largest tensor's
f32 size. Archives of one binary must be byte-identical across runs (determinism).
"""

import argparse
import datetime
import filecmp
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import time

from docsection import replace_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAWSFS = os.path.join(ROOT, "target/release/cawsfs")
CACHE = os.environ.get("CAWSFS_CACHE", os.path.expanduser("~/.cache/cawsfs"))
GiB = 1 << 30


def numels(model):
    """Element counts of every tensor of a Hugging Face directory's safetensors files."""
    files = [f for f in sorted(os.listdir(model)) if f.endswith(".safetensors")]
    out = []
    for f in files:
        with open(os.path.join(model, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                p = 1
                for d in t["shape"]:
                    p *= d
                out.append(p)
    return out


def convert(binary, model, out):
    """(peak RSS bytes, CPU seconds, wall seconds) of one conversion."""
    if os.path.exists(out):
        os.remove(out)
    t = time.perf_counter()
    p = subprocess.Popen([binary, "convert", model, "-o", out],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    err = p.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"bench-convert: {binary} convert failed: {err[-400:]}")
    return ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", help="another build's cawsfs binary, converted alongside")
    ap.add_argument("--out")
    ap.add_argument("--section", default="convert")
    a = ap.parse_args()
    model = a.model or subprocess.run([os.path.join(ROOT, "scripts/make-kquant-model.sh"), "1b"],
                                      check=True, capture_output=True, text=True).stdout.strip()
    work = os.path.join(CACHE, "bench-convert")
    os.makedirs(work, exist_ok=True)
    sizes = numels(model)
    weights, largest = sum(sizes), max(sizes)
    bound = GiB + 4 * 4 * largest

    bins = {"this build": CAWSFS}
    if a.baseline:
        bins["baseline"] = a.baseline
    runs = {k: [] for k in bins}
    identical = {k: True for k in bins}
    order = list(bins)
    for i in range(a.runs):
        for k in (order if i % 2 == 0 else order[::-1]):
            out = os.path.join(work, f"{k.replace(' ', '-')}-{i % 2}.cawsf")
            r = convert(bins[k], model, out)
            runs[k].append(r)
            print(f"{k}: peak RSS {r[0] / GiB:.2f} GiB, CPU {r[1]:.1f} s, wall {r[2]:.1f} s",
                  file=sys.stderr)
            prev = os.path.join(work, f"{k.replace(' ', '-')}-{(i + 1) % 2}.cawsf")
            if i > 0 and not filecmp.cmp(out, prev, shallow=False):
                identical[k] = False
    med = lambda k, j: statistics.median(r[j] for r in runs[k])

    rows = []
    for k in bins:
        rss, cpu, wall = med(k, 0), med(k, 1), med(k, 2)
        rows.append((k, f"{rss / GiB:.2f} GiB", f"{cpu:.1f} s", f"{weights / cpu / 1e6:.1f} M",
                     f"{wall:.1f} s", "yes" if identical[k] or a.runs < 2 else "NO"))
    table = ("| binary | peak RSS | CPU | weights per CPU-second | wall | archives identical across runs |\n"
             "|---|---|---|---|---|---|\n" + "".join(f"| {' | '.join(r)} |\n" for r in rows))
    if a.baseline:
        b, n = "baseline", "this build"
        table += (f"\nRatios this build / baseline: peak RSS {med(n, 0) / med(b, 0):.2f}, "
                  f"CPU {med(n, 1) / med(b, 1):.2f}, weights per CPU-second "
                  f"{med(b, 1) / med(n, 1):.2f}.\n")
    cmd = ("scripts/bench-convert.py" + (f" --model {a.model}" if a.model else "")
           + f" --runs {a.runs}" + (f" --baseline {a.baseline}" if a.baseline else ""))
    text = (f"Measured {datetime.date.today()} on {platform.node()} ({os.cpu_count()} cores), `{cmd}`: "
            f"{os.path.basename(model.rstrip('/'))}, {weights / 1e9:.2f} B weights, largest tensor "
            f"{largest / 1e6:.1f} M weights, so the bound 1 GiB + 4 x its f32 size is "
            f"{bound / GiB:.2f} GiB; medians of {a.runs} runs per binary, interleaved.\n\n" + table)
    print(text)
    if a.out:
        replace_section(a.out, a.section, text)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Reconstruction throughput on one core: GB of F16 output per CPU-second of
`cawsfs export --format safetensors --dtype f16 --threads 1`, the whole read path
(block read and checksum, decompression, decode, f32 -> f16, the file write).

  scripts/bench-decode.py ARCHIVE [--baseline BIN | --null] [--runs 5]
                          [--out docs/CODECS.md [--section decode]]

CPU is the child's user + system time (os.wait4); the output goes to /dev/shm (the
tmpfs write is counted; it is the same for every binary, but on this VM it varies up to
2x from run to run), or with --null to /dev/null (the read path alone; a baseline before
61e84e4 renames its output over /dev/null, which is detected and stops the run). With
--baseline, the two
binaries run interleaved (A B B A ...), medians, and the ratio; their outputs must be
byte-identical. With --out, the text replaces the <!-- SECTION:begin/end --> section (--section,
default decode).
"""

import argparse
import datetime
import filecmp
import os
import platform
import statistics
import subprocess
import sys
import time

from docsection import replace_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAWSFS = os.path.join(ROOT, "target/release/cawsfs")


def export(binary, archive, out):
    """(CPU seconds, wall seconds, output bytes) of one export."""
    if out != "/dev/null" and os.path.exists(out):
        os.remove(out)
    t = time.perf_counter()
    # The CPU path even where a GPU is (builds before --device had only that one).
    helps = subprocess.run([binary, "export", "--help"], capture_output=True, text=True).stdout
    device = ["--device", "cpu"] if "--device" in helps else []
    p = subprocess.Popen([binary, "export", archive, "--format", "safetensors", "--dtype", "f16",
                          "--threads", "1", *device, "-o", out],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    said = p.stdout.read().decode(errors="replace")
    err = p.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"bench-decode: {binary} export failed: {err[-400:]}")
    if out == "/dev/null":
        if not os.path.exists(out) or os.path.isfile(out):
            sys.exit(f"bench-decode: {binary} replaced /dev/null (restore: rm /dev/null; mknod -m 666 /dev/null c 1 3)")
        size = int(said.split("wrote /dev/null (")[1].split(" bytes")[0])
        return ru.ru_utime + ru.ru_stime, wall, size
    return ru.ru_utime + ru.ru_stime, wall, os.path.getsize(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("archive")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline", help="another build's cawsfs binary, run alongside")
    ap.add_argument("--null", action="store_true",
                    help="write to /dev/null (a baseline before 61e84e4 replaces it: refused)")
    ap.add_argument("--out")
    ap.add_argument("--section", default="decode")
    a = ap.parse_args()
    bins = {"this build": CAWSFS}
    if a.baseline:
        bins["baseline"] = a.baseline
    order = list(bins)
    runs = {k: [] for k in bins}
    outs = {k: "/dev/null" if a.null else f"/dev/shm/bench-decode-{i}.safetensors"
            for i, k in enumerate(bins)}
    try:
        for i in range(a.runs):
            for k in (order if i % 2 == 0 else order[::-1]):
                r = export(bins[k], a.archive, outs[k])
                runs[k].append(r)
                print(f"{k}: CPU {r[0]:.3f} s, wall {r[1]:.3f} s, {r[2] / r[0] / 1e9:.2f} GB/CPU-s",
                      file=sys.stderr)
        if a.baseline is None:
            same = True
        elif a.null:
            # Nothing kept to compare: the sizes the exports report.
            same = runs["this build"][0][2] == runs["baseline"][0][2]
        else:
            same = filecmp.cmp(outs["this build"], outs["baseline"], shallow=False)
    finally:
        for o in outs.values():
            if o != "/dev/null" and os.path.exists(o):
                os.remove(o)
    size = runs["this build"][0][2]
    med = {k: (statistics.median(r[0] for r in runs[k]), statistics.median(r[1] for r in runs[k]))
           for k in bins}
    rows = "".join(f"| {k} | {c:.3f} s | {w:.3f} s | {size / c / 1e9:.2f} |\n" for k, (c, w) in med.items())
    cmd = (f"scripts/bench-decode.py {os.path.basename(a.archive)} --runs {a.runs}"
           + (f" --baseline {a.baseline}" if a.baseline else "") + (" --null" if a.null else ""))
    text = (f"Measured {datetime.date.today()} on {platform.node()} ({os.cpu_count()} cores), `{cmd}`: "
            f"{size / 1e9:.3f} GB of F16 safetensors per export to {'/dev/null' if a.null else '/dev/shm'}, "
            f"one thread, medians of {a.runs} "
            f"runs per binary, interleaved.\n\n"
            "| binary | CPU | wall | GB of F16 per CPU-second |\n|---|---|---|---|\n" + rows)
    if a.baseline:
        what = "output sizes equal" if a.null else "outputs byte-identical"
        text += (f"\nRatio this build / baseline: {med['baseline'][0] / med['this build'][0]:.2f}x "
                 f"the output per CPU-second; {what}: {'yes' if same else 'NO'}.\n")
    print(text)
    if a.out:
        replace_section(a.out, a.section, text)
    if not same:
        sys.exit("bench-decode: the outputs differ")


if __name__ == "__main__":
    main()

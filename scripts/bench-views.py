#!/usr/bin/env python3
"""What llama.cpp holds and how fast it runs for each `model.gguf` view, as ratios
against the original quantized GGUF file measured in the same run.

  scripts/bench-views.py [--runs 3] [--limit-mib 160] [--mount-args "--no-disk-cache"]
                         [--out docs/MOUNT.md [--section views]]

1. Unconstrained, warm: llama-completion (-n 32, greedy, -c 512) on the original file and
   on each mounted view; peak RSS (getrusage of the child) and generation tokens/s.
2. Memory pressure: the same runs inside a cgroup (v1 or v2) whose memory limit lies
   between the quantized file's size and the F16 view's; the daemon runs outside it. The
   page cache is dropped before every run so the file's pages are faulted in (and
   charged) inside the cgroup.
3. Serving cost: CPU seconds (user + sys) of `cawsfs export` of model.gguf per view,
   against the F16 view of the same archive (the same weights).

Mounts use the default options (the disk tier on: once the warm-up run has read a view
whole, later opens are FUSE passthrough opens of the tier file) plus --mount-args;
`--mount-args=--no-disk-cache` measures the daemon serving every read.

Every measurement is repeated --runs times, cases interleaved (A B C A B C ...), medians.
Needs root (cgroups, drop_caches), target/release/cawsfs, the llama.cpp build
(scripts/build-llama-cpp.sh) and the test model (scripts/fetch-test-model.sh).
Archives are made once under $CAWSFS_CACHE/bench-views (default ~/.cache/cawsfs).
"""

import argparse
import datetime
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from memcg import Cgroup, drop_caches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAWSFS = os.path.join(ROOT, "target/release/cawsfs")
CACHE = os.environ.get("CAWSFS_CACHE", os.path.expanduser("~/.cache/cawsfs"))
MiB = 1 << 20
PROMPT = "The capital of France is"


def sh(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, **kw).stdout


class Mount:
    def __init__(self, archive, mp, *args):
        os.makedirs(mp, exist_ok=True)
        self.mp = mp
        out = sh(CAWSFS, "mount", archive, mp, "--cache-size", "1GiB", *args, *MOUNT_ARGS)
        self.pid = int(re.search(r"pid (\d+)", out).group(1))

    def close(self):
        subprocess.run([CAWSFS, "umount", self.mp], capture_output=True)

    def served_by(self):
        """How llama.cpp's opens were answered: by the kernel from the tier file
        (passthrough) or by the daemon."""
        import json
        tier = json.loads(sh(CAWSFS, "stat", self.mp, "--json")).get("tier") or {}
        return "passthrough" if tier.get("passthrough_opens") else "daemon"


MOUNT_ARGS = []


def run_child(argv):
    """Run argv; (stdout+stderr, CPU s of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {p.stderr[-800:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return p.stdout + p.stderr, cpu


def llama_run(bin_dir, model, cg=None):
    """(peak RSS MiB, tokens/s, wall s) of llama-completion; RSS via /usr/bin/time."""
    argv = ["/usr/bin/time", "-f", "MAXRSS %M", os.path.join(bin_dir, "llama-completion"), "-m", model,
            "-t", "1", "-no-cnv", "--no-warmup", "--temp", "0", "-n", "32", "-c", "512", "-p", PROMPT]
    if cg:
        argv = cg.enter_cmd(argv)
    t = time.perf_counter()
    out, _ = run_child(argv)
    wall = time.perf_counter() - t
    rss = int(re.search(r"MAXRSS (\d+)", out).group(1)) / 1024
    tps = float(re.search(r"(?<!prompt )eval time =.*?([\d.]+) tokens per second", out).group(1))
    return rss, tps, wall


def ensure_archives(model):
    d = os.path.join(CACHE, "bench-views")
    os.makedirs(d, exist_ok=True)
    arcs = {"default": os.path.join(d, "smol-default.cawsf"), "exact": os.path.join(d, "smol-exact.cawsf")}
    if not os.path.exists(arcs["default"]):
        sh(CAWSFS, "convert", model, "-o", arcs["default"])
    if not os.path.exists(arcs["exact"]):
        sh(CAWSFS, "convert", model, "-o", arcs["exact"], "--passthrough", "*")
    return arcs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit-mib", type=int, default=160)
    ap.add_argument("--views", default="auto,f16,q8_0,q6_k,q5_0,q4_k_m",
                    help="views of the default archive to measure")
    ap.add_argument("--cost-views", default="q8_0,q6_k,q5_k,q5_0,q4_k,q4_0,q4_k_m,auto",
                    help="views whose export CPU is compared with f16's")
    ap.add_argument("--mount-args", default="", help="more options for every mount")
    ap.add_argument("--out")
    ap.add_argument("--section", default="views", help="marker name of the section --out rewrites")
    a = ap.parse_args()
    MOUNT_ARGS.extend(shlex.split(a.mount_args))
    global BEGIN, END
    BEGIN, END = f"<!-- {a.section}:begin -->", f"<!-- {a.section}:end -->"
    bin_dir = sh(os.path.join(ROOT, "scripts/build-llama-cpp.sh")).strip()
    model = sh(os.path.join(ROOT, "scripts/fetch-test-model.sh")).strip()
    arcs = ensure_archives(model)
    load0 = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="bench-views-")
    mounts, cases = [], [("original Q4_1 file", "-", model)]
    rows = []
    cg = None
    try:
        m = Mount(arcs["exact"], os.path.join(tmp, "exact-source"), "--gguf-type", "source")
        mounts.append(m)
        cases.append(("mount, all-passthrough archive", "source", os.path.join(m.mp, "model.gguf")))
        for v in a.views.split(","):
            m = Mount(arcs["default"], os.path.join(tmp, f"default-{v}"), "--gguf-type", v)
            mounts.append(m)
            cases.append(("mount, default .cawsf", v, os.path.join(m.mp, "model.gguf")))
        sizes = {c[2]: os.path.getsize(c[2]) for c in cases}
        # Warm every daemon's chunk cache and the page cache once.
        for _, _, path in cases:
            llama_run(bin_dir, path)

        res = {c[2]: [] for c in cases}
        for _ in range(a.runs):
            for _, _, path in cases:
                res[path].append(llama_run(bin_dir, path))
        base = [statistics.median(x) for x in zip(*res[model])]
        rows.append(("Unconstrained, warm", None))
        for label, view, path in cases:
            med = [statistics.median(x) for x in zip(*res[path])]
            rows.append((label, view, sizes[path] / MiB, med[0], med[0] / base[0], med[1], med[1] / base[1]))

        limit = a.limit_mib * MiB
        cg = Cgroup("cawsfs-bench-views", limit)
        res = {c[2]: [] for c in cases}
        for _ in range(a.runs):
            for _, _, path in cases:
                drop_caches()
                res[path].append(llama_run(bin_dir, path, cg))
        base = [statistics.median(x) for x in zip(*res[model])]
        rows.append((f"In a {a.limit_mib} MiB memory cgroup ({cg.kind}), page cache dropped before each run", None))
        for label, view, path in cases:
            med = [statistics.median(x) for x in zip(*res[path])]
            rows.append((label, view, sizes[path] / MiB, med[0], med[0] / base[0], med[1], med[1] / base[1],
                         med[2], med[2] / base[2]))
        # Each case row names how its mount answered llama.cpp's opens.
        served = {(label, view): m.served_by() for (label, view, _), m in zip(cases[1:], mounts)}
        rows = [(f"{r[0]} ({served[r[:2]]})",) + r[1:] if r[:2] in served else r for r in rows]
    finally:
        for m in mounts:
            m.close()
        if cg:
            cg.close()

    # Serving cost: export CPU per view against the F16 view of the same archive.
    cost_views = ["f16"] + [v for v in a.cost_views.split(",") if v != "f16"]
    cpu = {v: [] for v in cost_views}
    for _ in range(a.runs):
        for v in cost_views:
            out = os.path.join(tmp, "export.gguf")
            _, c = run_child([CAWSFS, "export", arcs["default"], "--format", "gguf", "--gguf-type", v,
                              "-o", out])
            cpu[v].append(c)
            os.unlink(out)
    f16 = statistics.median(cpu["f16"])
    cost = [(v, statistics.median(cpu[v]), statistics.median(cpu[v]) / f16) for v in cost_views]
    os.rmdir(tmp) if not os.listdir(tmp) else None

    lines = render(rows, cost, a, load0)
    print("\n".join(lines))
    if a.out:
        write_doc(a.out, lines)


def render(rows, cost, a, load0):
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    cmd = "scripts/bench-views.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    out = [BEGIN,
           f"Measured {datetime.date.today().isoformat()} on {os.cpu_count()} cores ({cpu}), Linux "
           f"{platform.release()}; llama-completion -n 32 -c 512 -t 1, greedy; medians of {a.runs} "
           f"interleaved runs; 1-minute load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end. "
           "Command:", "", f"    {cmd}"]
    for r in rows:
        if r[1] is None:
            out += ["", f"**{r[0]}**", ""]
            if r[0].startswith("Unconstrained"):
                out += ["| file | view | MiB | llama peak RSS MiB | × original | tokens/s | × original |",
                        "|---|---|---|---|---|---|---|"]
            else:
                out += ["| file | view | MiB | llama peak RSS MiB | × original | tokens/s | × original | wall s | × original |",
                        "|---|---|---|---|---|---|---|---|---|"]
            continue
        cells = [r[0], r[1], f"{r[2]:.1f}", f"{r[3]:.0f}", f"{r[4]:.2f}", f"{r[5]:.1f}", f"{r[6]:.2f}"]
        if len(r) > 7:
            cells += [f"{r[7]:.2f}", f"{r[8]:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "**Serving cost**: CPU seconds (user + sys) of `cawsfs export --format gguf` of the "
            "default archive per view, against the F16 view (the same weights decoded once each)", "",
            "| view | CPU s | × f16 |", "|---|---|---|"]
    out += [f"| {v} | {c:.2f} | {r:.2f} |" for v, c, r in cost]
    out.append(END)
    return out


def write_doc(path, lines):
    text = open(path).read()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < 0:
        text = text.rstrip("\n") + "\n\n" + BEGIN + "\n" + END + "\n"
        i, j = text.find(BEGIN), text.find(END)
    open(path, "w").write(text[:i] + "\n".join(lines) + text[j + len(END):])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

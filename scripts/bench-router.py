#!/usr/bin/env python3
"""Router quality and route-driven prefetch, measured with llama.cpp through a mount.

  scripts/bench-router.py [--archive PATH] [--out docs/ROUTER.md] [--cache 32MiB] [--runs 2]

1. Recall. For each prompt: route (no prefetch) on a fresh mount, then `trace on`, run
   llama-completion on the prompt through the mount, `trace off`. Reported: the
   fraction of token-embedding chunks llama.cpp read that were in the route's top-k,
   at k = 2, 4, 8; and the same against the chunks that hold the prompt's token rows
   (llama-tokenize's ids: what get_rows needs). Two ways of running llama.cpp:
   - "mmap": as shipped. llama.cpp maps the file with MAP_POPULATE and
     madvise(WILLNEED), so it reads the whole file at load, every embedding chunk.
   - "on-demand": the same binary with an LD_PRELOAD shim that drops MAP_POPULATE and
     WILLNEED, and the mount's bdi read_ahead_kb set to 0, so pages are read when the
     computation first touches them. The embedding chunks read before the first read of
     any later tensor are those of the prompt's get_rows (the tied output head reads
     the whole table later, at the first logits).
2. Time to first token, total time and hit ratio of llama-completion (-n 8) through a
   cold mount with a cache budget well under model.gguf: no prefetch (no read-ahead by
   cawsfs), sequential read-ahead only (4 chunks), route-driven prefetch (route
   --prefetch before llama starts, budget half the cache) with router-aware eviction,
   and the same with plain LRU eviction. TTFT = wall time to the end of prompt
   evaluation = process wall time − llama's own "eval time" (generation after the first
   token).

Without --archive the test model is converted with default settings into
/tmp/bench-router/smol.cawsf (once). With --out, the text between the figures markers
of that file is replaced.
"""

import argparse
import ast
import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAWSFS = os.path.join(ROOT, "target/release/cawsfs")
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
MiB = 1 << 20
KS = (2, 4, 8)
PROMPTS = [
    "The capital of France is",
    "Water boils at one hundred degrees Celsius",
    "def fibonacci(n): return n if n < 2 else",
    "Once upon a time, a little dragon",
    "The stock market fell sharply on Monday after",
    "Photosynthesis converts sunlight into",
]

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/types.h>
/* Drop llama.cpp's whole-file prefetch so pages are read when first touched. */
void *mmap(void *a, size_t l, int p, int f, int fd, off_t o) {
    static void *(*real)(void *, size_t, int, int, int, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "mmap");
    return real(a, l, p, f & ~MAP_POPULATE, fd, o);
}
void *mmap64(void *a, size_t l, int p, int f, int fd, off_t o) { return mmap(a, l, p, f, fd, o); }
int posix_madvise(void *a, size_t l, int adv) {
    static int (*real)(void *, size_t, int);
    if (adv == POSIX_MADV_WILLNEED) return 0;
    if (!real) real = dlsym(RTLD_NEXT, "posix_madvise");
    return real(a, l, adv);
}
int madvise(void *a, size_t l, int adv) {
    static int (*real)(void *, size_t, int);
    if (adv == MADV_WILLNEED) return 0;
    if (!real) real = dlsym(RTLD_NEXT, "madvise");
    return real(a, l, adv);
}
"""


def sh(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True,
                          **kw).stdout


class Mount:
    def __init__(self, archive, mp, *args):
        self.mp = mp
        # Routes and cold loads are measured: no disk tier serving earlier runs' bytes.
        out = sh(CAWSFS, "mount", archive, mp, "--no-disk-cache", *args)
        self.pid = int(re.search(r"pid (\d+)", out).group(1))
        self.sock = re.search(r"socket (\S+?),", out).group(1)

    def call(self, req):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.sock)
            s.sendall((json.dumps(req) + "\n").encode())
            r = json.loads(s.makefile().readline())
        if not r.pop("ok"):
            raise RuntimeError(f"{req['verb']}: {r['error']}")
        return r

    def readahead_kb(self, kb):
        """Set the kernel read-ahead of this mount (its bdi)."""
        canon = os.path.realpath(self.mp)
        for line in open("/proc/self/mountinfo"):
            f = line.split()
            if f[4] == canon:
                with open(f"/sys/class/bdi/{f[2]}/read_ahead_kb", "w") as fh:
                    fh.write(str(kb))
                return
        raise RuntimeError(f"{self.mp} not in mountinfo")

    def wait_prefetch(self, timeout=120):
        t = time.time()
        while time.time() - t < timeout:
            c = self.call({"verb": "stat"})["cache"]
            if c["prefetch_queue_len"] == 0 and c["loads_in_flight"] == 0:
                return
            time.sleep(0.02)

    def close(self):
        sh(CAWSFS, "umount", self.mp)
        for _ in range(200):
            if not os.path.exists(f"/proc/{self.pid}"):
                return
            time.sleep(0.05)


def llama(bin_dir, gguf, prompt, n, threads, shim=None):
    env = dict(os.environ)
    if shim:
        env["LD_PRELOAD"] = shim
    t = time.perf_counter()
    out = subprocess.run(
        [os.path.join(bin_dir, "llama-completion"), "-m", gguf, "-t", str(threads), "-no-cnv",
         "--no-warmup", "--temp", "0", "-n", str(n), "-p", prompt],
        capture_output=True, text=True, timeout=900, env=env)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise RuntimeError(f"llama-completion failed: {out.stderr[-800:]}")
    ev = re.search(r"(?<!prompt )eval time =\s*([\d.]+) ms", out.stderr)
    gen_s = float(ev.group(1)) / 1000 if ev else 0.0
    return {"wall": wall, "ttft": wall - gen_s, "text": out.stdout}


def token_ids(bin_dir, gguf, prompt):
    out = sh(os.path.join(bin_dir, "llama-tokenize"), "-m", gguf, "-p", prompt, "--ids",
             "--log-disable")
    return ast.literal_eval(out.strip().splitlines()[-1])


def embd_span(gguf_path, cs):
    """(first chunk, end chunk, data offset, row bytes, end chunk of layer 0's tensors)
    of token_embd in a GGUF file."""
    from gguf import GGUFReader
    r = GGUFReader(gguf_path)
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    start, n = int(t.data_offset), int(t.n_bytes)
    rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
    l0 = max(int(x.data_offset) + int(x.n_bytes) for x in r.tensors if x.name.startswith("blk.0."))
    return start // cs, (start + n + cs - 1) // cs, start, n // rows, (l0 + cs - 1) // cs


def drop_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pct(x):
    return f"{100 * x:.1f}%"


def recall_section(archive, llama_bin, model, work, threads, shim, rows):
    rows.append("### Recall of the router (llama.cpp's reads traced through the mount)\n")
    rows.append(f"k = keyed shards (blocks of 227 token-embedding rows, ≤ 1 chunk each) in the "
                f"route; {len(PROMPTS)} prompts, means over prompts.\n")
    rows.append("| llama.cpp run | embedding chunks read (of the table) | "
                + " | ".join(f"recall@{k}" for k in KS) + " | "
                + " | ".join(f"needed-rows recall@{k}" for k in KS) + " |")
    rows.append("|---|---|" + "---|" * (2 * len(KS)))
    for mode in ("mmap", "on-demand"):
        read_n, rec, need = [], {k: [] for k in KS}, {k: [] for k in KS}
        total = None
        for prompt in PROMPTS:
            mp = os.path.join(work, "mnt-recall")
            os.makedirs(mp, exist_ok=True)
            m = Mount(archive, mp, "--cache-size", "1GiB")
            try:
                gguf = os.path.join(mp, "model.gguf")
                cs = m.call({"verb": "stat"})["cache"]["chunk_size"]
                c0, c1, off, rb, l0 = embd_span(gguf, cs)
                drop_page_cache(gguf)  # the header pages GGUFReader just read
                total = c1 - c0
                if mode == "on-demand":
                    m.readahead_kb(0)
                r = m.call({"verb": "route", "prompt": prompt, "top_k": max(KS)})
                ranked = [set(range(*s["chunks"])) for s in r["shards"] if s["kind"] == "embedding"]
                ids = token_ids(llama_bin, model, prompt)
                needed = {(off + t * rb) // cs for t in ids}
                m.call({"verb": "trace", "on": True})
                llama(llama_bin, gguf, prompt, 1, threads, shim if mode == "on-demand" else None)
                t = m.call({"verb": "trace", "on": False})
                fid = next(int(k) for k, v in t["files"].items() if v == "model.gguf")
                seq = [e[1] for e in t["events"] if e[0] == fid]
                if mode == "on-demand":
                    # Up to the first read of layer 0's tensors: the prompt's get_rows.
                    # The chunk holding the table's end also holds layer 0's first
                    # tensor; it counts as layer 0 here. (llama.cpp reads the file's
                    # last chunk and the header first; neither is in these ranges.)
                    # The header shares chunk c0 with the table's first rows: the phase
                    # starts at the first read of another table chunk (a prompt whose
                    # first token lies in chunk c0 would lose that read; none here).
                    start = next((i for i, c in enumerate(seq) if c0 < c < c1), len(seq))
                    cut = next((i for i, c in enumerate(seq) if c1 - 1 <= c < l0), len(seq))
                    seq = seq[start:cut]
                read = {c for c in seq if c0 <= c < c1}
                read_n.append(len(read))
                for k in KS:
                    top = set().union(*ranked[:k]) if ranked[:k] else set()
                    rec[k].append(len(read & top) / max(1, len(read)))
                    need[k].append(len(needed & top) / max(1, len(needed)))
            finally:
                m.close()
        mean = statistics.mean
        label = {"mmap": "as shipped (mmap, MAP_POPULATE + WILLNEED, read_ahead_kb 1024)",
                 "on-demand": "on-demand (shim drops MAP_POPULATE/WILLNEED, read_ahead_kb 0)"}[mode]
        rows.append(f"| {label} | {mean(read_n):.1f} of {total} | "
                    + " | ".join(pct(mean(rec[k])) for k in KS) + " | "
                    + " | ".join(pct(mean(need[k])) for k in KS) + " |")
    rows.append("")


def timing_section(archive, llama_bin, work, threads, shim, cache, runs, rows):
    configs = [
        ("no prefetch", ["--readahead-chunks", "0"], False),
        ("sequential read-ahead only", [], False),
        ("route prefetch, router-aware eviction", [], True),
        ("route prefetch, plain LRU eviction", ["--eviction", "lru"], True),
    ]
    rows.append(f"### llama-completion through a cold mount, cache budget {cache}\n")
    rows.append(f"-n 8, -t {threads}, --no-warmup; {runs} runs per cell × {len(PROMPTS[:3])} prompts, "
                "median; hit ratio = (hits + prefetch hits) / chunk lookups of the run.\n")
    rows.append("| llama.cpp run | config | TTFT s median (min) | total s median (min) | hit ratio | "
                "prefetch hits | misses |")
    rows.append("|---|---|---|---|---|---|---|")
    for mode in ("mmap", "on-demand"):
        for name, args, use_route in configs:
            ttft, wall, ratio, ph, miss = [], [], [], [], []
            for _ in range(runs):
                for prompt in PROMPTS[:3]:
                    mp = os.path.join(work, "mnt-time")
                    os.makedirs(mp, exist_ok=True)
                    m = Mount(archive, mp, "--cache-size", cache, *args)
                    try:
                        gguf = os.path.join(mp, "model.gguf")
                        if mode == "on-demand":
                            m.readahead_kb(0)
                        t0 = time.perf_counter()
                        if use_route:
                            budget = int(parse_size(cache) / 2)
                            m.call({"verb": "route", "prompt": prompt, "top_k": 8,
                                    "budget_bytes": budget, "prefetch": True})
                        s0 = m.call({"verb": "stat"})["cache"]
                        r = llama(llama_bin, gguf, prompt, 8, threads,
                                  shim if mode == "on-demand" else None)
                        extra = time.perf_counter() - t0 - r["wall"]  # the route call itself
                        s1 = m.call({"verb": "stat"})["cache"]
                        hits = s1["hits"] - s0["hits"]
                        misses = s1["misses"] - s0["misses"]
                        ttft.append(r["ttft"] + extra)
                        wall.append(r["wall"] + extra)
                        ratio.append(hits / max(1, hits + misses))
                        ph.append(s1["prefetch_hits"] - s0["prefetch_hits"])
                        miss.append(misses)
                    finally:
                        m.close()
            med = statistics.median
            rows.append(f"| {mode} | {name} | {med(ttft):.2f} ({min(ttft):.2f}) | "
                        f"{med(wall):.2f} ({min(wall):.2f}) | "
                        f"{pct(med(ratio))} | {med(ph):.0f} | {med(miss):.0f} |")
    rows.append("")


def parse_size(s):
    m = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB)?", s)
    return int(m.group(1)) * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, None: 1}[m.group(2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--archive")
    ap.add_argument("--out")
    ap.add_argument("--cache", default="32MiB")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-recall", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    a = ap.parse_args()
    model = sh(os.path.join(ROOT, "scripts/fetch-test-model.sh")).strip()
    llama_bin = sh(os.path.join(ROOT, "scripts/build-llama-cpp.sh")).strip()
    work = tempfile.mkdtemp(prefix="bench-router-")
    archive = a.archive
    if not archive:
        os.makedirs("/tmp/bench-router", exist_ok=True)
        archive = "/tmp/bench-router/smol.cawsf"
        if not os.path.exists(archive):
            sh(CAWSFS, "convert", model, "-o", archive)
    shim = os.path.join(work, "nopopulate.so")
    with open(shim + ".c", "w") as f:
        f.write(SHIM)
    sh("gcc", "-shared", "-fPIC", "-O2", "-o", shim, shim + ".c", "-ldl")
    routing = next(p for p in json.loads(sh(CAWSFS, "inspect", archive, "--json"))["sections"]
                   if p["kind"] == "ROUTING")
    rows = [f"Measured {datetime.date.today()} on {os.cpu_count()} CPUs; archive "
            f"`{os.path.basename(archive)}` ({os.path.getsize(archive) / MiB:.1f} MiB, ROUTING "
            f"section {routing['size']} bytes stored); command: `scripts/bench-router.py "
            + " ".join(f"--{k} {v}" for k, v in
                       (("cache", a.cache), ("runs", a.runs), ("threads", a.threads)))
            + (f" --archive {a.archive}" if a.archive else "") + "`.\n"]
    load0 = os.getloadavg()[0]
    if not a.skip_recall:
        recall_section(archive, llama_bin, model, work, a.threads, shim, rows)
    if not a.skip_timing:
        timing_section(archive, llama_bin, work, a.threads, shim, a.cache, a.runs, rows)
    rows.append(f"Load average (1 min) before / after: {load0:.2f} / {os.getloadavg()[0]:.2f}.\n")
    text = "\n".join(rows)
    print(text)
    if a.out:
        doc = open(a.out).read()
        i, j = doc.index(BEGIN) + len(BEGIN), doc.index(END)
        with open(a.out, "w") as f:
            f.write(doc[:i] + "\n" + text + "\n" + doc[j:])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Speed of a cawsfs mount against baselines measured in the same run.

  scripts/bench-mount.py [--archive PATH] [--out docs/MOUNT.md] [--runs 3]

1. Warm sequential reads of model.gguf (1 MiB pread()s), kernel page cache dropped
   before each pass so the reads reach the daemon: cawsfs (chunk cache full) vs the
   exported copy from the page cache vs examples/memfs serving it from RAM (the FUSE
   ceiling).
2. Cold reads (chunk cache evicted, page cache dropped): random 4 KiB / 64 KiB / 1 MiB
   reads and one sequential pass; bytes/s, bytes/s per daemon CPU second, archive
   bytes read (and decoded) per byte served.
3. llama.cpp load time and tokens/s: cold (fresh mount) and warm (second run on the
   same mount) vs the exported file with a warm page cache.

Needs target/release/cawsfs and `cargo build --release --example memfs`. Without
--archive the bundled test model is converted into /tmp/bench/smol.cawsf (once).
With --out, the section between the figures markers of that file is rewritten.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAWSFS = os.path.join(ROOT, "target/release/cawsfs")
MEMFS = os.path.join(ROOT, "target/release/examples/memfs")
MiB = 1 << 20
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
PROMPT = "The capital of France is"


def sh(*args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout


class Mount:
    """A cawsfs daemon; always unmounted by close()."""

    def __init__(self, archive, mp, cache="1GiB"):
        self.mp = mp
        # The daemon's own path is measured here: no disk tier (scripts/bench-tier.py has it).
        out = sh(CAWSFS, "mount", archive, mp, "--cache-size", cache, "--no-disk-cache")
        self.pid = int(re.search(r"pid (\d+)", out).group(1))
        self.sock = re.search(r"socket (\S+?),", out).group(1)

    def call(self, req):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.sock)
            s.sendall((json.dumps(req) + "\n").encode())
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
        reply = json.loads(buf)
        if not reply.get("ok", True):
            raise RuntimeError(f"control {req}: {reply.get('error')}")
        return reply

    def stat(self):
        return json.loads(sh(CAWSFS, "stat", self.mp, "--json"))

    def close(self):
        if os.path.ismount(self.mp):
            subprocess.run([CAWSFS, "umount", self.mp], capture_output=True)
        for _ in range(100):  # wait for the daemon to exit
            if not os.path.exists(f"/proc/{self.pid}"):
                break
            time.sleep(0.05)


class MemFs:
    def __init__(self, path, mp):
        self.mp = mp
        self.proc = subprocess.Popen([MEMFS, path, mp], stdout=subprocess.DEVNULL)
        for _ in range(600):
            if os.path.ismount(mp):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"memfs exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError("memfs did not mount within 30 s")

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.ismount(self.mp):
            subprocess.run(["fusermount3", "-u", self.mp], capture_output=True)


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drop(fd):
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_all(path, drop_first):
    """Seconds for a sequential read of the whole file in 1 MiB pread()s."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if drop_first:
            drop(fd)
        size, off = os.fstat(fd).st_size, 0
        t = time.perf_counter()
        while off < size:
            off += len(os.pread(fd, MiB, off))
        return time.perf_counter() - t, size
    finally:
        os.close(fd)


def read_random(path, size, count, seed):
    fd = os.open(path, os.O_RDONLY)
    try:
        drop(fd)
        # Only the requested bytes: no kernel read-ahead around each random read.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        n = os.fstat(fd).st_size // size
        offs = np.random.default_rng(seed).integers(0, n, count) * size
        t = time.perf_counter()
        for o in offs:
            os.pread(fd, size, int(o))
        return time.perf_counter() - t
    finally:
        os.close(fd)


def deltas(m, fn):
    """Run fn against mount m; return (fn result, Δstat counters, Δdaemon CPU s)."""
    s0, c0 = m.stat(), cpu_s(m.pid)
    r = fn()
    c1, s1 = cpu_s(m.pid), m.stat()
    d = {k: s1["cache"][k] - s0["cache"][k] for k in ("hits", "prefetch_hits", "misses", "bytes_served", "bytes_loaded")}
    d.update({k: s1["archive"][k] - s0["archive"][k] for k in ("bytes_read", "bytes_decoded")})
    return r, d, c1 - c0


def llama(bin_dir, model, threads, *extra):
    """(llama's load time ms, generation tokens/s, process wall s)."""
    t = time.perf_counter()
    out = subprocess.run(
        [os.path.join(bin_dir, "llama-completion"), "-m", model, "-t", str(threads), "-no-cnv",
         "--no-warmup", "--temp", "0", "-n", "32", "-p", PROMPT, *extra],
        capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise RuntimeError(f"llama-completion failed: {out.stderr[-500:]}")
    load = float(re.search(r"\bload time =\s*([\d.]+) ms", out.stderr).group(1))
    tps = float(re.search(r"(?<!prompt )eval time =.*?([\d.]+) tokens per second", out.stderr).group(1))
    return load, tps, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archive")
    ap.add_argument("--out")
    ap.add_argument("--runs", type=int, default=3)
    # ggml's spinning thread pool collapses when cores are oversubscribed (shared
    # build machines); one thread keeps the comparison about I/O.
    ap.add_argument("--llama-threads", type=int, default=1)
    a = ap.parse_args()
    for exe in (CAWSFS, MEMFS):
        if not os.access(exe, os.X_OK):
            sys.exit(f"bench-mount: {exe} is missing (cargo build --release; "
                     "cargo build --release --example memfs)")
    archive = a.archive
    if archive is None:
        archive = "/tmp/bench/smol.cawsf"
        if not os.path.exists(archive):
            os.makedirs("/tmp/bench", exist_ok=True)
            src = sh(os.path.join(ROOT, "scripts/fetch-test-model.sh")).strip()
            print(f"converting {src} -> {archive}", flush=True)
            sh(CAWSFS, "convert", src, "-o", archive)
    archive = os.path.abspath(archive)
    llama_bin = sh(os.path.join(ROOT, "scripts/build-llama-cpp.sh")).strip()
    R, rows, load0 = a.runs, [], os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="bench-mount.")
    mp, mmp = os.path.join(work, "mp"), os.path.join(work, "memfs")
    os.mkdir(mp)
    os.mkdir(mmp)
    exported = os.path.join(work, "model.gguf")
    sh(CAWSFS, "export", archive, "--format", "gguf", "-o", exported)
    size = os.path.getsize(exported)
    print(f"model.gguf {size / MiB:.1f} MiB; runs {R}", flush=True)
    live = []

    def row(*cells):
        rows.append(cells)
        print("  ".join(str(c) for c in cells), flush=True)

    try:
        # 1. Warm sequential reads.
        m = Mount(archive, mp)
        live.append(m)
        f = os.path.join(mp, "model.gguf")
        (t, _), d, cpu = deltas(m, lambda: read_all(f, True))
        cold_seq = (size / t, size / cpu if cpu else float("nan"), d)
        gbs, hit_ok = [], True
        for _ in range(R):
            (t, _), d, _ = deltas(m, lambda: read_all(f, True))
            hit_ok &= d["misses"] == 0 and d["hits"] > 0 and d["bytes_served"] >= size
            gbs.append(size / t / 1e9)
        m.close()
        live.remove(m)
        cawsfs_w = statistics.median(gbs)
        read_all(exported, False)
        page = statistics.median(size / read_all(exported, False)[0] / 1e9 for _ in range(R))
        mf = MemFs(exported, mmp)
        live.append(mf)
        mfile = os.path.join(mmp, "model.gguf")
        read_all(mfile, False)
        memfs = statistics.median(size / read_all(mfile, True)[0] / 1e9 for _ in range(R))
        mf.close()
        live.remove(mf)
        row("warm sequential 1 MiB reads", "GB/s", "")
        row("cawsfs, chunk cache full, page cache dropped", f"{cawsfs_w:.2f}",
            "all hits, no misses" if hit_ok else "NOT all hits: page cache drop did not reach the daemon")
        row("memfs (FUSE ceiling), page cache dropped", f"{memfs:.2f}", "")
        row("exported file, page cache warm", f"{page:.2f}", "")
        row("ratio cawsfs / memfs", f"{cawsfs_w / memfs:.2f}", "target >= 0.8")
        row("ratio cawsfs / page cache", f"{cawsfs_w / page:.2f}", "")

        # 2. Cold reads: evicted chunk cache, dropped page cache.
        row("cold reads", "MB/s served", "MB/s per daemon CPU s",
            "archive read / served", "archive decoded / served")
        m = Mount(archive, mp)
        live.append(m)
        for rsize, count in ((4096, 2000), (64 << 10, 500), (MiB, 100)):
            m.call({"verb": "evict"})
            t, d, cpu = deltas(m, lambda: read_random(f, rsize, count, rsize))
            served = d["bytes_served"]
            row(f"random {rsize >> 10} KiB x{count}", f"{served / t / 1e6:.1f}",
                f"{served / cpu / 1e6:.1f}" if cpu else "n/a",
                f"{d['bytes_read'] / served:.2f}", f"{d['bytes_decoded'] / served:.2f}")
        m.close()
        live.remove(m)
        bps, per_core, d = cold_seq
        row("sequential whole file (fresh mount)", f"{bps / 1e6:.1f}", f"{per_core / 1e6:.1f}",
            f"{d['bytes_read'] / d['bytes_served']:.2f}", f"{d['bytes_decoded'] / d['bytes_served']:.2f}")

        # 3. llama.cpp.
        cold, warm, copy, lt = [], [], [], a.llama_threads
        for _ in range(R):
            m = Mount(archive, mp)
            live.append(m)
            cold.append(llama(llama_bin, f, a.llama_threads))
            warm.append(llama(llama_bin, f, a.llama_threads))
            # Weights read into process memory instead of mmap'd: separates the cost of
            # mapping FUSE page-cache pages from that of serving them.
            copy.append(llama(llama_bin, f, lt, "-lm", "none"))
            m.close()
            live.remove(m)
        llama(llama_bin, exported, a.llama_threads)
        ref = [llama(llama_bin, exported, a.llama_threads) for _ in range(R)]
        ref_copy = [llama(llama_bin, exported, lt, "-lm", "none") for _ in range(R)]
        med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
        row(f"llama-completion (-n 32, -t {a.llama_threads})", "load ms", "tokens/s", "wall s",
            "load / exported", "tok/s / exported", "wall / exported")
        for name, xs, base in (
            ("cawsfs cold (fresh mount)", cold, ref), ("cawsfs warm (second run)", warm, ref),
            ("exported file, page cache warm", ref, ref),
            ("cawsfs warm, `-lm none` (no mmap)", copy, ref_copy),
            ("exported file, `-lm none` (no mmap)", ref_copy, ref_copy),
        ):
            row(name, f"{med(xs, 0):.0f}", f"{med(xs, 1):.1f}", f"{med(xs, 2):.2f}",
                f"{med(xs, 0) / med(base, 0):.2f}", f"{med(xs, 1) / med(base, 1):.2f}",
                f"{med(xs, 2) / med(base, 2):.2f}")
    finally:
        for x in reversed(live):
            x.close()
        for p in (exported,):
            if os.path.exists(p):
                os.remove(p)
        for p in (mp, mmp, work):
            try:
                os.rmdir(p)
            except OSError:
                pass

    if a.out:
        write_doc(a.out, rows, archive, size, R, (load0, os.getloadavg()[0]))


def write_doc(path, rows, archive, size, runs, load):
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    cmd = "scripts/bench-mount.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    lines = [
        BEGIN,
        f"Measured {datetime.date.today().isoformat()} on {os.cpu_count()} cores ({cpu}), "
        f"Linux {platform.release()}; archive `{os.path.basename(archive)}`, model.gguf "
        f"{size / MiB:.1f} MiB; medians of {runs} runs where repeated; 1-minute load average "
        f"{load[0]:.1f} at start, {load[1]:.1f} at end. Command:",
        "",
        f"    {cmd}",
    ]
    for cells in rows:
        if len(cells) >= 3 and cells[1] in ("GB/s", "MB/s served", "load ms"):
            lines += ["", "| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]
        else:
            lines.append("| " + " | ".join(cells) + " |")
    lines.append(END)
    text = open(path).read() if os.path.exists(path) else "# Mount speed\n\n" + BEGIN + "\n" + END + "\n"
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < 0:
        text = text.rstrip("\n") + "\n\n" + BEGIN + "\n" + END + "\n"
        i, j = text.find(BEGIN), text.find(END)
    open(path, "w").write(text[:i] + "\n".join(lines) + text[j + len(END):])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

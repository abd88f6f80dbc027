#!/usr/bin/env python3
"""How the way a file was written changes how fast it reads back cold.

  scripts/compare-write-ways.py FILE [--copies 3] [--rounds 12] [--dir DIR]

Writes COPIES copies of FILE each way — through the page cache (`cp`), with
`O_DIRECT` in 4 MiB requests one at a time (what the disk tier's writer did before
2026-12-02), with `O_DIRECT` in 64 MiB requests, and the same from a buffer of
transparent huge pages — into DIR (default: a new
directory beside FILE, removed at the end), interleaving the ways. Then each round
reads every copy once whole in 1 MiB reads, the page cache dropped (root) before each
read, the order reversed every other round. Prints each copy's median and its median
ratio of time to the first buffered copy's, per round, and each way's mean of those
ratios. docs/TIER.md ("Writing") used it on the bench's exported `model.gguf`.

--first-read: instead, each round writes one copy each way (order alternating) and
times each copy's first cold read right after it was written, then a second one; the
copies are removed after the round. Prints each way's medians.
"""

import argparse
import ctypes
import filecmp
import importlib.util
import mmap
import os
import shutil
import statistics
import tempfile

# The bench's own read and page-cache drop, so both measure the same way.
_spec = importlib.util.spec_from_file_location(
    "bench_tier", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-tier.py"))
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
read_all, drop_page_cache = _bench.read_all, _bench.drop_page_cache


def huge_buffer(request):
    """`request` bytes of private anonymous memory starting at a 2 MiB boundary, asked
    to be backed by transparent huge pages: physically contiguous 2 MiB pieces, so an
    O_DIRECT request from it reaches the disk in a few large segments instead of one
    per 4 KiB page (the queue's `max_segments` then cuts requests to ~0.5-1 MiB)."""
    huge = 2 << 20
    raw = mmap.mmap(-1, request + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = (-ctypes.addressof(ctypes.c_char.from_buffer(raw))) % huge
    raw.madvise(mmap.MADV_HUGEPAGE, skip, request)
    return memoryview(raw)[skip:skip + request]


def write_direct(src, dst, request, huge=False):
    """`src` to `dst` with O_DIRECT, `request` bytes per pwrite (the tail buffered)."""
    size = os.path.getsize(src)
    # page-aligned, as O_DIRECT wants
    buf = huge_buffer(request) if huge else mmap.mmap(-1, request)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.ftruncate(fd, size)  # sparse, as the tier creates its data files
        with open(src, "rb") as f:
            off = 0
            while size - off >= request:
                f.readinto(buf)
                os.pwrite(fd, buf, off)
                off += request
            tail = f.read()
    finally:
        os.close(fd)
    if tail:
        with open(dst, "r+b") as f:
            f.seek(off)
            f.write(tail)


WAYS = {
    "buffered (cp)": lambda s, d: shutil.copyfile(s, d),
    "O_DIRECT 4 MiB": lambda s, d: write_direct(s, d, 4 << 20),
    "O_DIRECT 64 MiB": lambda s, d: write_direct(s, d, 64 << 20),
    "O_DIRECT 64 MiB huge pages": lambda s, d: write_direct(s, d, 64 << 20, huge=True),
}


def first_reads(src, work, rounds):
    """Per round and way: a fresh copy, its first cold read at once, then a second."""
    first, second = {w: [] for w in WAYS}, {w: [] for w in WAYS}
    ways = list(WAYS.items())
    for r in range(rounds):
        for way, write in (ways if r % 2 == 0 else ways[::-1]):
            p = os.path.join(work, "copy")
            write(src, p)
            drop_page_cache()
            first[way].append(read_all(p))
            drop_page_cache()
            second[way].append(read_all(p))
            os.remove(p)
    for way in WAYS:
        print(f"{way:26} first cold read after writing: median "
              f"{statistics.median(first[way]) * 1000:.1f} ms, the next one "
              f"{statistics.median(second[way]) * 1000:.1f} ms; rounds "
              + " ".join(f"{x * 1000:.0f}/{y * 1000:.0f}" for x, y in zip(first[way], second[way])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--dir")
    ap.add_argument("--first-read", action="store_true")
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="write-ways-",
                                     dir=os.path.dirname(os.path.abspath(a.file)))
    os.makedirs(work, exist_ok=True)
    try:
        if a.first_read:
            return first_reads(a.file, work, a.rounds)
        files = []  # (way, path), ways interleaved
        for i in range(a.copies):
            for n, (way, write) in enumerate(WAYS.items()):
                p = os.path.join(work, f"w{n}-{i}")
                write(a.file, p)
                if not filecmp.cmp(a.file, p, shallow=False):
                    raise SystemExit(f"{p}: the copy written {way} differs from {a.file}")
                files.append((way, p))
        os.sync()
        res = {p: [] for _, p in files}
        for r in range(a.rounds):
            for _, p in (files if r % 2 == 0 else files[::-1]):
                drop_page_cache()
                res[p].append(read_all(p))
        base = files[0][1]
        per_way = {}
        for way, p in files:
            ratio = statistics.median(x / y for x, y in zip(res[p], res[base]))
            per_way.setdefault(way, []).append(ratio)
            print(f"{way:26} {os.path.basename(p)}: median {statistics.median(res[p]) * 1000:.2f} ms,"
                  f" {ratio:.3f}x the first buffered copy's time")
        for way, rs in per_way.items():
            print(f"{way:26} mean of its copies' ratios {statistics.mean(rs):.3f}"
                  f" ({min(rs):.3f}-{max(rs):.3f})")
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

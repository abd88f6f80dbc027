#!/usr/bin/env python3
"""Warm whole-file reads of several files, each round from a freshly filled page cache.

  scripts/compare-warm-reads.py [--rounds 10] [--cold] FILE FILE...

Each round drops the page cache (root), reads every file once (order alternating
between rounds), then times 8 whole reads of each (`open`, 1 MiB `read`s, `close`).
Prints each file's median and its median ratio of time to the second file's, per
round. docs/MOUNT.md ("Where the pages land") used it on a mounted `model.gguf`, the
exported file and the tier's data file behind the mount.

--cold: instead, each round times one whole read of each file, the page cache dropped
before every read (order alternating between rounds); docs/MOUNT.md (runs 24, 25) used
it on a tier data file, the exported file and copies of them written in other ways.
"""

import argparse
import importlib.util
import os
import statistics

READS = 8

# The bench's own read and page-cache drop, so both measure the same way.
_spec = importlib.util.spec_from_file_location(
    "bench_tier", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-tier.py"))
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
read_all, drop_page_cache = _bench.read_all, _bench.drop_page_cache


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    if len(a.files) < 2:
        ap.error("give at least two files")
    res = {p: [] for p in a.files}
    for r in range(a.rounds):
        order = a.files if r % 2 == 0 else a.files[::-1]
        if a.cold:
            for p in order:
                drop_page_cache()
                res[p].append(read_all(p))
            continue
        drop_page_cache()
        for p in order:
            read_all(p)
        for p in order:
            res[p].append(sum(read_all(p) for _ in range(READS)) / READS)
    base = a.files[1]
    for p in a.files:
        ratio = statistics.median(x / y for x, y in zip(res[p], res[base]))
        print(f"{p}: median {statistics.median(res[p]) * 1000:.2f} ms, "
              f"{ratio:.3f}x {base}'s time; rounds "
              + " ".join(f"{x * 1000:.1f}" for x in res[p]))


if __name__ == "__main__":
    main()

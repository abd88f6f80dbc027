#!/usr/bin/env python3
"""A first pass, two builds against each other: the daemon's CPU, page faults and read
time for one sequential read of a file through a fresh tier, cold page cache.

  scripts/compare-first-pass.py BIN_A BIN_B [--archive PATH] [--file model.gguf]
                                [--rounds 16] [--no-disk-cache] [--no-primer]

Per round and build: an empty tier directory, the page cache dropped (root; then a
scratch file read and dropped, as scripts/bench-tier.py does: its PRIMER), `mount`,
one sequential read of FILE in 1 MiB reads, the daemon's CPU (user + system) and minor
page faults over the read from /proc/PID/stat, `umount`. The order alternates (A B,
B A, ...). It prints each build's per-round CPU, the medians, and the median of the
per-round ratios B / A: what `scripts/bench-tier.py`'s row "daemon CPU / export CPU"
would gain or lose from B, without `export` in between. On a 2-core VM a pass's CPU
varies by ±15 % between rounds; take 16 rounds or more.
"""

import argparse
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CACHE = os.environ.get("CAWSFS_CACHE", os.path.expanduser("~/.cache/cawsfs"))

# The bench's own page-cache drop and CPU reading, so the figures mean what its rows do.
_spec = importlib.util.spec_from_file_location(
    "bench_tier", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-tier.py"))
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)


def minor_faults(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def one_pass(binary, archive, name, work, tier_on):
    mp, tier = os.path.join(work, "mnt"), os.path.join(work, "tier")
    shutil.rmtree(tier, ignore_errors=True)
    os.makedirs(mp, exist_ok=True)
    _bench.drop_page_cache()
    opts = ["--disk-cache", tier] if tier_on else ["--no-disk-cache"]
    out = subprocess.run([binary, "mount", archive, mp, *opts], check=True,
                         capture_output=True, text=True).stdout
    pid = int(re.search(r"pid (\d+)", out).group(1))
    try:
        c0, f0, t0 = _bench.cpu_s(pid), minor_faults(pid), time.perf_counter()
        with open(os.path.join(mp, name), "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
        secs = time.perf_counter() - t0
        return {"cpu s": _bench.cpu_s(pid) - c0, "faults": minor_faults(pid) - f0, "read s": secs}
    finally:
        subprocess.run([binary, "umount", mp], check=True, capture_output=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--archive", default=os.path.join(CACHE, "demo", "smol.cawsf"))
    ap.add_argument("--file", default="model.gguf")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--no-disk-cache", action="store_true",
                    help="mount without a tier (the daemon's own cost, no tier writes)")
    ap.add_argument("--no-primer", action="store_true",
                    help="no scratch read before each pass (bench-tier.py's PRIMER)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not os.path.isfile(a.archive):
        ap.error(f"{a.archive}: no such archive (scripts/demo.sh makes the default one;"
                 " scripts/bench-tier.py makes ~/.cache/cawsfs/bench-tier/demo/smol.cawsf)")
    rows = {a.a: [], a.b: []}
    with tempfile.TemporaryDirectory() as work:
        if not a.no_primer:  # about the view (twice the archive) and a 512 MiB cache
            size = os.path.getsize(a.archive) * 2 + (512 << 20)
            _bench.make_primer(os.path.join(work, "primer.bin"), size)
        for i in range(a.rounds):
            for binary in (a.a, a.b) if i % 2 == 0 else (a.b, a.a):
                rows[binary].append(one_pass(binary, a.archive, a.file, work,
                                             not a.no_disk_cache))
    tier = "no tier" if a.no_disk_cache else "fresh tier"
    print(f"{a.rounds} first passes of {a.file} from {a.archive} each, {tier}, cold page cache:")
    for binary, rs in rows.items():
        print(f"  {binary}: cpu s " + " ".join(f"{r['cpu s']:.2f}" for r in rs))
        meds = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"    medians: cpu {meds['cpu s']:.3f} s, read {meds['read s']:.3f} s, "
              f"minor faults {meds['faults']:.0f}")
    ratio = statistics.median(rb["cpu s"] / ra["cpu s"]
                              for ra, rb in zip(rows[a.a], rows[a.b]) if ra["cpu s"] > 0)
    print(f"  daemon CPU, {a.b} / {a.a} (median of the rounds' ratios): {ratio:.3f}")


if __name__ == "__main__":
    sys.exit(main())

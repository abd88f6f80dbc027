#!/usr/bin/env python3
"""A restart's setup, two builds against each other: mount and unmount each build in
turn, warm page cache, and print the medians of what the daemon logs about its setup.

  scripts/compare-setup.py BIN_A BIN_B [--archive PATH] [--tier DIR] [--rounds 10] [--cold]

Per mount: the wall time of `cawsfs mount` (until it returns: the mount answers), and
from the daemon's log (`CAWSFS_LOG=cawsfs=debug`) the archive's open, the GGUF and
safetensors layouts, and the whole setup. The order alternates (A B, B A, ...). The
archive defaults to the demo's, the tier to the bench's (`scripts/bench-tier.py` leaves
model.gguf whole there, so the mounts are restarts whose opens are passthrough).
`--cold` drops the page cache before each mount (root), as a restart after a reboot,
and as `scripts/bench-tier.py` measures restart + load: the binary itself is then read
from disk.
"""

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

CACHE = os.environ.get("CAWSFS_CACHE", os.path.expanduser("~/.cache/cawsfs"))
FIELDS = {
    "open ms": r"archive opened in ([\d.]+)(ms|µs|s)",
    "layouts ms": r"layouts ([\d.]+)(ms|µs|s)",
    "setup ms": r"set up in ([\d.]+)(ms|µs|s)",
}
SCALE = {"ms": 1.0, "µs": 1e-3, "s": 1e3}

# The bench's own page-cache drop, so `--cold` means what bench-tier.py's restarts do.
_spec = importlib.util.spec_from_file_location(
    "bench_tier", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-tier.py"))
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
drop_page_cache = _bench.drop_page_cache


def mount_once(binary, archive, mp, tier, cold):
    if cold:
        drop_page_cache()
    env = dict(os.environ, CAWSFS_LOG="cawsfs=debug")
    t = time.perf_counter()
    out = subprocess.run([binary, "mount", archive, mp, "--disk-cache", tier], env=env,
                         check=True, capture_output=True, text=True).stdout
    wall = (time.perf_counter() - t) * 1e3
    log = re.search(r"log (\S+?)\)", out).group(1)
    subprocess.run([binary, "umount", mp], check=True, capture_output=True)
    with open(log) as f:
        text = f.read()
    row = {"wall ms": wall}
    for name, pat in FIELDS.items():
        m = re.search(pat, text)
        row[name] = float(m.group(1)) * SCALE[m.group(2)] if m else float("nan")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--archive", default=os.path.join(CACHE, "demo", "smol.cawsf"))
    ap.add_argument("--tier", default=os.path.join(CACHE, "bench-tier", "demo", "tier"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each mount")
    a = ap.parse_args()
    rows = {a.a: [], a.b: []}
    with tempfile.TemporaryDirectory() as mp:
        for i in range(a.rounds):
            for binary in (a.a, a.b) if i % 2 == 0 else (a.b, a.a):
                rows[binary].append(mount_once(binary, a.archive, mp, a.tier, a.cold))
    cache = "cold" if a.cold else "warm"
    print(f"{a.rounds} mounts of {a.archive} each, {cache} page cache; medians:")
    for binary, rs in rows.items():
        meds = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"  {binary}: " + ", ".join(f"{k} {v:.1f}" for k, v in meds.items()))


if __name__ == "__main__":
    sys.exit(main())

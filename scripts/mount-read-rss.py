#!/usr/bin/env python3
"""Mount each archive with a 16 MiB cache, read model.gguf once sequentially in 1 MiB
reads, and print the rate, the daemon's peak RssAnon and its archive read counters.

Usage (repo root, after cargo build --release):
  scripts/mount-read-rss.py [--no-disk-cache] ARCHIVE...

With the default disk tier, a second run finds model.gguf whole there and measures
passthrough, not reconstruction: `--no-disk-cache` measures the daemon every time.
"""
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "clients"))
from test_mount import Mount, rss_sampler  # noqa: E402

cawsfs = ROOT / "target" / "release" / "cawsfs"
args = sys.argv[1:]
extra = ["--no-disk-cache"] if "--no-disk-cache" in args else []
for name in (a for a in args if a != "--no-disk-cache"):
    mp = Path(f"/tmp/cawsfs-rss-{Path(name).stem}")
    m = Mount(cawsfs, name, mp, "--cache-size", "16MiB", *extra)
    stop, peak = threading.Event(), {}
    th = threading.Thread(target=rss_sampler, args=(m.pid, stop, peak))
    th.start()
    t0, n = time.time(), 0
    with open(mp / "model.gguf", "rb") as f:
        while b := f.read(1 << 20):
            n += len(b)
    dt = time.time() - t0
    st = m.stat()
    stop.set()
    th.join()
    m.close()
    print(f"{name}: {n / 2**20:.1f} MiB in {dt:.1f} s ({n / dt / 1e6:.1f} MB/s), "
          f"peak RssAnon {peak['anon'] / 2**20:.1f} MiB, archive read/served "
          f"{st['archive']['read_per_served']:.2f}")

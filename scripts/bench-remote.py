#!/usr/bin/env python3
"""An archive in object storage against downloading it whole, measured in one run.

  scripts/bench-remote.py [--archive PATH] [--runs 5] [--rate 1000mbit]
                          [--server http|s3] [--tokens 8]

The server (nginx over HTTP, or s3s-fs over S3 with --server s3; tests/clients/
servers.py) runs in a network namespace of its own whose link to this one is shaped
with `tc tbf` (--rate, each way), so both cases get the same bandwidth. (The kernel
here has no netem, so no delay is added: the round trip is the veth pair's.) Each
round, paired and interleaved (remote, download, download, remote…):

- remote:   `cawsfs mount URL M --no-disk-cache` (the fetch cache emptied first),
            llama.cpp loads M/model.gguf and generates --tokens tokens, `cawsfs umount M`.
- download: the whole archive fetched with curl to local disk (one GET), then the same
            mount of the local file, load and generation, umount, file removed.

The client's page cache is dropped before each case. Printed: wall seconds of each,
the median of the pairs' ratios (remote / download), and the archive bytes the remote
mount fetched against those the local mount read (`stat`: fetch.bytes_fetched over
archive.bytes_read plus the sections read at open, and over the archive's size).
Needs root (netns, tc, drop_caches), nginx / s3s-fs (scripts/setup.sh), the release
build and llama.cpp (scripts/build-llama-cpp.sh). Nothing else should run meanwhile.
"""

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "clients"))
from servers import HttpServer, S3Server  # noqa: E402
from memcg import drop_caches as drop_page_cache  # noqa: E402

CAWSFS = os.path.join(ROOT, "target/release/cawsfs")
CACHE = os.environ.get("CAWSFS_CACHE", os.path.expanduser("~/.cache/cawsfs"))
NS = "cawsfs-bench"
HOST_IP, SRV_IP = "10.203.0.1", "10.203.0.2"
PROMPT = "The capital of France is"


def sh(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, **kw).stdout


def netns_up(rate):
    netns_down()
    for cmd in (
        f"ip netns add {NS}",
        "ip link add cb-host type veth peer name cb-srv",
        f"ip link set cb-srv netns {NS}",
        f"ip addr add {HOST_IP}/24 dev cb-host",
        "ip link set cb-host up",
        f"ip netns exec {NS} ip addr add {SRV_IP}/24 dev cb-srv",
        f"ip netns exec {NS} ip link set cb-srv up",
        f"ip netns exec {NS} ip link set lo up",
        # Shaped both ways: the answers (server side) and the requests (this side).
        f"ip netns exec {NS} tc qdisc add dev cb-srv root tbf rate {rate} burst 512kb latency 100ms",
        f"tc qdisc add dev cb-host root tbf rate {rate} burst 512kb latency 100ms",
    ):
        subprocess.run(cmd.split(), check=True)


def netns_down():
    subprocess.run(["ip", "link", "del", "cb-host"], capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def llama(bin_dir, model, n):
    out = subprocess.run(
        [os.path.join(bin_dir, "llama-completion"), "-m", model, "-no-cnv", "--no-warmup",
         "--temp", "0", "-n", str(n), "-p", PROMPT, "-t", str(os.cpu_count() or 1)],
        capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"llama-completion failed: {out.stderr[-500:]}")
    return out.stdout


def mount_load(source, mp, bin_dir, tokens, env, fetch_cache):
    """Mount `source`, generate, read `stat`, umount: (seconds to the end of the
    generation, stat, text). The fetch cache starts empty each time."""
    shutil.rmtree(fetch_cache, ignore_errors=True)
    t = time.perf_counter()
    sh(CAWSFS, "mount", source, mp, "--no-disk-cache", "--fetch-cache", fetch_cache, env=env)
    try:
        text = llama(bin_dir, os.path.join(mp, "model.gguf"), tokens)
        took = time.perf_counter() - t
        st = json.loads(sh(CAWSFS, "stat", mp, "--json"))
    finally:
        sh(CAWSFS, "umount", mp)
    return took, st, text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archive", default=os.path.join(CACHE, "demo", "smol.cawsf"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rate", default="1000mbit")
    ap.add_argument("--server", choices=["http", "s3"], default="http")
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench-remote.py: needs root (netns, tc, drop_caches)")
    bin_dir = sh(os.path.join(ROOT, "scripts", "build-llama-cpp.sh")).strip()
    size = os.path.getsize(a.archive)
    work = tempfile.mkdtemp(prefix="cawsfs-bench-remote-")
    mp = os.path.join(work, "mnt")
    os.makedirs(mp)
    local = os.path.join(work, "local.cawsf")
    fc = os.path.join(work, "fetch-cache")
    netns_up(a.rate)
    env = dict(os.environ)
    try:
        wrap = ["ip", "netns", "exec", NS]
        if a.server == "http":
            srv = HttpServer(os.path.join(work, "www"), host=SRV_IP, wrap=wrap)
            url = srv.put("bench.cawsf", a.archive)
            get = ["curl", "-sS", "--fail", "-o", local, url]
        else:
            srv = S3Server(os.path.join(work, "s3"), host=SRV_IP, wrap=wrap)
            url = srv.put("bench", "bench.cawsf", a.archive)
            env = srv.env()
            get = ["curl", "-sS", "--fail", "-o", local, "--aws-sigv4", "aws:amz:us-east-1:s3",
                   "--user", f"{env['AWS_ACCESS_KEY_ID']}:{env['AWS_SECRET_ACCESS_KEY']}",
                   "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
                   f"{srv.endpoint}/bench/bench.cawsf"]
        print(f"# {platform.node()}  {os.cpu_count()} cores  archive {a.archive} ({size / 2**20:.1f} MiB)"
              f"  server {a.server} in a netns, its link shaped by tc tbf to {a.rate} each way"
              f"  {a.tokens} tokens", flush=True)
        fetched, local_read = [], []
        texts = set()

        def remote():
            drop_page_cache()
            took, st, text = mount_load(url, mp, bin_dir, a.tokens, env, fc)
            fetched.append(st["fetch"]["bytes_fetched"])
            texts.add(text)
            return took

        def download():
            drop_page_cache()
            t = time.perf_counter()
            subprocess.run(get, check=True)
            took, st, text = mount_load(local, mp, bin_dir, a.tokens, env, fc)
            local_read.append(st["archive"]["bytes_read"])
            texts.add(text)
            os.unlink(local)
            return time.perf_counter() - t

        xs, ys = [], []
        for i in range(a.runs):
            if i % 2 == 0:
                xs.append(remote())
                ys.append(download())
            else:
                ys.append(download())
                xs.append(remote())
            print(f"round {i + 1}: remote {xs[-1]:.3f} s  download+local {ys[-1]:.3f} s", flush=True)
        ratios = [x / y for x, y in zip(xs, ys)]
        assert len(texts) == 1, f"the generations differ: {texts}"
        # The sections a local mount reads at open (header, TOC, META, index, ROUTING)
        # are not in archive.bytes_read, which counts blocks: add them from `inspect`.
        parts = json.loads(sh(CAWSFS, "inspect", a.archive, "--json"))
        opened = sum(p["size"] for p in parts["sections"] if p["kind"] not in ("SHARD_BANK", "DATA"))
        print()
        print("| measure | remote | download + local | ratio |")
        print("|---|---:|---:|---:|")
        print(f"| mount + load + {a.tokens} tokens, s (median of {a.runs}; ratio: median of pairs) "
              f"| {statistics.median(xs):.3f} | {statistics.median(ys):.3f} | {statistics.median(ratios):.3f} |")
        f, r = statistics.median(fetched), statistics.median(local_read) + opened
        print(f"| archive bytes fetched / read | {f / 2**20:.1f} MiB | {r / 2**20:.1f} MiB | {f / r:.3f} |")
        print(f"| archive bytes fetched / archive size | | {size / 2**20:.1f} MiB | {f / size:.3f} |")
        print(f"\npairs: {' '.join(f'{r:.3f}' for r in ratios)}")
    finally:
        try:
            srv.stop()
        except NameError:
            pass
        netns_down()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

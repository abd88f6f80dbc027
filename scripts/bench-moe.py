#!/usr/bin/env python3
"""A mixture of experts under a memory limit: llama.cpp generating from the mounted
model.gguf against the exported file on local disk, and the expert predictor on
against learning only, all in one memory cgroup (docs/MOE.md, "Measured").

  scripts/bench-moe.py [--affinity 0.9] [--limit-mib 640] [--cache-mib 128]
                       [--runs 3] [--tokens 32] [--threads 2] [--out docs/MOE.md]

The model is scripts/make-moe-bench-model.py's synthetic Mixtral (1.15 G parameters,
8 experts of which 2 per token, 16 layers; --affinity sets how strongly an expert of
layer l predicts one of layer l+1), converted with the default codec and served as the
default (auto) model.gguf; the baseline is that file exported to local disk.

Cases, interleaved (A B C D A B C D ...), medians over --runs:
  file     llama-completion on the exported model.gguf
  mount    the default mount (disk tier on: after a warm-up run the tier holds the
           file whole and opens are FUSE passthrough opens of it)
  learn    --no-disk-cache --expert-prefetch learn: every page the kernel drops is
           reconstructed again; the predictor learns and scores, queues nothing
  on       --no-disk-cache --expert-prefetch on: the same, predicted experts queued

llama.cpp runs in a memory cgroup (v1 or v2) of --limit-mib and the daemon outside it,
as issue 15 has it; with --daemon-inside the daemon runs in the same cgroup, so its
cache (--cache-mib) comes out of the same memory as llama.cpp's page cache. The page
cache is dropped before every run. Per generated token, from the daemon's counters
between llama.cpp's first generated token and its exit (the prompt's batch, which
reads most experts of every layer, is left out): reads that waited
for reconstruction (stalls), bytes reconstructed, and the bytes of the experts the
reads touched (each expert's extents once per layer step), and the daemon's CPU time
over that wall time (cores busy reconstructing). The predictor is trained
by one unmeasured run with another prompt; what it learns is kept between mounts.
Needs root, target/release/cawsfs and the llama.cpp build (scripts/setup.sh).
"""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

from memcg import Cgroup, drop_caches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAWSFS = os.path.join(ROOT, "target/release/cawsfs")
CACHE = os.environ.get("CAWSFS_CACHE", os.path.expanduser("~/.cache/cawsfs"))
LLAMA = os.path.join(CACHE, "llama.cpp-0.3.36/build/bin")
MiB = 1 << 20
PROMPT = "The license says that the program"
TRAIN_PROMPT = "Each contributor grants you a copyright license to"


def sh(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True,
                          **kw).stdout


def stat(mp):
    return json.loads(sh(CAWSFS, "stat", mp, "--json"))


def counters(s, pid=None):
    c, x = s["cache"], s.get("experts") or {}
    cpu = 0.0
    if pid:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        cpu = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return {"cpu": cpu, "stalls": c.get("stalls", 0), "stall_us": c.get("stall_us", 0),
            "loaded": c.get("bytes_loaded", 0), "served": c.get("bytes_served", 0),
            "read_bytes": x.get("read_bytes", 0),
            "predicted": x.get("predicted", 0),
            "predicted_scored": x.get("predicted_scored", 0), "predicted_read": x.get("predicted_read", 0),
            "read": x.get("read", 0), "hits": c.get("hits", 0),
            "prefetch_hits": c.get("prefetch_hits", 0), "coalesced": c.get("coalesced", 0),
            "misses": c.get("misses", 0), "prefetch_loads": c.get("prefetch_loads", 0),
            "prefetch_skipped": c.get("prefetch_skipped", 0),
            "prefetch_dropped": c.get("prefetch_dropped", 0),
            "queued_chunks": x.get("queued_chunks", 0),
            "infra": x.get("loaded_infra_bytes", 0)}


def generate(cg, model, prompt, a, mp=None, pid=None):
    """Run llama-completion in the cgroup; (tokens/s, counter deltas from its first
    output to its exit, or None without a mount)."""
    argv = cg.enter_cmd([os.path.join(LLAMA, "llama-completion"), "-m", model, "-t", str(a.threads),
                     "-no-cnv", "--no-warmup", "--temp", "0", "-n", str(a.tokens), "-c", "512",
                     "-p", prompt])
    err = open("/tmp/bench-moe-llama.log", "w+")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err)
    # The prompt is echoed once the model is loaded, then evaluated as one batch that
    # reads most experts of every layer; the first generated token follows it. What
    # comes after that is generation alone, one token per step: the window measured.
    seen = b""
    while not seen.rstrip().endswith(prompt.split()[-1].encode()):
        b = p.stdout.read(1)
        if not b:
            break
        seen += b
    p.stdout.read(1)
    t0 = time.perf_counter()
    before = counters(stat(mp), pid) if mp else None
    p.stdout.read()
    if p.wait(timeout=1800) != 0:
        err.seek(0)
        raise RuntimeError("llama-completion failed: " + err.read()[-800:])
    after = counters(stat(mp), pid) if mp else None
    wall = time.perf_counter() - t0
    err.seek(0)
    log = err.read()
    m = re.search(r"(?<!prompt )eval time =.*?/\s*(\d+) runs.*?([\d.]+) tokens per second", log)
    tps = float(m.group(2))
    delta = {k: after[k] - before[k] for k in after} if mp else None
    if delta:
        delta["wall"] = wall
        # The steps in the window: every generated token but the first.
        delta["tokens"] = int(m.group(1))
    return tps, delta


class Mount:
    def __init__(self, cg, archive, mp, env, *args):
        """The daemon runs in `cg` (None: where this script runs)."""
        os.makedirs(mp, exist_ok=True)
        self.mp = mp
        argv = [CAWSFS, "mount", archive, mp, *args]
        out = subprocess.run(cg.enter_cmd(argv) if cg else argv, check=True,
                             capture_output=True, text=True, env={**os.environ, **env}).stdout
        self.pid = int(re.search(r"pid (\d+)", out).group(1))

    def close(self):
        subprocess.run([CAWSFS, "umount", self.mp], capture_output=True)


def make_inputs(a):
    model = sh(sys.executable, os.path.join(ROOT, "scripts/make-moe-bench-model.py"),
               "--affinity", str(a.affinity)).strip().splitlines()[-1]
    work = os.path.join(CACHE, "bench-moe")
    os.makedirs(work, exist_ok=True)
    archive = os.path.join(work, f"{os.path.basename(model)}.cawsf")
    if not os.path.exists(archive):
        sh(CAWSFS, "convert", model, "-o", archive + ".tmp")
        os.rename(archive + ".tmp", archive)
    gguf = os.path.join(work, f"{os.path.basename(model)}.gguf")
    if not os.path.exists(gguf):
        sh(CAWSFS, "export", archive, "--format", "gguf", "-o", gguf + ".tmp")
        os.rename(gguf + ".tmp", gguf)
    return work, archive, gguf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--affinity", type=float, default=0.9)
    ap.add_argument("--limit-mib", type=int, default=640)
    ap.add_argument("--cache-mib", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="file,mount,learn,on")
    ap.add_argument("--daemon-inside", action="store_true",
                    help="run the daemon in llama.cpp's memory cgroup too")
    ap.add_argument("--pin-infra", action="store_true",
                    help="learn and on pin the infrastructure (--pin-infra --pin-infra-layers 0)")
    ap.add_argument("--out")
    a = ap.parse_args()
    work, archive, gguf = make_inputs(a)
    cases = a.cases.split(",")
    mp = "/tmp/cawsfs-bench-moe"
    state = os.path.join(work, "state")
    subprocess.run(["rm", "-rf", state])
    common = ["--cache-size", f"{a.cache_mib}MiB"]
    pin = ["--pin-infra", "--pin-infra-layers", "0"] if a.pin_infra else []
    mounts = {
        "mount": (["--disk-cache", os.path.join(state, "tier")], {}),
        "learn": (["--no-disk-cache", "--expert-prefetch", "learn", *pin], {"CAWSFS_CACHE": state}),
        "on": (["--no-disk-cache", "--expert-prefetch", "on", *pin], {"CAWSFS_CACHE": state}),
    }
    cg = Cgroup("cawsfs-bench-moe", a.limit_mib * MiB)
    res = {c: [] for c in cases}
    try:
        # Unmeasured: the tier fills (then settles: its writer and refill finish at
        # unmount) and the predictors learn, from another prompt.
        for c in [c for c in ("mount", "learn") if c in cases] + (["on"] if "learn" not in cases and "on" in cases else []):
            args, env = mounts[c]
            m = Mount(cg if a.daemon_inside else None, archive, mp, env, *common, *args)
            try:
                generate(cg, os.path.join(mp, "model.gguf"), TRAIN_PROMPT, a, mp, m.pid)
            finally:
                m.close()
        for r in range(a.runs):
            for c in cases:
                drop_caches()
                if c == "file":
                    tps, d = generate(cg, gguf, PROMPT, a)
                else:
                    args, env = mounts[c]
                    m = Mount(cg if a.daemon_inside else None, archive, mp, env, *common, *args)
                    try:
                        tps, d = generate(cg, os.path.join(mp, "model.gguf"), PROMPT, a, mp,
                                          m.pid)
                    finally:
                        m.close()
                res[c].append((tps, d))
                print(f"run {r + 1} {c:6} {tps:6.2f} tokens/s {d or ''}", file=sys.stderr, flush=True)
    finally:
        cg.close()
    lines = render(a, res, os.path.getsize(gguf), routed_bytes(gguf))
    print("\n".join(lines))
    if a.out:
        from docsection import replace_section
        replace_section(a.out, "bench-moe", lines)


def routed_bytes(gguf_path):
    """Bytes of the experts one token routes to in model.gguf: per layer, the experts
    a token uses times one expert's share of the layer's stacks."""
    import gguf
    r = gguf.GGUFReader(gguf_path)
    field = lambda k: int(r.fields[k].parts[-1][0])
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    n, used = field(f"{arch}.expert_count"), field(f"{arch}.expert_used_count")
    return sum(int(t.n_bytes) for t in r.tensors if "_exps." in t.name) * used // n


def render(a, res, gguf_bytes, routed):
    med = statistics.median
    base = med(t for t, _ in res["file"]) if "file" in res else None
    n = a.tokens
    out = [
        f"`scripts/bench-moe.py --affinity {a.affinity} --limit-mib {a.limit_mib} "
        f"--cache-mib {a.cache_mib} --runs {a.runs} --tokens {n} --threads {a.threads}"
        f"{' --pin-infra' if a.pin_infra else ''}{' --daemon-inside' if a.daemon_inside else ''}`, "
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores; nothing else "
        f"running); model.gguf {gguf_bytes / MiB:.0f} MiB, of which a token's routed experts "
        f"{routed / MiB:.0f} MiB; medians of {a.runs} runs:",
        "",
        "| case | tokens/s | × file | stalls / token | stall time / token | served / token "
        "| reconstructed / token | of it infrastructure | experts read / token "
        "| reconstructed ÷ (routed + infrastructure) | precision | recall | daemon CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, runs in res.items():
        tps = med(t for t, _ in runs)
        ratio = f"{tps / base:.2f}" if base else "-"
        d = [x for _, x in runs if x]
        if not d:
            out.append(f"| {c} | {tps:.2f} | {ratio} |" + " - |" * 10)
            continue
        per = lambda k: med(x[k] / x["tokens"] for x in d)
        # Issue 15's bound: what the routed experts hold plus the infrastructure's misses.
        amp = med(x["loaded"] / (routed * x["tokens"] + x["infra"]) for x in d)
        prec = med(x["predicted_read"] / x["predicted_scored"] for x in d
                   if x["predicted_scored"]) if any(x["predicted_scored"] for x in d) else float("nan")
        rec = med(x["predicted_read"] / x["read"] for x in d if x["read"]) if any(
            x["read"] for x in d) else float("nan")
        out.append(f"| {c} | {tps:.2f} | {ratio} | {per('stalls'):.1f} | {per('stall_us') / 1e3:.0f} ms | "
                   f"{per('served') / MiB:.1f} MiB | {per('loaded') / MiB:.1f} MiB | "
                   f"{per('infra') / MiB:.1f} MiB | {per('read_bytes') / MiB:.1f} MiB | "
                   f"{amp:.2f} | {prec:.2f} | {rec:.2f} | "
                   f"{med(x['cpu'] / x['wall'] for x in d):.2f} cores |")
    return out


if __name__ == "__main__":
    main()

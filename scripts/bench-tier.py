#!/usr/bin/env python3
"""The disk tier and FUSE passthrough against the exported file, measured in one run.

  scripts/bench-tier.py [--archive PATH] [--runs 6] [--load-only] [--baseline BIN]
                        [--token-runs N] [--no-primer] [--out docs/MOUNT.md [--section tier]]

Every comparison is paired and interleaved (mount, file, file, mount, ...) and reports
the median of the pairs' ratios (the first pass against no tier: the ratio of medians;
its CPU against `export`: the median of each round's ratio); "file" is
`cawsfs export` of the same view on the same disk.

1. First pass (fresh tier, page cache dropped, default options): one sequential read of
   model.gguf, paired with the same pass with `--no-disk-cache` (the read path before
   the tier existed); archive bytes decoded per archive byte, daemon CPU seconds against
   the CPU `cawsfs export` spends writing the same file (each round: both run at the
   host's speed of that moment). `--baseline BIN` adds the same
   pass through another build's default mount (e.g. one from before the tier existed,
   built in a git worktree).
2. After a restart (umount, mount with default options: the tier is whole, opens are
   passthrough): sequential read bytes/s, cold (page cache dropped; once with a tier
   file and an export written anew before every pair, once with the same two files
   for every pair) and warm (each
   warm sample the mean of 8 reads; both files dropped and read again before each
   pair); cold also against the tier's own file read directly, the control for where
   the two files lie on the disk.
3. Warm llama.cpp generation tokens/s (llama-completion, 128 tokens, end of text
   ignored so that every sample generates all of them) with 1 thread and
   with every core, `--token-runs` pairs (default: max(runs, 16); odd counts of pairs
   are rounded up, --runs too), the page cache of both files made anew before each
   pair; the MiB of each run's model mapping the kernel mapped with 2 MiB pages goes to
   stderr.
4. Restart then load: umount, drop the page cache, mount and generate 8 tokens, wall
   time, against generating from the exported file after dropping the page cache.
   `--load-only` leaves 3 out (for a large model, whose warm generation adds minutes
   and no new question; its cold reads are the ones least moved by a file's open).

Every cold step (page cache dropped) first reads a scratch file of the view's size plus
512 MiB through the page cache and drops it again (`--no-primer`: not), so that its own
page cache lands on memory the VM's host backs; see PRIMER.

Needs root (it drops the page cache), target/release/cawsfs and the llama.cpp build
(scripts/build-llama-cpp.sh). Work files go to $CAWSFS_CACHE/bench-tier (default
~/.cache/cawsfs), the archive defaults to the demo's (scripts/demo.sh makes it) or the
test model converted there once. With --out, the section between the tier markers of
that file is rewritten (`<!-- SECTION:begin -->` … `<!-- SECTION:end -->`, SECTION
`tier` unless `--section` names another).
"""

import argparse
import datetime
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAWSFS = os.path.join(ROOT, "target/release/cawsfs")
CACHE = os.environ.get("CAWSFS_CACHE", os.path.expanduser("~/.cache/cawsfs"))
MiB = 1 << 20
PROMPT = "The capital of France is"
# Tokens per warm generation: long enough that one sample is a few seconds of decoding,
# not the ~1 s that 64 tokens took, where the host's hiccups decide the median. Every one
# is generated (`--ignore-eos`): the test model ends its answer after about 20 tokens,
# which made each sample a quarter of a second.
TOKENS = 128
# Reads of the whole file per warm-read sample: one read of the test model's view takes
# ~16 ms, where a scheduler hiccup moves a single sample by 10 %.
WARM_READS = 8
GGUF = "model.gguf"


def sh(*args, **kw):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, **kw).stdout


# A scratch file read through the page cache (then dropped) before every measured cold
# step; None: not made yet (`make_primer`). Why: on the bench VM, memory the guest
# freed and left idle for a few seconds is handed back to the host (virtio-balloon free
# page reporting), and filling it again costs ~10 us of kernel time per 4 KiB page.
# The same exported file read cold in 0.42-0.68 s right after the page cache was
# dropped, and in 2.5-3.3 s (all of it system time) after 20 s idle; reading
# 1.7 GB of another file first, then dropping it, brought the latter back to
# 0.43-0.45 s (docs/MOUNT.md, "Runs 27–28"). Without it, a cold sample's time said how long
# the machine had been idle before it (which read went first in a pair) rather than how
# the file is served. Harmless where memory is the machine's own.
PRIMER = None


def make_primer(path, size):
    """A `size`-byte file of random bytes at `path` (kept for the next run if its size
    is right) read before every cold step from now on."""
    global PRIMER
    if not (os.path.exists(path) and os.path.getsize(path) == size):
        with open(path + ".tmp", "wb") as f:
            left = size
            while left:
                n = min(left, 64 * MiB)
                f.write(os.urandom(n))
                left -= n
        os.replace(path + ".tmp", path)
    PRIMER = path


def drop_page_cache():
    """Drop the page cache (after a sync); with a primer, read it through the page cache
    and drop it again, so the next step's page cache lands on memory the guest holds."""
    for primed in (False, True):
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        if primed or PRIMER is None:
            return
        read_all(PRIMER)


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Mount:
    def __init__(self, archive, mp, tier, binary=None):
        os.makedirs(mp, exist_ok=True)
        if binary:  # another build, with its own defaults
            out = sh(binary, "mount", archive, mp)
        else:
            out = sh(CAWSFS, "mount", archive, mp,
                     *(["--disk-cache", tier] if tier else ["--no-disk-cache"]))
        self.mp = mp
        self.pid = int(re.search(r"pid (\d+)", out).group(1))

    def stat(self):
        return json.loads(sh(CAWSFS, "stat", self.mp, "--json"))

    def close(self):
        sh(CAWSFS, "umount", self.mp)


def read_all(path):
    """Seconds to read `path` sequentially in 1 MiB reads."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(MiB):
            pass
    return time.perf_counter() - t


def pmd_mapped_mib(pid, name):
    """MiB of `name`'s mappings in process `pid` mapped with PMD (2 MiB) pages: how much
    of the model the kernel could map huge, which follows the page cache's folio sizes
    and moves tokens/s by ~10 % on this model (docs/MOUNT.md, "Where the pages land")."""
    total, inside = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                    inside = line.rstrip().endswith(name)
                elif inside and line.startswith("FilePmdMapped:"):
                    total += int(line.split()[1])
    except OSError:
        return None
    return total / 1024


def llama(bin_dir, model, threads, n, probe_after=None):
    """(generation tokens/s, process wall seconds, MiB of the model PMD-mapped
    `probe_after` seconds in, or None)."""
    t = time.perf_counter()
    p = subprocess.Popen(
        [os.path.join(bin_dir, "llama-completion"), "-m", model, "-t", str(threads), "-no-cnv",
         "--no-warmup", "--temp", "0", "--ignore-eos", "-n", str(n), "-p", PROMPT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pmd = None
    if probe_after is not None:
        try:
            p.wait(timeout=probe_after)
        except subprocess.TimeoutExpired:
            pmd = pmd_mapped_mib(p.pid, os.path.basename(model))
    out, err = p.communicate(timeout=600)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"llama-completion failed: {err[-500:]}")
    tps = float(re.search(r"(?<!prompt )eval time =.*?([\d.]+) tokens per second", err).group(1))
    return tps, wall, pmd


def paired(runs, a, b, what="", before=None):
    """Run a() and b() interleaved `runs` times, in the order a b, b a, a b, ... so that
    neither always goes first (on the bench VM a "cold" read also depends on what the
    host still caches of each file, which drifts during a run); (median a, median b,
    median of the pairs' a/b). The pairs' ratio is what the table reports: each pair
    ran back to back, so it cancels the host's speed drifting by ±10-20 % from one
    minute to the next, which a ratio of the two medians does not. Every sample is
    printed to stderr. An odd `runs` is rounded up: the first read of a cold pair can be
    the faster or the slower one by a third (seen on the 1 B model), and an extra pair of
    one order then decides the median. `before(i)` runs before pair `i`, unmeasured."""
    runs += runs % 2
    xs, ys = [], []
    for i in range(runs):
        if before:
            before(i)
        if i % 2 == 0:
            xs.append(a())
            ys.append(b())
        else:
            ys.append(b())
            xs.append(a())
    ratios = [x / y for x, y in zip(xs, ys)]
    print(f"{what}: mount {' '.join(f'{x:.3f}' for x in xs)} | file {' '.join(f'{y:.3f}' for y in ys)}"
          f" | pairs {' '.join(f'{r:.3f}' for r in ratios)}", file=sys.stderr)
    return statistics.median(xs), statistics.median(ys), statistics.median(ratios)


def passthrough_rows(archive, mp, tier, exported, bin_dir, runs, token_runs, tokens=True):
    """Steps 2-3 on a restarted mount whose tier holds model.gguf whole (3 unless
    `tokens` is false)."""
    rows, size = [], os.path.getsize(exported)
    m = Mount(archive, mp, tier)
    try:
        served = os.path.join(mp, GGUF)

        def cold(p):
            drop_page_cache()
            return read_all(p)

        cold(served), cold(exported)  # one unmeasured read each: both read as recently
        cm, cf, r = paired(runs, lambda: cold(served), lambda: cold(exported), "cold read s")
        rows.append(("sequential read, cold page cache, the same two files in every pair",
                     f"{size / MiB / cm:.0f} MiB/s", f"{size / MiB / cf:.0f} MiB/s",
                     f"{1 / r:.2f}"))
        # The control: the tier's own file (the one the kernel passes reads through to)
        # read directly. Same bytes, same filesystem, another place on the disk: on a
        # VM the two plain files have differed by 20 % cold (docs/MOUNT.md, run 19),
        # which is the disk's, not the mount's.
        listed = json.loads(sh(CAWSFS, "tier", "ls", "--dir", tier, "--json"))
        key = next(e["key"] for e in listed if e["file"] == GGUF and e["whole"])
        backing = os.path.join(tier, key + ".data")
        cold(backing)
        bm, bf, r = paired(runs, lambda: cold(served), lambda: cold(backing),
                           "cold read s, mount against the tier's file read directly")
        rows.append(("sequential read, cold page cache, vs the tier's own file read directly",
                     f"{size / MiB / bm:.0f} MiB/s", f"{size / MiB / bf:.0f} MiB/s (tier file)",
                     f"{1 / r:.2f}"))
        def warm(p):
            return sum(read_all(p) for _ in range(WARM_READS)) / WARM_READS

        def fresh(i):
            """Both files read into a freshly dropped page cache, in the pair's order.
            Where a file's pages land decides its warm speed for as long as they stay
            (docs/MOUNT.md, "Where the pages land"): ±10 % between two runs of the same
            files, one way for a whole run; placed anew before every pair, that luck
            spreads over the pairs instead of deciding the run."""
            drop_page_cache()
            for p in (served, exported) if i % 2 == 0 else (exported, served):
                read_all(p)

        wm, wf, r = paired(runs, lambda: warm(served), lambda: warm(exported), "warm read s",
                           before=fresh)
        rows.append(("sequential read, warm page cache", f"{size / MiB / wm:.0f} MiB/s",
                     f"{size / MiB / wf:.0f} MiB/s", f"{1 / r:.2f}"))
        for threads in sorted({1, os.cpu_count() or 1}) if tokens else ():
            pmds = {served: [], exported: []}

            def gen(model):
                tps, _, pmd = llama(bin_dir, model, threads, TOKENS, probe_after=1.0)
                pmds[model].append(pmd)
                return tps

            tm, tf, r = paired(token_runs, lambda: gen(served), lambda: gen(exported),
                               f"tokens/s, {threads} thread(s)", before=fresh)
            print(f"PMD-mapped MiB, {threads} thread(s): mount "
                  f"{' '.join(f'{x:.0f}' if x is not None else '-' for x in pmds[served])} | file "
                  f"{' '.join(f'{x:.0f}' if x is not None else '-' for x in pmds[exported])}",
                  file=sys.stderr)
            rows.append((f"warm llama.cpp tokens/s, {threads} thread(s), {token_runs} pairs",
                         f"{tm:.1f}", f"{tf:.1f}", f"{r:.3f}"))
        st = m.stat()
        assert st["tier"]["passthrough"] == "on", st["tier"]
        assert st["cache"]["bytes_served"] == 0, st["cache"]
    finally:
        m.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archive")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--load-only", action="store_true")
    ap.add_argument("--token-runs", type=int, help="pairs of llama.cpp generations (default: max(runs, 16))")
    ap.add_argument("--out")
    ap.add_argument("--section", default="tier")
    ap.add_argument("--baseline", help="another build's cawsfs binary: its first pass too")
    ap.add_argument("--no-primer", action="store_true",
                    help="no scratch read before each cold step (see PRIMER)")
    a = ap.parse_args()
    a.runs += a.runs % 2  # even: each order of a pair as often as the other (see paired)
    if os.geteuid() != 0:
        sys.exit("bench-tier: needs root (it drops the page cache)")
    work = os.path.join(CACHE, "bench-tier", os.path.splitext(os.path.basename(a.archive))[0] if a.archive else "demo")
    os.makedirs(work, exist_ok=True)
    bin_dir = sh(os.path.join(ROOT, "scripts/build-llama-cpp.sh")).strip()
    archive = a.archive or os.path.join(CACHE, "demo", "smol.cawsf")
    if not os.path.exists(archive):
        model = sh(os.path.join(ROOT, "scripts/fetch-test-model.sh")).strip()
        archive = os.path.join(work, "smol.cawsf")
        if not os.path.exists(archive):
            sh(CAWSFS, "convert", model, "-o", archive)
    exported = os.path.join(work, "exported.gguf")

    def export():
        """CPU seconds `cawsfs export` spends writing the view (page cache dropped)."""
        drop_page_cache()
        t = os.times()
        sh(CAWSFS, "export", archive, "--format", "gguf", "-o", exported)
        t2 = os.times()
        return (t2.children_user - t.children_user) + (t2.children_system - t.children_system)

    tier, mp = os.path.join(work, "tier"), os.path.join(work, "mnt")
    shutil.rmtree(tier, ignore_errors=True)
    export()  # the file the later steps compare with; each round measures it again
    size = os.path.getsize(exported)
    if not a.no_primer:  # the view, and the daemon's chunk cache (512 MiB by default)
        make_primer(os.path.join(work, "primer.bin"), size + 512 * MiB)
    archive_bytes = os.path.getsize(archive)
    rows = []

    # 1. First pass through a fresh tier, against the same pass without a tier (what
    # every read cost before the tier existed), both from a cold page cache.
    def first_pass(with_tier, binary=None):
        shutil.rmtree(tier, ignore_errors=True)
        drop_page_cache()
        m = Mount(archive, mp, tier if with_tier else None, binary)
        try:
            c0 = cpu_s(m.pid)
            secs = read_all(os.path.join(mp, GGUF))
            c1 = cpu_s(m.pid)
            st = m.stat()
        finally:
            m.close()  # returns after the tier is flushed
        return secs, c1 - c0, st["archive"]["bytes_read"]

    plain, fresh, base, exports = [], [], [], []
    for _ in range(a.runs):
        exports.append(export())
        plain.append(first_pass(False))
        if a.baseline:
            base.append(first_pass(False, a.baseline))
        fresh.append(first_pass(True))  # the tier is whole after the last
    med = lambda runs, i: statistics.median(r[i] for r in runs)
    for what, runs in (("no tier", plain), ("fresh tier", fresh), ("baseline", base)):
        if runs:
            print(f"first pass, {what}: s {' '.join(f'{r[0]:.3f}' for r in runs)}"
                  f" | daemon CPU s {' '.join(f'{r[1]:.2f}' for r in runs)}", file=sys.stderr)
    print(f"export CPU s: {' '.join(f'{x:.2f}' for x in exports)}", file=sys.stderr)
    first_s, cpu, decoded = med(fresh, 0), med(fresh, 1), med(fresh, 2)
    export_cpu = statistics.median(exports)
    rows.append(("first pass: sequential read of model.gguf, fresh tier vs no tier",
                 f"{size / MiB / first_s:.0f} MiB/s", f"{size / MiB / med(plain, 0):.0f} MiB/s (no tier)",
                 f"{med(plain, 0) / first_s:.2f}"))
    rows.append(("first pass: daemon CPU, fresh tier vs no tier", f"{cpu:.2f} s",
                 f"{med(plain, 1):.2f} s (no tier)", f"{cpu / med(plain, 1):.2f}"))
    if a.baseline:
        rows.append(("first pass: fresh tier vs the --baseline build's default mount",
                     f"{size / MiB / first_s:.0f} MiB/s", f"{size / MiB / med(base, 0):.0f} MiB/s",
                     f"{med(base, 0) / first_s:.2f}"))
        rows.append(("first pass: daemon CPU, fresh tier vs that build", f"{cpu:.2f} s",
                     f"{med(base, 1):.2f} s", f"{cpu / med(base, 1):.2f}"))
    rows.append(("first pass: archive bytes read and decoded / archive bytes", f"{decoded / archive_bytes:.2f}", "", ""))
    # Each round's daemon against that round's export, a few seconds apart: the host's
    # speed drifts by tens of percent within minutes here (export alone took 0.34-0.56 s
    # in one run), so the ratio of the two medians mixes rounds run at different speeds.
    cpu_ratios = [r[1] / x for r, x in zip(fresh, exports)]
    print(f"daemon CPU / export CPU per round: {' '.join(f'{x:.2f}' for x in cpu_ratios)}"
          f" (ratio of the medians {cpu / export_cpu:.2f})", file=sys.stderr)
    rows.append(("first pass: daemon CPU / export CPU", f"{cpu:.2f} s", f"{export_cpu:.2f} s",
                 f"{statistics.median(cpu_ratios):.2f}"))
    def make_whole():
        """Whether model.gguf was whole in the tier; made whole (materialize) if not."""
        listed = json.loads(sh(CAWSFS, "tier", "ls", "--dir", tier, "--json"))
        if any(e["file"] == GGUF and e["whole"] for e in listed):
            return True
        m = Mount(archive, mp, tier)
        try:
            sh(CAWSFS, "materialize", mp, "--file", GGUF)
        finally:
            m.close()
        return False

    rows.append(("first pass: model.gguf whole in the tier at unmount (last pass)",
                 "yes" if make_whole() else "no: extents dropped, not yet refilled", "", ""))

    # 2a. Cold reads with both files written anew before every pair. Where and how a
    # file was written moves its cold read on the bench VM by up to ±5 % (copies of one
    # file read 37.1-43.7 ms: docs/MOUNT.md, runs 24 and 25), and the rows below read
    # one tier file and one export for every pair, so one draw of that decides them.
    # Here each pair reads a tier file that a fresh first pass just wrote (through a
    # restarted mount: passthrough) and an export just written, so that the draws
    # spread over the pairs as the warm rows' page cache does.
    def replace_both(i):
        steps = [export, lambda: first_pass(True)]
        for step in steps if i % 2 == 0 else steps[::-1]:  # each written first as often
            step()
        make_whole()

    def cold_mount():
        m = Mount(archive, mp, tier)
        try:
            assert m.stat()["tier"]["passthrough"] == "on"
            drop_page_cache()
            return read_all(os.path.join(mp, GGUF))
        finally:
            m.close()

    def cold_file():
        drop_page_cache()
        return read_all(exported)

    cm, cf, r = paired(a.runs, cold_mount, cold_file,
                       "cold read s, both files written anew before each pair", before=replace_both)
    rows.append(("sequential read, cold page cache, both files written anew before each pair",
                 f"{size / MiB / cm:.0f} MiB/s", f"{size / MiB / cf:.0f} MiB/s", f"{1 / r:.2f}"))

    # 2-3. After a restart: passthrough.
    token_runs = a.token_runs or max(a.runs, 16)
    token_runs += token_runs % 2
    rows += passthrough_rows(archive, mp, tier, exported, bin_dir, a.runs, token_runs,
                             tokens=not a.load_only)

    # 4. Restart then load, both from a cold page cache.
    def restart_load():
        drop_page_cache()
        t = time.perf_counter()
        mm = Mount(archive, mp, tier)
        try:
            llama(bin_dir, os.path.join(mp, GGUF), os.cpu_count() or 1, 8)
            return time.perf_counter() - t
        finally:
            mm.close()

    def file_load():
        drop_page_cache()
        return llama(bin_dir, exported, os.cpu_count() or 1, 8)[1]

    rm, rf, r = paired(a.runs, restart_load, file_load, "restart+load s")
    rows.append(("mount + load + 8 tokens vs file, cold page cache", f"{rm:.2f} s", f"{rf:.2f} s",
                 f"{r:.2f}"))

    head = ("| measure | mount | exported file | ratio |\n|---|---|---|---|\n")
    table = head + "".join(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |\n" for r in rows)
    cmd = ("scripts/bench-tier.py" + (f" --archive {a.archive}" if a.archive else "")
           + f" --runs {a.runs}" + (" --load-only" if a.load_only else "")
           + (f" --token-runs {a.token_runs}" if a.token_runs else "")
           + (f" --baseline {a.baseline}" if a.baseline else "")
           + (" --no-primer" if a.no_primer else ""))
    text = (f"Measured {datetime.date.today()} on {platform.node()} ({os.cpu_count()} cores), "
            f"`{cmd}`, archive {os.path.basename(archive)} ({archive_bytes / MiB:.1f} MiB), "
            f"model.gguf {size / MiB:.1f} MiB; medians of {a.runs} interleaved pairs (tokens/s: "
            f"{token_runs} pairs of {TOKENS}-token generations). Ratios: the median of the pairs' "
            "ratios, bytes/s and tokens/s mount/file, times mount/file.\n\n" + table)
    print(text)
    if a.out:
        BEGIN, END = f"<!-- {a.section}:begin -->", f"<!-- {a.section}:end -->"
        doc = open(a.out).read()
        if BEGIN in doc and END in doc:
            pre, rest = doc.split(BEGIN, 1)
            post = rest.split(END, 1)[1]
            open(a.out, "w").write(pre + BEGIN + "\n" + text + END + post)
        else:
            sys.exit(f"bench-tier: {a.out} has no {BEGIN} ... {END} section")


if __name__ == "__main__":
    main()

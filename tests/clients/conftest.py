"""Shared fixtures for the real-client tests: the cawsfs binary, the real test model,
the llama.cpp build, and archives converted once per session."""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
# A fixed English text shipped by a Debian package (base-files), for perplexity.
TEXT = "/usr/share/common-licenses/GPL-3"


# A ggml abort forks a debugger to print a backtrace; where none can attach the child
# waits forever and so does the test: the abort's own message says enough.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")


def run(cmd, **kw):
    """Run a command, returning CompletedProcess; raise with its output on failure."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    p = subprocess.run([str(c) for c in cmd], **kw)
    if p.returncode != 0 and not kw.get("check_ok_fail"):
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


# A hang must fail its test with what every thread was doing, not use up CI's time in
# silence: past this many seconds (setup, call and teardown together) the watchdog
# prints the stacks of the test's Python threads and of every cawsfs process (gdb),
# then kills those processes, so that whatever waited on them fails.
TEST_LIMIT_S = int(os.environ.get("CAWSFS_TEST_LIMIT_S", "900"))


def _daemon_pids():
    out = subprocess.run(["pgrep", "-x", "cawsfs"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _hung(name):
    lines = [f"\n=== watchdog: {name} ran past {TEST_LIMIT_S} s ==="]
    for tid, frame in sys._current_frames().items():
        if tid != threading.get_ident():
            lines.append(f"--- python thread {tid}")
            lines.extend(l.rstrip() for l in traceback.format_stack(frame))
    for pid in _daemon_pids():
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        lines.append(f"--- cawsfs pid {pid}: {cmd}")
        try:
            bt = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx",
                                 "-ex", "thread apply all bt 16"],
                                capture_output=True, text=True, timeout=120).stdout
            lines.extend(l[:200] for l in bt.splitlines() if l.startswith(("#", "Thread")))
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"(no stacks: {e})")
    # Straight to the terminal (fd 2 may be pytest's capture file; /dev/tty absent on CI).
    text = "\n".join(lines) + "\n"
    try:
        with open(f"/proc/{os.getppid()}/fd/2", "w") as tty:
            tty.write(text)
    except OSError:
        pass
    sys.__stderr__.write(text)
    for pid in _daemon_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    timer = threading.Timer(TEST_LIMIT_S, _hung, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def run_status(cmd):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True)


@pytest.fixture(scope="session")
def cawsfs():
    """The binary under test: $CAWSFS_BIN when set (a build of one's own, safe from
    other checkouts sharing a target directory), else this checkout's release build."""
    if os.environ.get("CAWSFS_BIN"):
        exe = Path(os.environ["CAWSFS_BIN"]).resolve()
    else:
        run(["cargo", "build", "--release", "--quiet"], cwd=ROOT)
        exe = ROOT / os.environ.get("CARGO_TARGET_DIR", "target") / "release" / "cawsfs"
    assert exe.is_file(), exe
    return exe


@pytest.fixture(scope="session")
def model_gguf():
    out = run([ROOT / "scripts" / "fetch-test-model.sh"]).stdout.strip()
    return Path(out)


@pytest.fixture(scope="session")
def llama_bin():
    return Path(run([ROOT / "scripts" / "build-llama-cpp.sh"]).stdout.strip())


# Disk is scarce on CI machines and one run writes ~17 GB in all, so what is written
# lives only as long as what needs it: a test's own files in `work` (removed when it
# passes, pytest.ini), a module's fixtures in `shelf` (removed after the module), and
# only the session's archives in `store`.
@pytest.fixture(scope="session")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("cawsfs-e2e")


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    d = tmp_path_factory.mktemp("module")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture()
def work(tmp_path):
    return tmp_path


# Mounts keep a disk tier by default (docs/TIER.md). Each test's mounts get one of their
# own, so what one test reconstructed never serves another; mounts made by module
# fixtures, set up before any test's, share the session's.
@pytest.fixture(scope="session", autouse=True)
def session_tier(tmp_path_factory):
    d = tmp_path_factory.mktemp("tier")
    os.environ["CAWSFS_TIER_DIR"] = str(d)
    return d


@pytest.fixture(autouse=True)
def own_tier(tmp_path, monkeypatch, session_tier):
    monkeypatch.setenv("CAWSFS_TIER_DIR", str(tmp_path / "tier"))
    # Likewise the fetch cache of remote archives (docs/REMOTE.md).
    monkeypatch.setenv("CAWSFS_FETCH_CACHE_DIR", str(tmp_path / "fetch"))


def convert(cawsfs, src, out, *args):
    report = Path(str(out) + ".report.json")
    p = run([cawsfs, "convert", src, "-o", out, "--report-json", report, *args])
    return json.loads(report.read_text()), p.stdout


def convert_each(cawsfs, src, settings, path_of, *common):
    """Convert `src` once per named setting to `path_of(name)` with `common` arguments
    first; returns {name: (path, report, stdout)}."""
    out = {}
    for name, args in settings.items():
        path = path_of(name)
        report, stdout = convert(cawsfs, src, path, *common, *args)
        out[name] = (path, report, stdout)
    return out


# Settings under test: the default (a 5-bit --bpw plan), PQ as it was the default
# before (~4.2 bits per weight on coded matrices, rank 4, outliers, the embedding kept),
# PQ at 4.0, a low-bit one as the paper sketches (PQ of 4-wide sub-vectors, rank 16),
# and all-passthrough (bit-exact, the reference the lossy settings are compared with).
SETTINGS = {
    "default": [],
    "pq": ["--pq-dim", "2"],
    "q4": ["--pq-dim", "2", "--rank", "0"],
    "low": ["--pq-dim", "4", "--rank", "16"],
    "exact": ["--passthrough", "*"],
    # R as 4-bit scalar groups of 32: the test model's Q4_1 layers come back on their grid.
    "sq": ["--sq-bits", "4", "--rank", "0", "--outlier-q", "1"],
}


@pytest.fixture(scope="session")
def archives(cawsfs, model_gguf, store):
    made = convert_each(cawsfs, model_gguf, SETTINGS, lambda n: store / f"smol-{n}.cawsf")
    return {name: (path, report) for name, (path, report, _) in made.items()}


def llama_generate(llama_bin, gguf, prompt=PROMPT, n=24):
    p = run([
        llama_bin / "llama-completion", "-m", gguf, "-p", prompt, "-n", n, "--temp", "0",
        "-no-cnv", "--no-warmup", "-t", str(min(4, os.cpu_count() or 1)), "-s", "1",
    ])
    return p.stdout, p.stderr


def corrupt_block(cawsfs, path, bad, tensor, block):
    """Copy archive `path` to `bad` with one bit flipped mid-way through the stored bytes
    of `tensor`'s block `block` (located by `inspect --blocks`)."""
    info = json.loads(run([cawsfs, "inspect", path, "--json", "--blocks"]).stdout)
    t = next(t for t in info["tensors"] if t["name"] == tensor)
    off, ln = t["block_locations"][block]
    shutil.copy(path, bad)
    with open(bad, "r+b") as f:
        f.seek(off + ln // 2)
        b = f.read(1)
        f.seek(off + ln // 2)
        f.write(bytes([b[0] ^ 0x01]))


def pread_eio_offsets(path, ref, step=1 << 20):
    """Read file `path` in `step`-byte preads: each read must equal `ref` there or fail
    with EIO (never other bytes). A short read is POSIX's way of saying the part after
    it failed: its bytes must be right, and reading on from its end continues the check.
    Returns the offsets of the steps where a read failed."""
    fd = os.open(path, os.O_RDONLY)
    failed = []
    try:
        for pos in range(0, len(ref), step):
            at, end = pos, min(pos + step, len(ref))
            while at < end:
                try:
                    b = os.pread(fd, end - at, at)
                except OSError as e:
                    assert e.errno == errno.EIO
                    failed.append(pos)
                    break
                assert b and b == ref[at:at + len(b)], (pos, at, len(b))
                at += len(b)
    finally:
        os.close(fd)
    return failed


def kld_base(cawsfs, archives, llama_bin, work, ctx=128):
    """The F16 reference's token distributions over GPL-3 (`TEXT`, not part of the
    calibration text of scripts/imatrix.sh), for [`kld`]: 12 chunks of `ctx` tokens."""
    ref = work / "ref.gguf"
    run([cawsfs, "export", archives["exact"][0], "--format", "gguf", "--gguf-type", "f16", "-o", ref])
    base = work / f"ref{ctx}.kld"
    run([llama_bin / "llama-perplexity", "-m", ref, "-f", TEXT, "-c", str(ctx), "--chunks", "12",
         "-t", str(min(4, os.cpu_count() or 1)), "--kl-divergence-base", base])
    ref.unlink()
    return base


def kld(llama_bin, base, gguf_path, ctx=128):
    """Mean KL-divergence of `gguf_path`'s token distributions from those in `base`
    (made with the same `ctx`)."""
    p = run([llama_bin / "llama-perplexity", "-m", gguf_path, "--kl-divergence-base", base,
             "--kl-divergence", "-c", str(ctx), "--chunks", "12", "-t", str(min(4, os.cpu_count() or 1))])
    return float(re.search(r"Mean\s+KLD:\s*([-\d.]+)", p.stdout + p.stderr)[1])

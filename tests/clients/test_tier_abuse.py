"""The disk tier as hostile input (issue 58), through real mounts: whatever another
process leaves or puts in the tier directory (FIFOs, symlinks, devices, directories,
truncated or edited files, stale temporary files, a full disk, a crashed daemon's
leftovers) never blocks a mount, never makes it write outside the tier, never serves
wrong bytes and never floods the log; a tier path or mount point that cannot be used is
a one-line error naming it.

Every step that could block (a mount, a read through it, an unmount, a `cawsfs tier`
command) runs under a timeout, so a regression fails its test rather than hanging CI;
whatever a failed test leaves mounted or running is killed and unmounted after it."""
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from test_mount import Mount, exported  # noqa: F401 (fixture)
from test_tier import GGUF, entry_of, tier  # noqa: F401 (fixture)

# Seconds each kind of step may take before it counts as hung. A mount comes up in
# well under a second; a whole read of model.gguf (~106 MiB) decodes for a few
# seconds on the 2-core build machine; `cawsfs umount` waits for the daemon's last
# tier writes (at most 20 s) and its exit.
MOUNT_S = 30
READ_S = 90
UMOUNT_S = 90
CLI_S = 30
# The daemon's resident memory that counts as unbounded (an index read whole from
# /dev/zero grows without end): the watcher kills it there.
RSS_LIMIT = 1 << 30


def bounded(cmd, timeout, input=None, text=True):
    """Run `cmd` (output captured); a run past `timeout` s is killed and fails the test.
    Not waited for after the kill: a process in a FUSE request the daemon has taken
    waits uninterruptibly until the daemon answers or dies (the teardown kills it)."""
    cmd = [str(c) for c in cmd]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text)
    try:
        out, err = p.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        try:
            p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        raise AssertionError(f"{' '.join(cmd)}: still running after {timeout} s") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def within(timeout, what, fn, *args):
    """`fn(*args)` on a thread of its own; failing the test if it has not returned after
    `timeout` s (the thread stays blocked until the teardown kills the daemon, which
    aborts the FUSE connection it waits on)."""
    box = {}

    def go():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            box["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AssertionError(f"{what}: still blocked after {timeout} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def same_within(path, ref, timeout=READ_S):
    """`path` read whole (by `cmp`, a process a timeout can kill even inside a FUSE
    read) equals `ref`."""
    p = bounded(["cmp", path, ref], timeout)
    return p.returncode == 0


def fd_mismatch(fd, ref, step=8 << 20):
    """The first offset where descriptor `fd` read by preads differs from file `ref`,
    or None when every byte matches (and the sizes agree)."""
    with open(ref, "rb") as r:
        at = 0
        while True:
            want = r.read(step)
            got = os.pread(fd, step, at)
            if got != want:
                return at
            if not want:
                return None
            at += len(want)


def unescape(field):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mount_points_under(path):
    """Mount points at or below `path`, deepest first."""
    base = str(path)
    with open("/proc/self/mountinfo") as f:
        points = [unescape(line.split()[4]) for line in f]
    return sorted((p for p in points if p == base or p.startswith(base + "/")), key=len, reverse=True)


def is_mounted(path):
    return str(path) in mount_points_under(path)


def cawsfs_pids(naming):
    """`cawsfs mount` processes (the command and its daemon) with an argument containing
    `naming`: told by their arguments, not by the program's name, which is whatever
    $CAWSFS_BIN is called."""
    needle, pids = str(naming).encode(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        argv = cmdline(int(d)).split(b"\0")
        if len(argv) > 3 and argv[1] == b"mount" and any(needle in a for a in argv[2:]):
            pids.append(int(d))
    return pids


def gone(pid, timeout=10.0):
    """Wait until process `pid` has exited (or is a zombie); whether it did."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def force_release(path):
    """Kill every cawsfs process naming `path` or something below it, then lazily
    unmount whatever is mounted there (FUSE mounts and the tmpfs alike)."""
    pids = cawsfs_pids(path)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        gone(pid, 5)
    for p in mount_points_under(path):
        try:
            r = subprocess.run(["umount", "-l", p], capture_output=True, timeout=15)
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-uz", p], capture_output=True, timeout=15)
        except subprocess.TimeoutExpired:
            pass


def unseal(path):
    """Clear the immutable flag on every regular file below `path` (a daemon killed
    while the kernel read a tier file leaves it set), so the tree can be removed."""
    files = []
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            try:
                if stat.S_ISREG(os.lstat(p).st_mode):
                    files.append(p)
            except OSError:
                pass
    for i in range(0, len(files), 200):
        try:
            subprocess.run(["chattr", "-i", *files[i:i + 200]], capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(autouse=True)
def leave_nothing(work):
    """Whatever a test left behind (a hung or killed daemon, its dead mount, the tmpfs,
    sealed tier files) goes, so that it neither blocks the next test nor the removal of
    its files."""
    yield
    force_release(work)
    unseal(work)


def message(p):
    """The lines of an error on stderr, less the blank ones and clap's pointer to
    --help."""
    return [l for l in p.stderr.strip().splitlines()
            if l.strip() and not l.startswith("For more information")]


def log_mentions(log, key):
    """Lines of the daemon's log that name tier entry `key`."""
    return [l for l in Path(log).read_text(errors="replace").splitlines() if key in l]


def lsattr_flags(path):
    p = bounded(["lsattr", "-d", path], CLI_S)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()[0]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def vmrss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read())[1]) << 10
    except (OSError, TypeError):
        return 0


class Daemon(Mount):
    """test_mount's Mount with every step bounded, and the daemon's log at hand."""

    def __init__(self, cawsfs, archive, mp, *args, timeout=MOUNT_S):
        self.cawsfs, self.mp = cawsfs, Path(mp)
        self.mp.mkdir(parents=True, exist_ok=True)
        p = bounded([cawsfs, "mount", archive, mp, *args], timeout)
        assert p.returncode == 0, f"mount failed ({p.returncode}): {p.stderr[-3000:]}"
        self.pid = int(re.search(r"pid (\d+)", p.stdout)[1])
        self.socket = re.search(r"socket (\S+),", p.stdout)[1]
        self.log = Path(re.search(r"log (\S+)\)", p.stdout)[1])

    def stat(self):
        p = bounded([self.cawsfs, "stat", self.mp, "--json"], CLI_S)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    def close(self):
        p = bounded([self.cawsfs, "umount", self.mp], UMOUNT_S)
        assert p.returncode == 0, f"umount failed ({p.returncode}): {p.stderr[-2000:]}"
        assert gone(self.pid), "daemon still running after umount"


@contextmanager
def mounted(cawsfs, archive, mp, *args, **kw):
    """A Daemon for the with-block: unmounted with `cawsfs umount` (checked) when the
    block succeeds, killed and unmounted lazily when it fails."""
    m = Daemon(cawsfs, archive, mp, *args, **kw)
    ok = False
    try:
        yield m
        ok = True
    finally:
        if ok:
            m.close()
        else:
            force_release(m.mp)


def tiered(cawsfs, archive, mp, tier_dir, *args):
    return mounted(cawsfs, archive, mp, "--cache-size", "64MiB", "--disk-cache", tier_dir, *args)


class RssWatch:
    """Samples the resident memory of the daemon mounting at `mp` (found by its command
    line before `cawsfs mount` returns) every 10 ms; kills it past RSS_LIMIT, so that a
    daemon reading a file without end fails its test instead of the machine."""

    def __init__(self, mp):
        self.mp, self.pid, self.peak, self.killed = str(mp), None, 0, False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            if self.pid is None:
                found = [p for p in cawsfs_pids(self.mp) if b"--foreground" in cmdline(p)]
                self.pid = found[0] if found else None
            if self.pid is not None:
                rss = vmrss(self.pid)
                self.peak = max(self.peak, rss)
                if rss > RSS_LIMIT:
                    self.killed = True
                    try:
                        os.kill(self.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return
            time.sleep(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


def dd_byte(path, at, byte):
    """What an adversary types: `printf '\\xNN' | dd of=PATH bs=1 seek=AT conv=notrunc`
    (output as bytes)."""
    return bounded(["dd", f"of={path}", "bs=1", f"seek={at}", "conv=notrunc"], CLI_S,
                   input=bytes([byte]), text=False)


def other_byte(ref, at):
    with open(ref, "rb") as f:
        f.seek(at)
        b = f.read(1)[0]
    return 0xFF if b != 0xFF else 0x00


def wait_ok(pred, seconds, step=0.1):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


# --- set-up shared by the cases ------------------------------------------------------


@pytest.fixture(scope="module")
def filled(cawsfs, archives, exported, shelf):  # noqa: F811
    """A tier holding model.gguf whole, as a mount that read it once leaves it (mount
    with --disk-cache, read model.gguf whole, compare with the export, unmount): each
    test works on a copy of it (`seeded`), a copy costing far less than decoding."""
    d, mp = shelf / "tier-filled", shelf / "mnt-fill"
    try:
        with tiered(cawsfs, archives["default"][0], mp, d) as m:
            assert same_within(m.mp / GGUF, exported / GGUF)
    except BaseException:
        force_release(mp)
        raise
    data = entry_of(d, (exported / GGUF).stat().st_size)
    assert data.with_suffix(".idx").stat().st_size > 0, sorted(os.listdir(d))
    return d


@pytest.fixture()
def seeded(filled, tier, exported):  # noqa: F811
    """This test's tier `T`, a copy of `filled`; returns `T/K.data`, model.gguf's data
    file (`K` its key, the stem)."""
    shutil.copytree(filled, tier, symlinks=True)
    return entry_of(tier, (exported / GGUF).stat().st_size)


def archive_of(archives):
    return archives["default"][0]


# --- 1. a FIFO in place of the stamp -------------------------------------------------


def test_a_fifo_stamp_blocks_neither_open_nor_the_mount(cawsfs, archives, work, exported, seeded):  # noqa: F811
    """T/K.ok replaced by a FIFO (no writer ever opens it): opening and reading
    model.gguf finishes with the export's bytes; meanwhile the listing and config.json
    answer; `cawsfs umount` works."""
    ok = seeded.with_suffix(".ok")
    if ok.exists() or ok.is_symlink():
        ok.unlink()
    os.mkfifo(ok)
    ref = exported / GGUF
    with tiered(cawsfs, archive_of(archives), work / "mnt", seeded.parent) as m:
        reader = subprocess.Popen(["cmp", m.mp / GGUF, ref], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            ls = bounded(["ls", m.mp], CLI_S)
            assert ls.returncode == 0 and GGUF in ls.stdout.split(), (ls.stdout, ls.stderr)
            assert same_within(m.mp / "config.json", exported / "config.json", CLI_S)
            try:
                rc = reader.wait(timeout=READ_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"reading {GGUF} with a FIFO as {ok.name}: still blocked "
                                     f"after {READ_S} s") from None
            assert rc == 0, f"{GGUF} read through the mount differs from the export"
        finally:
            if reader.poll() is None:
                reader.kill()
        assert same_within(m.mp / GGUF, ref)  # a second open, after the first closed


# --- 2. FIFOs with entry names -------------------------------------------------------


def test_fifos_named_like_an_entry_block_nothing_and_clear_removes_them(
        cawsfs, archives, work, exported, seeded):  # noqa: F811
    """FIFOs named KEY.data, KEY.idx and KEY.json (a random KEY) in the tier: a mount
    starts and serves the export's bytes; `tier ls` (both forms), `tier gc --max-size
    1` and `tier clear` finish with exit 0; after `clear` the FIFOs are gone."""
    T = seeded.parent
    key = secrets.token_hex(16)
    fifos = [T / f"{key}.{ext}" for ext in ("data", "idx", "json")]
    for f in fifos:
        os.mkfifo(f)
    with tiered(cawsfs, archive_of(archives), work / "mnt", T) as m:
        assert same_within(m.mp / GGUF, exported / GGUF)
        # Beside a live mount too.
        p = bounded([cawsfs, "tier", "ls", "--dir", T, "--json"], CLI_S)
        assert p.returncode == 0, p.stderr
    for args in (["ls"], ["ls", "--json"], ["gc", "--max-size", "1"], ["clear"]):
        p = bounded([cawsfs, "tier", *args, "--dir", T], CLI_S)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        if args == ["ls", "--json"]:
            assert isinstance(json.loads(p.stdout), list), p.stdout
    left = [f.name for f in fifos if os.path.lexists(f)]
    assert not left, (left, sorted(os.listdir(T)))


# --- 3. editing a file the kernel reads through passthrough --------------------------


def open_passthrough(m, ref):
    """model.gguf opened in this process, checked to be a passthrough open."""
    fd = within(MOUNT_S, f"opening {GGUF}", os.open, m.mp / GGUF, os.O_RDONLY)
    try:
        st = m.stat()
        t = st["tier"]
        assert t["passthrough"] == "on" and t["passthrough_opens"] >= 1, t
        assert [f["passthrough"] for f in st["files"] if f["name"] == GGUF] == [True], st["files"]
    except BaseException:
        os.close(fd)
        raise
    return fd


def test_a_passthrough_file_is_sealed_while_the_kernel_reads_it(
        cawsfs, archives, work, exported, seeded):  # noqa: F811
    """With model.gguf open through passthrough, an in-place `dd` into T/K.data and a
    truncate of it fail (the daemon sets the immutable flag: EPERM even for root); the
    open descriptor, a new open and an open after all were closed read the export's
    bytes. After unmount the flag is gone and the tier can be removed."""
    data, ref = seeded, exported / GGUF
    size = data.stat().st_size
    with tiered(cawsfs, archive_of(archives), work / "mnt", data.parent) as m:
        fd = open_passthrough(m, ref)
        try:
            p = dd_byte(data, 1000, other_byte(ref, 1000))
            assert p.returncode != 0, (f"dd into the passthrough file succeeded; flags "
                                       f"{lsattr_flags(data)}: {p.stderr.decode()}")
            assert b"Operation not permitted" in p.stderr, p.stderr.decode()
            with pytest.raises(PermissionError):
                os.truncate(data, 0)
            assert data.stat().st_size == size
            assert within(READ_S, "reading the open descriptor", fd_mismatch, fd, ref) is None
            assert same_within(m.mp / GGUF, ref)  # a new open beside it
        finally:
            os.close(fd)
        assert same_within(m.mp / GGUF, ref)  # reopened after every descriptor closed
    assert "i" not in lsattr_flags(data), "tier file still immutable after unmount"
    p = bounded(["rm", "-rf", data.parent], CLI_S)
    assert p.returncode == 0 and not data.parent.exists(), p.stderr


def test_an_edit_past_the_seal_is_put_right_at_the_next_open(
        cawsfs, archives, work, exported, seeded):  # noqa: F811
    """The adversary clears the immutable flag (`chattr -i`) and edits a byte of the
    passthrough file while a descriptor has it open: the next open sees the seal
    broken, puts the byte right in the very file the kernel reads and seals it again,
    so that the new open and the old descriptor both read the export's bytes; `stat`
    counts one `tampered` and the extent as bad. A truncation past the seal is put
    right the same way. After unmount the file is not immutable and can be removed."""
    data, ref = seeded, exported / GGUF
    size = ref.stat().st_size
    with tiered(cawsfs, archive_of(archives), work / "mnt", data.parent) as m:
        fd = open_passthrough(m, ref)
        try:
            p = bounded(["chattr", "-i", data], CLI_S)
            assert p.returncode == 0, p.stderr
            p = dd_byte(data, 1000, other_byte(ref, 1000))
            assert p.returncode == 0, p.stderr.decode()  # the edit itself is possible now
            # A new open beside the live descriptor: the file is put right first.
            assert same_within(m.mp / GGUF, ref), "an edited tier file was served"
            assert within(READ_S, "reading the old descriptor", fd_mismatch, fd, ref) is None
            t = m.stat()["tier"]
            assert t.get("tampered") == 1 and t.get("bad_extents", 0) >= 1, t
            assert "i" in lsattr_flags(data), "not sealed again after the repair"
            # Lifted again and cut short: put right at the next open again.
            assert bounded(["chattr", "-i", data], CLI_S).returncode == 0
            os.truncate(data, size // 2)
            assert same_within(m.mp / GGUF, ref), "a truncated tier file was served"
            assert within(READ_S, "reading the old descriptor", fd_mismatch, fd, ref) is None
            assert data.stat().st_size == size
            assert m.stat()["tier"].get("tampered") == 2
        finally:
            os.close(fd)
        assert same_within(m.mp / GGUF, ref)
    assert "i" not in lsattr_flags(data), "tier file still immutable after unmount"
    p = bounded(["rm", "-rf", data.parent], CLI_S)
    assert p.returncode == 0 and not data.parent.exists(), p.stderr


def test_an_edit_past_the_seal_is_put_right_without_any_open(
        cawsfs, archives, work, exported, seeded):  # noqa: F811
    """A client that keeps one descriptor (as llama.cpp keeps its mapping) and opens
    nothing more: the daemon watches the sealed file, so an edit past the seal is put
    right within moments, and the old descriptor reads the export's bytes again."""
    data, ref = seeded, exported / GGUF
    with tiered(cawsfs, archive_of(archives), work / "mnt", data.parent) as m:
        fd = open_passthrough(m, ref)
        try:
            assert bounded(["chattr", "-i", data], CLI_S).returncode == 0
            p = dd_byte(data, 5000, other_byte(ref, 5000))
            assert p.returncode == 0, p.stderr.decode()
            assert wait_ok(lambda: m.stat()["tier"].get("tampered") == 1
                           and "i" in lsattr_flags(data), 10), m.stat()["tier"]
            assert within(READ_S, "reading the old descriptor", fd_mismatch, fd, ref) is None
        finally:
            os.close(fd)


# --- 4. a data file that is a symlink out of the tier --------------------------------


def test_a_symlinked_data_file_is_never_written_through(cawsfs, archives, work, exported, seeded):  # noqa: F811
    """T/K.data replaced by a symlink to a file outside the tier (its index kept): the
    mount serves the export's bytes and the file pointed at keeps its bytes and size."""
    victim = work / "victim.bin"
    content = os.urandom(1 << 20)
    victim.write_bytes(content)
    seeded.unlink()
    seeded.symlink_to(victim)
    with tiered(cawsfs, archive_of(archives), work / "mnt", seeded.parent) as m:
        assert same_within(m.mp / GGUF, exported / GGUF)
    assert victim.stat().st_size == len(content), victim.stat().st_size
    intact = victim.read_bytes() == content
    assert intact, "the file a tier symlink points at was written"


def test_a_symlinked_label_is_never_written_through(cawsfs, archives, work, exported, seeded):  # noqa: F811
    """T/K.json (the label `tier ls` shows) replaced by a symlink to a file outside the
    tier, and the index removed so that the entry is made and labelled again: the file
    pointed at keeps its bytes. Not in issue 58's list: the same hole as case 4, in the
    label's write."""
    victim = work / "victim.txt"
    victim.write_text("keep me\n")
    label = seeded.with_suffix(".json")
    label.unlink()
    label.symlink_to(victim)
    seeded.with_suffix(".idx").unlink()
    with tiered(cawsfs, archive_of(archives), work / "mnt", seeded.parent) as m:
        assert same_within(m.mp / "config.json", exported / "config.json", CLI_S)
    assert victim.read_text() == "keep me\n"


# --- 5. an index that never ends -----------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "chardev"])
def test_an_endless_index_is_not_read_whole(cawsfs, archives, work, exported, seeded, kind):  # noqa: F811
    """T/K.idx replaced by a symlink to /dev/zero, or by a character device (1, 5): the
    mount starts, the daemon's resident memory stays under 1 GiB, bytes are right."""
    idx = seeded.with_suffix(".idx")
    idx.unlink()
    if kind == "symlink":
        idx.symlink_to("/dev/zero")
    else:
        os.mknod(idx, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    mp = work / "mnt"
    with RssWatch(mp) as w:
        try:
            with tiered(cawsfs, archive_of(archives), mp, seeded.parent) as m:
                assert same_within(m.mp / GGUF, exported / GGUF)
                w.peak = max(w.peak, vmrss(m.pid))
        finally:
            assert not w.killed, f"daemon killed at {w.peak >> 20} MiB resident"
    assert 0 < w.peak < RSS_LIMIT, w.peak


# --- 6. data files that are not files; tier paths that are not directories -----------


@pytest.mark.parametrize("kind", ["directory", "fifo", "devzero"])
def test_a_data_file_of_another_kind_costs_only_its_entry(cawsfs, archives, work, exported, seeded, kind):  # noqa: F811
    """T/K.data replaced by a (non-empty) directory, a FIFO or a symlink to /dev/zero:
    the mount starts and serves the export's bytes, and its log names the entry in at
    most 3 lines (no line per extent or per read)."""
    data = seeded
    data.unlink()
    if kind == "directory":
        data.mkdir()
        (data / "inside").write_bytes(b"x")
    elif kind == "fifo":
        os.mkfifo(data)
    else:
        data.symlink_to("/dev/zero")
    with tiered(cawsfs, archive_of(archives), work / "mnt", data.parent) as m:
        assert same_within(m.mp / GGUF, exported / GGUF)
        assert same_within(m.mp / GGUF, exported / GGUF)
    lines = log_mentions(m.log, data.stem)
    assert len(lines) <= 3, "\n".join(lines[:20])
    assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)


def hostile_tier_path(work, kind):
    if kind == "dangling":
        p = work / "t-1"
        p.symlink_to(work / "nowhere")
    elif kind == "loop":
        p, q = work / "t-2", work / "t-3"
        p.symlink_to(q)
        q.symlink_to(p)
    elif kind == "devnull":
        p = Path("/dev/null")
    else:
        p = work / "t-4"
        p.write_text("not a directory\n")
    return p


WHAT_IS_WRONG = {
    "dangling": ("dangling", "does not exist", "no such file", "points nowhere", "broken"),
    "loop": ("loop", "too many levels"),
    "devnull": ("not a directory",),
    "file": ("not a directory",),
}


@pytest.mark.parametrize("kind", ["dangling", "loop", "devnull", "file"])
def test_a_tier_path_that_is_not_a_directory_fails_the_mount(cawsfs, archives, work, kind):
    """`--disk-cache P` where P is a dangling symlink, a symlink loop, /dev/null or a
    regular file: the mount fails, its last stderr line names P and says what is wrong
    (not "File exists"), nothing is mounted and nothing is made where P points."""
    p = hostile_tier_path(work, kind)
    mp = work / "mnt"
    mp.mkdir()
    r = bounded([cawsfs, "mount", archive_of(archives), mp, "--disk-cache", p], MOUNT_S)
    lines = message(r)
    assert r.returncode != 0 and lines, (r.returncode, r.stdout, r.stderr)
    last = lines[-1]
    assert str(p) in last, last
    said = without(last, p, work).lower()
    assert any(w in said for w in WHAT_IS_WRONG[kind]), last
    assert "os error 17" not in r.stderr and "File exists" not in r.stderr, r.stderr
    assert not is_mounted(mp)
    assert not os.path.lexists(work / "nowhere")


def test_a_tier_others_can_write_fails_the_mount(cawsfs, archives, work):
    """A tier directory of mode 0777 (anyone could plant files in it): the mount fails
    with one line naming it and saying it is writable."""
    t = work / "t777"
    t.mkdir()
    os.chmod(t, 0o777)
    mp = work / "mnt"
    mp.mkdir()
    r = bounded([cawsfs, "mount", archive_of(archives), mp, "--disk-cache", t], MOUNT_S)
    lines = message(r)
    assert r.returncode != 0 and len(lines) == 1, (r.returncode, r.stderr)
    assert str(t) in lines[0] and "writable" in without(lines[0], t), lines[0]
    assert not is_mounted(mp)


def test_clear_passes_over_a_directory_named_like_a_data_file(cawsfs, work):
    """`tier clear` with a non-empty directory named KEY.data in the tier exits 0 (and
    never follows what is inside it); `tier ls` too."""
    t = work / "t-clear"
    t.mkdir(mode=0o700)
    d = t / f"{secrets.token_hex(16)}.data"
    d.mkdir()
    (d / "inside").write_bytes(b"x")
    victim = work / "victim.bin"
    victim.write_bytes(b"keep me")
    (d / "link").symlink_to(victim)
    for args in (["clear"], ["ls", "--json"], ["gc", "--max-size", "1"]):
        p = bounded([cawsfs, "tier", *args, "--dir", t], CLI_S)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    assert victim.read_bytes() == b"keep me"


# --- 7. a full disk, and stale temporary files ---------------------------------------


def test_a_full_disk_then_space_back_ends_with_a_published_tier(cawsfs, archives, work, exported):  # noqa: F811
    """The tier on a 150 MiB tmpfs filled to ~8 MiB free: model.gguf still reads right;
    with the space back (the filler deleted) the extents that found no room are made
    again without any read, the file becomes whole in the tier, the index is published
    and no temporary file is left; the next mount serves it from the tier.
    (--disk-cache-size is given: the default, a fifth of the free space at mount,
    would keep the writer under 2 MiB and never meet the full disk.)"""
    small = work / "small"
    small.mkdir()
    r = bounded(["mount", "-t", "tmpfs", "-o", "size=150m,mode=0700", "tmpfs", small], CLI_S)
    assert r.returncode == 0, r.stderr
    ref = exported / GGUF
    try:
        T = small / "t"
        T.mkdir(mode=0o700)
        filler = small / "filler"
        v = os.statvfs(small)
        free = v.f_bavail * v.f_frsize
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, free - (8 << 20))
        args = ("--disk-cache-size", "1GiB")
        with tiered(cawsfs, archive_of(archives), work / "mnt", T, *args) as m:
            assert same_within(m.mp / GGUF, ref)
            t = m.stat()["tier"]
            assert t["write_errors"] > 0 and t["whole_files"] == 0, t
            filler.unlink()
            # No read asks for it: the writer makes again what found no room.
            wait_ok(lambda: m.stat()["tier"]["whole_files"] >= 1, 30)
            assert m.stat()["tier"]["whole_files"] >= 1, m.stat()["tier"]
            assert same_within(m.mp / GGUF, ref)
        K = entry_of(T, ref.stat().st_size).stem
        idx = T / f"{K}.idx"
        assert idx.exists() and idx.stat().st_size > 0, sorted(os.listdir(T))
        tmp = [n for n in os.listdir(T) if n.endswith(".tmp")]
        assert not tmp, tmp
        with tiered(cawsfs, archive_of(archives), work / "mnt", T, *args) as m:
            assert same_within(m.mp / GGUF, ref)
            t = m.stat()["tier"]
            assert t["whole_files"] >= 1 and t["bad_extents"] == 0, t
    finally:
        force_release(work / "mnt")
        force_release(small)


def test_stale_temporary_index_files_are_removed_at_mount(cawsfs, archives, work, exported, seeded):  # noqa: F811
    """T/K.idx.12345.tmp and T/K.idx.tmp (empty, left by a crash) are gone once a mount
    of the entry has started; the mount serves the export's bytes."""
    T, K = seeded.parent, seeded.stem
    stale = [T / f"{K}.idx.12345.tmp", T / f"{K}.idx.tmp"]
    for s in stale:
        s.write_bytes(b"")
    with tiered(cawsfs, archive_of(archives), work / "mnt", T) as m:
        wait_ok(lambda: not any(s.exists() for s in stale), 2)
        left = [s.name for s in stale if s.exists()]
        assert not left, left
        assert same_within(m.mp / GGUF, exported / GGUF)


# --- 8. command-line edges -----------------------------------------------------------


def without(line, *paths):
    """`line` less the paths it names, so that words looked for in it are not found in
    a path (a test's directory is named after the test)."""
    for p in sorted(map(str, paths), key=len, reverse=True):
        line = line.replace(p, "<path>")
    return line


def one_line_error(r, path, *words):
    """`r` failed with one line of error naming `path` and saying each of `words` (found
    outside the path); returns that line less the path."""
    lines = message(r)
    assert r.returncode != 0, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1, r.stderr
    assert path is None or str(path) in lines[0], (str(path), lines[0])
    said = without(lines[0], path) if path is not None else lines[0]
    for w in words:
        assert w in said, (w, lines[0])
    assert "panicked" not in r.stderr
    return said


def test_a_missing_mountpoint_is_named(cawsfs, archives, work):
    mp = work / "no-such" / "dir"
    r = bounded([cawsfs, "mount", archive_of(archives), mp, "--no-disk-cache"], MOUNT_S)
    one_line_error(r, mp, "does not exist")


def test_a_stale_mountpoint_says_to_umount(cawsfs, archives, work):
    """The mount point of a SIGKILLed daemon: mounting there again fails with one line
    naming it as stale / pointing at `cawsfs umount`; after that umount a mount there
    works."""
    mp = work / "mnt-dead"
    m = Daemon(cawsfs, archive_of(archives), mp, "--no-disk-cache")
    os.kill(m.pid, signal.SIGKILL)
    assert gone(m.pid)
    r = bounded([cawsfs, "mount", archive_of(archives), mp, "--no-disk-cache"], MOUNT_S)
    said = one_line_error(r, mp)
    assert "stale" in said or "cawsfs umount" in said, said
    p = bounded([cawsfs, "umount", mp], UMOUNT_S)
    assert p.returncode == 0, p.stderr
    with mounted(cawsfs, archive_of(archives), mp, "--no-disk-cache") as m:
        assert GGUF in within(CLI_S, "listing the new mount", os.listdir, m.mp)


def test_export_onto_a_directory_fails_and_leaves_no_temporary(cawsfs, archives, work):
    parent = work / "exp"
    out = parent / "out"
    out.mkdir(parents=True)
    r = bounded([cawsfs, "export", archive_of(archives), "--format", "gguf", "-o", out], READ_S)
    one_line_error(r, out)
    assert sorted(os.listdir(parent)) == ["out"], os.listdir(parent)
    assert os.listdir(out) == []


def test_a_mountpoint_with_files_needs_nonempty(cawsfs, archives, work):
    mp = work / "mnt-full"
    mp.mkdir()
    (mp / "mine.txt").write_text("mine")
    r = bounded([cawsfs, "mount", archive_of(archives), mp, "--no-disk-cache"], MOUNT_S)
    one_line_error(r, mp, "not empty")
    assert not is_mounted(mp)
    with mounted(cawsfs, archive_of(archives), mp, "--no-disk-cache", "--nonempty") as m:
        assert GGUF in within(CLI_S, "listing the mount", os.listdir, m.mp)
    assert (mp / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("args,needles", [
    (["--cache-size", "1"], ["cache-size"]),
    (["--threads", "0"], ["threads"]),
    (["--gguf-type", "nope"], ["nope", "q2_k"]),
], ids=["cache-size", "threads", "gguf-type"])
def test_unusable_mount_options_are_one_line_errors(cawsfs, archives, work, args, needles):
    mp = work / "mnt-opt"
    mp.mkdir()
    r = bounded([cawsfs, "mount", archive_of(archives), mp, "--no-disk-cache", *args], MOUNT_S)
    one_line_error(r, None, *needles)
    assert not is_mounted(mp)


def test_a_data_file_truncated_under_a_live_mount(cawsfs, archives, work, exported, seeded):  # noqa: F811
    """T/K.data truncated to 0 bytes while a --no-passthrough mount serves it from the
    tier: a whole read still equals the export, and the log names the entry in at most
    3 lines."""
    with tiered(cawsfs, archive_of(archives), work / "mnt", seeded.parent, "--no-passthrough") as m:
        os.truncate(seeded, 0)
        assert same_within(m.mp / GGUF, exported / GGUF)
    lines = log_mentions(m.log, seeded.stem)
    assert len(lines) <= 3, "\n".join(lines[:20])


# --- 9. a daemon killed while it writes the tier -------------------------------------


@pytest.mark.parametrize("after", [0.2, 0.6, 1.5])
def test_sigkill_during_tier_writes(cawsfs, archives, work, exported, tier, after):  # noqa: F811
    """The daemon SIGKILLed `after` s into a first read of model.gguf (a fresh tier,
    being written): once the dead mount is cleaned up, a new mount reads the export's
    bytes and `tier ls --json` finishes."""
    ref, mp = exported / GGUF, work / "mnt"
    m = Daemon(cawsfs, archive_of(archives), mp, "--cache-size", "64MiB", "--disk-cache", tier)
    reader = subprocess.Popen(["cmp", m.mp / GGUF, ref], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(after)
        os.kill(m.pid, signal.SIGKILL)
        assert gone(m.pid)
        try:
            reader.wait(timeout=CLI_S)
        except subprocess.TimeoutExpired:
            raise AssertionError("a read of the killed mount is still blocked") from None
    finally:
        if reader.poll() is None:
            reader.kill()
    if bounded([cawsfs, "umount", mp], UMOUNT_S).returncode != 0:
        bounded(["fusermount3", "-uz", mp], CLI_S)
    assert not is_mounted(mp)
    with tiered(cawsfs, archive_of(archives), mp, tier) as m:
        assert same_within(m.mp / GGUF, ref)
    p = bounded([cawsfs, "tier", "ls", "--dir", tier, "--json"], CLI_S)
    assert p.returncode == 0, p.stderr
    entries = json.loads(p.stdout)
    assert any(e["file"] == GGUF for e in entries) and not any(e["in_use"] for e in entries), entries


def test_a_daemon_killed_while_the_kernel_reads_a_tier_file_leaves_a_usable_tier(
        cawsfs, archives, work, exported, seeded):  # noqa: F811
    """SIGKILL while model.gguf is open through passthrough (its tier file sealed, so
    the seal outlives the daemon): the next mount starts and serves the export's bytes,
    and once it has unmounted cleanly `tier clear` removes the entry (a leftover seal
    makes the tier neither unusable nor unremovable). Not in issue 58's list: the
    consequence of sealing that its cases 3 and 9 meet together."""
    data, ref, mp = seeded, exported / GGUF, work / "mnt"
    m = Daemon(cawsfs, archive_of(archives), mp, "--cache-size", "64MiB", "--disk-cache", data.parent)
    fd = open_passthrough(m, ref)
    try:
        os.kill(m.pid, signal.SIGKILL)
        assert gone(m.pid)
    finally:
        os.close(fd)
    if bounded([cawsfs, "umount", mp], UMOUNT_S).returncode != 0:
        bounded(["fusermount3", "-uz", mp], CLI_S)
    assert not is_mounted(mp)
    with tiered(cawsfs, archive_of(archives), mp, data.parent) as m:
        assert same_within(m.mp / GGUF, ref)
    p = bounded([cawsfs, "tier", "clear", "--dir", data.parent], CLI_S)
    assert p.returncode == 0, p.stderr
    assert not os.path.lexists(data), (sorted(os.listdir(data.parent)), lsattr_flags(data))

"""The daemon's life at its edges: a stop signal while a file on the mount is open
leaves the mount point usable, `cawsfs umount` returns only once the daemon is gone,
neither logs a false alarm, and the client refuses a control socket served by
another user."""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import run, run_status
from test_mount import Mount


@pytest.fixture(scope="module")
def exact(cawsfs, model_gguf, shelf):
    """The test model, bit-exact (fast to convert)."""
    path = shelf / "life-exact.cawsf"
    run([cawsfs, "convert", model_gguf, "-o", path, "--passthrough", "*"])
    return path


def alive(pid):
    """Whether `pid` runs (a zombie has exited; only its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def mounted_at(mp):
    """Whether anything is mounted at `mp`, from /proc/self/mountinfo (never stat'ing
    `mp`, which would fail on a dead mount)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(mp) for line in f)


def log_of(m):
    return open(m.socket[: -len(".sock")] + ".log").read()


def wait_gone(pid, secs=20):
    end = time.monotonic() + secs
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_with_an_open_file_leaves_the_mount_point_usable(cawsfs, exact, work, sig):
    mp = work / f"mnt-life-{sig.name}"
    m = Mount(cawsfs, exact, mp)
    fd = os.open(mp / "model.gguf", os.O_RDONLY)
    try:
        assert len(os.pread(fd, 4096, 0)) == 4096
        os.kill(m.pid, sig)
        assert wait_gone(m.pid), "daemon still running after the signal"
        assert os.listdir(mp) == []  # not ENOTCONN
        assert not mounted_at(mp)
        # The open file is cut off, not served stale.
        with pytest.raises(OSError):
            os.pread(fd, 4096, 64 << 20)
    finally:
        # close() flushes through FUSE, which answers ENOTCONN once the daemon is gone.
        try:
            os.close(fd)
        except OSError:
            pass
    log = log_of(m)
    assert "busy (a file is still open), detached it lazily" in log, log
    assert "Unmount failed" not in log and "WARN fuser" not in log, log
    # The mount point takes a new mount.
    m = Mount(cawsfs, exact, mp)
    m.close()


def test_stop_signal_without_open_files_unmounts_plainly(cawsfs, exact, work):
    m = Mount(cawsfs, exact, work / "mnt-life-plain")
    assert (m.mp / "config.json").read_bytes()
    os.kill(m.pid, signal.SIGTERM)
    assert wait_gone(m.pid)
    assert not mounted_at(m.mp) and os.listdir(m.mp) == []
    log = log_of(m)
    assert "lazily" not in log and "WARN" not in log, log


def test_umount_returns_after_the_daemon_exits(cawsfs, exact, work):
    mp = work / "mnt-life-umount"
    for _ in range(3):
        m = Mount(cawsfs, exact, mp, "--cache-size", "256MiB")
        # A full cache makes the daemon's exit take longest.
        assert len((mp / "model.gguf").read_bytes()) > 0
        p = run([cawsfs, "umount", mp])
        assert not alive(m.pid), "cawsfs umount returned while its daemon still ran"
        assert p.stderr == "", p.stderr
        assert not mounted_at(mp)
        log = log_of(m)
        assert "Unmount failed" not in log and "WARN" not in log, log


def test_umount_refuses_a_busy_mount_and_leaves_it_serving(cawsfs, exact, work):
    m = Mount(cawsfs, exact, work / "mnt-life-busy")
    with open(m.mp / "config.json", "rb") as f:
        p = run_status([cawsfs, "umount", m.mp])
        assert p.returncode != 0 and "still using it" in p.stderr, p.stderr
        assert alive(m.pid) and m.stat()
    m.close()


def test_client_refuses_a_socket_served_by_another_user(cawsfs, work):
    if os.geteuid() != 0:
        pytest.skip("needs root to serve a socket as another user")
    # World-writable like /tmp, and reachable by the other user (pytest's own
    # directories are private).
    d = Path(tempfile.mkdtemp(prefix="cawsfs-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    sock = d / "c.sock"
    # A fake daemon of uid 65534 that answers every line with a pong.
    server = subprocess.Popen(
        ["python3", "-c", f"""
import os, socket
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX); s.bind({str(sock)!r}); os.chmod({str(sock)!r}, 0o777)
s.listen(); print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        c.recv(4096); c.sendall(b'{{"ok":true,"pong":true}}\\n')
    except OSError:
        pass
    c.close()
"""],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        with socket.socket(socket.AF_UNIX) as s:  # it does answer
            s.connect(str(sock))
        p = run_status([cawsfs, "stat", work, "--socket", sock])
        assert p.returncode != 0
        assert p.stderr.strip() == (
            f"cawsfs: error: refusing the control socket {sock}: its server runs as "
            f"uid 65534, not as us (uid 0) or root"), p.stderr
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(d)

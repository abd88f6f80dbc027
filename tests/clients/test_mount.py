"""The mount: virtual files served over FUSE from a .cawsf archive, read by real
clients (llama.cpp through mmap, transformers, safetensors), compared byte for byte
with `cawsfs export`, under concurrency, a tiny cache budget and a corrupt block."""
import errno
import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest
from safetensors import safe_open

from conftest import PROMPT, corrupt_block, llama_generate, pread_eio_offsets, run, run_status

FILES = ["model.gguf", "model.safetensors", "config.json", "tokenizer.json",
         "tokenizer_config.json", "generation_config.json"]


class Mount:
    def __init__(self, cawsfs, archive, mp, *args):
        self.cawsfs, self.mp = cawsfs, mp
        mp.mkdir(parents=True, exist_ok=True)
        out = run([cawsfs, "mount", archive, mp, *args]).stdout
        self.pid = int(re.search(r"pid (\d+)", out).group(1))
        self.socket = re.search(r"socket (\S+),", out).group(1)

    def stat(self):
        return json.loads(run([self.cawsfs, "stat", self.mp, "--json"]).stdout)

    def request(self, line):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.socket)
            s.sendall(line)
            return json.loads(s.makefile().readline())

    def close(self):
        run([self.cawsfs, "umount", self.mp])
        for _ in range(100):
            if not os.path.exists(f"/proc/{self.pid}"):
                break
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{self.pid}"), "daemon still running after umount"


@pytest.fixture(scope="module")
def exported(cawsfs, archives, shelf):
    """The reference bytes: `cawsfs export` of each layout of the default archive."""
    path, _ = archives["default"]
    d = shelf / "ref-hf"
    run([cawsfs, "export", path, "--format", "hf-dir", "-o", d])
    run([cawsfs, "export", path, "--format", "gguf", "-o", d / "model.gguf"])
    return d


@pytest.fixture(scope="module")
def mounted(cawsfs, archives, shelf):
    # These tests watch the daemon's cache: without a disk tier, since a file read
    # whole into the tier is then opened with passthrough and its reads bypass it.
    m = Mount(cawsfs, archives["default"][0], shelf / "mnt", "--cache-size", "1GiB", "--no-disk-cache")
    yield m
    m.close()


def test_listing_and_sizes(mounted, exported):
    names = sorted(os.listdir(mounted.mp))
    assert names == sorted(FILES), names
    for f in FILES:
        assert os.stat(mounted.mp / f).st_size == os.stat(exported / f).st_size, f
    with pytest.raises(OSError) as e:
        open(mounted.mp / "model.gguf", "r+b")
    assert e.value.errno in (errno.EROFS, errno.EACCES)
    assert not os.path.exists(mounted.mp / "nope.bin")


def test_files_equal_export(mounted, exported):
    for f in FILES:
        assert subprocess.run(["cmp", mounted.mp / f, exported / f]).returncode == 0, f


def test_llama_cpp_reads_the_mount(mounted, exported, llama_bin):
    """llama.cpp mmaps model.gguf from the mount; same tokens as on the exported file."""
    via_mount, _ = llama_generate(llama_bin, mounted.mp / "model.gguf")
    via_file, _ = llama_generate(llama_bin, exported / "model.gguf")
    assert via_mount == via_file
    assert via_mount.startswith(PROMPT) and len(via_mount.split()) > 8


def test_transformers_and_safetensors_read_the_mount(mounted, exported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mounted.mp)
    model = AutoModelForCausalLM.from_pretrained(mounted.mp, torch_dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert len(tok.decode(out[0][ids.shape[1]:]).split()) >= 2
    with safe_open(str(mounted.mp / "model.safetensors"), "np") as a, \
            safe_open(str(exported / "model.safetensors"), "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k))


def test_concurrent_random_reads(cawsfs, archives, work, exported):
    """Thousands of random reads from 8 threads on a fresh mount equal the export."""
    m = Mount(cawsfs, archives["default"][0], work / "mnt-rand", "--cache-size", "64MiB")
    try:
        errors = []

        def worker(seed):
            rng = random.Random(seed)
            name = "model.gguf" if seed % 2 else "model.safetensors"
            ref = open(exported / name, "rb")
            fd = os.open(m.mp / name, os.O_RDONLY)
            size = os.fstat(fd).st_size
            try:
                for _ in range(400):
                    length = rng.choice([1, 100, 4096, 65536, 1 << 20, rng.randrange(1, 3 << 20)])
                    off = rng.randrange(0, size)
                    got = os.pread(fd, length, off)
                    ref.seek(off)
                    if got != ref.read(length):
                        errors.append((name, off, length))
            finally:
                os.close(fd)
                ref.close()

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        st = m.stat()
        assert st["cache"]["bytes_used"] <= st["cache"]["budget"]
    finally:
        m.close()


def rss_sampler(pid, stop, peak):
    while not stop.is_set():
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            return
        anon = int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) * 1024
        peak["anon"] = max(peak.get("anon", 0), anon)
        time.sleep(0.02)


def random_preads(path, ref_path, n, seed):
    """`n` preads of 4 KiB, 64 KiB or 1 MiB at random offsets, each checked."""
    rng = random.Random(seed)
    fd, ref = os.open(path, os.O_RDONLY), open(ref_path, "rb")
    try:
        size = os.fstat(fd).st_size
        for _ in range(n):
            ln, off = rng.choice([4096, 65536, 1 << 20]), rng.randrange(size)
            ref.seek(off)
            assert os.pread(fd, ln, off) == ref.read(ln), (path, off, ln)
    finally:
        os.close(fd)
        ref.close()


def sampled_peak(pid, work):
    """Run `work()` while sampling the daemon's RssAnon; return the peak in bytes."""
    stop, peak = threading.Event(), {}
    sampler = threading.Thread(target=rss_sampler, args=(pid, stop, peak))
    sampler.start()
    try:
        work()
    finally:
        stop.set()
        sampler.join()
    return peak["anon"]


def test_small_budget_serves_everything_within_budget(cawsfs, archives, work, exported):
    """A 16 MiB cache for a 270 MB file: every byte still right, and the daemon's
    anonymous resident memory stays under budget + 24 MiB (the reliability issue's
    target) for sequential and random reads, before and after the router's tokenizer
    is loaded (it is charged to the budget)."""
    budget, target = 16 << 20, 24 << 20
    m = Mount(cawsfs, archives["default"][0], work / "mnt-small", "--cache-size", "16MiB")
    try:
        # Before any read: the fixed part (model description, layouts' compressed
        # headers and tokenizer.json) once the heap the setup fragmented is trimmed.
        for _ in range(30):  # the daemon trims right after it starts serving
            status = open(f"/proc/{m.pid}/status").read()
            idle = int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) << 10
            if idle < 12 << 20:
                break
            time.sleep(0.1)
        print(f"idle RssAnon {idle / 2**20:.1f} MiB")
        assert idle < 12 << 20, f"idle RssAnon {idle / 2**20:.1f} MiB"

        def reads():
            for f in ("model.gguf", "model.safetensors"):
                assert subprocess.run(["cmp", m.mp / f, exported / f]).returncode == 0, f
            random_preads(m.mp / "model.safetensors", exported / "model.safetensors", 600, 1)

        peak = sampled_peak(m.pid, reads)
        st = m.stat()["cache"]
        assert st["evictions"] > 0 and st["bytes_used"] <= budget, st
        print(f"reads: peak RssAnon {peak / 2**20:.1f} MiB, budget + {(peak - budget) / 2**20:.1f} MiB")
        assert peak - budget < target, peak

        # A route loads the tokenizer (~9 MiB for this 49 k-token vocabulary): charged
        # to the budget, so the same reads leave the same margin. Its load briefly
        # holds ~24 MB (tokenizer.json derived from the GGUF vocabulary, then parsed):
        # the cache makes room for that first.
        route = [cawsfs, "route", m.mp, "-p", "The capital of France is"]
        peak = sampled_peak(m.pid, lambda: subprocess.run(route, capture_output=True, check=True))
        print(f"first route: peak RssAnon {peak / 2**20:.1f} MiB, budget + {(peak - budget) / 2**20:.1f} MiB")
        assert peak - budget < target, peak
        st = m.stat()["cache"]
        # What the load set aside is given back; what the tokenizer keeps stays charged.
        assert 4 << 20 < st["charged_bytes"] < 12 << 20, st
        assert st["bytes_used"] + st["charged_bytes"] <= budget, st
        time.sleep(0.5)

        def reads_and_control():
            for _ in range(20):
                m.stat()
            # Abuse beside the reads: many connections at once, each with a request
            # line just under the 64 KiB limit, half of them malformed, half never
            # ending (the daemon buffers each until the line ends or the limit).
            conns = []
            for i in range(48):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(m.socket)
                junk = b"{" + b"x" * (60 << 10)
                c.sendall(junk + b"\n" if i % 2 else junk)
                conns.append(c)
            reads()
            assert m.stat()["cache"]["bytes_used"] <= budget
            for c in conns:
                c.close()

        peak = sampled_peak(m.pid, reads_and_control)
        st = m.stat()["cache"]
        assert st["bytes_used"] + st["charged_bytes"] <= budget, st
        print(f"after a route: peak RssAnon {peak / 2**20:.1f} MiB, budget + {(peak - budget) / 2**20:.1f} MiB")
        assert peak - budget < target, peak
    finally:
        m.close()


def test_corrupt_block_gives_eio_only_there(cawsfs, archives, work, exported):
    path, _ = archives["default"]
    bad = work / "corrupt.cawsf"
    corrupt_block(cawsfs, path, bad, "model.layers.10.mlp.up_proj.weight", 3)
    m = Mount(cawsfs, bad, work / "mnt-bad", "--cache-size", "64MiB")
    try:
        name = "model.safetensors"
        failed = pread_eio_offsets(m.mp / name, (exported / name).read_bytes())
        # Only the reads that cover the bad block fail (a 1 MiB read spans ≤ 2 of them).
        assert 1 <= len(failed) <= 2, failed
        assert m.stat()["cache"]["bytes_served"] > 0  # the daemon is still serving
        log = open(m.socket.replace(".sock", ".log")).read()
        assert "model.layers.10.mlp.up_proj.weight" in log and "block 3" in log, log[-2000:]
    finally:
        m.close()


def test_second_read_is_a_hit(mounted):
    fd = os.open(mounted.mp / "model.safetensors", os.O_RDONLY)
    try:
        off = 100 << 20
        # Start cold: empty the daemon's cache and the kernel's page cache for the range.
        assert mounted.request(b'{"verb":"evict"}\n')["ok"] is True
        os.posix_fadvise(fd, off, 65536, os.POSIX_FADV_DONTNEED)
        before = mounted.stat()["cache"]
        first = os.pread(fd, 65536, off)
        # Drop the kernel's page cache for the range so the daemon sees the read again.
        os.posix_fadvise(fd, off, 65536, os.POSIX_FADV_DONTNEED)
        mid = mounted.stat()["cache"]
        second = os.pread(fd, 65536, off)
        after = mounted.stat()["cache"]
    finally:
        os.close(fd)
    assert first == second
    assert mid["bytes_served"] > before["bytes_served"] and mid["misses"] > before["misses"]
    assert after["hits"] > mid["hits"] and after["misses"] == mid["misses"], (before, mid, after)
    text = run([mounted.cawsfs, "stat", mounted.mp]).stdout
    assert "hit ratio" in text and "model.safetensors" in text
    try:
        subprocess.run([mounted.cawsfs, "stat", mounted.mp, "--watch", "--interval", "0.2"],
                       capture_output=True, text=True, timeout=1.5)
    except subprocess.TimeoutExpired as e:
        frames = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        assert frames.count("\x1b[H") >= 3 and "hit ratio" in frames, frames[:500]
    else:
        raise AssertionError("stat --watch exited by itself")
    prom = run([mounted.cawsfs, "stat", mounted.mp, "--prometheus"]).stdout
    assert re.search(r"^cawsfs_cache_hits_total \d+", prom, re.M)


def test_control_socket(mounted):
    mode = os.stat(mounted.socket).st_mode & 0o777
    assert mode == 0o600, oct(mode)
    for bad in (b"not json\n", b'{"verb":"frobnicate"}\n', b'{"verb":"prefetch","tensor":7}\n',
                b'{"verb":"pin","tensor":"no.such.tensor"}\n'):
        r = mounted.request(bad)
        assert r["ok"] is False and r["error"], (bad, r)
    assert mounted.request(b'{"verb":"ping"}\n')["ok"] is True
    r = mounted.request(b'{"verb":"prefetch","layer":3}\n')
    assert r["ok"] is True and r["queued_chunks"] >= 0


def test_sigterm_unmounts_and_exits_zero(cawsfs, archives, work):
    mp = work / "mnt-fg"
    mp.mkdir(exist_ok=True)
    p = subprocess.Popen([cawsfs, "mount", archives["default"][0], mp, "--foreground"],
                         stderr=subprocess.PIPE, text=True)
    for _ in range(200):
        if "model.gguf" in (os.listdir(mp) if os.path.ismount(mp) else []):
            break
        time.sleep(0.05)
    assert os.path.ismount(mp)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 0, p.stderr.read()
    assert not os.path.ismount(mp)


def test_mount_errors(cawsfs, work):
    bad = work / "garbage.cawsf"
    bad.write_bytes(b"garbage" * 100)
    mp = work / "mnt-err"
    mp.mkdir(exist_ok=True)
    p = run_status([cawsfs, "mount", bad, mp])
    assert p.returncode != 0 and "garbage.cawsf" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = run_status([cawsfs, "mount", bad, work / "no-such-dir"])
    assert p.returncode != 0
    p = run_status([cawsfs, "stat", mp])
    assert p.returncode != 0 and "mounted" in p.stderr
    p = run_status([cawsfs, "umount", mp])
    assert p.returncode != 0 and "not a cawsfs mount" in p.stderr


def test_umount_cleans_up_after_a_crashed_daemon(cawsfs, archives, work):
    mp = work / "mnt-crash"
    m = Mount(cawsfs, archives["default"][0], mp)
    os.kill(m.pid, signal.SIGKILL)
    time.sleep(0.3)
    with pytest.raises(OSError) as e:
        os.listdir(mp)
    assert e.value.errno == errno.ENOTCONN
    run([cawsfs, "umount", mp])
    assert os.listdir(mp) == []


def test_prefetch_pin_unpin_evict_from_the_cli(cawsfs, archives, work):
    """Pinned chunks survive a read pattern that evicts everything else; pinning past
    the budget is refused and the daemon keeps serving."""
    m = Mount(cawsfs, archives["default"][0], work / "mnt-pin", "--cache-size", "32MiB")
    try:
        name = "model.layers.0.self_attn.q_proj.weight"
        assert json.loads(run([cawsfs, "pin", m.mp, "--tensor", name]).stdout)["pinned_chunks"] > 0
        pinned = m.stat()["cache"]["pinned_bytes"]
        assert pinned > 0
        for _ in range(100):  # pin queues the loads; wait for them
            if m.stat()["cache"]["pinned_resident_bytes"] == pinned:
                break
            time.sleep(0.05)
        # Stream both big files through a 32 MiB cache: everything unpinned is evicted.
        for f in ("model.gguf", "model.safetensors"):
            with open(m.mp / f, "rb") as fh:
                while fh.read(1 << 20):
                    pass
        st = m.stat()["cache"]
        assert st["evictions"] > 0 and st["pinned_bytes"] == pinned and st["bytes_used"] <= 32 << 20
        # Pinning loads the chunks; after the scan they are all still resident.
        assert st["pinned_resident_bytes"] == pinned, st
        over = run_status([cawsfs, "pin", m.mp, "--file", "model.gguf"])
        assert over.returncode != 0 and "budget" in over.stderr
        assert m.stat()["cache"]["pinned_bytes"] == pinned  # all or nothing
        q = json.loads(run([cawsfs, "prefetch", m.mp, "--layer", "2"]).stdout)["queued_chunks"]
        assert q > 0
        assert json.loads(run([cawsfs, "unpin", m.mp, "--tensor", name]).stdout)["unpinned_chunks"] > 0
        assert m.stat()["cache"]["pinned_bytes"] == 0
        # Evict by selector frees only that tensor's chunks (layer 2 was just prefetched);
        # then evict everything.
        for _ in range(200):
            c = m.stat()["cache"]
            if c["prefetch_queue_len"] == 0 and c["loads_in_flight"] == 0:
                break
            time.sleep(0.05)
        used = m.stat()["cache"]["bytes_used"]
        freed = json.loads(run([cawsfs, "evict", m.mp, "--tensor", "model.layers.2.mlp.down_proj.weight"]).stdout)["freed_bytes"]
        assert 0 < freed < used, (freed, used)
        assert m.stat()["cache"]["bytes_used"] == used - freed
        assert json.loads(run([cawsfs, "evict", m.mp]).stdout)["freed_bytes"] == used - freed
        assert m.stat()["cache"]["bytes_used"] == 0
        assert run_status([cawsfs, "prefetch", m.mp, "--tensor", "no.such"]).returncode != 0
    finally:
        m.close()

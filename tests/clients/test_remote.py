"""Archives in object storage (docs/REMOTE.md): an S3 server (s3s-fs, SigV4 checked)
and an HTTP server (nginx) started by the tests; the mount, export and verify read the
archive by range and serve exactly what the local archive serves. A replaced object,
a server that goes away, wrong credentials: EIO or one line, never wrong bytes."""
import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import llama_generate, pread_eio_offsets, run
from servers import SECRET_KEY, FaultProxy, HttpServer, S3Server
from test_mount import Mount


@pytest.fixture(scope="module")
def reference(cawsfs, archives, shelf):
    """The local archive's exported model.gguf and model.safetensors."""
    path, _ = archives["default"]
    d = shelf / "ref-remote"
    run([cawsfs, "export", path, "--format", "hf-dir", "-o", d])
    run([cawsfs, "export", path, "--format", "gguf", "-o", d / "model.gguf"])
    return d


@pytest.fixture()
def s3(work, monkeypatch):
    srv = S3Server(work / "s3root")
    for k, v in srv.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    yield srv
    srv.stop()


@pytest.fixture()
def http(work):
    srv = HttpServer(work / "www")
    yield srv
    srv.stop()


def log_of(m):
    return open(m.socket.replace(".sock", ".log")).read()


def test_s3_mount_serves_the_local_archives_bytes(cawsfs, archives, reference, llama_bin, s3, work):
    src, _ = archives["default"]
    url = s3.put("models", "smol/default.cawsf", src)
    info = run([cawsfs, "inspect", url]).stdout
    assert info.startswith(f"archive: {url} (cawsf)"), info[:200]
    m = Mount(cawsfs, url, work / "mnt-s3", "--no-disk-cache")
    try:
        got = (m.mp / "model.gguf").read_bytes()
        assert got == (reference / "model.gguf").read_bytes()
        ours, _ = llama_generate(llama_bin, m.mp / "model.gguf")
        theirs, _ = llama_generate(llama_bin, reference / "model.gguf")
        assert ours == theirs and len(ours) > len("The capital of France is") + 10
        st = m.stat()
        f = st["fetch"]
        size = os.path.getsize(src)
        assert f["url"] == url and f["object_bytes"] == size
        assert f["requests"] > 0 and f["failed_requests"] == 0
        # Fetched only once, in essence: the whole file read whole, not much more.
        assert size * 0.9 < f["bytes_fetched"] < size * 1.3, (f, size)
        assert f["readahead_bytes"] > size / 2, f
        assert f["latency_p50_us"] > 0
        text = run([cawsfs, "stat", m.mp]).stdout
        assert f"fetch    {url}" in text, text
        prom = run([cawsfs, "stat", m.mp, "--prometheus"]).stdout
        assert "cawsfs_fetch_bytes_total " in prom
        for where in (text, prom, log_of(m)):
            assert SECRET_KEY not in where
    finally:
        m.close()


def test_fetch_cache_fetches_each_part_once_and_checks_it(cawsfs, archives, reference, s3, work):
    """A second mount of the same object reads every part from the fetch cache on disk
    (no GET at all); a flipped byte there is caught and that part fetched again."""
    src, _ = archives["default"]
    url = s3.put("models", "cached.cawsf", src)
    ref = (reference / "model.gguf").read_bytes()
    fc = work / "fetch"

    def mount_and_read(name):
        m = Mount(cawsfs, url, work / name, "--no-disk-cache", "--fetch-cache", fc)
        try:
            assert (m.mp / "model.gguf").read_bytes() == ref
            return m.stat()["fetch"], log_of(m)
        finally:
            m.close()

    first, _ = mount_and_read("mnt-fc1")
    size = os.path.getsize(src)
    assert first["requests"] > 0 and first["fetch_cache_written_bytes"] >= size * 0.9, first
    second, _ = mount_and_read("mnt-fc2")
    assert second["requests"] == 0 and second["bytes_fetched"] == 0, second
    assert second["fetch_cache_hit_bytes"] >= size * 0.9, second
    (data,) = fc.glob("*.data")
    with open(data, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x10]))
    third, log = mount_and_read("mnt-fc3")
    # Two readers can meet the bad part at once: each counts it; one line is logged.
    assert third["fetch_cache_bad_parts"] >= 1 and third["requests"] >= 1, third
    assert third["bytes_fetched"] <= 2 * 256 * 1024, third  # that part, not the object
    assert log.count("failed its checksum; fetched again") == 1, log[-2000:]


def test_convert_uploads_to_s3(cawsfs, model_gguf, s3, work):
    """`convert -o s3://…` writes locally, verifies, then uploads in parts: the object is
    the archive a local convert writes (conversion is deterministic)."""
    url = "s3://models/up/smol-exact.cawsf"
    out = run([cawsfs, "convert", model_gguf, "-o", url, "--passthrough", "*", "--verify"]).stdout
    assert f"to {url} in" in out, out[-500:]
    run([cawsfs, "convert", model_gguf, "-o", work / "local.cawsf", "--passthrough", "*"])
    obj = s3.root / "models" / "up" / "smol-exact.cawsf"
    assert obj.read_bytes() == (work / "local.cawsf").read_bytes()
    assert run([cawsfs, "inspect", url]).stdout.startswith(f"archive: {url} (cawsf)")
    # Not to an HTTP server, not as a directory: one line each.
    e = one_line_error([cawsfs, "convert", model_gguf, "-o", "http://127.0.0.1:9/x.cawsf",
                        "--passthrough", "*"])
    assert "s3:// only" in e, e
    e = one_line_error([cawsfs, "convert", model_gguf, "-o", "s3://models/d/", "--to", "npy-dir"])
    assert "local directory only" in e, e


def test_several_daemons_mount_one_object(cawsfs, archives, reference, s3, work):
    """Three mounts of one object at once (as three machines would), all three reading
    it at the same time, serve the local export's bytes. Sharing one fetch cache (as
    mounts on one machine do), the parts one of them fetched after the others were
    mounted serve the others: they fetch next to nothing."""
    import threading

    src, _ = archives["default"]
    url = s3.put("models", "shared.cawsf", src)
    ref = (reference / "model.gguf").read_bytes()
    size = os.path.getsize(src)

    def mount(name, fc):
        return Mount(cawsfs, url, work / name, "--no-disk-cache", "--fetch-cache", work / fc)

    def read_all(ms):
        got = [None] * len(ms)

        def read(i):
            got[i] = (ms[i].mp / "model.gguf").read_bytes()

        threads = [threading.Thread(target=read, args=(i,)) for i in range(len(ms))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert all(g == ref for g in got)
        return [m.stat()["fetch"] for m in ms]

    # Three machines: three fetch caches, three concurrent readers.
    ms = [mount(f"mnt-machine-{i}", f"fc-machine-{i}") for i in range(3)]
    try:
        for f in read_all(ms):
            assert size * 0.9 < f["bytes_fetched"] < size * 1.3, f
    finally:
        for m in ms:
            m.close()
    # One machine: a shared fetch cache, all mounted first, one reads, then the others.
    ms = [mount(f"mnt-shared-{i}", "fc-shared") for i in range(3)]
    try:
        read_all(ms[:1])
        for f in read_all(ms[1:]):
            assert f["bytes_fetched"] < size * 0.05, f
            assert f["fetch_cache_hit_bytes"] > size * 0.9, f
    finally:
        for m in ms:
            m.close()


def test_http_archives_export_and_verify(cawsfs, archives, model_gguf, reference, http, work):
    src, _ = archives["default"]
    url = http.put("default.cawsf", src)
    run([cawsfs, "verify", url])
    run([cawsfs, "export", url, "--format", "gguf", "-o", work / "r.gguf"])
    assert (work / "r.gguf").read_bytes() == (reference / "model.gguf").read_bytes()
    # A delta archive too: its kind is told by the object's first bytes.
    delta = work / "d.cawsd"
    run([cawsfs, "convert", model_gguf, "-o", delta, "--to", "delta", "--rank", "8"])
    run([cawsfs, "export", delta, "--format", "gguf", "-o", work / "d-local.gguf"])
    durl = http.put("d.cawsd", delta)
    assert run([cawsfs, "inspect", durl]).stdout.startswith(f"archive: {durl} (delta)")
    run([cawsfs, "export", durl, "--format", "gguf", "-o", work / "d-remote.gguf"])
    assert (work / "d-remote.gguf").read_bytes() == (work / "d-local.gguf").read_bytes()


def test_npy_dirs_under_prefixes(cawsfs, model_gguf, reference, s3, http, work):
    """An npy-dir in object storage is a prefix: one listing pins every file (no HEAD
    each), the mount serves what the local directory serves and fetches about what it
    reads. cawsfs's own directory (cawsfs.json names every file) and a Squish one
    written by numpy (matched against the listing) over S3; cawsfs's own over plain
    HTTP too (nginx cannot list: its files are named by cawsfs.json and HEADed)."""
    ours, squish = work / "ours", work / "squish"
    run([cawsfs, "convert", model_gguf, "--to", "npy-dir", "-o", ours])
    run([sys.executable, Path(__file__).parent / "make_npydir.py", reference, squish])
    for name, d in (("ours", ours), ("squish", squish)):
        run([cawsfs, "export", d, "--format", "gguf", "-o", work / f"{name}.gguf"])
        s3.put_tree("models", f"npy/{name}", d)
    for name, d, url in (("ours", ours, "s3://models/npy/ours/"),
                         ("squish", squish, "s3://models/npy/squish")):
        want = (work / f"{name}.gguf").read_bytes()
        files = [p for p in d.rglob("*") if p.is_file()]
        stored = sum(p.stat().st_size for p in files)
        m = Mount(cawsfs, url, work / f"mnt-{name}", "--no-disk-cache")
        try:
            assert (m.mp / "model.gguf").read_bytes() == want, name
            f = m.stat()["fetch"]
            assert f["url"] == url.rstrip("/") + "/", f
            # Every data file is opened once (cawsfs.json may carry the side files).
            assert len(files) - 8 <= f["objects"] <= len(files), (f, len(files))
            assert stored * 0.9 < f["object_bytes"] <= stored, (f, stored)
            assert f["failed_requests"] == 0 and f["retries"] == 0, f
            # Every byte was needed once; read-ahead stops at each file's end.
            opened = f["object_bytes"]
            assert opened * 0.9 < f["bytes_fetched"] <= opened * 1.1, f
            assert "retries 0" in run([cawsfs, "stat", m.mp]).stdout
        finally:
            m.close()
    # Plain HTTP: no listing, so only a directory that names its files.
    shutil.copytree(ours, http.root / "ours")
    shutil.copytree(squish, http.root / "squish")
    base = f"http://{http.host}:{http.port}"
    run([cawsfs, "verify", f"{base}/ours/"])
    run([cawsfs, "export", f"{base}/ours/", "--format", "gguf", "-o", work / "h.gguf"])
    assert (work / "h.gguf").read_bytes() == (work / "ours.gguf").read_bytes()
    e = one_line_error([cawsfs, "inspect", f"{base}/squish/"])
    assert f"{base}/squish/" in e and "does not list" in e, e


def test_router_prefetch_and_pins_fetch_only_what_they_name(cawsfs, archives, s3, work):
    """Pinning and route-driven prefetch work on an object as on a file: the pinned
    infrastructure and the prompt's embedding blocks load, then the routed blocks,
    each then read without reconstructing (no miss); no part is fetched twice."""
    from test_router import PROMPTS, CS, route, traced_read, wait_idle
    src, _ = archives["default"]
    url = s3.put("models", "routed.cawsf", src)
    size = os.path.getsize(src)
    m = Mount(cawsfs, url, work / "mnt-routed", "--no-disk-cache", "--cache-size", "48MiB",
              "--pin-infra", "--pin-infra-layers", "1", "--pin-prompt", PROMPTS[0])
    try:
        st = m.stat()
        pinned = st["cache"]["pinned_bytes"]
        assert pinned > 1 << 20, st["cache"]
        for _ in range(400):
            if m.stat()["cache"]["pinned_resident_bytes"] == pinned:
                break
            time.sleep(0.05)
        f0 = m.stat()["fetch"]
        # Fetched as they were loaded, each part once (read-ahead may reach most of the
        # archive: docs/REMOTE.md, "What is fetched").
        # (The header and small sections read at open are fetched by themselves too.)
        assert 0 < f0["bytes_fetched"] <= size + (64 << 10), (f0, size)
        r = route(cawsfs, m, PROMPTS[1], "--top-k", "8", "--prefetch")
        assert r["queued_chunks"] > 0, r
        wait_idle(m)
        f1 = m.stat()["fetch"]
        assert f0["bytes_fetched"] <= f1["bytes_fetched"] <= size + (64 << 10), (f1, size)
        mine = {c for s in r["shards"] for c in range(*s["chunks"])}
        t = traced_read(cawsfs, m, [(s["chunks"][0] * CS, s["chunks"][0] * CS + 1)
                                    for s in r["shards"]])
        seen = [e for e in t["events"] if e[1] in mine]
        assert seen and all(e[3] in ("hit", "prefetch_hit") for e in seen), seen
    finally:
        m.close()


def one_line_error(cmd, env=None, limit=60):
    t0 = time.time()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    took = time.time() - t0
    assert p.returncode != 0, p.stdout
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, p.stderr
    assert took < limit, took
    return lines[0]


def test_bad_remote_sources_get_one_line(cawsfs, archives, s3, http, work):
    src, _ = archives["default"]
    url = s3.put("models", "a.cawsf", src)
    # Wrong secret: the server refuses the signature.
    e = one_line_error([cawsfs, "inspect", url], env=s3.env(AWS_SECRET_ACCESS_KEY="wrong-secret"))
    assert url in e and "wrong-secret" not in e and SECRET_KEY not in e, e
    e = one_line_error([cawsfs, "inspect", "s3://models/missing.cawsf"], env=s3.env())
    assert "s3://models/missing.cawsf" in e and "no such object" in e, e
    e = one_line_error([cawsfs, "inspect", http.put("x", src).replace("/x", "/nothing-here")])
    assert "no such object" in e, e
    # A prefix is an npy-dir only with a manifest.
    e = one_line_error([cawsfs, "inspect", "s3://models/"], env=s3.env())
    assert "s3://models/" in e and "no manifest.json" in e, e
    # Nothing listens there: refused at once, retried a bounded number of times.
    dead = s3.env(AWS_ENDPOINT_URL="http://127.0.0.1:9", CAWSFS_FETCH_RETRIES="2",
                  CAWSFS_FETCH_RETRY_TIMEOUT_S="5")
    e = one_line_error([cawsfs, "inspect", url], env=dead, limit=30)
    assert url in e, e
    # Not an archive at all.
    (work / "junk").write_bytes(b"\0" * 100000)
    e = one_line_error([cawsfs, "inspect", http.put("junk.cawsf", work / "junk")])
    assert "junk.cawsf" in e, e


def test_object_replaced_under_the_mount_fails_reads(cawsfs, archives, reference, s3, work):
    src, _ = archives["default"]
    url = s3.put("models", "live.cawsf", src)
    m = Mount(cawsfs, url, work / "mnt-replaced", "--cache-size", "16MiB", "--no-disk-cache")
    try:
        ref = (reference / "model.safetensors").read_bytes()
        fd = os.open(m.mp / "model.safetensors", os.O_RDONLY)
        assert os.pread(fd, 1 << 20, 50 << 20) == ref[50 << 20:51 << 20]
        os.close(fd)
        # Another archive at the same key (the server's file rewritten).
        s3.put("models", "live.cawsf", archives["q4"][0])
        failed = pread_eio_offsets(m.mp / "model.safetensors", ref)
        assert failed, "no read failed although the object changed"
        assert m.stat()["cache"]["bytes_served"] > 0  # still answering
        assert log_of(m).count("changed since it was opened") == 1, log_of(m)[-3000:]
    finally:
        m.close()


def test_server_gone_then_back(cawsfs, archives, reference, s3, work, monkeypatch):
    """While the server is down, reads that need it fail with EIO after bounded retries
    and the mount stays; when it is back, the same reads return the right bytes."""
    monkeypatch.setenv("CAWSFS_FETCH_RETRIES", "2")
    monkeypatch.setenv("CAWSFS_FETCH_RETRY_TIMEOUT_S", "4")
    monkeypatch.setenv("CAWSFS_FETCH_TIMEOUT_S", "5")
    src, _ = archives["default"]
    url = s3.put("models", "flaky.cawsf", src)
    m = Mount(cawsfs, url, work / "mnt-flaky", "--cache-size", "16MiB", "--no-disk-cache")
    try:
        ref = (reference / "model.safetensors").read_bytes()
        path = m.mp / "model.safetensors"
        s3.stop()
        fd = os.open(path, os.O_RDONLY)
        at = 200 << 20
        t0 = time.time()
        with pytest.raises(OSError) as e:
            os.pread(fd, 1 << 20, at)
        assert e.value.errno == errno.EIO
        assert time.time() - t0 < 60
        st = m.stat()
        assert st["fetch"]["failed_requests"] > 0
        s3.start()
        assert os.pread(fd, 1 << 20, at) == ref[at:at + (1 << 20)]
        for at in (0, 100 << 20, len(ref) - (3 << 20)):
            assert os.pread(fd, 3 << 20, at) == ref[at:at + (3 << 20)]
        log = log_of(m)
        assert log.count("reads that need it fail until a request succeeds") == 1, log[-3000:]
        assert "requests succeed again" in log
        os.close(fd)
    finally:
        m.close()


@pytest.mark.parametrize("mode", ["503", "cut", "flip"])
def test_injected_faults_never_give_wrong_bytes(cawsfs, archives, reference, http, work, monkeypatch, mode):
    """Through a proxy that breaks one answer in three: 503s are retried away; a body
    cut short or a flipped byte gives EIO or the right bytes, never other bytes, with
    no hang; once the faults stop, every read returns the right bytes."""
    # Requests interleave at the proxy, so each attempt of one is a 503 with chance 1/3:
    # 10 retries make a request that fails for good (11 503s in a row) improbable.
    retries = "10" if mode == "503" else "3"
    monkeypatch.setenv("CAWSFS_FETCH_RETRIES", retries)
    monkeypatch.setenv("CAWSFS_FETCH_RETRY_TIMEOUT_S", "30" if mode == "503" else "10")
    src, _ = archives["default"]
    http.put("f.cawsf", src)
    proxy = FaultProxy(http.port, mode=mode, every=3)
    ref = (reference / "model.gguf").read_bytes()
    m = Mount(cawsfs, proxy.url("f.cawsf"), work / f"mnt-fault-{mode}", "--no-disk-cache",
              "--cache-size", "16MiB", "--readahead-chunks", "0")
    try:
        t0 = time.time()
        failed = pread_eio_offsets(m.mp / "model.gguf", ref)
        assert time.time() - t0 < 300
        assert proxy.injected > 0
        f = m.stat()["fetch"]
        if mode == "503":
            assert not failed and f["failed_requests"] == 0, (failed, f)
            # Every 503 was an attempt made again (HEADs pass the proxy untouched).
            assert f["retries"] == proxy.injected, (f, proxy.injected)
        if mode == "flip":
            # Each flipped answer fails a block's checksum and is fetched again.
            assert f["refetched_blocks"] > 0, f
        proxy.mode = None
        assert not pread_eio_offsets(m.mp / "model.gguf", ref)
    finally:
        m.close()
        proxy.stop()

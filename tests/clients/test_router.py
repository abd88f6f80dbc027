"""The semantic router and route-driven prefetch through a real mount: routes name the
embedding blocks that hold a prompt's tokens (as llama.cpp's own tokenizer splits it),
prefetched chunks are counted as prefetch hits, route hints survive a scan that plain
LRU would not, pins survive everything, and the control socket refuses bad requests and
other users while it keeps serving."""
import ast
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from conftest import run, run_status
from test_mount import Mount

PROMPTS = ["The capital of France is", "Water boils at one hundred degrees",
           "def fibonacci(n): return n"]
CS = 256 * 1024  # the mount's default chunk size
# For mounts whose reads are traced: once a file is whole in the disk tier its opens are
# FUSE passthrough ones, whose reads never reach the daemon (nor its trace).
NO_TIER = ["--no-disk-cache"]


@pytest.fixture(scope="module")
def exact(cawsfs, model_gguf, shelf):
    """The test model, bit-exact (fast to convert); routes come with every archive."""
    path = shelf / "router-exact.cawsf"
    run([cawsfs, "convert", model_gguf, "-o", path, "--passthrough", "*"])
    return path


@pytest.fixture(scope="module")
def routed(cawsfs, exact, shelf):
    m = Mount(cawsfs, exact, shelf / "mnt-router", "--cache-size", "64MiB")
    yield m
    m.close()


def llama_ids(llama_bin, gguf, prompt):
    out = run([llama_bin / "llama-tokenize", "-m", gguf, "-p", prompt, "--ids",
               "--log-disable"]).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def route(cawsfs, m, prompt, *args):
    return json.loads(run([cawsfs, "route", m.mp, "-p", prompt, "--json", *args]).stdout)


def wait_idle(m, timeout=30):
    """Wait until the prefetch queue is drained and no load runs."""
    for _ in range(int(timeout / 0.05)):
        c = m.stat()["cache"]
        if c["prefetch_queue_len"] == 0 and c["loads_in_flight"] == 0 and c["prefetch_loads"] > 0:
            return c
        time.sleep(0.05)
    raise AssertionError(f"prefetch did not finish: {m.stat()['cache']}")


def drop_page_cache(path):
    """Forget the kernel's cached pages of a mounted file, so the next read reaches the
    daemon (FOPEN_KEEP_CACHE would otherwise serve it from the page cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def traced_read(cawsfs, m, ranges, f="model.gguf"):
    """Trace the chunk lookups of reading these byte ranges of `f`; only `f`'s events
    are kept (a prefetch of another file still running would add its own, with chunk
    indices that look the same)."""
    drop_page_cache(m.mp / f)
    run([cawsfs, "trace", m.mp, "on"])
    with open(m.mp / f, "rb") as fh:
        for a, b in ranges:
            fh.seek(a)
            fh.read(b - a)
    t = json.loads(run([cawsfs, "trace", m.mp, "off"]).stdout)
    fid = next(int(k) for k, name in t["files"].items() if name == f)
    t["events"] = [e for e in t["events"] if e[0] == fid]
    return t


def test_route_puts_the_blocks_of_the_prompt_tokens_first(cawsfs, routed, llama_bin, model_gguf):
    for prompt in PROMPTS:
        ids = llama_ids(llama_bin, model_gguf, prompt)
        r = route(cawsfs, routed, prompt, "--top-k", "32")
        shards = r["shards"]
        assert r["file"] == "model.gguf" and len(r["tokens"]) == len(ids), (r["tokens"], ids)
        assert all(s["kind"] == "embedding" and s["tensor"] == "model.embed_tokens.weight"
                   for s in shards)
        # The blocks holding the tokens, as llama.cpp tokenizes the prompt ...
        blocks = {next(i for i, s in enumerate(shards) if s["rows"][0] <= t < s["rows"][1])
                  for t in ids}
        # ... are exactly the first len(blocks) ranks.
        assert blocks == set(range(len(blocks))), (prompt, ids, shards[:len(blocks) + 2])
        scores = [s["score"] for s in shards]
        assert scores == sorted(scores, reverse=True) and scores[0] > 0
        # A shard is at most one chunk of bytes, so it touches at most two chunks.
        assert all(s["chunks"][1] - s["chunks"][0] <= 2 for s in shards)


def test_budget_and_top_k_bound_the_route(cawsfs, routed):
    r = route(cawsfs, routed, PROMPTS[0], "--top-k", "2")
    assert len(r["shards"]) == 2
    r = route(cawsfs, routed, "zzzzqqqq", "--top-k", "2")  # unknown word: still a route
    assert 1 <= len(r["shards"]) <= 2
    # With a budget the rest of it goes to the other shards in forward-pass order.
    r = route(cawsfs, routed, PROMPTS[0], "--top-k", "3", "--budget", "16MiB")
    kinds = [s["kind"] for s in r["shards"]]
    assert kinds[:3] == ["embedding"] * 3 and set(kinds[3:]) == {"other"}
    orders = [s["order"] for s in r["shards"][3:]]
    assert orders == sorted(orders) and orders[0] == 1
    assert 0 < r["chunk_bytes"] <= 16 << 20
    r = route(cawsfs, routed, PROMPTS[0], "--budget", "300KiB")
    assert r["chunk_bytes"] <= 300 << 10 and len(r["shards"]) >= 1


def test_prefetch_then_read_counts_prefetch_hits(cawsfs, exact, work):
    m = Mount(cawsfs, exact, work / "mnt-route-pf", "--cache-size", "64MiB", *NO_TIER)
    try:
        before = m.stat()["cache"]
        assert before["prefetch_hits"] == 0
        r = route(cawsfs, m, PROMPTS[0], "--top-k", "4", "--prefetch")
        assert r["queued_chunks"] > 0 and r["hinted_chunks"] == r["queued_chunks"]
        wait_idle(m)
        chunks = sorted({c for s in r["shards"] for c in range(*s["chunks"])})
        t = traced_read(cawsfs, m, [(c * CS, c * CS + 4096) for c in chunks])
        first = {}
        for f, idx, _t, outcome in t["events"]:
            first.setdefault(idx, outcome)
        assert all(first[c] == "prefetch_hit" for c in chunks), (chunks, t["events"])
        st = m.stat()["cache"]
        assert st["prefetch_hits"] >= len(chunks)
        # stat --watch shows them apart from ordinary hits; Prometheus has a counter.
        prom = run([cawsfs, "stat", m.mp, "--prometheus"]).stdout
        line = next(l for l in prom.splitlines() if l.startswith("cawsfs_cache_prefetch_hits_total"))
        assert int(float(line.split()[-1])) >= len(chunks)
        assert st["route_hints"] == 0  # every hinted chunk was read: hints consumed
    finally:
        m.close()


def scan(path):
    with open(path, "rb") as fh:
        while fh.read(1 << 20):
            pass


@pytest.mark.parametrize("policy", ["router", "lru"])
def test_route_hints_survive_a_scan_only_with_router_eviction(cawsfs, exact, work, policy):
    """Routed, prefetched blocks outlive a scan of the rest of the file (everything past
    the token embedding, 7x the budget) with router-aware eviction; under plain LRU the
    scan evicts them. (Reading a hinted chunk consumes its hint, so the scan skips them.)
    32 MiB: the route's tokenizer (~9 MiB) and the scan's loads in flight count against
    the budget too, and the hinted chunks must fit beside them."""
    m = Mount(cawsfs, exact, work / f"mnt-evict-{policy}", "--cache-size", "32MiB",
              "--eviction", policy, *NO_TIER)
    try:
        r = route(cawsfs, m, PROMPTS[0], "--top-k", "4", "--prefetch")
        wait_idle(m)
        chunks = sorted({c for s in r["shards"] for c in range(*s["chunks"])})
        with open(m.mp / "model.gguf", "rb") as fh:
            fh.seek((max(chunks) + 8) * CS)
            while fh.read(1 << 20):
                pass
        assert m.stat()["cache"]["evictions"] > 0
        assert m.stat()["cache"]["route_hints"] == (len(chunks) if policy == "router" else 0)
        t = traced_read(cawsfs, m, [(c * CS, c * CS + 4096) for c in chunks])
        outcome = {idx: o for _f, idx, _t, o in t["events"] if idx in chunks}
        if policy == "router":
            assert all(outcome[c] != "miss" for c in chunks), outcome
        else:
            assert any(outcome[c] == "miss" for c in chunks), outcome
    finally:
        m.close()


def test_pinned_chunks_survive_and_pin_infra(cawsfs, exact, work):
    # 48 MiB: up to 28 MiB of pins beside the tokenizer --pin-prompt loads (~9 MiB,
    # charged to the budget) and room for the scans' loads.
    m = Mount(cawsfs, exact, work / "mnt-infra", "--cache-size", "48MiB", *NO_TIER, "--pin-infra",
              "--pin-infra-layers", "1", "--pin-prompt", PROMPTS[0])
    try:
        st = m.stat()["cache"]
        assert st["charged_bytes"] > 4 << 20, st
        pinned = st["pinned_bytes"]
        # Layer 0 of model.gguf (the stored Q4_1 blocks in the default view) is ~2 MiB;
        # each of the 61 norms is 2 KiB but takes a whole 256 KiB chunk (they lie between
        # the layers' matrices); the prompt's 4 embedding blocks take at most 8 chunks.
        assert 7 << 20 < pinned < 28 << 20, st
        for _ in range(200):
            if m.stat()["cache"]["pinned_resident_bytes"] == pinned:
                break
            time.sleep(0.05)
        scan(m.mp / "model.gguf")
        scan(m.mp / "model.safetensors")
        st = m.stat()["cache"]
        assert st["evictions"] > 0 and st["pinned_resident_bytes"] == pinned
        # The prompt's embedding blocks were pinned too: still resident after the scans.
        emb = route(cawsfs, m, PROMPTS[0], "--top-k", "8")["shards"]
        mine = {c for s in emb for c in range(*s["chunks"])}
        t = traced_read(cawsfs, m, [(s["chunks"][0] * CS, s["chunks"][0] * CS + 1)
                                    for s in emb])
        seen = [e for e in t["events"] if e[1] in mine]  # (kernel read-ahead adds others)
        assert {e[1] for e in seen} >= {s["chunks"][0] for s in emb}
        assert all(e[3] in ("hit", "prefetch_hit") for e in seen), seen
        # Reading layer 0's q_proj again: every lookup is a hit, the daemon reconstructs
        # nothing; a chunk wholly inside an (unpinned) tensor of layer 5 is a miss.
        r0 = route(cawsfs, m, PROMPTS[0], "--top-k", "1", "--budget", "1GiB")
        q0 = next(s for s in r0["shards"] if s["tensor"] == "model.layers.0.self_attn.q_proj.weight")
        l5 = next(s for s in r0["shards"]
                  if ".layers.5." in s["tensor"] and s["chunks"][1] - s["chunks"][0] >= 3)
        t = traced_read(cawsfs, m, [(q0["chunks"][0] * CS + CS // 2, q0["chunks"][0] * CS + CS // 2 + 4096)])
        assert t["events"] and all(e[3] == "hit" for e in t["events"]), t["events"]
        mid = l5["chunks"][0] + 1  # shared with no pinned norm
        t = traced_read(cawsfs, m, [(mid * CS + CS // 2, mid * CS + CS // 2 + 4096)])
        assert any(e[3] == "miss" for e in t["events"]), t["events"]
    finally:
        m.close()
    # Infrastructure that does not fit the budget fails the mount, naming the problem.
    mp = work / "mnt-infra-over"
    mp.mkdir(exist_ok=True)
    p = run_status([cawsfs, "mount", exact, mp, "--cache-size", "4MiB", "--pin-infra",
                    "--pin-infra-layers", "30"])
    assert p.returncode != 0 and "--pin-infra" in p.stderr and "budget" in p.stderr, p.stderr
    assert not os.path.ismount(mp)


def test_bad_requests_get_errors_and_the_daemon_keeps_serving(cawsfs, routed):
    bad = [
        b'{"verb":"route"}\n',
        b'{"verb":"route","prompt":""}\n',
        b'{"verb":"route","prompt":"x","top_k":0}\n',
        b'{"verb":"route","prompt":"x","top_k":"3"}\n',
        b'{"verb":"route","prompt":"x","budget_bytes":-1}\n',
        b'{"verb":"route","prompt":"x","file":"nope.bin"}\n',
        b'{"verb":"route","prompt":"x","file":"config.json"}\n',
        b'{"verb":"route","prompt":"x","extra":1}\n',
        b'{"verb":"trace"}\n',
        b'{"verb":"trace","on":"yes"}\n',
        b'{"verb":"evict","tensor":"no.such"}\n',
        b'{"verb":"pin","file":"model.gguf"}\n',  # 258 MiB into a 64 MiB budget
        b'{"verb":"routes","prompt":"x"}\n',
        b'\xff\xfe\n',
    ]
    for line in bad:
        r = routed.request(line)
        assert r["ok"] is False and r["error"] and "\n" not in r["error"], (line, r)
    assert routed.stat()["cache"]["pinned_bytes"] == 0
    r = routed.request(b'{"verb":"route","prompt":"The capital","top_k":2}\n')
    assert r["ok"] is True and len(r["shards"]) == 2
    # Well-formed requests are still served after the bad ones (that an evict selector
    # frees only its chunks is test_mount.py::test_prefetch_pin_unpin_evict_from_the_cli).
    r = routed.request(b'{"verb":"evict","layer":0}\n')
    assert r["ok"] is True and "freed_bytes" in r


def test_socket_is_private_and_other_uids_are_refused(cawsfs, exact, work):
    # Under /tmp directly: pytest's own tmp dirs are 0700, closed to uid 65534 anyway.
    sockdir = Path(tempfile.mkdtemp(prefix="cawsfs-peercred-", dir="/tmp"))
    os.chmod(sockdir, 0o755)
    path = sockdir / "c.sock"
    m = Mount(cawsfs, exact, work / "mnt-peercred", "--socket", path)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        # Loosen the file by hand: only SO_PEERCRED stands between uid 65534 and the daemon.
        os.chmod(path, 0o666)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: become nobody, connect, report what happened
            os.close(r)
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(10)
                s.connect(str(path))
                try:  # the daemon may answer and close before reading anything
                    s.sendall(b'{"verb":"stat"}\n')
                except BrokenPipeError:
                    pass
                reply = s.makefile().readline()
                os.write(w, ("REPLY " + reply).encode())
            except OSError as e:
                os.write(w, f"OSERROR {e}".encode())
            os._exit(0)
        os.close(w)
        got = b""
        while chunk := os.read(r, 65536):
            got += chunk
        os.close(r)
        os.waitpid(pid, 0)
        got = got.decode()
        assert got.startswith("REPLY "), got
        reply = json.loads(got[6:])
        assert reply["ok"] is False and "permission denied" in reply["error"], reply
        assert "uid 65534" in reply["error"]
        # Root still gets served.
        assert m.request(b'{"verb":"ping"}\n')["ok"] is True
    finally:
        m.close()
        shutil.rmtree(sockdir, ignore_errors=True)

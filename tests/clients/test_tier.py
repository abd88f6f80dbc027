"""The disk tier (docs/TIER.md) through real mounts: bytes reconstructed once are served
after a restart without decoding, byte-identical to `cawsfs export`; a flipped byte in
the tier is caught and the read still returns the right bytes; a damaged index is
dropped; the size bound holds; the tier follows the archive, not its path."""
import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import run, run_status
from test_mount import Mount, exported  # noqa: F401 (fixture)
from test_router import drop_page_cache

GGUF = "model.gguf"


def same(a, b):
    return subprocess.run(["cmp", a, b]).returncode == 0


def mount(cawsfs, archive, mp, tier, *args):
    return Mount(cawsfs, archive, mp, "--cache-size", "64MiB", "--disk-cache", tier, *args)


def fill(cawsfs, archive, mp, tier, ref):
    """Mount, read `ref`'s file through the mount (checked), unmount: the tier holds it."""
    m = mount(cawsfs, archive, mp, tier)
    try:
        assert same(m.mp / ref.name, ref)
    finally:
        m.close()  # umount returns after the daemon flushed the tier


def entry_of(tier, size):
    """The data file of the entry holding a virtual file of `size` bytes."""
    found = [tier / n for n in os.listdir(tier)
             if n.endswith(".data") and os.path.getsize(tier / n) == size]
    assert len(found) == 1, (os.listdir(tier), size)
    return found[0]


def assert_same_bytes(path, ref):
    """`path` holds `ref`'s bytes. Compared apart from the assert: pytest's diff of two
    100 MB byte strings takes longer than a test's time limit."""
    whole = path.read_bytes() == ref.read_bytes()
    assert whole, f"{path} differs from {ref}"


@pytest.fixture()
def tier(work, request):
    d = work / f"tier-{request.node.name}"
    shutil.rmtree(d, ignore_errors=True)
    return d


def test_restart_serves_from_the_tier_without_decoding(cawsfs, archives, work, exported, tier):  # noqa: F811
    path, _ = archives["default"]
    ref = exported / GGUF
    m = mount(cawsfs, path, work / "mnt-tier", tier)
    try:
        assert same(m.mp / GGUF, ref)
        st = m.stat()
        assert st["tier"]["hit_bytes"] == 0 and st["archive"]["bytes_decoded"] > 0, st["tier"]
    finally:
        m.close()
    data = entry_of(tier, ref.stat().st_size)
    assert_same_bytes(data, ref)
    # Made whole from this daemon's own writes, the entry was stamped at unmount: the
    # next mount's first passthrough open does not read it whole first.
    assert data.with_suffix(".ok").exists(), sorted(os.listdir(tier))

    m = mount(cawsfs, path, work / "mnt-tier", tier)
    try:
        st = m.stat()
        assert st["tier"]["whole_files"] >= 1, st["tier"]
        drop_page_cache(m.mp / GGUF)
        assert same(m.mp / GGUF, ref)
        st = m.stat()
        # Every byte of model.gguf came from the tier: nothing was decoded, and the
        # daemon served nothing (the kernel reads the tier file through passthrough).
        assert st["archive"]["bytes_decoded"] == 0, st["archive"]
        assert st["cache"]["bytes_served"] == 0, st["cache"]
        assert st["tier"]["bad_extents"] == 0
        assert st["tier"]["passthrough"] == "on" and st["tier"]["passthrough_opens"] >= 1, st["tier"]
        assert [f["passthrough"] for f in st["files"] if f["name"] == GGUF] == [True], st["files"]
        human = run([cawsfs, "stat", m.mp]).stdout
        assert "tier " in human and "whole" in human and "passthrough on" in human, human
        assert any(l.startswith(GGUF) and l.endswith("kernel") for l in human.splitlines()), human
    finally:
        m.close()


def test_a_flipped_byte_in_the_tier_is_never_served(cawsfs, archives, work, exported, tier):  # noqa: F811
    path, _ = archives["default"]
    ref = exported / GGUF
    fill(cawsfs, path, work / "mnt-flip", tier, ref)
    data = entry_of(tier, ref.stat().st_size)
    at = 37 << 20
    with open(data, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))
    m = mount(cawsfs, path, work / "mnt-flip", tier)
    try:
        drop_page_cache(m.mp / GGUF)
        assert same(m.mp / GGUF, ref)
        st = m.stat()
        assert st["tier"]["bad_extents"] == 1, st["tier"]
        # Only that chunk was reconstructed.
        assert 0 < st["archive"]["bytes_decoded"] < 4 << 20, st["archive"]
        log = open(m.socket.replace(".sock", ".log")).read()
        assert "does not match its checksum" in log and data.name in log, log[-2000:]
    finally:
        m.close()
    # The rewritten extent is whole again on disk.
    assert_same_bytes(data, ref)


def test_a_damaged_index_is_dropped_and_rebuilt(cawsfs, archives, work, exported, tier):  # noqa: F811
    path, _ = archives["default"]
    ref = exported / GGUF
    fill(cawsfs, path, work / "mnt-idx", tier, ref)
    idx = entry_of(tier, ref.stat().st_size).with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:100])  # truncated
    m = mount(cawsfs, path, work / "mnt-idx", tier)
    try:
        assert m.stat()["tier"]["present_bytes"] == 0
        log = open(m.socket.replace(".sock", ".log")).read()
        assert "unusable" in log and idx.stem in log, log[-2000:]
        assert same(m.mp / GGUF, ref)
        assert m.stat()["archive"]["bytes_decoded"] > 0
    finally:
        m.close()


def test_extents_a_full_queue_dropped_are_made_again(cawsfs, archives, work, exported, tier):  # noqa: F811
    """A 4 MiB budget gives the tier's writer a queue of one chunk, so a fast read drops
    copies; they are made again once the queue is empty and the file becomes whole in
    the tier without `materialize`, its bytes those of the export."""
    path, _ = archives["default"]
    ref = exported / GGUF
    m = Mount(cawsfs, path, work / "mnt-refill", "--cache-size", "4MiB", "--disk-cache", tier)
    try:
        with ThreadPoolExecutor(4) as pool:  # four readers at once outrun one writer
            quarter = ref.stat().st_size // 4 + 1
            assert all(pool.map(lambda i: read_range(m.mp / GGUF, ref, i * quarter, quarter), range(4)))
        for _ in range(300):
            t = m.stat()["tier"]
            if t["whole_files"] >= 1:
                break
            time.sleep(0.1)
        assert t["dropped_extents"] > 0, t
        assert t["refilled_extents"] > 0 and t["whole_files"] >= 1, t
        assert "refilled" in run([cawsfs, "stat", m.mp]).stdout
    finally:
        m.close()
    assert_same_bytes(entry_of(tier, ref.stat().st_size), ref)


def test_umount_during_a_refill_returns_with_the_tier_released(cawsfs, archives, work, exported, tier):  # noqa: F811
    """Unmounting while the refill still makes what a full queue dropped: `cawsfs
    umount` returns after the daemon stopped the refill and exited, so no tier entry is
    in use any more (its threads held the files after its main thread had exited), and
    the next mount serves what the tier lists."""
    path, _ = archives["default"]
    ref = exported / "model.safetensors"  # the larger file: more to make again
    m = Mount(cawsfs, path, work / "mnt-stop", "--cache-size", "4MiB", "--disk-cache", tier)
    try:
        with ThreadPoolExecutor(4) as pool:
            quarter = ref.stat().st_size // 4 + 1
            assert all(pool.map(lambda i: read_range(m.mp / ref.name, ref, i * quarter, quarter), range(4)))
    finally:
        m.close()
    entries = json.loads(run([cawsfs, "tier", "ls", "--dir", tier, "--json"]).stdout)
    assert entries and not any(e["in_use"] for e in entries), entries
    m = mount(cawsfs, path, work / "mnt-stop", tier)
    try:
        assert same(m.mp / ref.name, ref)
    finally:
        m.close()


def read_range(path, ref, off, n):
    with open(path, "rb") as f, open(ref, "rb") as r:
        f.seek(off)
        r.seek(off)
        return f.read(n) == r.read(n)


def test_the_size_bound_holds(cawsfs, archives, work, exported, tier):  # noqa: F811
    path, _ = archives["default"]
    bound = 40 << 20
    m = mount(cawsfs, path, work / "mnt-bound", tier, "--disk-cache-size", "40MiB")
    try:
        for f in (GGUF, "model.safetensors"):
            assert same(m.mp / f, exported / f)
        st = m.stat()["tier"]
        assert st["over_bound_extents"] > 0 and st["max_bytes"] == bound, st
    finally:
        m.close()
    used = sum(os.stat(tier / n).st_blocks * 512 for n in os.listdir(tier) if n.endswith(".data"))
    assert 0 < used <= bound, used


def test_another_archive_at_the_same_path_does_not_meet_the_old_entries(
        cawsfs, archives, work, exported, tier):  # noqa: F811
    path, _ = archives["default"]
    moved = work / "tier-moved.cawsf"
    shutil.copy(path, moved)
    fill(cawsfs, moved, work / "mnt-moved", tier, exported / GGUF)
    # The same archive under another path shares the entries (identity, not path).
    m = mount(cawsfs, path, work / "mnt-moved", tier)
    try:
        assert m.stat()["tier"]["whole_files"] >= 1
    finally:
        m.close()
    # Another archive at the moved path: no entry of the old one is used.
    shutil.copy(archives["exact"][0], moved)
    m = mount(cawsfs, moved, work / "mnt-moved", tier)
    try:
        st = m.stat()["tier"]
        assert st["present_bytes"] == 0 and st["whole_files"] == 0, st
    finally:
        m.close()


def test_without_passthrough_the_daemon_serves_the_tier(cawsfs, archives, work, exported, tier):  # noqa: F811
    """The path where passthrough is unavailable (older kernel, not root), taken on
    purpose: every byte through the daemon, from the tier, nothing decoded."""
    path, _ = archives["default"]
    ref = exported / GGUF
    fill(cawsfs, path, work / "mnt-nopt", tier, ref)
    m = mount(cawsfs, path, work / "mnt-nopt", tier, "--no-passthrough")
    try:
        drop_page_cache(m.mp / GGUF)
        assert same(m.mp / GGUF, ref)
        st = m.stat()
        assert st["archive"]["bytes_decoded"] == 0, st["archive"]
        assert st["tier"]["hit_bytes"] == ref.stat().st_size, st["tier"]
        assert st["cache"]["bytes_served"] >= ref.stat().st_size, st["cache"]
        assert st["tier"]["passthrough"] == "off" and st["tier"]["passthrough_opens"] == 0, st["tier"]
    finally:
        m.close()


def test_llama_generates_from_a_passthrough_file(cawsfs, archives, work, exported, tier, llama_bin):  # noqa: F811
    """llama.cpp maps the restarted mount's model.gguf (a passthrough backing file) and
    generates the same greedy tokens as from the exported copy."""
    from conftest import llama_generate
    path, _ = archives["default"]
    ref = exported / GGUF
    # Whole in the tier for certain (materialize waits for it): this test is about the
    # passthrough open, not about what one pass leaves (the restart test checks that).
    m = mount(cawsfs, path, work / "mnt-llama", tier)
    try:
        run([cawsfs, "materialize", m.mp, "--file", GGUF])
    finally:
        m.close()
    m = mount(cawsfs, path, work / "mnt-llama", tier)
    try:
        got, _ = llama_generate(llama_bin, m.mp / GGUF)
        want, _ = llama_generate(llama_bin, ref)
        assert got == want and len(got) > 20, (got, want)
        assert m.stat()["cache"]["bytes_served"] == 0
    finally:
        m.close()


def test_tier_ls_gc_clear_keep_what_a_mount_has_open(cawsfs, archives, work, exported, tier):  # noqa: F811
    """`cawsfs tier ls` names each entry's file and archive and whether a mount has it
    open; `clear` keeps those, removes the rest; after unmount it removes everything,
    and the next mount reconstructs again."""
    path, _ = archives["default"]
    ref = exported / GGUF
    m = mount(cawsfs, path, work / "mnt-ls", tier)
    try:
        assert same(m.mp / GGUF, ref)
        m.stat()
        entries = json.loads(run([cawsfs, "tier", "ls", "--dir", tier, "--json"]).stdout)
        gguf_entry = next(e for e in entries if e["file"] == GGUF)
        assert gguf_entry["in_use"] and gguf_entry["archive"] == str(path), gguf_entry
        assert gguf_entry["size"] == ref.stat().st_size
        out = run([cawsfs, "tier", "clear", "--dir", tier]).stdout
        assert "in use by a mount, kept" in out, out
        assert same(m.mp / GGUF, ref)
    finally:
        m.close()
    human = run([cawsfs, "tier", "ls", "--dir", tier]).stdout
    assert GGUF in human and str(path) in human, human
    out = run([cawsfs, "tier", "clear", "--dir", tier]).stdout
    assert "removed" in out and "in use" not in out, out
    assert json.loads(run([cawsfs, "tier", "ls", "--dir", tier, "--json"]).stdout) == []
    m = mount(cawsfs, path, work / "mnt-ls", tier)
    try:
        assert same(m.mp / GGUF, ref)
        assert m.stat()["archive"]["bytes_decoded"] > 0
    finally:
        m.close()


def test_materialize_fills_the_tier_for_passthrough(cawsfs, archives, work, exported, tier):  # noqa: F811
    """`cawsfs materialize` reconstructs whole files into the tier without any read; the
    next open of each is a passthrough open with the export's bytes, nothing decoded.
    Errors are one line: an unknown file, and a mount without a tier."""
    path, _ = archives["default"]
    m = mount(cawsfs, path, work / "mnt-mat", tier)
    try:
        out = run([cawsfs, "materialize", m.mp]).stdout
        assert "whole in the disk tier" in out, out
        st = m.stat()
        mat = st["tier"]["materialize"]
        assert not mat["running"] and "error" not in mat, mat
        assert mat["done_bytes"] == mat["total_bytes"] > 0, mat
        assert st["tier"]["whole_files"] == 2 and st["cache"]["bytes_served"] == 0, st
        again = run([cawsfs, "materialize", m.mp, "--file", GGUF]).stdout
        assert "(0 B reconstructed" in again, again
        bad = run_status([cawsfs, "materialize", m.mp, "--file", "nope.bin"])
        assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
            "cawsfs: error: no file named nope.bin in this mount's disk tier"], bad.stderr
        for f in (GGUF, "model.safetensors"):
            assert same(m.mp / f, exported / f)
        st = m.stat()
        assert st["cache"]["bytes_served"] == 0 and st["tier"]["passthrough_opens"] == 2, st
    finally:
        m.close()
    m = Mount(cawsfs, path, work / "mnt-mat", "--no-disk-cache")
    try:
        p = run_status([cawsfs, "materialize", m.mp])
        assert p.returncode != 0 and "has no disk tier" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    finally:
        m.close()


def test_the_default_cache_budget_follows_the_tier(cawsfs, archives, work, tier):
    """With the tier on, the default budget is a quarter of RAM but at most 512 MiB (the
    bytes also live in the page cache and the tier); without it, or with pins charged to
    the budget, the quarter (at least 256 MiB)."""
    path, _ = archives["default"]
    quarter = max(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4, 256 << 20)
    for args, budget in ((["--disk-cache", tier], min(quarter, 512 << 20)),
                         (["--no-disk-cache"], quarter),
                         (["--disk-cache", tier, "--pin-infra"], quarter),
                         (["--disk-cache", tier, "--cache-size", "40MiB"], 40 << 20)):
        m = Mount(cawsfs, path, work / "mnt-budget", *args)
        try:
            assert m.stat()["cache"]["budget"] == budget, (args, m.stat()["cache"])
        finally:
            m.close()

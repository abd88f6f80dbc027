"""An archive truncated, rewritten in place or replaced under a live mount: the daemon
keeps running, every read returns the original bytes or fails with EIO (never bytes of
the new file, never a mix), and the change is logged once. It used to die of SIGBUS
(exit 135) and leave the mount dead."""
import os
import shutil

import pytest

from conftest import pread_eio_offsets, run
from test_mount import Mount

CHANGED = "changed since it was opened"


@pytest.fixture(scope="module")
def reference(cawsfs, archives, shelf):
    path, _ = archives["default"]
    d = shelf / "ref-changes"
    run([cawsfs, "export", path, "--format", "hf-dir", "-o", d])
    return (d / "model.safetensors").read_bytes()


def check_after_change(m, ref, log):
    """Whole-file reads after the change: equal to `ref` or EIO, some EIO, the daemon
    alive, one log line about the change."""
    failed = pread_eio_offsets(m.mp / "model.safetensors", ref)
    assert failed, "no read failed although the archive changed"
    assert m.stat()["cache"]["bytes_served"] > 0  # still answering
    text = open(log).read()
    assert text.count(CHANGED) == 1, text[-3000:]
    return failed


@pytest.mark.parametrize("how", ["truncate", "cp-over"])
def test_cawsf_changed_under_the_mount(cawsfs, archives, work, reference, how):
    src, _ = archives["default"]
    arch = work / f"changing-{how}.cawsf"
    shutil.copy(src, arch)
    m = Mount(cawsfs, arch, work / f"mnt-change-{how}", "--cache-size", "16MiB")
    try:
        fd = os.open(m.mp / "model.safetensors", os.O_RDONLY)
        assert os.pread(fd, 1 << 20, 50 << 20) == reference[50 << 20:51 << 20]
        os.close(fd)
        if how == "truncate":
            os.truncate(arch, 42_000_000)
        else:
            # `cp` writes into the same inode: another archive's bytes under the old index.
            shutil.copyfile(archives["q4"][0], arch)
        check_after_change(m, reference, m.socket.replace(".sock", ".log"))
    finally:
        m.close()


def test_renamed_over_archive_keeps_serving_the_opened_one(cawsfs, archives, work, reference):
    src, _ = archives["default"]
    arch = work / "renamed.cawsf"
    shutil.copy(src, arch)
    m = Mount(cawsfs, arch, work / "mnt-rename", "--cache-size", "16MiB")
    try:
        tmp = work / "renamed.cawsf.new"
        shutil.copy(archives["q4"][0], tmp)
        os.rename(tmp, arch)
        # The daemon holds the opened file: every byte is still the original's.
        assert pread_eio_offsets(m.mp / "model.safetensors", reference) == []
    finally:
        m.close()


def test_npydir_file_truncated_under_the_mount(cawsfs, model_gguf, work):
    d = work / "changing-npydir"
    run([cawsfs, "convert", model_gguf, "--to", "npy-dir", "-o", d])
    ref_dir = work / "ref-npydir"
    run([cawsfs, "export", d, "--format", "hf-dir", "-o", ref_dir])
    ref = (ref_dir / "model.safetensors").read_bytes()
    m = Mount(cawsfs, d, work / "mnt-change-npydir", "--cache-size", "16MiB")
    try:
        victims = sorted((d / "tensors").glob("*mlp__down_proj__weight__q.npy*"))
        assert victims
        for v in victims:
            os.truncate(v, os.path.getsize(v) // 2)
        failed = pread_eio_offsets(m.mp / "model.safetensors", ref)
        assert failed
        assert m.stat()["cache"]["bytes_served"] > 0
        log = open(m.socket.replace(".sock", ".log")).read()
        # One line per changed file, not one per read.
        assert log.count(CHANGED) == len(victims), log[-3000:]
    finally:
        m.close()

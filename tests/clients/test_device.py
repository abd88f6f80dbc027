"""`--device` on a machine as CI has it (no GPU): `auto` reconstructs on the CPU, the
same bytes as `cpu`; `cuda` is one clear error line from every command that takes it,
the mount daemon included; `stat` says where reconstruction runs. The GPU itself is
checked by scripts/test-cuda.sh where one is (docs/CUDA.md)."""
import subprocess
from pathlib import Path

from conftest import run, run_status

# The NVIDIA driver's device node: where it exists, `cuda` is expected to work.
HAS_GPU = Path("/dev/nvidia0").exists()


def test_auto_and_cpu_give_the_same_bytes(cawsfs, archives, work):
    path, _ = archives["default"]
    for dev in ["cpu", "auto"]:
        p = run([cawsfs, "export", path, "--format", "safetensors", "-o", work / dev, "--device", dev])
        # The CPU is the default's fallback without a word on stderr.
        if not HAS_GPU:
            assert "reconstructing on" not in p.stderr
    assert (work / "cpu").read_bytes() == (work / "auto").read_bytes()


def test_cuda_without_a_gpu_is_one_line(cawsfs, archives, work):
    path, _ = archives["default"]
    for cmd in (
        ["export", path, "--format", "gguf", "-o", work / "x.gguf", "--device", "cuda"],
        ["verify", path, "--device", "cuda:0"],
        ["device-check", path],
        ["convert", path, "-o", work / "c.cawsf", "--passthrough", "*", "--verify", "--device", "cuda"],
    ):
        p = run_status([cawsfs, *cmd])
        if HAS_GPU:
            assert p.returncode == 0, p.stderr
            continue
        assert p.returncode != 0
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1, p.stderr
        assert lines[0].startswith("cawsfs: error: --device cuda:0: "), lines[0]
        assert "libcuda" in lines[0] or "no CUDA device" in lines[0], lines[0]
    assert not (work / "x.gguf").exists() or HAS_GPU
    # The device is tried before converting: nothing was written.
    assert not (work / "c.cawsf").exists() or HAS_GPU


def test_convert_verifies_on_the_device_asked(cawsfs, model_gguf, work):
    # Two kinds (delta's conversion alone takes 17 s here); all three reach the same pass.
    for to, opts in (("cawsf", ["--sq-bits", "4", "--rank", "0", "--outlier-q", "1"]),
                     ("npy-dir", [])):
        p = run([cawsfs, "convert", model_gguf, "-o", work / to, "--to", to, *opts,
                 "--verify", "--device", "cpu"])
        last = p.stdout.strip().splitlines()[-1]
        assert last.startswith(f"{work / to}: ok (") and "verified and decoded" in last, p.stdout
    # Without --verify the device has nothing to choose.
    p = run_status([cawsfs, "convert", model_gguf, "-o", work / "y", "--device", "cpu"])
    assert p.returncode != 0
    assert p.stderr.strip() == "cawsfs: error: --device and --vram-budget choose where --verify decodes: add --verify", p.stderr
    assert not (work / "y").exists()


def test_bad_device_names_the_choices(cawsfs, archives, work):
    path, _ = archives["default"]
    for bad in ["gpu", "cuda:x", "cuda:"]:
        p = run_status([cawsfs, "export", path, "--format", "gguf", "-o", work / "x", "--device", bad])
        assert p.returncode != 0
        assert "expected auto, cpu, cuda or cuda:N" in p.stderr, p.stderr


def test_mount_reports_its_device(cawsfs, archives, work):
    path, _ = archives["default"]
    mnt = work / "m"
    mnt.mkdir()
    if not HAS_GPU:
        p = run_status([cawsfs, "mount", path, mnt, "--device", "cuda"])
        assert p.returncode != 0
        assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr
        assert "--device cuda:0: " in p.stderr, p.stderr
        assert not list(mnt.iterdir())
    run([cawsfs, "mount", path, mnt, "--no-disk-cache"])
    try:
        with open(mnt / "model.safetensors", "rb") as f:
            f.read(1 << 20)
        stat = run([cawsfs, "stat", mnt]).stdout
        line = next(l for l in stat.splitlines() if l.startswith("device"))
        if HAS_GPU:
            assert "cuda:0" in line, line
        else:
            assert line.split()[1] == "cpu", line
            assert "reconstructed 0 B" not in line, line
    finally:
        subprocess.run([str(cawsfs), "umount", str(mnt)], check=False)

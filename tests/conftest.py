"""Shared fixtures for the real-client tests: the cawsfs binary, the real test model,
the llama.cpp build, and archives converted once per session."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
# A fixed English text shipped by a Debian package (base-files), for perplexity.
TEXT = "/usr/share/common-licenses/GPL-3"


def run(cmd, **kw):
    """Run a command, returning CompletedProcess; raise with its output on failure."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    p = subprocess.run([str(c) for c in cmd], **kw)
    if p.returncode != 0 and not kw.get("check_ok_fail"):
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def run_status(cmd):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True)


@pytest.fixture(scope="session")
def cawsfs():
    exe = ROOT / "target" / "release" / "cawsfs"
    run(["cargo", "build", "--release", "--quiet"], cwd=ROOT)
    assert exe.is_file()
    return exe


@pytest.fixture(scope="session")
def model_gguf():
    out = run([ROOT / "scripts" / "fetch-test-model.sh"]).stdout.strip()
    return Path(out)


@pytest.fixture(scope="session")
def llama_bin():
    return Path(run([ROOT / "scripts" / "build-llama-cpp.sh"]).stdout.strip())


@pytest.fixture(scope="session")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("cawsfs-e2e")


def convert(cawsfs, src, out, *args):
    report = Path(str(out) + ".report.json")
    p = run([cawsfs, "convert", src, "-o", out, "--report-json", report, *args])
    return json.loads(report.read_text()), p.stdout


# Settings under test: the defaults (~4.2 bits per weight on coded matrices), one at
# 4.0, a low-bit one as the paper sketches (PQ of 4-wide sub-vectors, rank 16), and
# all-passthrough (bit-exact, the reference the lossy settings are compared with).
SETTINGS = {
    "default": [],
    "q4": ["--pq-dim", "2", "--rank", "0"],
    "low": ["--pq-dim", "4", "--rank", "16"],
    "exact": ["--passthrough", "*"],
}


@pytest.fixture(scope="session")
def archives(cawsfs, model_gguf, work):
    out = {}
    for name, args in SETTINGS.items():
        path = work / f"smol-{name}.cawsf"
        report, _ = convert(cawsfs, model_gguf, path, *args)
        out[name] = (path, report)
    return out


def llama_generate(llama_bin, gguf, prompt=PROMPT, n=24):
    p = run([
        llama_bin / "llama-completion", "-m", gguf, "-p", prompt, "-n", n, "--temp", "0",
        "-no-cnv", "--no-warmup", "-t", str(min(4, os.cpu_count() or 1)), "-s", "1",
    ])
    return p.stdout, p.stderr

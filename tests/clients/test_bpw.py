"""`cawsfs convert --bpw TARGET` (docs/CODECS.md, "Bits-per-weight target") on the test
model: the archive lands at or just under the target, deterministically; the KL-divergence
llama.cpp measures from the F16 reference stays under a ceiling at 5 bits (the default)
and grows as the target falls; a target no archive of the model can meet is a one-line
error, except for the default, which then makes the smallest archive the model allows."""
from conftest import convert, kld, kld_base, run, run_status


def test_bits_per_weight_target_is_met_with_bounded_divergence(cawsfs, archives, llama_bin, model_gguf, work):
    base = kld_base(cawsfs, archives, llama_bin, work)
    got = {}
    for target in (5.0, 4.0):
        out = work / f"bpw{target}.cawsf"
        report, stdout = convert(cawsfs, model_gguf, out, "--bpw", str(target))
        achieved = report["bits_per_weight"]
        # Planned with block compression estimated from samples; compression does a
        # little better than the samples say, so the archive lands just under. At 5
        # bits, further under: the Q4_1 layers' own grid is found at 4.5 bits (planes)
        # and more bits would buy no less error.
        assert target - 0.25 < achieved <= target, (target, achieved)
        assert abs(report["bpw"]["planned"] - achieved) < 0.05, report["bpw"]
        assert report["bpw"]["target"] == target and report["bpw"]["planned"] <= target + 1e-9
        assert f"target {target:g}, planned" in stdout, stdout
        g = work / f"bpw{target}.gguf"
        run([cawsfs, "export", out, "--format", "gguf", "--gguf-type", "f16", "-o", g])
        got[target] = kld(llama_bin, base, g)
        g.unlink()
    # The default is this plan at 5 bits.
    assert (work / "bpw5.0.cawsf").read_bytes() == archives["default"][0].read_bytes()
    pq = work / "pq.gguf"
    run([cawsfs, "export", archives["pq"][0], "--format", "gguf", "--gguf-type", "f16", "-o", pq])
    got["pq"] = kld(llama_bin, base, pq)
    print("mean KLD", got)
    # Measured over 4096 tokens: --bpw 5 0.066 at 4.97 bits, PQ (--pq-dim 2, the
    # default before) 0.276 at 5.02; here (contexts of 128) 0.081, 0.326, --bpw 4 0.84.
    assert got[5.0] < 0.12 and got[5.0] < 0.5 * got["pq"], got
    assert got[5.0] < got[4.0] < 1.2, got
    again = work / "bpw4-again.cawsf"
    convert(cawsfs, model_gguf, again, "--bpw", "4.0")
    assert again.read_bytes() == (work / "bpw4.0.cawsf").read_bytes()


def test_unreachable_targets_are_one_line_errors(cawsfs, archives, model_gguf, work):
    for target, says in (("1.0", "is below the smallest archive this model allows"),
                         ("0", "is not a positive number"),
                         ("nan", "is not a positive number")):
        p = run_status([cawsfs, "convert", model_gguf, "-o", work / "x.cawsf", "--bpw", target])
        err = p.stderr.strip()
        assert p.returncode != 0 and "\n" not in err and says in err, (target, err)
        assert not (work / "x.cawsf").exists()
    p = run_status([cawsfs, "convert", model_gguf, "-o", work / "x.cawsf", "--bpw", "4", "--sq-bits", "4"])
    assert p.returncode != 0 and "--sq-bits" in p.stderr, p.stderr
    p = run_status([cawsfs, "convert", model_gguf, "-o", work / "x.cawsf", "--bpw", "4", "--kmeans-iters", "3"])
    assert p.returncode != 0 and "--kmeans-iters" in p.stderr and "\n" not in p.stderr.strip(), p.stderr
    # The default target gives way instead: `--passthrough '*'` (5.54 bits on this
    # model) makes the smallest archive the model allows, every tensor whole.
    exact = archives["exact"][1]
    assert exact["bpw"]["target"] == 5.0 and exact["bpw"]["at_floor"], exact["bpw"]
    assert exact["max_rel_err"] == 0.0 and exact["bits_per_weight"] > 5.0

#!/usr/bin/env python3
"""Print the figures of a `llama-perplexity --kl-divergence` log through a format string:
  scripts/kld-log.py LOG FORMAT
FORMAT names ppl, ppl_err, kld, kld_err, top1, top1_err (str.format fields), e.g.
'{ppl:.3f} | {kld:.4f} ± {kld_err:.4f} | {top1:.2f}'. Used by quality.sh and
bench-imatrix.sh, so their tables read the log the same way."""
import re
import sys

t = open(sys.argv[1]).read()
ppl = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)", t)
kl = re.search(r"Mean\s+KLD:\s*([-\d.]+)\s*±\s*([\d.]+)", t)
top = re.search(r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)", t)
if not (ppl and kl and top):
    sys.exit(f"kld-log: {sys.argv[1]}: no PPL/KLD/top-1 figures (llama-perplexity failed?)")
print(sys.argv[2].format(ppl=float(ppl[1]), ppl_err=float(ppl[2]), kld=float(kl[1]),
                         kld_err=float(kl[2]), top1=float(top[1]), top1_err=float(top[2])))

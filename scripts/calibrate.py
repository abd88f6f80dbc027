#!/usr/bin/env python3
"""Second moments of every linear layer's inputs over a calibration text, for
`cawsfs convert --calibration FILE` (docs/CODECS.md, "Error feedback").

Runs the model with Hugging Face `transformers` on the CPU over TEXT in windows of CTX
tokens and accumulates, for each distinct input of the model's `nn.Linear` layers,
H = Σ x xᵀ / n (cols × cols, f32). Layers that read the same input (q/k/v, gate/up)
share one matrix. Writes a safetensors file: tensor `<weight name>` for the first weight
reading each input, and metadata `"readers"` mapping every weight name (as in the
model's safetensors) to the tensor holding its input's moments, plus the token count.

Usage: scripts/calibrate.py HF_DIR TEXT OUT.safetensors [--ctx 512] [--windows 8]
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("out")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.eval()
    text = open(a.text, encoding="utf-8").read()
    # The `tokenizers` library on the model's tokenizer.json, as cawsfs tokenizes:
    # transformers' own tokenizer class may split differently (SmolLM2: "\n\n" as two
    # tokens), which moves every later window.
    tj = os.path.join(a.model, "tokenizer.json")
    if os.path.exists(tj):
        ids = torch.tensor(Tokenizer.from_file(tj).encode(text).ids)
    else:
        ids = AutoTokenizer.from_pretrained(a.model)(text, return_tensors="pt").input_ids[0]
    # Windows spread evenly over the text, as `cawsfs calibrate` picks them; a text
    # shorter than one window is one window.
    ctx = min(a.ctx, len(ids))
    if ctx < 64:
        raise SystemExit(f"{a.text}: {len(ids)} tokens, fewer than 64")
    have = len(ids) // ctx
    want = max(1, min(have, a.windows))
    windows = [ids[(w * have // want) * ctx:][:ctx] for w in range(want)]
    sums, first_reader, readers, count = {}, {}, {}, {}

    def hook(name):
        def f(mod, inp, _out):
            x = inp[0].detach().reshape(-1, inp[0].shape[-1]).double()
            key = id(inp[0])
            # Modules fed the very same tensor share one matrix (the tensor is held
            # for the window so that its id is not reused).
            if key not in first_reader:
                first_reader[key] = (name, inp[0])
                sums[name] = sums.get(name, 0) + x.T @ x
                count[name] = count.get(name, 0) + x.shape[0]
            readers[name] = first_reader[key][0]
        return f

    hooks = [m.register_forward_hook(hook(n + ".weight"))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for w in windows:
            first_reader.clear()
            model(w[None, :])
    for h in hooks:
        h.remove()
    # A reader's first window may name another module than later ones: resolve once.
    out = {n: (s / count[n]).float().contiguous() for n, s in sums.items()
           if n in set(readers.values())}
    meta = {"readers": json.dumps(readers), "tokens": str(sum(len(w) for w in windows)),
            "ctx": str(ctx)}
    save_file(out, a.out, metadata=meta)
    print(a.out)


if __name__ == "__main__":
    main()

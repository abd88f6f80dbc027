#!/usr/bin/env python3
"""A synthetic Mixtral (random, seeded; bf16; ~2.3 GB) for benchmarking expert prefetching
under a memory limit, cached under ~/.cache/cawsfs/models/moe-bench-vN-aA. Prints each
directory on stdout (sizes and the measurement go to stderr unless --measure).

    scripts/make-moe-bench-model.py [--affinity A ...] [--measure] [shape flags]

--affinity A (in [0, 1], default 0.9; several may be given) sets how predictable routing
is from one layer to the next. A random model's routers are independent, so knowing a
token's experts at layer l says nothing about layer l+1; real MoE models are not like
that (published work reports for Mixtral 8x7B that a token's expert at layer l
predicts its expert at l+1 well; not measured here). For l >= 1
the router of layer l becomes

    W_l = sqrt(A) * P_l @ W_{l-1} + sqrt(1 - A) * R_l,   rescaled to R_l's std

where R_l is the router the random init gave layer l and P_l a seeded random permutation
of the experts: expert e at layer l-1 tends to be followed by expert P_l(e) at layer l
(as far as the residual stream into the two routers is alike). A = 0 is the plain random
model; every weight but the routers is the same for every A.

--measure then runs each model on CPU over ~2000 tokens of text (not the tokenizer's
training text) and prints how predictable its routing is: next-layer predictors trained
on the first half of the tokens and scored on the second half, expert balance, and how
often consecutive tokens use the same experts.

Shape flags that differ from the defaults are added to the directory name.
"""
import argparse
import gc
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

# Bump when the recipe changes, so cached directories are made again.
VERSION = 1
SEED = 1234
EMBED_STD = 1.0

DEFAULTS = dict(vocab=1024, hidden=1024, intermediate=2816, layers=16, heads=16, kv_heads=4,
                experts=8, experts_per_tok=2, max_pos=2048)
# Short names for the directory suffix of non-default shapes.
SHORT = dict(vocab="v", hidden="h", intermediate="i", layers="l", heads="ah", kv_heads="kv",
             experts="e", experts_per_tok="k", max_pos="p")

# Text to measure routing on: license texts other than the tokenizer's (GPL-3).
MEASURE_TEXTS = ["/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/MPL-2.0",
                 "/usr/share/common-licenses/GFDL-1.3", "/usr/share/common-licenses/LGPL-2.1"]


def arch_models():
    """scripts/make-arch-models.py as a module (for its tokenizer)."""
    path = Path(__file__).resolve().with_name("make-arch-models.py")
    spec = importlib.util.spec_from_file_location("make_arch_models", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def out_dir(args, affinity):
    cache = Path(os.environ.get("CAWSFS_CACHE", Path.home() / ".cache" / "cawsfs"))
    name = f"moe-bench-v{VERSION}-a{affinity:g}"
    for key, default in DEFAULTS.items():
        if getattr(args, key) != default:
            name += f"-{SHORT[key]}{getattr(args, key)}"
    if args.embed_std != EMBED_STD:
        name += f"-emb{args.embed_std:g}"
    return cache / "models" / name


def routers(model, n_experts, hidden):
    """Each layer's router (weight [n_experts, hidden]), in layer order."""
    import torch
    found = []
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if name.endswith(".gate") and isinstance(w, torch.Tensor) \
                and tuple(w.shape) == (n_experts, hidden):
            layer = int(name.split(".layers.")[1].split(".")[0])
            found.append((layer, module))
    found.sort(key=lambda x: x[0])
    assert [l for l, _ in found] == list(range(len(found))), [l for l, _ in found]
    return [m for _, m in found]


def set_affinity(model, config, affinity):
    import torch
    gates = routers(model, config.num_local_experts, config.hidden_size)
    assert len(gates) == config.num_hidden_layers
    gen = torch.Generator().manual_seed(SEED + 1)
    prev = gates[0].weight.detach().float()
    perms = []
    for gate in gates[1:]:
        # Drawn whatever the affinity, so every A gets the same permutations.
        perm = torch.randperm(config.num_local_experts, generator=gen)
        fresh = gate.weight.detach().float()
        moved = torch.empty_like(prev)
        moved[perm] = prev  # row perm[e] of P @ W_{l-1} is row e of W_{l-1}
        mixed = math.sqrt(affinity) * moved + math.sqrt(1 - affinity) * fresh
        mixed *= fresh.std() / mixed.std()
        with torch.no_grad():
            gate.weight.copy_(mixed.to(gate.weight.dtype))
        prev = mixed
        perms.append(perm.tolist())
    return perms


def make(args, affinity, out):
    import torch
    import transformers as tf
    t0 = time.time()
    tok = arch_models().bpe_tokenizer(args.vocab)
    config = tf.MixtralConfig(vocab_size=len(tok), hidden_size=args.hidden,
                              intermediate_size=args.intermediate,
                              num_hidden_layers=args.layers, num_attention_heads=args.heads,
                              num_key_value_heads=args.kv_heads,
                              num_local_experts=args.experts,
                              num_experts_per_tok=args.experts_per_tok,
                              max_position_embeddings=args.max_pos,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              tie_word_embeddings=False)
    torch.manual_seed(SEED)
    # Made directly in bf16: ~2.3 GB rather than f32's ~4.6 GB plus a copy.
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    # Scaled from the init's std (0.02): see --embed-std.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(args.embed_std / config.initializer_range)
    perms = set_affinity(model, config, affinity) if affinity > 0 else None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "moe-bench.json").write_text(json.dumps(
        {"version": VERSION, "seed": SEED, "affinity": affinity, "embed_std": args.embed_std,
         "permutations": perms}, indent=1) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    print(f"made {out.name} in {time.time() - t0:.0f} s", file=sys.stderr)


def summary(out):
    """Parameter count and bytes from the safetensors headers."""
    params = nbytes = expert = 0
    for f in sorted(out.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(t["shape"])
            params += count
            nbytes += t["data_offsets"][1] - t["data_offsets"][0]
            if ".experts." in name:
                expert += count
    disk = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out.name}: {params:,} parameters ({expert:,} in experts), {nbytes:,} bytes of "
          f"tensors, {disk / 1e9:.2f} GB on disk", file=sys.stderr)


# --- measurement --------------------------------------------------------------------

def route(out, n_tokens, dtype):
    """Top-k expert indices [layers, tokens, k] (best first) and the token ids."""
    import torch
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(out)
    text = "\n\n".join(Path(p).read_text() for p in MEASURE_TEXTS if Path(p).is_file())
    ids = tok(text)["input_ids"][:n_tokens]
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype)).eval()
    cfg = model.config
    logits = []
    hooks = [g.register_forward_hook(lambda m, i, o: logits.append(
                 (o[0] if isinstance(o, tuple) else o).detach().float().reshape(-1, cfg.num_local_experts)))
             for g in routers(model, cfg.num_local_experts, cfg.hidden_size)]
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    top = torch.stack(logits).topk(cfg.num_experts_per_tok, dim=-1).indices
    return top, torch.tensor(ids), cfg.num_local_experts


def stats(top, ids, n_experts):
    import torch
    L, T, K = top.shape
    half = T // 2
    top1 = top[..., 0]
    sets = torch.zeros(L, T, n_experts, dtype=torch.bool)
    sets.scatter_(2, top, True)
    r = {}
    acc1, p2, p3, r3, same_next, marg1 = [], [], [], [], [], []
    for l in range(L - 1):
        a, b = top1[l], top1[l + 1]
        # 1. top-1 -> most frequent top-1 successor (counts on the first half).
        c = torch.zeros(n_experts, n_experts)
        c.index_put_((a[:half], b[:half]), torch.ones(half), accumulate=True)
        fallback = torch.bincount(b[:half], minlength=n_experts).argmax()
        pred = torch.where(c.sum(1) > 0, c.argmax(1), fallback)
        acc1.append((pred[a[half:]] == b[half:]).float().mean().item())
        marg1.append((b[half:] == fallback).float().mean().item())
        # 2. set -> set: P(b in S_{l+1} | a in S_l), summed over a in S_l.
        s, n = sets[l].float(), sets[l + 1].float()
        cond = (s[:half].T @ n[:half]) / s[:half].sum(0).clamp(min=1)[:, None]
        score = s[half:] @ cond
        actual = sets[l + 1][half:]
        for k, prec, rec in ((2, p2, None), (3, p3, r3)):
            hit = actual.gather(1, score.topk(k, dim=1).indices).sum(1).float()
            prec.append((hit / k).mean().item())
            if rec is not None:
                rec.append((hit / K).mean().item())
        # Naive: the next layer uses the same experts.
        same_next.append((sets[l][half:] == sets[l + 1][half:]).all(1).float().mean().item())
    mean = lambda xs: sum(xs) / len(xs)
    r["top1 -> top1 successor acc"] = (mean(acc1), min(acc1), max(acc1))
    r["  baseline: most frequent expert"] = (mean(marg1), min(marg1), max(marg1))
    r["set -> top-2 precision(=recall)"] = (mean(p2), min(p2), max(p2))
    r["set -> top-3 precision"] = (mean(p3), min(p3), max(p3))
    r["set -> top-3 recall"] = (mean(r3), min(r3), max(r3))
    r["S_l+1 == S_l (no transition)"] = (mean(same_next), min(same_next), max(same_next))
    # 3. balance: fraction of token-expert slots per expert (uniform = 1/n_experts).
    frac = sets.float().mean(1) / K  # [L, E]
    r["expert share min (per layer)"] = (frac.min(1).values.mean().item(), frac.min().item(),
                                         frac.min(1).values.max().item())
    r["expert share max (per layer)"] = (frac.max(1).values.mean().item(),
                                         frac.max(1).values.min().item(), frac.max().item())
    # 4. temporal: token t's set at layer l equals token t-1's.
    same = (sets[:, 1:] == sets[:, :-1]).all(2).float().mean(1)
    overlap = (sets[:, 1:] & sets[:, :-1]).sum(2).float().mean(1) / K
    r["S_l(t) == S_l(t-1)"] = (same.mean().item(), same.min().item(), same.max().item())
    r["|S_l(t) & S_l(t-1)| / k"] = (overlap.mean().item(), overlap.min().item(),
                                    overlap.max().item())
    # How much routing is a function of the token id: predict S_l(t) as the most common
    # set for that id on the first half (test tokens whose id was seen).
    acc = []
    key = (sets.long() * (2 ** torch.arange(n_experts))).sum(2)  # [L, T] set as bitmask
    seen_ids = set(ids[:half].tolist())
    test = [t for t in range(half, T) if ids[t].item() in seen_ids]
    for l in range(L):
        best = {}
        for t in range(half):
            best.setdefault(ids[t].item(), []).append(key[l, t].item())
        best = {i: max(set(v), key=v.count) for i, v in best.items()}
        acc.append(sum(best[ids[t].item()] == key[l, t].item() for t in test) / len(test))
    r["S_l from token id (seen ids)"] = (mean(acc), min(acc), max(acc))
    return r


def measure(outs, n_tokens, dtype):
    results = {}
    for out in outs:
        t0 = time.time()
        top, ids, n_experts = route(out, n_tokens, dtype)
        results[out.name.removeprefix(f"moe-bench-v{VERSION}-")] = stats(top, ids, n_experts)
        gc.collect()
        print(f"measured {out.name}: {top.shape[1]} tokens, {top.shape[0]} layers, "
              f"{time.time() - t0:.0f} s", file=sys.stderr)
    k = top.shape[2]
    chance = {"top1 -> top1 successor acc": 1 / n_experts,
              "set -> top-2 precision(=recall)": k / n_experts,
              "set -> top-3 precision": k / n_experts, "set -> top-3 recall": 3 / n_experts,
              "S_l(t) == S_l(t-1)": 1 / math.comb(n_experts, k),
              "S_l+1 == S_l (no transition)": 1 / math.comb(n_experts, k),
              "|S_l(t) & S_l(t-1)| / k": k / n_experts,
              "expert share min (per layer)": 1 / n_experts,
              "expert share max (per layer)": 1 / n_experts}
    print("\nmean over layers (min..max); 'chance' = uniform independent routing")
    names = list(results)
    print(f"{'':34}" + "".join(f"{n:>22}  " for n in names) + f"{'chance':>8}")
    for row in next(iter(results.values())):
        line = f"{row:34}"
        for n in names:
            m, lo, hi = results[n][row]
            line += f"{m:>8.3f} ({lo:.2f}..{hi:.2f})".rjust(24)
        c = chance.get(row)
        print(line + (f"{c:>8.3f}" if c is not None else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--affinity", type=float, nargs="+", default=[0.9],
                   help="inter-layer expert affinity(ies) in [0, 1] (default 0.9)")
    p.add_argument("--measure", action="store_true",
                   help="run the model(s) over ~2000 tokens and print routing statistics")
    p.add_argument("--embed-std", type=float, default=EMBED_STD,
                   help="std of the token embeddings (random init: 0.02)")
    p.add_argument("--tokens", type=int, default=2000, help="tokens to measure on")
    p.add_argument("--measure-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    for key, default in DEFAULTS.items():
        p.add_argument("--" + key.replace("_", "-"), type=int, default=default)
    args = p.parse_args()
    outs = []
    for a in args.affinity:
        if not 0 <= a <= 1:
            p.error(f"affinity {a} not in [0, 1]")
        out = out_dir(args, a)
        if not (out / "config.json").is_file():
            make(args, a, out)
        summary(out)
        print(out, flush=True)
        outs.append(out)
    if args.measure:
        measure(outs, args.tokens, args.measure_dtype)


if __name__ == "__main__":
    main()

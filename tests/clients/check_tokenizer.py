#!/usr/bin/env python3
"""Check a derived Hugging Face tokenizer.json against the GGUF vocabulary it came from.

  check_tokenizer.py compare TOKENIZER_JSON GGUF [--llama-tokenize BIN]
      Tokenize several strings with `tokenizers` (and with transformers' AutoTokenizer
      over the directory holding TOKENIZER_JSON when it has a tokenizer_config.json)
      and compare with llama.cpp's `llama-tokenize` on the GGUF. Without the binary,
      the reference is transformers' own GGUF tokenizer conversion. Exit 1 on mismatch.

  check_tokenizer.py dump-meta GGUF OUT_JSON
      Write the GGUF metadata as cawsfs's `Vec<(String, GgufValue)>` JSON, a fixture
      for the Rust test `layout::tests::real_gguf_vocab_to_tokenizer_json`
      (env CAWSFS_GGUF_META_JSON=OUT_JSON CAWSFS_TOKENIZER_OUT=DIR).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

STRINGS = [
    "The capital of France is 12345.",
    "Hello, world! How are you doing today?",
    "  leading spaces and\ttabs\nand newlines\n\n",
    "numbers 3.14159 and 1,000,000 and 2024-11-21",
    "Ünïcödé façade — naïve café 東京 😀",
    "def f(x):\n    return x**2  # comment",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say we've done it, haven't we?",
]

DEFAULT_LLAMA_TOKENIZE = os.path.expanduser(
    "~/.cache/cawsfs/llama.cpp-0.3.36/build/bin/llama-tokenize"
)


def llama_ids(binary, gguf_path, text):
    out = subprocess.run(
        [binary, "-m", gguf_path, "-p", text, "--ids", "--log-disable", "--no-bos"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return json.loads(line)


def transformers_gguf_ids(gguf_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    return lambda text: tok.encode(text, add_special_tokens=False)


def compare(args):
    from tokenizers import Tokenizer

    derived = Tokenizer.from_file(args.tokenizer_json)
    binary = args.llama_tokenize or DEFAULT_LLAMA_TOKENIZE
    if binary and os.path.exists(binary):
        ref_name = "llama-tokenize"
        ref = lambda text: llama_ids(binary, args.gguf, text)  # noqa: E731
    else:
        ref_name = "transformers(gguf)"
        ref = transformers_gguf_ids(args.gguf)

    auto = None
    tdir = os.path.dirname(os.path.abspath(args.tokenizer_json))
    if os.path.exists(os.path.join(tdir, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(tdir)

    bad = 0
    for text in STRINGS:
        want = ref(text)
        got = derived.encode(text, add_special_tokens=False).ids
        ok = got == want
        if auto is not None:
            got_auto = auto.encode(text, add_special_tokens=False)
            ok = ok and got_auto == want
        else:
            got_auto = None
        if not ok:
            bad += 1
            print(f"MISMATCH {text!r}\n  {ref_name}: {want}\n  tokenizers: {got}\n  AutoTokenizer: {got_auto}")
        else:
            print(f"ok {text!r}: {len(want)} tokens")
        if derived.decode(got, skip_special_tokens=False) != text:
            print(f"  (note: decode does not round-trip {text!r})")
    print(f"{len(STRINGS) - bad}/{len(STRINGS)} strings match {ref_name}")
    return 1 if bad else 0


def dump_meta(args):
    import gguf

    tag = {
        gguf.GGUFValueType.UINT8: "u8",
        gguf.GGUFValueType.INT8: "i8",
        gguf.GGUFValueType.UINT16: "u16",
        gguf.GGUFValueType.INT16: "i16",
        gguf.GGUFValueType.UINT32: "u32",
        gguf.GGUFValueType.INT32: "i32",
        gguf.GGUFValueType.FLOAT32: "f32",
        gguf.GGUFValueType.BOOL: "bool",
        gguf.GGUFValueType.STRING: "string",
        gguf.GGUFValueType.UINT64: "u64",
        gguf.GGUFValueType.INT64: "i64",
        gguf.GGUFValueType.FLOAT64: "f64",
    }
    r = gguf.GGUFReader(args.gguf)
    out = []
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        t = field.types
        v = field.contents()
        if t[0] == gguf.GGUFValueType.ARRAY:
            if len(t) != 2:
                continue  # nested arrays: not used by llama models
            out.append([key, {"array": {tag[t[1]]: list(v)}}])
        else:
            out.append([key, {tag[t[0]]: v}])
    with open(args.out_json, "w") as f:
        json.dump(out, f, ensure_ascii=False)
    print(f"{len(out)} keys -> {args.out_json}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("tokenizer_json")
    c.add_argument("gguf")
    c.add_argument("--llama-tokenize", default=shutil.which("llama-tokenize"))
    d = sub.add_parser("dump-meta")
    d.add_argument("gguf")
    d.add_argument("out_json")
    args = p.parse_args()
    return compare(args) if args.cmd == "compare" else dump_meta(args)


if __name__ == "__main__":
    sys.exit(main())

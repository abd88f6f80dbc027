"""Write a small random-weight llama model whose every 2-D tensor has rows of a multiple of
256 values, so llama.cpp's K-quants (Q4_K, Q6_K …) apply to every weight without falling
back. Called by scripts/make-kquant-model.sh, which supplies the tokenizer side files.

    python3 scripts/make-kquant-model.py TOKENIZER_HF_DIR OUT_DIR [k256|1b|w2k]

Shape `k256` (the default): hidden 256, intermediate 768, 4 heads of 64 with 1 KV head
(GQA ratio 4, which some llama-quantize presets test), 8 layers (so the medium mixes'
first/last-eighth rules pick distinct layers), an untied output head (the test model's
is tied), and the tokenizer and vocabulary of TOKENIZER_HF_DIR (49152 tokens for
SmolLM2) so llama.cpp tokenizes real text. Shape `1b`: TinyLlama's (hidden 2048,
intermediate 5632, 22 layers, 32 heads of 64 with 4 KV heads, untied), 1.17 B
parameters with this vocabulary, 2.3 GB in bf16: the large model the disk-tier
benchmark loads. Weights come from numpy's PCG64 with a fixed seed, not from torch's
initializers, so the bytes do not depend on the torch or transformers version.
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 20240601
SIDE_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json"]


SHAPES = {
    "k256": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=64),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, head_dim=64),
    # The 1b shape's matrices in 2 layers (0.29 B parameters): GPU throughput runs
    # (scripts/test-cuda.sh) on tensors of realistic size in little time.
    "w2k": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                num_attention_heads=32, num_key_value_heads=4, head_dim=64),
}


def main(tok_dir, out, shape="k256"):
    tok_dir, out = Path(tok_dir), Path(out)
    src = json.loads((tok_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=src["vocab_size"],
        **SHAPES[shape],
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=src.get("rope_theta", 10000.0),
        tie_word_embeddings=False,
        bos_token_id=src.get("bos_token_id"),
        eos_token_id=src.get("eos_token_id"),
        pad_token_id=src.get("pad_token_id"),
    )
    # Built in bf16 (the large shape would take 4.7 GB in f32); values are drawn in f32.
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(config)
    rng = np.random.default_rng(SEED)
    with torch.no_grad():
        # Sorted names: the draw order, hence the bytes, is fixed by the names alone.
        params = dict(model.named_parameters())
        for name in sorted(params):
            p = params[name]
            if p.dim() == 1:
                # RMS norm gains near 1, not all equal, so a wrong norm shows.
                v = 1.0 + 0.1 * rng.standard_normal(p.shape)
            else:
                v = 0.02 * rng.standard_normal(p.shape)
            p.copy_(torch.from_numpy(v.astype(np.float32)))
            del v
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)
    # transformers 5 writes rope_theta only inside rope_parameters; readers of the older
    # layout (cawsfs's HF import among them) look for it at the top level.
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("rope_theta", config.rope_parameters["rope_theta"]
                   if getattr(config, "rope_parameters", None) else config.rope_theta)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in SIDE_FILES:
        if (tok_dir / f).is_file() and not (out / f).exists():
            shutil.copy(tok_dir / f, out / f)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or (len(sys.argv) == 4 and sys.argv[3] not in SHAPES):
        sys.exit(__doc__)
    main(*sys.argv[1:])

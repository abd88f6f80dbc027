#!/usr/bin/env python3
"""Tiny randomly initialised Hugging Face models of several architectures, for the
architecture tests (tests/clients/test_arch.py): config -> from_config -> save_pretrained,
a few MB each, cached under ~/.cache/cawsfs/models/arch/NAME-vN. Prints each directory.

    scripts/make-arch-models.py [NAME ...]     # default: every model below

The weights are random (seeded), so only what is read back, not what a model says,
can be compared. Each model's dtype and sharding differ on purpose: f32, f16 and bf16
sources, and one sharded source directory.
"""
import os
import shutil
import sys
from pathlib import Path

# Bump when a model's recipe changes, so cached directories are made again.
VERSION = 6

# Text the causal models' byte-level BPE tokenizer is trained on (Debian's base-files).
TEXT = "/usr/share/common-licenses/GPL-3"
# The causal models that get that tokenizer (llama.cpp needs a vocabulary to load one);
# BERT gets a WordPiece one trained on the same text.
WITH_TOKENIZER = ("gpt2", "qwen3", "phi3", "gemma2", "phi3-long", "mixtral", "qwen2moe",
                  "qwen3moe", "olmoe")

# Large enough that an archive's own metadata is a small part of it (the default codec
# plans bits per weight for the whole archive), small enough to make in a second.
COMMON = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256)


def recipes():
    import transformers as tf
    return {
        # An encoder: AutoModel, no head; f32 like sentence-transformers checkpoints.
        "bert": (tf.BertConfig(**COMMON, type_vocab_size=2), "float32", None),
        "gpt2": (tf.GPT2Config(vocab_size=1024, n_embd=256, n_layer=2, n_head=4, n_positions=256),
                 "float32", None),
        "qwen3": (tf.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=64,
                                 tie_word_embeddings=False), "bfloat16", None),
        # query_pre_attn_scalar = head_dim as in Gemma 2 2B and 9B (llama.cpp scales
        # by the head size except for 27B).
        "gemma2": (tf.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=64,
                                   query_pre_attn_scalar=64), "float16", None),
        # Sharded like a large checkpoint: model-0000i-of-0000N + index.
        "phi3": (tf.Phi3Config(**COMMON, num_key_value_heads=2, pad_token_id=0), "bfloat16",
                 "1MB"),
        # LongRoPE (Phi-3.5's rotary scaling): factors llama.cpp reads as tensors.
        "phi3-long": (tf.Phi3Config(**{**COMMON, "max_position_embeddings": 256},
                                    num_key_value_heads=2, pad_token_id=0,
                                    original_max_position_embeddings=128,
                                    rope_scaling={"rope_type": "longrope",
                                                  "long_factor": [1.0 + 0.1 * i for i in range(32)],
                                                  "short_factor": [1.0 + 0.01 * i for i in range(32)]}),
                      "float32", None),
        # A SentencePiece vocabulary (tokenizer.model beside its tokenizer.json), as
        # Llama 2, Mistral 7B v0.1 and Gemma have.
        "llama-spm": (tf.LlamaConfig(**COMMON, num_key_value_heads=2), "float16", None),
        # An architecture llama.cpp does not run: no GGUF view.
        # Mixtures of experts: 4 experts, 2 per token. Mixtral is a llama with experts;
        # Qwen2-MoE adds a shared expert behind a gate; OLMoE normalizes Q and K whole
        # (llama.cpp sizes its K norm by the hidden size: no grouped-query attention).
        "mixtral": (tf.MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2), "bfloat16", None),
        "qwen2moe": (tf.Qwen2MoeConfig(**COMMON, num_key_value_heads=2, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=128,
                                       shared_expert_intermediate_size=256), "float16", None),
        # Qwen3-MoE: Qwen3's attention (per-head Q and K norms, head_dim its own key),
        # no shared expert, the chosen experts' weights renormalized (llama.cpp always
        # does for qwen3moe; Qwen3-30B-A3B's config says so too).
        "qwen3moe": (tf.Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=64,
                                       num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=128, norm_topk_prob=True,
                                       tie_word_embeddings=False), "bfloat16", None),
        "olmoe": (tf.OlmoeConfig(**COMMON, num_key_value_heads=4, num_experts=4,
                                 num_experts_per_tok=2, pad_token_id=0, eos_token_id=1,
                                 bos_token_id=None), "float32", None),
        "opt": (tf.OPTConfig(vocab_size=1024, hidden_size=256, ffn_dim=512, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=256,
                             word_embed_proj_dim=256), "float16", None),
    }


def bpe_tokenizer(vocab_size, specials=("<|endoftext|>",)):
    """A byte-level BPE (GPT-2's kind) of `vocab_size` tokens trained on TEXT: the
    same tokenizer on every machine (training is deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(Path(TEXT).read_text().splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")


def spm_tokenizer(vocab_size, out):
    """A SentencePiece BPE with byte fallback (Llama 2's kind) of `vocab_size` pieces
    trained on TEXT, saved in `out` as tokenizer.model and as the tokenizer.json
    transformers converts it to."""
    import io
    import sentencepiece as spm
    from transformers import AutoTokenizer
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(Path(TEXT).read_text().splitlines()), model_writer=model,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    (out / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", '
        '"unk_token": "<unk>", "add_bos_token": true}')
    AutoTokenizer.from_pretrained(out).save_pretrained(out)


def wordpiece_tokenizer(vocab_size):
    """BERT's kind of tokenizer (lower-cased WordPiece, [CLS] text [SEP]) of `vocab_size`
    tokens trained on TEXT."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special,
                                        show_progress=False)
    tok.train_from_iterator(Path(TEXT).read_text().splitlines(), trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def make(name, out):
    import torch
    import transformers as tf
    config, dtype, shard = recipes()[name]
    torch.manual_seed(1234)
    auto = tf.AutoModel if name == "bert" else tf.AutoModelForCausalLM
    model = auto.from_config(config).to(getattr(torch, dtype)).eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp, **kw)
    if name in WITH_TOKENIZER:
        # Phi-3's vocabulary has SentencePiece's specials; llama.cpp looks them up by
        # name when it loads a model named phi3.
        specials = (("<|endoftext|>", "<unk>", "<s>", "</s>") if name.startswith("phi3")
                    else ("<|endoftext|>",))
        bpe_tokenizer(config.vocab_size, specials).save_pretrained(tmp)
    if name == "bert":
        wordpiece_tokenizer(config.vocab_size).save_pretrained(tmp)
    if name == "llama-spm":
        spm_tokenizer(config.vocab_size, tmp)
    tmp.rename(out)


def main(names):
    cache = Path(os.environ.get("CAWSFS_CACHE", Path.home() / ".cache" / "cawsfs"))
    root = cache / "models" / "arch"
    root.mkdir(parents=True, exist_ok=True)
    for name in names or list(recipes()):
        out = root / f"{name}-v{VERSION}"
        if not (out / "config.json").is_file():
            make(name, out)
        print(out)


if __name__ == "__main__":
    main(sys.argv[1:])

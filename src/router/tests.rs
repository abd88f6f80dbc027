use std::collections::BTreeMap;

use super::*;
use crate::archive::{encode_routing, ShardKind};
use crate::gguf::GgufValue;
use crate::model::ArchConfig;
use crate::test_support::{self, f32_tensor, tiny_arch, word_level_tokenizer, MemSource};

const WORDS: [&str; 12] = [
    "<unk>", "the", "capital", "of", "france", "is", "paris", "dog", "cat", "red", "blue", "sky",
];

/// 12-token vocabulary, hidden 4, one layer; with `moe`, a 2-expert layer whose gate
/// row e equals the embedding of token 7 (e = 0) or 10 (e = 1).
fn fake(moe: bool, tokenizer: bool) -> MemSource {
    let mut tensors = vec![
        f32_tensor("model.embed_tokens.weight", &[12, 4]),
        f32_tensor("model.layers.0.input_layernorm.weight", &[4]),
        f32_tensor("model.layers.0.mlp.up_proj.weight", &[8, 4]),
        f32_tensor("model.norm.weight", &[4]),
    ];
    // One-hot-ish embeddings: token i points along axis i % 4, scaled by i.
    let emb: Vec<f32> = (0..12)
        .flat_map(|i| (0..4).map(move |c| if c == i % 4 { 1.0 + i as f32 } else { 0.0 }))
        .collect();
    let mut data = vec![emb.clone(), vec![1.0; 4], vec![0.5; 32], vec![1.0; 4]];
    if moe {
        tensors.push(f32_tensor(
            "model.layers.0.block_sparse_moe.gate.weight",
            &[2, 4],
        ));
        let mut gate = emb[7 * 4..8 * 4].to_vec();
        gate.extend_from_slice(&emb[10 * 4..11 * 4]);
        data.push(gate);
        for e in 0..2 {
            for w in ["w1", "w2", "w3"] {
                tensors.push(f32_tensor(
                    &format!("model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"),
                    &[8, 4],
                ));
                data.push(vec![0.25; 32]);
            }
        }
    }
    let mut hf_files = BTreeMap::new();
    if tokenizer {
        hf_files.insert("tokenizer.json".to_string(), word_level_tokenizer(&WORDS));
    }
    let arch = ArchConfig {
        vocab_size: 12,
        tie_word_embeddings: true,
        bos_token_id: None,
        eos_token_id: None,
        ..tiny_arch()
    };
    MemSource {
        desc: ModelDesc {
            hf_files,
            gguf_meta: vec![("general.name".into(), GgufValue::String("fake".into()))],
            ..test_support::model(arch, tensors)
        },
        data,
    }
}

#[test]
fn keys_are_normalized_and_deterministic() {
    let k = bag_key(["a", "b", "a"], KEY_DIM);
    let n: f32 = k.iter().map(|x| x.1 * x.1).sum();
    assert!((n - 1.0).abs() < 1e-5);
    assert_eq!(k, bag_key(["b", "a", "a"], KEY_DIM));
    assert!(k.windows(2).all(|w| w[0].0 < w[1].0));
    assert!(bag_key(std::iter::empty::<&str>(), KEY_DIM).is_empty());
    assert_eq!(
        token_slot("Ġcapital", KEY_DIM),
        token_slot("Ġcapital", KEY_DIM)
    );
    // Same bag → cosine 1; disjoint bags → 0 (no collision among these few tokens).
    assert!((cosine(&k, &k) - 1.0).abs() < 1e-5);
    assert_eq!(
        cosine(&bag_key(["x"], KEY_DIM), &bag_key(["y"], KEY_DIM)),
        0.0
    );
    // In a one-dimensional space every token collides: only the sign is left.
    let tiny = bag_key(["a", "b", "c", "d"], 1);
    assert!(tiny.len() <= 1);
}

#[test]
fn embedding_blocks_hold_their_tokens_and_rank_first() {
    let src = fake(false, true);
    // 4-column f32 rows are 16 bytes: 48-byte "chunks" give 3-row shards.
    let r = build_routing(&src, 48).unwrap();
    let emb: Vec<_> = r
        .shards
        .iter()
        .filter(|s| s.kind == ShardKind::Embedding)
        .collect();
    assert_eq!(emb.len(), 4);
    assert_eq!((emb[1].row0, emb[1].row1, emb[1].cost), (3, 6, 48));
    assert!(emb.iter().all(|s| !s.key.is_empty() && s.order == 0));
    // The others: order and cost, no key; the embedding has no whole-tensor shard.
    let others: Vec<_> = r
        .shards
        .iter()
        .filter(|s| s.kind == ShardKind::Other)
        .collect();
    assert_eq!(others.len(), 3);
    assert!(others.iter().all(|s| s.key.is_empty()));
    assert_eq!(
        others.iter().map(|s| s.order).collect::<Vec<_>>(),
        [1, 1, 2]
    );

    let bytes = encode_routing(&r);
    let router = Router::open(&src.desc, &bytes).unwrap().unwrap();
    let (tokens, key) = router.prompt_key(&src.desc, "the capital of").unwrap();
    assert_eq!(tokens, ["the", "capital", "of"]);
    let ranked = router.rank(&key, 10);
    // Tokens 1, 2 live in block 0 (rows 0..3), token 3 in block 1 (rows 3..6).
    let rows: Vec<(u64, u64)> = ranked
        .iter()
        .map(|x| (r.shards[x.shard].row0, r.shards[x.shard].row1))
        .collect();
    assert_eq!(rows, [(0, 3), (3, 6)], "{ranked:?}");
    assert!(ranked[0].score > ranked[1].score);
    assert_eq!(router.rank(&key, 1).len(), 1);
    // A prompt of unrelated words ranks nothing from block 0.
    let (_, key) = router.prompt_key(&src.desc, "red sky").unwrap();
    assert!(router
        .rank(&key, 10)
        .iter()
        .all(|x| r.shards[x.shard].row0 >= 9));
    assert_eq!(router.ordered().len(), 3);
}

#[test]
fn experts_are_keyed_by_the_tokens_their_gate_prefers() {
    let src = fake(true, true);
    let r = build_routing(&src, 1 << 20).unwrap();
    let experts: Vec<_> = r
        .shards
        .iter()
        .filter(|s| s.kind == ShardKind::Expert)
        .collect();
    assert_eq!(experts.len(), 6);
    assert!(experts.iter().all(|s| s.order == 1 && s.cost == 8 * 4 * 4));
    // 12 tokens / 2 experts: each key holds the 6 tokens its gate scores highest. Gate 0
    // points along token 7's axis (tokens 3, 7, 11 score > 0), gate 1 along token 10's.
    let router = Router::open(&src.desc, &encode_routing(&r))
        .unwrap()
        .unwrap();
    let expert_of = |x: &Ranked| {
        let name = &src.desc.tensors[r.shards[x.shard].tensor as usize].name;
        name.contains("experts.0.")
            .then_some(0)
            .or(name.contains("experts.1.").then_some(1))
    };
    let (_, key) = router.prompt_key(&src.desc, "dog").unwrap();
    let hits: Vec<_> = router
        .rank(&key, 100)
        .iter()
        .filter_map(expert_of)
        .collect();
    assert_eq!(hits, [0, 0, 0]);
    let (_, key) = router.prompt_key(&src.desc, "blue").unwrap();
    let hits: Vec<_> = router
        .rank(&key, 100)
        .iter()
        .filter_map(expert_of)
        .collect();
    assert_eq!(hits, [1, 1, 1]);
    // Deterministic.
    assert_eq!(
        encode_routing(&r),
        encode_routing(&build_routing(&src, 1 << 20).unwrap())
    );
}

#[test]
fn top_tokens_follow_the_gate() {
    let emb: Vec<f32> = vec![1.0, 0.0, 0.0, 1.0, 0.7, 0.7, -1.0, 0.0];
    assert_eq!(build::top_tokens_for_test(&emb, &[0.0, 1.0], 2), [1, 2]);
    assert_eq!(build::top_tokens_for_test(&emb, &[1.0, 0.0], 1), [0]);
}

#[test]
fn without_a_tokenizer_routes_have_no_keys() {
    let src = fake(false, false);
    let r = build_routing(&src, 48).unwrap();
    assert!(!r.is_empty());
    assert!(r.shards.iter().all(|s| s.key.is_empty()));
    let router = Router::open(&src.desc, &encode_routing(&r))
        .unwrap()
        .unwrap();
    assert!(router.prompt_key(&src.desc, "the").is_err());
}

#[test]
fn routing_that_does_not_fit_the_model_is_refused() {
    let src = fake(false, true);
    let mut r = build_routing(&src, 48).unwrap();
    r.shards[0].row1 = 99;
    let e = Router::open(&src.desc, &encode_routing(&r)).err().unwrap();
    assert!(e.contains("past the 12 rows"), "{e}");
    r.shards[0].row1 = 3;
    r.shards[0].tensor = 50;
    let e = Router::open(&src.desc, &encode_routing(&r)).err().unwrap();
    assert!(e.contains("tensor 50 does not exist"), "{e}");
    assert!(Router::open(&src.desc, &[]).unwrap().is_none());
}

/// `tokenizer.json` of a byte-level BPE with `n` merges (deterministic), added tokens
/// both inside the vocabulary and after it, and the usual GPT-2 style parts.
fn byte_level_bpe(n: usize) -> Vec<u8> {
    use rand::{RngExt, SeedableRng};
    let mut alphabet: Vec<String> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .map(String::from)
        .collect();
    alphabet.sort();
    let mut vocab = alphabet.clone();
    let mut seen: std::collections::HashSet<String> = vocab.iter().cloned().collect();
    let mut merges = Vec::new();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    // Every pair of lowercase letters, then merges of earlier merges.
    let letters: Vec<String> = ('a'..='z').map(String::from).collect();
    let mut pool = letters.clone();
    for a in &letters {
        for b in &letters {
            seen.insert(format!("{a}{b}"));
            merges.push(format!("{a} {b}"));
            vocab.push(format!("{a}{b}"));
            pool.push(format!("{a}{b}"));
        }
    }
    while merges.len() < n {
        let a = pool[rng.random_range(0..pool.len())].clone();
        let b = pool[rng.random_range(0..pool.len())].clone();
        let m = format!("{a}{b}");
        if m.len() > 12 || !seen.insert(m.clone()) {
            continue;
        }
        merges.push(format!("{a} {b}"));
        vocab.push(m.clone());
        pool.push(m);
    }
    vocab.push("<|endoftext|>".into());
    let vocab: serde_json::Map<String, serde_json::Value> = vocab
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i.into()))
        .collect();
    let n_vocab = vocab.len();
    serde_json::to_vec(&serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": n_vocab - 1, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true},
            {"id": n_vocab, "content": "<|im_start|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true},
            {"id": n_vocab + 1, "content": " hello", "single_word": true, "lstrip": false,
             "rstrip": false, "normalized": true, "special": false}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges}
    }))
    .unwrap()
}

#[test]
fn bpe_tokenizers_load_as_tokenizers_loads_them_with_less_memory() {
    let json = byte_level_bpe(40_000);
    let (theirs, their_peak) =
        crate::mem::peak_above(|| tokenizers::Tokenizer::from_bytes(&json).unwrap());
    let (ours, our_peak) = crate::mem::peak_above(|| super::tokenizer_from_json(&json).unwrap());
    assert_eq!(ours.get_vocab_size(true), theirs.get_vocab_size(true));
    assert_eq!(ours.get_vocab(true), theirs.get_vocab(true));
    assert_eq!(
        ours.get_added_tokens_decoder(),
        theirs.get_added_tokens_decoder()
    );
    for text in [
        "the quick brown fox jumps over the lazy dog",
        "<|im_start|>user hello world<|endoftext|> and hello again",
        "Ünïcödé, digits 12345 and   spaces\n\ttabs",
        "",
    ] {
        let (a, b) = (
            ours.encode(text, true).unwrap(),
            theirs.encode(text, true).unwrap(),
        );
        assert_eq!(
            (a.get_ids(), a.get_tokens()),
            (b.get_ids(), b.get_tokens()),
            "{text:?}"
        );
    }
    let fox = ours.encode("the quick brown fox", false).unwrap();
    assert!(
        fox.get_ids().len() < 15,
        "merges apply: {:?}",
        fox.get_tokens()
    );
    // tokenizers' own path buffers the whole model as a generic tree first (0.56x here,
    // 20 MB against 53 MB for SmolLM2's tokenizer.json).
    assert!(
        our_peak * 3 < their_peak * 2,
        "heap peak {our_peak} bytes, tokenizers' own load {their_peak}"
    );
}

#[test]
fn tokenizers_that_are_not_bpe_load_through_tokenizers() {
    let json = word_level_tokenizer(&WORDS);
    let ours = super::tokenizer_from_json(&json).unwrap();
    let theirs = tokenizers::Tokenizer::from_bytes(&json).unwrap();
    assert_eq!(ours.get_vocab(true), theirs.get_vocab(true));
    let text = WORDS.join(" ");
    assert_eq!(
        ours.encode(text.as_str(), false).unwrap().get_ids(),
        theirs.encode(text.as_str(), false).unwrap().get_ids()
    );
}

//! Inputs the fuzz targets (fuzz/, scripts/fuzz.sh, docs/RELIABILITY.md) found to crash,
//! minimized, each kept as a test that the crash stays fixed.

use std::collections::BTreeMap;

use cawsfs::model::{ArchConfig, ModelDesc};

fn model_with_tokenizer(tokenizer_json: &[u8]) -> ModelDesc {
    ModelDesc {
        arch: ArchConfig {
            model_type: "llama".into(),
            gguf_arch: Some("llama".into()),
            n_layers: 1,
            hidden_size: 4,
            intermediate_size: 8,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            vocab_size: 10,
            context_length: 64,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            bos_token_id: None,
            eos_token_id: None,
            pad_token_id: None,
        },
        tensors: Vec::new(),
        hf_files: BTreeMap::from([("tokenizer.json".to_string(), tokenizer_json.to_vec())]),
        gguf_meta: Vec::new(),
    }
}

/// hf_json target: a JSON syntax error inside tokenizer.json's "decoder" made tokenizers
/// 0.22 panic (`expect("Helper")` in its decoder deserializer) instead of returning an
/// error — a panic of `convert` (routing keys) and of the daemon's `route`, from any
/// archive or source whose tokenizer.json is malformed there. Found as a stray comma,
/// a control character, and an invalid UTF-8 byte in the decoder of the seed tokenizer.
#[test]
fn malformed_decoder_in_tokenizer_json_is_an_error_not_a_panic() {
    for input in [
        &b"{\"decoder\":{\"type\":\"ByteLevel\",}}"[..],
        b"{\"decoder\":{\"type\":\"Byte\x01Level\"}}",
        b"{\"decoder\":{\"type\":\"Byte\xffLevel\"}}",
        b"{\"decoder\":{\"type\":",
    ] {
        let Err(err) = cawsfs::router::load_tokenizer(&model_with_tokenizer(input)) else {
            panic!("a malformed tokenizer.json loaded");
        };
        assert!(err.contains("tokenizer.json"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }
}

/// hf_json target (2026-11-29, 8.0 M executions into the campaign against the fixes
/// above): a number out of range ("1e999") inside "decoder" passed the JSON check
/// (skipping a value does not read its numbers) and made tokenizers panic ("Helper")
/// again; caught, but with the panic's message on stderr. Now refused before tokenizers
/// sees it.
#[test]
fn number_out_of_range_in_the_decoder_is_an_error_before_tokenizers() {
    let input = br#"{"decoder":{"type":"ByteLevel","trim_offsets":1e999}}"#;
    let Err(err) = cawsfs::router::load_tokenizer(&model_with_tokenizer(input)) else {
        panic!("a tokenizer.json with a number out of range loaded");
    };
    assert!(
        err.contains("tokenizer.json") && err.contains("decoder"),
        "{err}"
    );
    assert!(
        !err.contains("tokenizers crate failed"),
        "tokenizers saw it: {err}"
    );
}

/// hf_json target (2026-11-28, 2.2 M executions into a new campaign): a BPE model
/// whose merge's second token is shorter than its `continuing_subword_prefix` made
/// tokenizers 0.22 slice a string out of bounds (`BpeBuilder::build`) and panic, with or
/// without the model's "type". Now one error naming tokenizer.json.
#[test]
fn merge_shorter_than_the_subword_prefix_is_an_error_not_a_panic() {
    for ty in ["", r#""type":"BPE","#] {
        let input = format!(
            r#"{{"model":{{{ty}"vocab":{{"a":0,"t":1,"at":2}},"merges":[["a","t"]],"continuing_subword_prefix":"@@@@@@@@@@"}}}}"#
        );
        let Err(err) = cawsfs::router::load_tokenizer(&model_with_tokenizer(input.as_bytes()))
        else {
            panic!("a malformed tokenizer.json loaded");
        };
        assert!(err.contains("tokenizer.json"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }
}

/// imatrix target (2026-11-27): a GGUF importance matrix whose in_sum2 tensor's first
/// dimension times the number of counts overflows usize panicked on the multiply
/// (`attempt to multiply with overflow` in debug builds; a wrong comparison in release)
/// instead of being refused. The input as AFL++ found it (afl-tmin could not shorten it).
#[test]
fn overflowing_imatrix_dimensions_are_an_error_not_a_panic() {
    let bytes = include_bytes!("data/fuzz/imatrix-dims-overflow.gguf");
    let e = cawsfs::import::imatrix::Imatrix::parse(bytes).unwrap_err();
    assert!(e.contains("values for") && e.contains("columns"), "{e}");
}

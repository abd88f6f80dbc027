//! Tokenizers between the two conventions: `tokenizer.json` (+ `tokenizer_config.json`,
//! `config.json`) → GGUF `tokenizer.ggml.*` keys, and back. Byte-level BPE ("gpt2" in
//! GGUF) both ways, SentencePiece-style BPE with byte fallback ("llama") both ways,
//! WordPiece ("bert") both ways; other models are refused with a clear error.

use std::borrow::Cow;

use serde_json::{json, Value};

use crate::gguf::{GgufArray, GgufValue, StrList};
use crate::model::ModelDesc;

use super::tokjson::{self, TokenizerJson};
use super::LayoutError;

mod to_hf;
pub(super) use to_hf::{hf_tokenizer, json_len_estimate};

/// Split regexes of pre-tokenizers llama.cpp knows by name.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types.
const TT_NORMAL: i32 = 1;
const TT_UNKNOWN: i32 = 2;
const TT_CONTROL: i32 = 3;
const TT_USER_DEFINED: i32 = 4;
const TT_UNUSED: i32 = 5;
const TT_BYTE: i32 = 6;

/// Largest vocabulary accepted (bounds allocations driven by config values).
const MAX_VOCAB: u64 = 1 << 24;

fn meta_err(s: String) -> LayoutError {
    LayoutError::Metadata(s)
}

fn is_type(v: &Value, ty: &str) -> bool {
    v.get("type").and_then(Value::as_str) == Some(ty)
}

fn split_regex(v: &Value) -> Option<&str> {
    if !is_type(v, "Split") {
        return None;
    }
    v.get("pattern")?.get("Regex")?.as_str()
}

pub(super) fn pre_name(pre: &Value) -> &'static str {
    let uses_regex = |v: &Value| v.get("use_regex").and_then(Value::as_bool) != Some(false);
    if is_type(pre, "ByteLevel") && uses_regex(pre) {
        return "gpt-2";
    }
    if !is_type(pre, "Sequence") {
        return "default";
    }
    let Some(seq) = pre.get("pretokenizers").and_then(Value::as_array) else {
        return "default";
    };
    match seq.as_slice() {
        [d, b]
            if is_type(d, "Digits")
                && d.get("individual_digits").and_then(Value::as_bool) == Some(true)
                && is_type(b, "ByteLevel")
                && uses_regex(b) =>
        {
            "smollm"
        }
        [s, b] if is_type(b, "ByteLevel") && !uses_regex(b) => match split_regex(s) {
            Some(LLAMA3_REGEX) => "llama-bpe",
            Some(QWEN2_REGEX) => "qwen2",
            _ => "default",
        },
        _ => "default",
    }
}

/// The `tokenizer.json` pre-tokenizer for a GGUF `tokenizer.ggml.pre` name.
fn pre_tokenizer_for(pre: &str) -> Value {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    match pre {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama3" | "llama-v3" | "llama-bpe" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]})
        }
        "qwen2" => {
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]})
        }
        _ => byte_level(true),
    }
}

/// A special token entry of tokenizer_config.json: a string or `{"content": ...}`.
fn token_string(v: &Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Value::as_str))
}

/// GGUF `tokenizer.*` keys for a Hugging Face source; empty when it has no
/// tokenizer.json (llama.cpp then loads the model without a vocabulary).
pub(super) fn gguf_tokenizer_meta(
    model: &ModelDesc,
    config: Option<&Value>,
) -> Result<Vec<(String, GgufValue)>, LayoutError> {
    let Some((tj, tc)) = hf_tokenizer_files(model)? else {
        return Ok(Vec::new());
    };
    if tj.model.ty.as_str() == Some("WordPiece") {
        return wordpiece_meta(model, config, &tj, &tc);
    }
    if tj.model.ty.as_str() == Some("BPE") && tj.model.byte_fallback.as_bool() == Some(true) {
        return sentencepiece_meta(model, config, &tj, &tc);
    }
    byte_level_bpe(&tj.model)?;
    let entries = token_entries(&tj)?;
    let (tokens, types) = token_table(&entries, model.arch.vocab_size)?;
    let n = tokens.len() as u64;
    let mut merges = StrList::with_capacity(tj.model.merges.len());
    let mut buf = String::new();
    tj.model
        .merges
        .iter()
        .for_each(|m| m.push_to(&mut merges, &mut buf));

    let pre = &tj.pre_tokenizer;
    let mut out: Vec<(String, GgufValue)> = vec![(
        "tokenizer.ggml.add_space_prefix".into(),
        GgufValue::Bool(add_space_prefix(pre)),
    )];
    out.extend(vocab_keys("gpt2", pre_name(pre), tokens, None, types));
    out.push((
        "tokenizer.ggml.merges".into(),
        GgufValue::Array(GgufArray::String(merges)),
    ));
    out.extend(special_token_ids(model, config, &tc, &entries, n));
    out.extend(bos_eos_template(model, &tj, &tc));
    Ok(out)
}

/// A SentencePiece-style BPE (byte fallback, U+2581 for spaces: Llama 2's, Mistral's,
/// Gemma's) as llama.cpp's converter writes one from `tokenizer.model`: model "llama",
/// tokens by id, types (`<0xXX>` bytes, the unknown token, control and user-defined
/// added tokens), and scores: 0 for those, minus the rank among the ordinary pieces
/// for these (a SentencePiece BPE model scores its pieces in merge order, which is
/// the id order tokenizer.json keeps). No merges: llama.cpp's SentencePiece tokenizer
/// merges by score.
fn sentencepiece_meta(
    model: &ModelDesc,
    config: Option<&Value>,
    tj: &TokenizerJson,
    tc: &Value,
) -> Result<Vec<(String, GgufValue)>, LayoutError> {
    let entries = token_entries(tj)?;
    let (tokens, mut types) = token_table(&entries, model.arch.vocab_size)?;
    // transformers 5 leaves the model's unk_token null and names it in the config.
    let unk = (tj.model.unk_token.as_str()).or_else(|| tc.get("unk_token").and_then(token_string));
    let mut rank = 0u32;
    let mut scores = Vec::with_capacity(tokens.len());
    for (tok, ty) in tokens.iter().zip(types.iter_mut()) {
        if Some(tok) == unk {
            *ty = TT_UNKNOWN;
        } else if *ty == TT_NORMAL && is_byte_token(tok) {
            *ty = TT_BYTE;
        }
        if *ty == TT_NORMAL {
            scores.push(-(rank as f32));
            rank += 1;
        } else {
            scores.push(0.0);
        }
    }
    let n = tokens.len() as u64;
    let mut out = vocab_keys("llama", "default", tokens, Some(scores), types);
    // llama.cpp prefixes a space unless told not to (the converter says so only then).
    if !spm_prefixes_space(tj) {
        out.push((
            "tokenizer.ggml.add_space_prefix".into(),
            GgufValue::Bool(false),
        ));
    }
    out.extend(special_token_ids(model, config, tc, &entries, n));
    let has_unk = out
        .iter()
        .any(|(k, _)| k == "tokenizer.ggml.unknown_token_id");
    if let Some(id) = unk.and_then(|u| entries.iter().find(|e| e.1 == u)) {
        if id.0 < n && !has_unk {
            out.push((
                "tokenizer.ggml.unknown_token_id".into(),
                GgufValue::U32(id.0 as u32),
            ));
        }
    }
    out.extend(bos_eos_template(model, tj, tc));
    Ok(out)
}

/// Whether to add BOS and EOS, and the chat template, of a causal model's tokenizer.
fn bos_eos_template(model: &ModelDesc, tj: &TokenizerJson, tc: &Value) -> Vec<(String, GgufValue)> {
    let mut out = vec![(
        "tokenizer.ggml.add_bos_token".into(),
        GgufValue::Bool(add_bos_token(&tj.post_processor, tc)),
    )];
    if let Some(add_eos) = tc.get("add_eos_token").and_then(Value::as_bool) {
        out.push((
            "tokenizer.ggml.add_eos_token".into(),
            GgufValue::Bool(add_eos),
        ));
    }
    if let Some(t) = chat_template(model, tc) {
        out.push(("tokenizer.chat_template".into(), GgufValue::String(t)));
    }
    out
}

/// The keys every GGUF vocabulary has: its model, pre-tokenizer, tokens, scores (when
/// it has them) and token types.
fn vocab_keys(
    model: &str,
    pre: &str,
    tokens: StrList,
    scores: Option<Vec<f32>>,
    types: Vec<i32>,
) -> Vec<(String, GgufValue)> {
    let s = |v: &str| GgufValue::String(v.into());
    let mut out = vec![
        ("tokenizer.ggml.model".into(), s(model)),
        ("tokenizer.ggml.pre".into(), s(pre)),
        (
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(GgufArray::String(tokens)),
        ),
    ];
    if let Some(scores) = scores {
        out.push((
            "tokenizer.ggml.scores".into(),
            GgufValue::Array(GgufArray::F32(scores)),
        ));
    }
    out.push((
        "tokenizer.ggml.token_type".into(),
        GgufValue::Array(GgufArray::I32(types)),
    ));
    out
}

/// `<0xXX>`: a byte-fallback token.
fn is_byte_token(t: &str) -> bool {
    t.len() == 6
        && t.starts_with("<0x")
        && t.ends_with('>')
        && t[3..5].bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether a SentencePiece-style tokenizer.json puts U+2581 before the text: a
/// Metaspace pre-tokenizer whose scheme is not "never" (transformers' conversions), or
/// a normalizer that prepends it (older ones).
fn spm_prefixes_space(tj: &TokenizerJson) -> bool {
    let prepends = |n: &Value| is_type(n, "Prepend");
    let norm = &tj.normalizer;
    if prepends(norm)
        || norm["normalizers"]
            .as_array()
            .is_some_and(|v| v.iter().any(prepends))
    {
        return true;
    }
    let pre = &tj.pre_tokenizer;
    let metaspace = std::iter::once(pre)
        .chain(pre["pretokenizers"].as_array().into_iter().flatten())
        .find(|p| is_type(p, "Metaspace"));
    match metaspace {
        Some(m) => {
            m.get("prepend_scheme").and_then(Value::as_str) != Some("never")
                && m.get("add_prefix_space").and_then(Value::as_bool) != Some(false)
        }
        None => false,
    }
}

/// A WordPiece vocabulary (BERT's) as llama.cpp's converter writes it: model "bert",
/// tokens in "phantom space" (a word-initial token gets a leading U+2581, a `##`
/// continuation loses its `##`, control tokens stay as they are), the special tokens
/// named in tokenizer_config.json ([CLS] also as BOS, which llama.cpp puts first), and
/// the number of token types from config.json.
fn wordpiece_meta(
    model: &ModelDesc,
    config: Option<&Value>,
    tj: &TokenizerJson,
    tc: &Value,
) -> Result<Vec<(String, GgufValue)>, LayoutError> {
    let entries = token_entries(tj)?;
    let (tokens, types) = token_table(&entries, model.arch.vocab_size)?;
    let tokens: StrList = tokens
        .iter()
        .zip(&types)
        .map(|(t, &ty)| match t.strip_prefix("##") {
            _ if ty == TT_CONTROL => Cow::Borrowed(t),
            Some(rest) => Cow::Borrowed(rest),
            None => Cow::Owned(format!("\u{2581}{t}")),
        })
        .collect();
    let n = tokens.len() as u64;
    let type_count = config
        .and_then(|c| c.get("type_vocab_size"))
        .and_then(Value::as_u64)
        .unwrap_or(2);
    let mut out = vocab_keys("bert", "default", tokens, None, types);
    out.push((
        "tokenizer.ggml.token_type_count".into(),
        GgufValue::U32(type_count.min(u32::MAX as u64) as u32),
    ));
    out.extend(normalizer_keys(&tj.normalizer));
    let id_of = |typ: &str| -> Option<u32> {
        let content = tc.get(format!("{typ}_token")).and_then(token_string)?;
        entries
            .iter()
            .filter(|e| e.1 == content)
            .max_by_key(|e| e.2.is_some())
            .map(|e| e.0 as u32)
            .filter(|&id| (id as u64) < n)
    };
    for (typ, key) in [
        ("cls", "bos_token_id"),
        ("sep", "seperator_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
        ("mask", "mask_token_id"),
        ("cls", "cls_token_id"),
    ] {
        if let Some(id) = id_of(typ) {
            out.push((format!("tokenizer.ggml.{key}"), GgufValue::U32(id)));
        }
    }
    Ok(out)
}

/// tokenizer.json and tokenizer_config.json (`Null` when absent) parsed; `None`
/// without a tokenizer.json.
fn hf_tokenizer_files(
    model: &ModelDesc,
) -> Result<Option<(TokenizerJson<'_>, Value)>, LayoutError> {
    let Some(raw) = model.hf_files.get("tokenizer.json") else {
        return Ok(None);
    };
    let tj: TokenizerJson =
        serde_json::from_slice(raw).map_err(|e| meta_err(format!("tokenizer.json: {e}")))?;
    let tc: Value = match model.hf_files.get("tokenizer_config.json") {
        Some(b) => serde_json::from_slice(b)
            .map_err(|e| meta_err(format!("tokenizer_config.json: not valid JSON: {e}")))?,
        None => Value::Null,
    };
    Ok(Some((tj, tc)))
}

/// tokenizer.json's `model`, refused unless it is a byte-level BPE.
fn byte_level_bpe(m: &tokjson::Model) -> Result<(), LayoutError> {
    let ty = m.ty.as_str().unwrap_or("?");
    if ty != "BPE" {
        return Err(LayoutError::Unsupported(format!(
            "tokenizer.json model type {ty}: only byte-level BPE tokenizers can be written to GGUF"
        )));
    }
    if m.byte_fallback.as_bool() == Some(true) {
        return Err(LayoutError::Unsupported(
            "tokenizer.json is a SentencePiece-style BPE (byte_fallback): only byte-level BPE tokenizers can be written to GGUF".into(),
        ));
    }
    Ok(())
}

/// One token of tokenizer.json: id, content, and for added tokens whether it is special
/// (`None`: a base-vocabulary token).
type TokenEntry<'a> = (u64, &'a str, Option<bool>);

/// Every token of the base vocabulary, then every added token.
fn token_entries<'a>(tj: &'a TokenizerJson) -> Result<Vec<TokenEntry<'a>>, LayoutError> {
    let vocab = (tj.model.vocab.0.as_ref())
        .ok_or_else(|| meta_err("tokenizer.json: model.vocab missing".into()))?;
    let mut entries: Vec<TokenEntry> = Vec::with_capacity(vocab.len());
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| meta_err(format!("tokenizer.json: token {tok:?} has no integer id")))?;
        entries.push((id, tok, None));
    }
    for a in &tj.added_tokens {
        let (Some(id), Some(content)) = (
            a.get("id").and_then(Value::as_u64),
            a.get("content").and_then(Value::as_str),
        ) else {
            return Err(meta_err(
                "tokenizer.json: added token without id/content".into(),
            ));
        };
        let special = a.get("special").and_then(Value::as_bool).unwrap_or(false);
        entries.push((id, content, Some(special)));
    }
    Ok(entries)
}

/// Token strings and GGUF token types indexed by id, over the model's vocabulary size
/// (the largest id + 1 when it has none); ids without a token become `[PAD<id>]`.
fn token_table(
    entries: &[TokenEntry],
    vocab_size: u32,
) -> Result<(StrList, Vec<i32>), LayoutError> {
    let max_id = entries.iter().map(|e| e.0).max().map_or(0, |m| m + 1);
    let n = if vocab_size > 0 {
        vocab_size as u64
    } else {
        max_id
    };
    if n > MAX_VOCAB || max_id > n {
        return Err(meta_err(format!(
            "tokenizer.json: token ids up to {max_id} do not fit a vocabulary of {n}"
        )));
    }
    // Borrowed until they are appended to one list: no `String` per token.
    let mut tokens: Vec<Option<&str>> = vec![None; n as usize];
    let mut types = vec![TT_UNUSED; n as usize];
    for &(id, content, special) in entries {
        tokens[id as usize] = Some(content);
        types[id as usize] = match special {
            None => TT_NORMAL,
            Some(true) => TT_CONTROL,
            Some(false) => TT_USER_DEFINED,
        };
    }
    let mut list = StrList::with_capacity(tokens.len());
    for (i, t) in tokens.into_iter().enumerate() {
        match t {
            Some(t) => list.push(t),
            None => list.push(&format!("[PAD{i}]")),
        }
    }
    Ok((list, types))
}

/// `tokenizer.ggml.{bos,eos,unknown,padding}_token_id`: tokenizer_config.json's token,
/// else config.json's id, else the architecture's; only ids below `n`.
fn special_token_ids(
    model: &ModelDesc,
    config: Option<&Value>,
    tc: &Value,
    entries: &[TokenEntry],
    n: u64,
) -> Vec<(String, GgufValue)> {
    let id_of = |content: &str| -> Option<u32> {
        // Added tokens win over the base vocabulary, as in `tokenizers`.
        entries
            .iter()
            .filter(|e| e.1 == content)
            .max_by_key(|e| e.2.is_some())
            .map(|e| e.0 as u32)
    };
    let special_id = |typ: &str, fallback: Option<u32>| -> Option<u32> {
        if let Some(id) = tc
            .get(format!("{typ}_token"))
            .and_then(token_string)
            .and_then(id_of)
        {
            return Some(id);
        }
        let from_config = config
            .and_then(|c| c.get(format!("{typ}_token_id")))
            .and_then(|v| {
                v.as_u64()
                    .or_else(|| v.as_array().and_then(|a| a.first()).and_then(Value::as_u64))
            });
        from_config
            .map(|v| v as u32)
            .or(fallback)
            .filter(|&v| (v as u64) < n)
    };
    let a = &model.arch;
    let mut out = Vec::new();
    for (typ, key, fallback) in [
        ("bos", "bos_token_id", a.bos_token_id),
        ("eos", "eos_token_id", a.eos_token_id),
        ("unk", "unknown_token_id", None),
        ("pad", "padding_token_id", a.pad_token_id),
    ] {
        if let Some(id) = special_id(typ, fallback) {
            out.push((format!("tokenizer.ggml.{key}"), GgufValue::U32(id)));
        }
    }
    out
}

/// The byte-level pre-tokenizer's add_prefix_space, as llama.cpp's own key.
fn add_space_prefix(pre: &Value) -> bool {
    std::iter::once(pre)
        .chain(pre["pretokenizers"].as_array().into_iter().flatten())
        .filter(|p| is_type(p, "ByteLevel"))
        .any(|p| p.get("add_prefix_space").and_then(Value::as_bool) == Some(true))
}

/// add_bos_token: tokenizer_config.json, else whether the post-processor template
/// starts with a special token.
fn add_bos_token(post_processor: &Value, tc: &Value) -> bool {
    tc.get("add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or_else(|| {
            is_type(post_processor, "TemplateProcessing")
                && post_processor["single"][0].get("SpecialToken").is_some()
        })
}

/// The chat template: tokenizer_config.json's (a string, or the "default" of a named
/// list), else a `chat_template.jinja` side file.
fn chat_template(model: &ModelDesc, tc: &Value) -> Option<String> {
    match tc.get("chat_template") {
        Some(Value::String(s)) => return Some(s.clone()),
        Some(Value::Array(list)) => {
            let d = list
                .iter()
                .find(|e| e.get("name").and_then(Value::as_str) == Some("default"))
                .or(list.first());
            if let Some(t) = d.and_then(|e| e.get("template")).and_then(Value::as_str) {
                return Some(t.to_string());
            }
        }
        _ => {}
    }
    model
        .hf_files
        .get("chat_template.jinja")
        .and_then(|b| String::from_utf8(b.clone()).ok())
}

/// `tokenizer.ggml.normalizer.*`: the case and accent handling of a tokenizer.json
/// normalizer (a BertNormalizer's flags, Lowercase and StripAccents steps, inside a
/// Sequence too), as llama.cpp's converter reads them; llama.cpp's WordPiece
/// lowercases without them.
fn normalizer_keys(n: &Value) -> Vec<(String, GgufValue)> {
    fn walk(n: &Value, lower: &mut Option<bool>, strip: &mut Option<bool>) {
        match n.get("type").and_then(Value::as_str) {
            Some("Lowercase") => *lower = Some(true),
            Some("StripAccents") => *strip = Some(true),
            Some("BertNormalizer") => {
                if let Some(v) = n.get("lowercase").and_then(Value::as_bool) {
                    *lower = Some(v);
                }
                if let Some(v) = n.get("strip_accents").and_then(Value::as_bool) {
                    *strip = Some(v);
                }
            }
            Some("Sequence") => {
                for m in n["normalizers"].as_array().into_iter().flatten() {
                    walk(m, lower, strip);
                }
            }
            _ => {}
        }
    }
    let (mut lower, mut strip) = (None, None);
    walk(n, &mut lower, &mut strip);
    let mut out = Vec::new();
    if let Some(v) = lower {
        out.push((
            "tokenizer.ggml.normalizer.lowercase".into(),
            GgufValue::Bool(v),
        ));
    }
    if let Some(v) = strip {
        out.push((
            "tokenizer.ggml.normalizer.strip_accents".into(),
            GgufValue::Bool(v),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cased BERT's normalizer says so to llama.cpp (which lowercases by default);
    /// flags inside a Sequence count, a null strip_accents is left to llama.cpp.
    #[test]
    fn normalizer_flags_become_gguf_keys() {
        let keys = |n: Value| {
            normalizer_keys(&n)
                .into_iter()
                .map(|(k, v)| (k, v.as_bool().unwrap()))
                .collect::<Vec<_>>()
        };
        let lower = "tokenizer.ggml.normalizer.lowercase".to_string();
        let strip = "tokenizer.ggml.normalizer.strip_accents".to_string();
        assert_eq!(
            keys(json!({"type": "BertNormalizer", "lowercase": false, "strip_accents": null})),
            [(lower.clone(), false)]
        );
        assert_eq!(
            keys(
                json!({"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Lowercase"},
                        {"type": "StripAccents"}]})
            ),
            [(lower, true), (strip, true)]
        );
        assert!(keys(Value::Null).is_empty());
    }
}

//! GGUF vocabularies to Hugging Face tokenizer files: `tokenizer.json` and
//! `tokenizer_config.json` for byte-level BPE ("gpt2"), SentencePiece ("llama") and
//! WordPiece ("bert") vocabularies of a GGUF source.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{
    meta_err, pre_tokenizer_for, LayoutError, TT_CONTROL, TT_NORMAL, TT_UNKNOWN, TT_USER_DEFINED,
};
use crate::gguf::{meta_get, GgufArray, GgufValue, StrList};

/// Hugging Face tokenizer files derived from GGUF metadata.
pub(in crate::layout) struct HfTokenizer {
    /// The file's bytes, pretty-printed as `serde_json::to_vec_pretty` would, with a
    /// final newline.
    pub tokenizer_json: Vec<u8>,
    pub tokenizer_config: Value,
}

/// Stand-ins for the vocabulary and merges in the document built as JSON values; their
/// pretty-printed text is put in their place by [`splice_pretty`].
const VOCAB_MARK: &str = "\u{1}cawsfs:vocab\u{1}";
const MERGES_MARK: &str = "\u{1}cawsfs:merges\u{1}";

/// `doc` pretty-printed with its two marks replaced by the vocabulary (token → first id;
/// a duplicate string keeps its first id, as a JSON object holds one) and the merges
/// (`"a b"` → `["a", "b"]`), both at `model`'s depth, byte for byte as serde_json's
/// pretty printer writes them, and a final newline.
fn splice_pretty(doc: &Value, tokens: &StrList, merges: &StrList) -> Result<Vec<u8>, LayoutError> {
    let fail = |e: serde_json::Error| LayoutError::Metadata(format!("serializing JSON: {e}"));
    let text = serde_json::to_vec_pretty(doc).map_err(fail)?;
    // The two values sit inside "model", itself inside the top-level object.
    let (inner, outer) = ("      ", "    ");
    let mut vocab = Vec::with_capacity(tokens.len() * 24);
    let mut seen = std::collections::HashSet::with_capacity(tokens.len());
    for (id, tok) in tokens.iter().enumerate() {
        if seen.insert(tok) {
            let sep = if seen.len() == 1 { "{\n" } else { ",\n" };
            vocab.extend_from_slice(format!("{sep}{inner}").as_bytes());
            serde_json::to_writer(&mut vocab, tok).map_err(fail)?;
            vocab.extend_from_slice(format!(": {id}").as_bytes());
        }
    }
    let close = |v: &mut Vec<u8>, empty: &str, end: char, any: bool| {
        let tail = if any {
            format!("\n{outer}{end}")
        } else {
            empty.to_string()
        };
        v.extend_from_slice(tail.as_bytes());
    };
    close(&mut vocab, "{}", '}', !seen.is_empty());
    let mut pairs = Vec::with_capacity(merges.len() * 32);
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = m.split_once(' ').expect("merges checked above");
        let sep = if i == 0 { "[\n" } else { ",\n" };
        pairs.extend_from_slice(format!("{sep}{inner}[\n{inner}  ").as_bytes());
        serde_json::to_writer(&mut pairs, a).map_err(fail)?;
        pairs.extend_from_slice(format!(",\n{inner}  ").as_bytes());
        serde_json::to_writer(&mut pairs, b).map_err(fail)?;
        pairs.extend_from_slice(format!("\n{inner}]").as_bytes());
    }
    close(&mut pairs, "[]", ']', !merges.is_empty());
    // The marks are the document's last two strings ("model" is its last key), so they
    // are found from the end: a token that happens to read like one sits earlier.
    let last = |hay: &[u8], mark: &str| -> Result<(usize, usize), LayoutError> {
        let q = serde_json::to_vec(mark).map_err(fail)?;
        let at = hay.windows(q.len()).rposition(|w| w == q);
        Ok((at.expect("the document holds both marks"), q.len()))
    };
    let (m_at, m_len) = last(&text, MERGES_MARK)?;
    let (v_at, v_len) = last(&text[..m_at], VOCAB_MARK)?;
    let mut out = Vec::with_capacity(text.len() + vocab.len() + pairs.len() + 1);
    out.extend_from_slice(&text[..v_at]);
    out.extend_from_slice(&vocab);
    out.extend_from_slice(&text[v_at + v_len..m_at]);
    out.extend_from_slice(&pairs);
    out.extend_from_slice(&text[m_at + m_len..]);
    out.push(b'\n');
    Ok(out)
}

/// About the length of the tokenizer.json [`hf_tokenizer`] writes for `meta`: each
/// vocabulary entry is a line `"token": id,` and each merge a pretty-printed pair
/// (SmolLM2: 3.52 MB written, 3.53 MB estimated).
pub(in crate::layout) fn json_len_estimate(meta: &[(String, GgufValue)]) -> u64 {
    let size = |key, per_entry: u64| {
        meta_strings(meta, key).map_or(0, |l| {
            l.iter().map(|s| s.len() as u64 + per_entry).sum::<u64>()
        })
    };
    size("tokenizer.ggml.tokens", 16) + size("tokenizer.ggml.merges", 40)
}

fn meta_strings<'a>(meta: &'a [(String, GgufValue)], key: &str) -> Option<&'a StrList> {
    match meta_get(meta, key) {
        Some(GgufValue::Array(GgufArray::String(v))) => Some(v),
        _ => None,
    }
}

fn meta_token_types(meta: &[(String, GgufValue)], n: usize) -> Vec<i64> {
    let v: Vec<i64> = match meta_get(meta, "tokenizer.ggml.token_type") {
        Some(GgufValue::Array(GgufArray::I32(v))) => v.iter().map(|&x| x as i64).collect(),
        Some(GgufValue::Array(GgufArray::U32(v))) => v.iter().map(|&x| x as i64).collect(),
        Some(GgufValue::Array(GgufArray::I64(v))) => v.clone(),
        _ => Vec::new(),
    };
    if v.len() == n {
        v
    } else {
        vec![TT_NORMAL as i64; n]
    }
}

/// tokenizer.json and tokenizer_config.json for a GGUF WordPiece vocabulary (BERT's):
/// the phantom-space tokens turned back (a leading U+2581 marks a word's first token,
/// any other ordinary token continues a word: `##`), BERT's normalizer with the
/// case and accent handling the GGUF names, `[CLS] A [SEP]` templates.
fn hf_wordpiece(
    meta: &[(String, GgufValue)],
    context_length: u32,
) -> Result<HfTokenizer, LayoutError> {
    let tokens = meta_strings(meta, "tokenizer.ggml.tokens")
        .ok_or_else(|| meta_err("GGUF metadata: tokenizer.ggml.tokens missing".into()))?;
    let types = meta_token_types(meta, tokens.len());
    let words: Vec<String> = tokens
        .iter()
        .zip(&types)
        .map(|(t, &ty)| match t.strip_prefix('\u{2581}') {
            _ if ty == TT_CONTROL as i64 => t.to_string(),
            Some(rest) => rest.to_string(),
            None => format!("##{t}"),
        })
        .collect();
    let tok_id = |key: &str| {
        meta_get(meta, key)
            .and_then(GgufValue::as_u64)
            .filter(|&i| (i as usize) < words.len())
            .map(|i| (i, words[i as usize].as_str()))
    };
    let cls = tok_id("tokenizer.ggml.cls_token_id").or(tok_id("tokenizer.ggml.bos_token_id"));
    let sep = tok_id("tokenizer.ggml.seperator_token_id").or(tok_id("tokenizer.ggml.eos_token_id"));
    let unk = tok_id("tokenizer.ggml.unknown_token_id");
    let flag = |key: &str| meta_get(meta, key).and_then(GgufValue::as_bool);
    // llama.cpp lowercases unless told not to, and strips accents when it lowercases.
    let lowercase = flag("tokenizer.ggml.normalizer.lowercase").unwrap_or(true);
    let strip_accents = flag("tokenizer.ggml.normalizer.strip_accents").unwrap_or(lowercase);

    let mut vocab = serde_json::Map::new();
    for (id, w) in words.iter().enumerate() {
        vocab.entry(w.clone()).or_insert(json!(id));
    }
    let added: Vec<Value> = words
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == TT_CONTROL as i64)
        .map(|(id, (w, _))| {
            json!({"id": id, "content": w, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let post_processor = match (cls, sep) {
        (Some((c, ct)), Some((s, st))) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": ct, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": st, "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": ct, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": st, "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": st, "type_id": 1}}],
            "special_tokens": {ct: {"id": ct, "ids": [c], "tokens": [ct]},
                               st: {"id": st, "ids": [s], "tokens": [st]}},
        }),
        _ => Value::Null,
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": strip_accents, "lowercase": lowercase},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": post_processor,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": unk.map_or("[UNK]", |u| u.1),
                  "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                  "vocab": vocab},
    });
    let mut tokenizer_json = serde_json::to_vec_pretty(&tokenizer_json)
        .map_err(|e| meta_err(format!("serializing JSON: {e}")))?;
    tokenizer_json.push(b'\n');

    let mut tc = serde_json::Map::new();
    tc.insert("clean_up_tokenization_spaces".into(), json!(true));
    tc.insert("do_lower_case".into(), json!(lowercase));
    for (name, v) in [
        ("cls_token", cls),
        ("sep_token", sep),
        ("unk_token", unk),
        ("pad_token", tok_id("tokenizer.ggml.padding_token_id")),
        ("mask_token", tok_id("tokenizer.ggml.mask_token_id")),
    ] {
        if let Some((_, t)) = v {
            tc.insert(name.into(), json!(t));
        }
    }
    tc.insert("model_max_length".into(), json!(context_length));
    tc.insert("strip_accents".into(), json!(strip_accents));
    tc.insert("tokenizer_class".into(), json!("BertTokenizer"));
    Ok(HfTokenizer {
        tokenizer_json,
        tokenizer_config: Value::Object(tc),
    })
}

/// Merges for a SentencePiece BPE vocabulary, made as transformers' converter makes
/// them from `tokenizer.model` (`generate_merges`): for each piece in id order, every
/// split of it into two pieces of the vocabulary, shorter left part first. Pieces are
/// ranked by id because a SentencePiece BPE model lists them in merge order.
fn sentencepiece_merges(tokens: &StrList) -> StrList {
    let mut ids = std::collections::HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        // transformers' `{piece: id}` keeps the last id of a repeated piece.
        ids.insert(t, id);
    }
    let mut merges = StrList::with_capacity(tokens.len());
    let mut pair = String::new();
    for t in tokens.iter() {
        for (i, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(i);
            if ids.contains_key(l) && ids.contains_key(r) {
                pair.clear();
                pair.push_str(l);
                pair.push(' ');
                pair.push_str(r);
                merges.push(&pair);
            }
        }
    }
    merges
}

/// tokenizer.json and tokenizer_config.json for a GGUF vocabulary: byte-level BPE
/// (`tokenizer.ggml.model == "gpt2"`) or SentencePiece (`"llama"`, byte fallback).
pub(in crate::layout) fn hf_tokenizer(
    meta: &[(String, GgufValue)],
    context_length: u32,
) -> Result<HfTokenizer, LayoutError> {
    let model = meta_get(meta, "tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .unwrap_or("");
    let spm = match model {
        "gpt2" => false,
        "llama" => true,
        "bert" => return hf_wordpiece(meta, context_length),
        _ => {
            return Err(LayoutError::Unsupported(format!(
                "GGUF tokenizer model {model:?}: only byte-level BPE (\"gpt2\"), SentencePiece (\"llama\") and WordPiece (\"bert\") tokenizers can be converted to tokenizer.json"
            )))
        }
    };
    let tokens = meta_strings(meta, "tokenizer.ggml.tokens")
        .ok_or_else(|| meta_err("GGUF metadata: tokenizer.ggml.tokens missing".into()))?;
    let types = meta_token_types(meta, tokens.len());
    static NO_MERGES: StrList = StrList::EMPTY;
    let spm_merges;
    let merges = if spm {
        spm_merges = sentencepiece_merges(tokens);
        &spm_merges
    } else {
        meta_strings(meta, "tokenizer.ggml.merges").unwrap_or(&NO_MERGES)
    };
    let pre = meta_get(meta, "tokenizer.ggml.pre")
        .and_then(GgufValue::as_str)
        .unwrap_or("default");

    let mut added = Vec::new();
    for (id, (tok, &tt)) in tokens.iter().zip(&types).enumerate() {
        // SentencePiece's unknown token is special too.
        let special = tt == TT_CONTROL as i64 || (spm && tt == TT_UNKNOWN as i64);
        if special || tt == TT_USER_DEFINED as i64 {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": !special,
                "special": special,
            }));
        }
    }
    // The vocabulary and merges (nearly all of the file) are written straight to text
    // below; building them as JSON values first took half of a mount's setup.
    if let Some(m) = merges.iter().find(|m| !m.contains(' ')) {
        return Err(meta_err(format!("GGUF metadata: malformed merge {m:?}")));
    }

    let tok_id = |key: &str| {
        meta_get(meta, key)
            .and_then(GgufValue::as_u64)
            .filter(|&i| (i as usize) < tokens.len())
    };
    let bos = tok_id("tokenizer.ggml.bos_token_id");
    let add_bos = meta_get(meta, "tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let post_processor = match (add_bos, bos) {
        (true, Some(b)) => {
            let bt = &tokens[b as usize];
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bt, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bt, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bt, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bt: {"id": bt, "ids": [b], "tokens": [bt]}},
            })
        }
        _ if spm => Value::Null,
        _ => {
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
        }
    };
    let tokenizer_json = if spm {
        // As transformers converts a SentencePiece BPE: spaces as U+2581, one before
        // the text unless the GGUF says llama.cpp adds none, bytes by fallback.
        let space = meta_get(meta, "tokenizer.ggml.add_space_prefix")
            .and_then(GgufValue::as_bool)
            .unwrap_or(true);
        let unk = meta_get(meta, "tokenizer.ggml.unknown_token_id")
            .and_then(GgufValue::as_u64)
            .and_then(|i| tokens.get(i as usize));
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if space {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}",
                              "prepend_scheme": if space { "first" } else { "never" }, "split": false},
            "post_processor": post_processor,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": unk,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": VOCAB_MARK, "merges": MERGES_MARK,
            },
        })
    } else {
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer_for(pre),
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": VOCAB_MARK, "merges": MERGES_MARK,
            },
        })
    };
    let tokenizer_json = splice_pretty(&tokenizer_json, tokens, merges)?;

    let mut tc = serde_json::Map::new();
    tc.insert("add_bos_token".into(), json!(add_bos));
    if let Some(v) = meta_get(meta, "tokenizer.ggml.add_eos_token").and_then(GgufValue::as_bool) {
        tc.insert("add_eos_token".into(), json!(v));
    }
    let mut decoder = BTreeMap::new();
    for (id, (tok, &tt)) in tokens.iter().zip(&types).enumerate() {
        let special = tt == TT_CONTROL as i64 || (spm && tt == TT_UNKNOWN as i64);
        if special || tt == TT_USER_DEFINED as i64 {
            decoder.insert(
                id,
                json!({"content": tok, "lstrip": false, "normalized": !special,
                       "rstrip": false, "single_word": false, "special": special}),
            );
        }
    }
    let decoder: serde_json::Map<String, Value> = decoder
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    tc.insert("added_tokens_decoder".into(), Value::Object(decoder));
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Some(id) = tok_id(key) {
            tc.insert(name.into(), json!(tokens[id as usize]));
        }
    }
    if let Some(t) = meta_get(meta, "tokenizer.chat_template").and_then(GgufValue::as_str) {
        tc.insert("chat_template".into(), json!(t));
    }
    tc.insert("clean_up_tokenization_spaces".into(), json!(false));
    tc.insert("model_max_length".into(), json!(context_length));
    let class = if spm {
        "LlamaTokenizer"
    } else {
        "GPT2Tokenizer"
    };
    tc.insert("tokenizer_class".into(), json!(class));
    Ok(HfTokenizer {
        tokenizer_json,
        tokenizer_config: Value::Object(tc),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' `generate_merges` on a SentencePiece BPE vocabulary: every split
    /// into two pieces of the vocabulary, pieces in id order, shorter left part first.
    #[test]
    fn sentencepiece_merges_follow_transformers() {
        let tokens: StrList = [
            "<unk>",
            "a",
            "b",
            "ab",
            "abc",
            "c",
            "bc",
            "\u{2581}é",
            "\u{2581}",
        ]
        .into_iter()
        .collect();
        let got = sentencepiece_merges(&tokens);
        assert_eq!(
            got.iter().collect::<Vec<_>>(),
            ["a b", "a bc", "ab c", "b c"]
        );
        let with_e: StrList = ["\u{2581}", "é", "\u{2581}é"].into_iter().collect();
        let m = sentencepiece_merges(&with_e);
        assert_eq!(m.iter().collect::<Vec<_>>(), ["\u{2581} é"]);
        use super::super::is_byte_token;
        assert!(is_byte_token("<0x0A>") && !is_byte_token("<0x0G>") && !is_byte_token("<s>"));
    }

    /// The spliced text is exactly what building the whole document as JSON values and
    /// pretty-printing it gives: escapes, a duplicate token (first id kept), and empty
    /// vocabularies and merge lists included.
    #[test]
    fn spliced_vocabulary_and_merges_equal_serde_json_pretty() {
        let cases: [(&[&str], &[&str]); 3] = [
            (
                &["a", "b", "ab", "\"q\\", "ä\u{1}\n", "a", "Ġt"],
                &["a b", "ab \"q\\", "Ġ t"],
            ),
            (&["x"], &[]),
            (&[], &[]),
        ];
        for (toks, merges) in cases {
            let doc = |vocab: Value, merges: Value| {
                json!({"version": "1.0", "added_tokens": [{"content": VOCAB_MARK}],
                       "model": {"type": "BPE", "vocab": vocab, "merges": merges}})
            };
            let mut map = serde_json::Map::new();
            for (id, t) in toks.iter().enumerate() {
                if !map.contains_key(*t) {
                    map.insert(t.to_string(), json!(id));
                }
            }
            let pairs: Vec<Value> = merges
                .iter()
                .map(|m| {
                    let (a, b) = m.split_once(' ').unwrap();
                    json!([a, b])
                })
                .collect();
            let mut want =
                serde_json::to_vec_pretty(&doc(Value::Object(map), json!(pairs))).unwrap();
            want.push(b'\n');
            let got = splice_pretty(
                &doc(json!(VOCAB_MARK), json!(MERGES_MARK)),
                &toks.iter().collect(),
                &merges.iter().collect(),
            )
            .unwrap();
            assert_eq!(
                String::from_utf8(got).unwrap(),
                String::from_utf8(want).unwrap()
            );
        }
    }
}

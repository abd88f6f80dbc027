//! The parts of a Hugging Face `tokenizer.json` the GGUF header needs, parsed straight
//! from its bytes with the vocabulary's strings borrowed from them. Parsed whole as a
//! `serde_json::Value` (an ordered map per object, an owned `String` per token and per
//! merge), it made the GGUF and safetensors layouts of the 1 B-parameter bench model
//! (SmolLM2's 49 k-token, 3.5 MB tokenizer.json) take 74–110 ms of every mount's setup;
//! 57–63 ms with this, and 41 ms once tokens and merges went into their `StrList`s
//! without a `String` each (docs/MOUNT.md, the 1 B model "before and after a cheaper
//! tokenizer").

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
pub(super) struct TokenizerJson<'a> {
    #[serde(borrow, default)]
    pub model: Model<'a>,
    #[serde(default)]
    pub added_tokens: Vec<Value>,
    #[serde(default)]
    pub normalizer: Value,
    #[serde(default)]
    pub pre_tokenizer: Value,
    #[serde(default)]
    pub post_processor: Value,
}

#[derive(Default, Deserialize)]
pub(super) struct Model<'a> {
    #[serde(rename = "type", default)]
    pub ty: Value,
    #[serde(default)]
    pub byte_fallback: Value,
    #[serde(default)]
    pub unk_token: Value,
    #[serde(borrow, default)]
    pub vocab: Vocab<'a>,
    #[serde(borrow, default)]
    pub merges: Vec<Merge<'a>>,
}

/// A string borrowed from the input unless it has escapes.
#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

/// `model.vocab` as `(token, id)` in file order; `None` when it is not an object (the
/// vocabulary of another tokenizer model, refused by its type before it is used).
#[derive(Default)]
pub(super) struct Vocab<'a>(pub Option<Vec<(Cow<'a, str>, Value)>>);

impl<'de: 'a, 'a> Deserialize<'de> for Vocab<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Vocab<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a vocabulary")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vocab<'a>, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0).min(1 << 20));
                while let Some((Text(token), id)) = map.next_entry::<Text, Value>()? {
                    out.push((token, id));
                }
                Ok(Vocab(Some(out)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vocab<'a>, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Vocab(None))
            }
            fn visit_unit<E>(self) -> Result<Vocab<'a>, E> {
                Ok(Vocab(None))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// One BPE merge; GGUF writes it as `"a b"`, tokenizer.json has that string (`b` is
/// then `None`) or the pair `["a", "b"]`. Kept in parts, borrowed where the input has
/// no escapes: a `String` per merge was ~48 k allocations on every mount of a model
/// with SmolLM2's tokenizer.
pub(super) struct Merge<'a>(pub Cow<'a, str>, pub Option<Cow<'a, str>>);

impl Merge<'_> {
    /// Append `"a b"` to `out`.
    pub fn push_to(&self, out: &mut crate::gguf::StrList, buf: &mut String) {
        match &self.1 {
            None => out.push(&self.0),
            Some(b) => {
                buf.clear();
                buf.push_str(&self.0);
                buf.push(' ');
                buf.push_str(b);
                out.push(buf);
            }
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Merge<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Merge<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(r#"a BPE merge ("a b" or ["a", "b"])"#)
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Merge<'a>, E> {
                Ok(Merge(Cow::Borrowed(v), None))
            }
            fn visit_str<E>(self, v: &str) -> Result<Merge<'a>, E> {
                Ok(Merge(Cow::Owned(v.to_owned()), None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Merge<'a>, A::Error> {
                use serde::de::Error;
                let mut next = || -> Result<Cow<'a, str>, A::Error> {
                    let t: Option<Text> = seq.next_element()?;
                    t.map(|t| t.0)
                        .ok_or_else(|| A::Error::invalid_length(1, &self))
                };
                let (a, b) = (next()?, next()?);
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    return Err(A::Error::invalid_length(3, &self));
                }
                Ok(Merge(a, Some(b)))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_merge_forms_escapes_and_other_vocabularies() {
        let j = br#"{"model": {"type": "BPE", "vocab": {"a": 0, "\u0120b": 1, "c": 2.5},
            "merges": ["a b", ["\u0120b", "c"]]}, "extra": [1, 2]}"#;
        let t: TokenizerJson = serde_json::from_slice(j).unwrap();
        let v = t.model.vocab.0.unwrap();
        assert_eq!(v[1].0, "\u{120}b");
        assert!(matches!(v[0].0, Cow::Borrowed("a")));
        assert_eq!(v[2].1, serde_json::json!(2.5));
        let (mut m, mut buf) = (crate::gguf::StrList::default(), String::new());
        t.model
            .merges
            .iter()
            .for_each(|x| x.push_to(&mut m, &mut buf));
        assert_eq!(m.iter().collect::<Vec<_>>(), ["a b", "\u{120}b c"]);
        assert!(matches!(t.model.merges[0].0, Cow::Borrowed("a b")));
        // A Unigram vocabulary (pairs) is not a BPE one: no vocabulary, no error.
        let u = br#"{"model": {"type": "Unigram", "vocab": [["a", -1.0]]}}"#;
        let t: TokenizerJson = serde_json::from_slice(u).unwrap();
        assert!(t.model.vocab.0.is_none() && t.model.merges.is_empty());
        for bad in [r#"["a"]"#, r#"["a", "b", "c"]"#, "5"] {
            let j = format!(r#"{{"model": {{"merges": [{bad}]}}}}"#);
            let e = serde_json::from_str::<TokenizerJson>(&j).err().unwrap();
            assert!(e.to_string().contains("BPE merge"), "{bad}: {e}");
        }
    }
}

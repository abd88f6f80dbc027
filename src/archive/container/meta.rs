//! META's JSON as both container kinds write it (docs/FORMAT.md §3, FORMAT-DELTA.md §5):
//! a head and a tail every kind has (`format`, `version`, `model`, `hf_files`; then
//! `checksum_index`, `extra`) around the kind's own keys, and the conversion of a
//! [`ModelDesc`] to and from its `model` + `hf_files` keys.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::model::{check_hf_file_name, ModelDesc, MAX_HF_FILES};

/// META as written. Field order here is the JSON key order: serde emits the flattened
/// `kind`'s keys where the field stands, so they land between `hf_files` and
/// `checksum_index` as the formats specify.
#[derive(Serialize)]
pub struct MetaOut<'a, K: Serialize> {
    pub format: &'a str,
    pub version: u32,
    /// `ModelDesc` with `hf_files` emptied (they go to the `hf_files` key below).
    pub model: serde_json::Value,
    pub hf_files: BTreeMap<String, serde_json::Value>,
    #[serde(flatten)]
    pub kind: K,
    pub checksum_index: BTreeMap<String, String>,
    pub extra: &'a serde_json::Value,
}

/// META as read (unknown keys ignored).
pub struct MetaIn<K> {
    pub format: String,
    pub version: u32,
    /// `model` with `hf_files` empty: [`model_from_meta`] puts them back.
    pub model: ModelDesc,
    pub hf_files: BTreeMap<String, serde_json::Value>,
    /// The kind's own keys.
    pub kind: K,
    pub checksum_index: BTreeMap<String, String>,
    pub extra: serde_json::Value,
}

impl<K: DeserializeOwned> MetaIn<K> {
    /// Parses META's bytes; `check` sees `format` and `version` before the rest is
    /// parsed (a wrong kind is reported as that, not as a missing key). One pass reads
    /// the common keys and `model` (mostly a GGUF vocabulary: 1.3 MB for a 49 k-token
    /// model) and keeps the kind's keys as raw text, parsed after: one struct with the
    /// kind's keys `#[serde(flatten)]`ed copied the whole document into serde's generic
    /// buffer first (3× as long), and parsing the common keys, the kind's keys and
    /// `model` each from the whole text scanned the vocabulary three times.
    pub fn parse(
        bytes: &[u8],
        check: impl FnOnce(&str, u32) -> Result<(), String>,
    ) -> Result<Self, String> {
        let text = std::str::from_utf8(bytes)
            .map_err(|e| format!("META is not valid: not UTF-8 text ({e})"))?;
        let (mut check_err, mut at) = (None, None);
        let top = {
            let mut de = serde_json::Deserializer::from_str(text);
            let top = serde::Deserializer::deserialize_map(
                &mut de,
                TopVisitor {
                    check: Some(check),
                    check_err: &mut check_err,
                    at: &mut at,
                },
            )
            .and_then(|top| de.end().map(|()| top));
            match (top, check_err) {
                (_, Some(e)) => return Err(e),
                (top, None) => top.map_err(|e| match at {
                    Some(key) => format!("META is not valid: {key}: {e}"),
                    None => format!("META is not valid: {e}"),
                })?,
            }
        };
        let kind = K::deserialize(serde::de::value::MapDeserializer::new(top.rest.into_iter()))
            .map_err(|e: serde_json::Error| format!("META is not valid: {e}"))?;
        Ok(MetaIn {
            format: top.format,
            version: top.version,
            model: top.model,
            hf_files: top.hf_files,
            kind,
            checksum_index: top.checksum_index,
            extra: top.extra,
        })
    }
}

/// META's keys every kind has, and the kind's own as raw JSON text.
struct Top<'a> {
    format: String,
    version: u32,
    model: ModelDesc,
    hf_files: BTreeMap<String, serde_json::Value>,
    checksum_index: BTreeMap<String, String>,
    extra: serde_json::Value,
    rest: BTreeMap<String, &'a RawValue>,
}

/// Reads META's top-level object in one pass. `check` runs on `format` and `version`
/// before `model` is parsed (or at the end, were `model` to come first); its error
/// goes to `check_err` and ends the parse. `at` names the key whose value failed to
/// parse (serde_json's message already says where).
struct TopVisitor<'e, F> {
    check: Option<F>,
    check_err: &'e mut Option<String>,
    at: &'e mut Option<String>,
}

impl<F: FnOnce(&str, u32) -> Result<(), String>> TopVisitor<'_, F> {
    fn run_check<E: serde::de::Error>(
        &mut self,
        format: Option<&str>,
        version: Option<u32>,
    ) -> Result<(), E> {
        let (Some(f), Some(v)) = (format, version) else {
            return Ok(());
        };
        match self.check.take().map(|c| c(f, v)) {
            Some(Err(e)) => {
                *self.check_err = Some(e);
                Err(E::custom("wrong kind"))
            }
            _ => Ok(()),
        }
    }
}

impl<'de, F: FnOnce(&str, u32) -> Result<(), String>> serde::de::Visitor<'de>
    for TopVisitor<'_, F>
{
    type Value = Top<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(mut self, mut map: A) -> Result<Top<'de>, A::Error> {
        use serde::de::Error;
        let (mut format, mut version, mut model) = (None, None, None);
        let (mut hf_files, mut checksum_index, mut extra) = (None, None, None);
        let mut rest = BTreeMap::new();
        fn put<T, E: Error>(slot: &mut Option<T>, key: &'static str, v: T) -> Result<(), E> {
            match slot.replace(v) {
                Some(_) => Err(E::duplicate_field(key)),
                None => Ok(()),
            }
        }
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "format" => put(&mut format, "format", map.next_value::<String>()?)?,
                "version" => put(&mut version, "version", map.next_value::<u32>()?)?,
                "model" => {
                    self.run_check(format.as_deref(), version)?;
                    *self.at = Some(key);
                    let m = map.next_value::<ModelDesc>()?;
                    *self.at = None;
                    put(&mut model, "model", m)?
                }
                "hf_files" => put(&mut hf_files, "hf_files", map.next_value()?)?,
                "checksum_index" => put(&mut checksum_index, "checksum_index", map.next_value()?)?,
                "extra" => put(&mut extra, "extra", map.next_value()?)?,
                // A map, not a list: a crafted META of many keys stays linear.
                _ => match rest.entry(key) {
                    std::collections::btree_map::Entry::Occupied(e) => {
                        return Err(A::Error::custom(format_args!(
                            "duplicate field `{}`",
                            e.key()
                        )))
                    }
                    std::collections::btree_map::Entry::Vacant(e) => {
                        e.insert(map.next_value::<&'de RawValue>()?);
                    }
                },
            }
        }
        let format = format.ok_or_else(|| A::Error::missing_field("format"))?;
        let version = version.ok_or_else(|| A::Error::missing_field("version"))?;
        self.run_check(Some(&format), Some(version))?;
        Ok(Top {
            format,
            version,
            model: model.ok_or_else(|| A::Error::missing_field("model"))?,
            hf_files: hf_files.unwrap_or_default(),
            checksum_index: checksum_index
                .ok_or_else(|| A::Error::missing_field("checksum_index"))?,
            extra: extra.unwrap_or_default(),
            rest,
        })
    }
}

/// META's `model` + `hf_files` for a model: side files as JSON strings when they are
/// UTF-8 (they are JSON/text: ~1 byte per byte instead of ~4 as a number array).
pub fn model_to_meta(
    model: &ModelDesc,
) -> serde_json::Result<(serde_json::Value, BTreeMap<String, serde_json::Value>)> {
    let mut v = serde_json::to_value(model)?;
    if let Some(obj) = v.as_object_mut() {
        obj.insert(
            "hf_files".into(),
            serde_json::Value::Object(Default::default()),
        );
    }
    let files = model
        .hf_files
        .iter()
        .map(|(k, bytes)| {
            let val = match std::str::from_utf8(bytes) {
                Ok(s) => serde_json::Value::String(s.to_owned()),
                Err(_) => serde_json::to_value(bytes).expect("bytes serialize"),
            };
            (k.clone(), val)
        })
        .collect();
    Ok((v, files))
}

/// Inverse of [`model_to_meta`].
pub fn model_from_meta(
    mut m: ModelDesc,
    files: BTreeMap<String, serde_json::Value>,
) -> Result<ModelDesc, String> {
    if files.len() > MAX_HF_FILES {
        return Err(format!(
            "hf_files lists {} files (at most {MAX_HF_FILES})",
            files.len()
        ));
    }
    for (k, v) in files {
        check_hf_file_name(&k)?;
        let bytes = match v {
            serde_json::Value::String(s) => s.into_bytes(),
            other => serde_json::from_value::<Vec<u8>>(other)
                .map_err(|e| format!("hf_files[{k:?}]: {e}"))?,
        };
        m.hf_files.insert(k, bytes);
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    struct Kind {
        tensors: Vec<u32>,
    }

    fn parse(text: &str) -> Result<MetaIn<Kind>, String> {
        MetaIn::<Kind>::parse(text.as_bytes(), |f, v| match (f, v) {
            ("cawsf", 1) => Ok(()),
            _ => Err(format!("META format {f:?} version {v}: not this kind")),
        })
    }

    /// A META with `model` spliced in, the kind's key and the common tail.
    fn meta(head: &str, model: &str, tail: &str) -> String {
        format!(
            r#"{{{head}"model":{model},"hf_files":{{}},"tensors":[1,2],{tail}"checksum_index":{{"META":"0"}},"extra":null}}"#
        )
    }

    #[test]
    fn one_pass_reads_every_key_and_each_error_says_it_once() {
        let m = crate::test_support::model(crate::test_support::tiny_arch(), vec![]);
        let model = serde_json::to_string(&m).unwrap();
        let ok = parse(&meta(r#""format":"cawsf","version":1,"#, &model, "")).unwrap();
        assert_eq!((ok.format.as_str(), ok.version), ("cawsf", 1));
        assert_eq!(ok.kind.tensors, [1, 2]);
        assert_eq!(ok.model.tensors.len(), m.tensors.len());
        assert_eq!(ok.checksum_index.len(), 1);
        // Keys in any order, unknown keys ignored.
        let moved = meta(
            r#""x":[{"y":1}],"#,
            &model,
            r#""version":1,"format":"cawsf","#,
        );
        assert_eq!(parse(&moved).unwrap().kind.tensors, [1, 2]);

        let cases = [
            // The kind is checked before `model` is read: a wrong kind says so.
            (
                meta(r#""format":"zip","version":1,"#, "5", ""),
                "META format \"zip\"",
            ),
            (
                meta(r#""format":"cawsf","version":2,"#, "5", ""),
                "version 2",
            ),
            (
                meta(r#""format":"cawsf","version":1,"#, "5", ""),
                "META is not valid: model: invalid type",
            ),
            (
                meta(r#""version":1,"#, &model, ""),
                "missing field `format`",
            ),
            (
                meta(
                    r#""format":"cawsf","format":"cawsf","version":1,"#,
                    &model,
                    "",
                ),
                "duplicate field `format`",
            ),
            (
                meta(r#""format":"cawsf","version":1,"tensors":[],"#, &model, ""),
                "duplicate field `tensors`",
            ),
            (
                meta(r#""format":"cawsf","version":1,"#, &model, "")
                    .replace(r#""tensors":[1,2],"#, ""),
                "missing field `tensors`",
            ),
            (
                meta(r#""format":"cawsf","version":1,"#, &model, "") + "x",
                "trailing characters",
            ),
            (
                "[1]".to_string(),
                "META is not valid: invalid type: sequence",
            ),
        ];
        for (text, want) in cases {
            let e = parse(&text)
                .err()
                .unwrap_or_else(|| panic!("{text:.80} parsed"));
            assert!(e.contains(want), "want {want:?}, got {e}");
            assert_eq!(e.matches("line ").count().max(1), 1, "{e}");
            assert_eq!(e.matches("META").count(), 1, "{e}");
        }
        // 200 000 unknown keys: parsed in linear time (a list searched per key took
        // minutes), then the one repeated among them refused.
        let many: String = (0..200_000).map(|i| format!("\"k{i}\":0,")).collect();
        let t = std::time::Instant::now();
        let text = meta(r#""format":"cawsf","version":1,"#, &model, &many);
        assert_eq!(parse(&text).unwrap().kind.tensors, [1, 2]);
        let e = parse(&text.replace("\"k7\":0,", "\"k8\":0,"))
            .err()
            .unwrap();
        assert!(e.contains("duplicate field `k8`"), "{e}");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            t.elapsed()
        );
        let bad = [b"{\"format\":\"".as_slice(), &[0xff], b"\"}"].concat();
        let e = MetaIn::<Kind>::parse(&bad, |_, _| Ok(())).err().unwrap();
        assert!(e.contains("not UTF-8"), "{e}");
    }

    #[test]
    fn side_file_names_from_meta_are_checked() {
        let model = crate::test_support::model(crate::test_support::tiny_arch(), vec![]);
        let files = |names: &[&str]| -> BTreeMap<String, serde_json::Value> {
            names.iter().map(|n| (n.to_string(), "x".into())).collect()
        };
        assert!(model_from_meta(
            model.clone(),
            files(&["config.json", "1_Pooling/config.json"])
        )
        .is_ok());
        for bad in ["", "a/b/c", "a/..", "../../escape", ".."] {
            let e = model_from_meta(model.clone(), files(&[bad])).unwrap_err();
            assert!(e.contains("side file name") && !e.contains('\n'), "{e}");
        }
        let many: Vec<String> = (0..=MAX_HF_FILES).map(|i| format!("f{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let e = model_from_meta(model, files(&many)).unwrap_err();
        assert!(e.contains("at most 256"), "{e}");
    }
}

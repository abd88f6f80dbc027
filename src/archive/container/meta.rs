//! META's JSON as both container kinds write it (docs/FORMAT.md §3, FORMAT-DELTA.md §5):
//! a head and a tail every kind has (`format`, `version`, `model`, `hf_files`; then
//! `checksum_index`, `extra`) around the kind's own keys, and the conversion of a
//! [`ModelDesc`] to and from its `model` + `hf_files` keys.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
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
    /// parsed (a wrong kind is reported as that, not as a missing key). The common keys,
    /// the kind's keys and `model` are each parsed straight from the bytes: one struct
    /// with the kind's keys `#[serde(flatten)]`ed copied the whole document (mostly a
    /// GGUF vocabulary: 1.3 MB for a 49 k-token model) into serde's generic buffer
    /// first, and took 3× as long (20 ms of a 28 ms archive open).
    pub fn parse(
        bytes: &[u8],
        check: impl FnOnce(&str, u32) -> Result<(), String>,
    ) -> Result<Self, String> {
        #[derive(Deserialize)]
        struct Common<'a> {
            format: String,
            version: u32,
            #[serde(borrow)]
            model: &'a RawValue,
            #[serde(default)]
            hf_files: BTreeMap<String, serde_json::Value>,
            checksum_index: BTreeMap<String, String>,
            #[serde(default)]
            extra: serde_json::Value,
        }
        let invalid = |e: serde_json::Error| format!("META is not valid: {e}");
        let c: Common = serde_json::from_slice(bytes).map_err(invalid)?;
        check(&c.format, c.version)?;
        let kind = serde_json::from_slice(bytes).map_err(invalid)?;
        let model = serde_json::from_str(c.model.get())
            .map_err(|e| format!("META is not valid: model: {e}"))?;
        Ok(MetaIn {
            format: c.format,
            version: c.version,
            model,
            hf_files: c.hf_files,
            kind,
            checksum_index: c.checksum_index,
            extra: c.extra,
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

//! llama.cpp importance matrices (`llama-imatrix -o FILE`, docs/IMATRIX.md): per tensor,
//! the mean square of each input column's activations over calibration text. Both of
//! llama.cpp's formats are read: the GGUF one (`general.type = imatrix`, tensors
//! `NAME.in_sum2` and `NAME.counts`) and the legacy binary one. Entries are keyed by
//! llama.cpp tensor names; [`Imatrix::for_tensor`] looks them up by the canonical (HF)
//! name. The file is hostile input: every count and length is checked against the
//! bytes left, and every error names the file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::ImportError;
use crate::gguf::reader::parse_header;
use crate::gguf::{GgmlType, GgufValue};
use crate::model::names::hf_to_gguf;

/// An importance matrix read from a file.
pub struct Imatrix {
    path: PathBuf,
    /// llama.cpp tensor name → importance of each input column (≥ 0, finite).
    entries: HashMap<String, Vec<f32>>,
    /// Calibration chunks it was computed over, where the file says.
    pub chunks: Option<u64>,
    /// The calibration text(s), where the file names them.
    pub datasets: Vec<String>,
}

impl std::fmt::Debug for Imatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Imatrix")
            .field("path", &self.path)
            .field("entries", &self.entries.len())
            .field("chunks", &self.chunks)
            .finish()
    }
}

/// Larger files are not importance matrices of any model (a 405 B model's is ~100 MB).
const MAX_BYTES: u64 = 4 << 30;

impl Imatrix {
    pub fn open(path: &Path) -> Result<Imatrix, ImportError> {
        let meta = std::fs::metadata(path).map_err(|e| ImportError::io(path, e))?;
        if !meta.is_file() {
            return Err(ImportError::invalid(
                path,
                "not a regular file (an importance matrix is a file written by llama-imatrix)",
            ));
        }
        if meta.len() > MAX_BYTES {
            return Err(ImportError::invalid(
                path,
                format!("{} bytes is too large for an importance matrix", meta.len()),
            ));
        }
        let bytes = std::fs::read(path).map_err(|e| ImportError::io(path, e))?;
        let mut m = Self::parse(&bytes).map_err(|why| ImportError::invalid(path, why))?;
        m.path = path.to_path_buf();
        Ok(m)
    }

    /// Parses a file's bytes (either format); the reason in one line when they are not
    /// an importance matrix with at least one entry.
    pub fn parse(bytes: &[u8]) -> Result<Imatrix, String> {
        let m = if bytes.starts_with(b"GGUF") {
            parse_gguf(bytes)
        } else {
            parse_legacy(bytes)
        }?;
        if m.entries.is_empty() {
            return Err("importance matrix has no entries".into());
        }
        Ok(m)
    }

    /// Every entry: llama.cpp tensor name and column importances.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &[f32])> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_slice()))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The importance of each of the `cols` input columns of the tensor with canonical
    /// name `hf_name`; None when the file has no entry for it (an embedding never has
    /// one: it is looked up, not multiplied). An entry of another length means the file
    /// was made for another model: an error naming both.
    pub fn for_tensor(&self, hf_name: &str, cols: u64) -> Result<Option<&[f32]>, ImportError> {
        let Some(v) = hf_to_gguf(hf_name).and_then(|g| self.entries.get(&g)) else {
            return Ok(None);
        };
        if v.len() as u64 != cols {
            return Err(ImportError::invalid(
                &self.path,
                format!(
                    "entry for {hf_name} has {} values but the tensor has {cols} input columns (an importance matrix of another model?)",
                    v.len()
                ),
            ));
        }
        Ok(Some(v))
    }
}

/// One entry, checked: every importance a finite non-negative number.
fn entry(name: &str, values: Vec<f32>) -> Result<(String, Vec<f32>), String> {
    if let Some(j) = values.iter().position(|v| !(v.is_finite() && *v >= 0.0)) {
        return Err(format!(
            "entry {name}: value {} at column {j} is not a finite non-negative number",
            values[j]
        ));
    }
    Ok((name.to_string(), values))
}

/// llama.cpp's GGUF imatrix: `NAME.in_sum2` (F32, ne = [in_dim, n_expert]) and
/// `NAME.counts` (F32, ne = [1, n_expert]). Experts' sums are pooled.
fn parse_gguf(bytes: &[u8]) -> Result<Imatrix, String> {
    let h = parse_header(bytes)?;
    let get = |k: &str| h.meta.iter().find(|(n, _)| n == k).map(|(_, v)| v);
    match get("general.type") {
        Some(GgufValue::String(t)) if t == "imatrix" => {}
        Some(GgufValue::String(t)) => {
            return Err(format!(
                "a GGUF file of type {t:?}, not an importance matrix"
            ))
        }
        _ => {
            return Err(
                "a GGUF file without general.type = imatrix (a model, not an importance matrix?)"
                    .into(),
            )
        }
    }
    let chunks = match get("imatrix.chunk_count") {
        Some(GgufValue::U32(n)) => Some(*n as u64),
        Some(GgufValue::U64(n)) => Some(*n),
        Some(GgufValue::I32(n)) => u64::try_from(*n).ok(),
        _ => None,
    };
    let datasets = match get("imatrix.datasets") {
        Some(GgufValue::Array(crate::gguf::GgufArray::String(s))) => {
            s.iter().map(String::from).collect()
        }
        _ => Vec::new(),
    };
    let f32s = |i: usize| -> Result<Vec<f32>, String> {
        let t = &h.tensors[i];
        if t.ty != GgmlType::F32 {
            return Err(format!("tensor {} is {:?}, not F32", t.name, t.ty));
        }
        let s = h
            .data_offset
            .checked_add(t.offset)
            .filter(|s| {
                s.checked_add(t.n_bytes)
                    .is_some_and(|e| e <= bytes.len() as u64)
            })
            .ok_or_else(|| format!("tensor {} lies past the end of the file", t.name))?;
        Ok(bytes[s as usize..(s + t.n_bytes) as usize]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect())
    };
    let index: HashMap<&str, usize> = h
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut entries = HashMap::new();
    for (i, t) in h.tensors.iter().enumerate() {
        let Some(name) = t.name.strip_suffix(".in_sum2") else {
            continue;
        };
        let c = *index
            .get(format!("{name}.counts").as_str())
            .ok_or_else(|| format!("{} has no {name}.counts", t.name))?;
        let (sums, counts) = (f32s(i)?, f32s(c)?);
        let in_dim = *t.ne.first().unwrap_or(&0) as usize;
        let experts = counts.len();
        if in_dim == 0 || experts == 0 || in_dim.checked_mul(experts) != Some(sums.len()) {
            return Err(format!(
                "{} holds {} values for {experts} counts and {in_dim} columns",
                t.name,
                sums.len()
            ));
        }
        let mut v = vec![0f64; in_dim];
        let mut total = 0f64;
        for (e, &n) in counts.iter().enumerate() {
            if !(n.is_finite() && n >= 0.0) {
                return Err(format!("{name}.counts holds {n}"));
            }
            total += n as f64;
            for (a, &s) in v.iter_mut().zip(&sums[e * in_dim..(e + 1) * in_dim]) {
                *a += s as f64;
            }
        }
        let v = v
            .into_iter()
            .map(|s| if total > 0.0 { (s / total) as f32 } else { 1.0 })
            .collect();
        let (k, v) = entry(name, v)?;
        entries.insert(k, v);
    }
    if entries.is_empty() && !h.tensors.is_empty() {
        return Err("no NAME.in_sum2 tensors (not an importance matrix?)".into());
    }
    Ok(Imatrix {
        path: PathBuf::new(),
        entries,
        chunks,
        datasets,
    })
}

/// The legacy format: `i32 n`, then n times `i32 len, name, i32 ncall, i32 nval,
/// f32[nval]` (each value is the mean square times ncall), then optionally
/// `i32 chunks, i32 len, dataset name`.
fn parse_legacy(bytes: &[u8]) -> Result<Imatrix, String> {
    struct Cur<'a>(&'a [u8], usize);
    impl<'a> Cur<'a> {
        fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
            let end = self
                .1
                .checked_add(n)
                .filter(|&e| e <= self.0.len())
                .ok_or_else(|| format!("truncated at byte {} (reading {what})", self.1))?;
            let s = &self.0[self.1..end];
            self.1 = end;
            Ok(s)
        }
        fn i32(&mut self, what: &str) -> Result<i32, String> {
            Ok(i32::from_le_bytes(
                self.take(4, what)?.try_into().expect("4"),
            ))
        }
        fn count(&mut self, what: &str, unit: usize) -> Result<usize, String> {
            let n = self.i32(what)?;
            let left = (self.0.len() - self.1) / unit.max(1);
            if n < 0 || n as usize > left {
                return Err(format!(
                    "{what} {n} at byte {} does not fit in the file (truncated, or not an importance matrix)",
                    self.1 - 4
                ));
            }
            Ok(n as usize)
        }
    }
    let mut c = Cur(bytes, 0);
    // Each entry takes at least 12 bytes of counts.
    let n = c.count("entry count", 12)?;
    let mut entries = HashMap::with_capacity(n);
    for _ in 0..n {
        let len = c.count("name length", 1)?;
        let name = std::str::from_utf8(c.take(len, "a name")?)
            .map_err(|_| format!("entry name at byte {} is not UTF-8", c.1 - len))?
            .to_string();
        let ncall = c.i32("call count")?;
        let nval = c.count("value count", 4)?;
        let raw = c.take(nval * 4, "values")?;
        let v: Vec<f32> = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4")))
            .map(|x| if ncall > 0 { x / ncall as f32 } else { x })
            .collect();
        if nval == 0 {
            return Err(format!("entry {name} has no values"));
        }
        let (k, v) = entry(&name, v)?;
        if entries.insert(k, v).is_some() {
            return Err(format!("entry {name} appears twice"));
        }
    }
    let mut chunks = None;
    let mut datasets = Vec::new();
    if c.1 < bytes.len() {
        chunks = u64::try_from(c.i32("chunk count")?).ok();
        let len = c.count("dataset name length", 1)?;
        datasets.push(String::from_utf8_lossy(c.take(len, "the dataset name")?).into_owned());
    }
    if c.1 != bytes.len() {
        return Err(format!("{} bytes after the last entry", bytes.len() - c.1));
    }
    Ok(Imatrix {
        path: PathBuf::new(),
        entries,
        chunks,
        datasets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(entries: &[(&str, i32, &[f32])], tail: Option<(i32, &str)>) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend((entries.len() as i32).to_le_bytes());
        for (name, ncall, v) in entries {
            b.extend((name.len() as i32).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend(ncall.to_le_bytes());
            b.extend((v.len() as i32).to_le_bytes());
            v.iter().for_each(|x| b.extend(x.to_le_bytes()));
        }
        if let Some((n, d)) = tail {
            b.extend(n.to_le_bytes());
            b.extend((d.len() as i32).to_le_bytes());
            b.extend(d.as_bytes());
        }
        b
    }

    #[test]
    fn legacy_values_are_divided_by_their_calls() {
        let b = legacy(
            &[("blk.0.attn_q.weight", 4, &[4.0, 8.0, 0.0])],
            Some((10, "t.txt")),
        );
        let m = parse_legacy(&b).unwrap();
        assert_eq!(m.entries["blk.0.attn_q.weight"], vec![1.0, 2.0, 0.0]);
        assert_eq!(
            (m.chunks, m.datasets.clone()),
            (Some(10), vec!["t.txt".to_string()])
        );
    }

    #[test]
    fn every_truncation_and_bad_count_is_an_error() {
        let b = legacy(&[("blk.0.ffn_up.weight", 1, &[1.0, 2.0])], Some((3, "x")));
        for n in 0..b.len() {
            // A cut right after the last entry is a file without the dataset trailer.
            let cut = &b[..n];
            let r = parse_legacy(cut);
            if n == b.len() - 9 {
                assert!(r.is_ok(), "{n}");
            } else {
                assert!(r.is_err(), "{n}");
            }
        }
        let mut neg = b.clone();
        neg[0..4].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(parse_legacy(&neg).unwrap_err().contains("entry count -1"));
        let nan = legacy(&[("a", 1, &[f32::NAN])], None);
        assert!(parse_legacy(&nan).unwrap_err().contains("not a finite"));
    }

    #[test]
    fn gguf_sums_are_divided_by_counts_and_pooled_over_experts() {
        use crate::gguf::writer::GgufHeader;
        let tensors: [(&str, Vec<u64>, Vec<f32>); 4] = [
            (
                "blk.0.ffn_down.weight.in_sum2",
                vec![3, 2],
                vec![2.0, 4.0, 6.0, 2.0, 0.0, 2.0],
            ),
            ("blk.0.ffn_down.weight.counts", vec![1, 2], vec![1.0, 1.0]),
            ("blk.1.ffn_down.weight.in_sum2", vec![2, 1], vec![5.0, 7.0]),
            ("blk.1.ffn_down.weight.counts", vec![1, 1], vec![0.0]),
        ];
        let h = GgufHeader::new(
            vec![
                ("general.type".into(), GgufValue::String("imatrix".into())),
                ("imatrix.chunk_count".into(), GgufValue::U32(8)),
            ],
            tensors
                .iter()
                .map(|(n, ne, _)| (n.to_string(), ne.clone(), GgmlType::F32))
                .collect(),
            32,
        );
        let mut bytes = h.to_bytes();
        let base = bytes.len();
        bytes.resize(base + h.data_size() as usize, 0);
        for (t, (_, _, v)) in h.tensors.iter().zip(&tensors) {
            let at = base + t.offset as usize;
            for (k, x) in v.iter().enumerate() {
                bytes[at + 4 * k..at + 4 * k + 4].copy_from_slice(&x.to_le_bytes());
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("im.gguf");
        std::fs::write(&p, &bytes).unwrap();
        let m = Imatrix::open(&p).unwrap();
        assert_eq!(m.chunks, Some(8));
        let v = m
            .for_tensor("model.layers.0.mlp.down_proj.weight", 3)
            .unwrap()
            .unwrap();
        assert_eq!(v, &[2.0, 2.0, 4.0]);
        let v = m
            .for_tensor("model.layers.1.mlp.down_proj.weight", 2)
            .unwrap()
            .unwrap();
        assert_eq!(v, &[1.0, 1.0]);
        assert!(m
            .for_tensor("model.layers.2.mlp.down_proj.weight", 3)
            .unwrap()
            .is_none());
        let e = m
            .for_tensor("model.layers.0.mlp.down_proj.weight", 4)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with(&p.display().to_string()) && e.contains("another model"),
            "{e}"
        );
    }
}

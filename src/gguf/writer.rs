//! GGUF v3 header serialization for the virtual GGUF layout: magic, version, counts,
//! metadata, tensor infos, and zero padding up to the aligned data section. The data
//! section itself (tensors at their offsets, zero padding between them) is written by
//! whoever owns the tensor bytes.

use super::{GgmlType, GgufArray, GgufValue};

#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorEntry {
    pub name: String,
    /// ggml order (`ne[0]` fastest).
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Offset relative to the data section, a multiple of the alignment.
    pub offset: u64,
    pub n_bytes: u64,
}

/// A complete GGUF header: magic, version, counts, metadata, tensor infos, and the
/// padding up to the aligned start of the data section.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub meta: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorEntry>,
    pub alignment: u64,
}

/// GGUF value type id of a value.
fn value_type(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.push(*x as u8),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(*x as u8),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &GgufArray) {
    fn each<T>(out: &mut Vec<u8>, ty: u32, v: &[T], f: impl Fn(&mut Vec<u8>, &T)) {
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            f(out, x);
        }
    }
    match a {
        GgufArray::U8(v) => each(out, 0, v, |o, x| o.push(*x)),
        GgufArray::I8(v) => each(out, 1, v, |o, x| o.push(*x as u8)),
        GgufArray::U16(v) => each(out, 2, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        GgufArray::I16(v) => each(out, 3, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        GgufArray::U32(v) => each(out, 4, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        GgufArray::I32(v) => each(out, 5, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        GgufArray::F32(v) => each(out, 6, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        GgufArray::Bool(v) => each(out, 7, v, |o, x| o.push(*x as u8)),
        GgufArray::String(v) => {
            out.extend_from_slice(&8u32.to_le_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v.iter() {
                put_str(out, x);
            }
        }
        GgufArray::U64(v) => each(out, 10, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        GgufArray::I64(v) => each(out, 11, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        GgufArray::F64(v) => each(out, 12, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
    }
}

impl GgufHeader {
    /// Lay tensors out in the given order, each at the next multiple of `alignment`.
    /// `general.alignment` is written into the metadata (replacing any existing one).
    ///
    /// Panics when [`GgufHeader::try_new`] would fail (alignment not a power of two, a
    /// tensor's `ne[0]` not a whole number of blocks, sizes overflowing u64); use
    /// `try_new` for shapes that come from untrusted input.
    pub fn new(
        meta: Vec<(String, GgufValue)>,
        tensors: Vec<(String, Vec<u64>, GgmlType)>,
        alignment: u64,
    ) -> GgufHeader {
        match Self::try_new(meta, tensors, alignment) {
            Ok(h) => h,
            Err(e) => panic!("GgufHeader::new: {e}"),
        }
    }

    /// [`GgufHeader::new`], returning a one-line reason instead of panicking.
    pub fn try_new(
        mut meta: Vec<(String, GgufValue)>,
        tensors: Vec<(String, Vec<u64>, GgmlType)>,
        alignment: u64,
    ) -> Result<GgufHeader, String> {
        let align32 = u32::try_from(alignment)
            .ok()
            .filter(|a| a.is_power_of_two())
            .ok_or_else(|| format!("alignment {alignment} is not a power of two below 2^32"))?;
        let av = GgufValue::U32(align32);
        match meta.iter_mut().find(|(k, _)| k == "general.alignment") {
            Some((_, v)) => *v = av,
            None => meta.push(("general.alignment".into(), av)),
        }
        let mut entries = Vec::with_capacity(tensors.len());
        let mut cur = 0u64;
        for (name, ne, ty) in tensors {
            let row = ne
                .first()
                .and_then(|&n0| ty.row_bytes(n0))
                .ok_or_else(|| format!("tensor {name}: shape {ne:?} is not whole {ty:?} rows"))?;
            let n_bytes = ne[1..]
                .iter()
                .try_fold(row, |a, &d| a.checked_mul(d))
                .ok_or_else(|| format!("tensor {name}: byte size of {ne:?} overflows"))?;
            let offset = cur
                .checked_next_multiple_of(alignment)
                .ok_or_else(|| format!("tensor {name}: offset overflows"))?;
            cur = offset
                .checked_add(n_bytes)
                .ok_or_else(|| format!("tensor {name}: offset overflows"))?;
            entries.push(GgufTensorEntry {
                name,
                ne,
                ty,
                offset,
                n_bytes,
            });
        }
        Ok(GgufHeader {
            meta,
            tensors: entries,
            alignment,
        })
    }

    /// Serialized header including padding; the data section starts at `len()`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.meta.len() as u64).to_le_bytes());
        for (k, v) in &self.meta {
            put_str(&mut out, k);
            out.extend_from_slice(&value_type(v).to_le_bytes());
            put_value(&mut out, v);
        }
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&t.offset.to_le_bytes());
        }
        let padded = (out.len() as u64).next_multiple_of(self.alignment);
        out.resize(padded as usize, 0);
        out
    }

    /// Size of the data section (last tensor end, padded to the alignment).
    pub fn data_size(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.offset + t.n_bytes)
            .max()
            .unwrap_or(0)
            .next_multiple_of(self.alignment)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_alignment_key() {
        let meta = vec![
            ("general.alignment".to_string(), GgufValue::U64(8)),
            ("x".to_string(), GgufValue::Bool(false)),
        ];
        let h = GgufHeader::new(
            meta,
            vec![
                ("a".into(), vec![3], GgmlType::F32),
                ("b".into(), vec![64, 2], GgmlType::Q4_0),
                ("c".into(), vec![256], GgmlType::Q6_K),
            ],
            64,
        );
        assert_eq!(h.meta[0], ("general.alignment".into(), GgufValue::U32(64)));
        assert_eq!(h.meta.len(), 2);
        let offs: Vec<_> = h.tensors.iter().map(|t| (t.offset, t.n_bytes)).collect();
        assert_eq!(offs, vec![(0, 12), (64, 72), (192, 210)]);
        assert_eq!(h.data_size(), 448);
        assert_eq!(h.to_bytes().len() % 64, 0);
        let h = GgufHeader::new(vec![], vec![], 32);
        assert_eq!(h.meta.len(), 1);
        assert_eq!(h.data_size(), 0);
        assert!(
            GgufHeader::try_new(vec![], vec![("q".into(), vec![31], GgmlType::Q8_0)], 32).is_err()
        );
        assert!(GgufHeader::try_new(vec![], vec![], 24).is_err());
    }
}

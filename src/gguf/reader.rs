//! Bounds-checked GGUF reader (memory-mapped). Accepts versions 2 and 3 (same layout:
//! 64-bit counts and lengths, little-endian).
//!
//! The file is hostile input: every count is checked against the bytes left before
//! anything is allocated, every length before it is sliced, every size computation is
//! checked arithmetic, and each tensor's data must lie inside the file. Errors name the
//! file and the thing that is wrong, in one line.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use super::{GgmlType, GgufArray, GgufValue, StrList};

/// Why a GGUF file cannot be read: the file and the problem.
pub use crate::error::FileError as GgufError;

#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `ne[0]` is the fastest-varying (column) dimension.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Offset relative to the start of the data section.
    pub offset: u64,
    /// Bytes of this tensor's data.
    pub n_bytes: u64,
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub meta: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    map: memmap2::Mmap,
}

/// Largest number of dimensions ggml supports.
const MAX_DIMS: u32 = 4;
/// Smallest possible metadata KV: key length (8) + value type (4) + a 1-byte value.
const MIN_KV_BYTES: u64 = 13;
/// Smallest possible tensor info: name length (8) + n_dims (4) + one dim (8) + type
/// (4) + offset (8).
const MIN_TENSOR_BYTES: u64 = 32;
/// GGUF value type id of arrays.
const TYPE_ARRAY: u32 = 9;
const TYPE_STRING: u32 = 8;

/// The parsed header of a GGUF file, independent of how its bytes were obtained.
#[derive(Debug)]
pub struct ParsedHeader {
    pub version: u32,
    pub meta: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    pub data_offset: u64,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Err(GgufError::Invalid {
                path: path.display().to_string(),
                reason: "truncated header (file is empty)".into(),
            });
        }
        // SAFETY: the map is read-only; a concurrent writer truncating the file could
        // fault reads, which is the accepted contract of every mmap-based reader.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let h = parse_header(&map).map_err(|reason| GgufError::Invalid {
            path: path.display().to_string(),
            reason,
        })?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: h.version,
            meta: h.meta,
            tensors: h.tensors,
            alignment: h.alignment,
            data_offset: h.data_offset,
            map,
        })
    }
    /// The raw bytes of tensor `i`.
    pub fn tensor_data(&self, i: usize) -> &[u8] {
        let t = &self.tensors[i];
        let s = (self.data_offset + t.offset) as usize;
        &self.map[s..s + t.n_bytes as usize]
    }
    /// Drop tensor `i`'s pages from this process (read: no longer needed here; see
    /// [`crate::mem::release_pages`]).
    pub fn release_tensor_data(&self, i: usize) {
        let t = &self.tensors[i];
        let s = (self.data_offset + t.offset) as usize;
        crate::mem::release_pages(&self.map, s..s + t.n_bytes as usize);
    }
    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// A forward-only reader over a byte slice; every read is bounds-checked.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Why a read failed; callers turn it into a reason naming what was being read.
enum ReadErr {
    Truncated,
    Bad(String),
}

type R<T> = Result<T, ReadErr>;

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
    fn take(&mut self, n: u64) -> R<&'a [u8]> {
        if n > self.remaining() {
            return Err(ReadErr::Truncated);
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> R<[u8; N]> {
        Ok(self
            .take(N as u64)?
            .try_into()
            .expect("take returned N bytes"))
    }
    fn u8(&mut self) -> R<u8> {
        Ok(self.arr::<1>()?[0])
    }
    fn u32(&mut self) -> R<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> R<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn string(&mut self) -> R<String> {
        let n = self.u64()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| ReadErr::Bad("string is not valid UTF-8".into()))
    }
    /// Check that `count` items of at least `min` bytes each can fit in what is left,
    /// so a following `Vec::with_capacity(count)` is justified by the input.
    fn fits(&self, count: u64, min: u64) -> R<usize> {
        match count.checked_mul(min) {
            Some(need) if need <= self.remaining() => Ok(count as usize),
            _ => Err(ReadErr::Truncated),
        }
    }
    fn value(&mut self, ty: u32) -> R<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.u8()?),
            1 => GgufValue::I8(self.u8()? as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.arr()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.arr()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.arr()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => GgufValue::Bool(self.bool()?),
            TYPE_STRING => GgufValue::String(self.string()?),
            TYPE_ARRAY => GgufValue::Array(self.array()?),
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.arr()?)),
            t => return Err(ReadErr::Bad(format!("unknown value type {t}"))),
        })
    }
    fn bool(&mut self) -> R<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(ReadErr::Bad(format!("bool value {b} is neither 0 nor 1"))),
        }
    }
    fn array(&mut self) -> R<GgufArray> {
        let ty = self.u32()?;
        let n = self.u64()?;
        fn many<T>(
            c: &mut Cursor,
            n: u64,
            size: u64,
            f: impl Fn(&mut Cursor) -> R<T>,
        ) -> R<Vec<T>> {
            let n = c.fits(n, size)?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(f(c)?);
            }
            Ok(v)
        }
        Ok(match ty {
            0 => GgufArray::U8(many(self, n, 1, |c| c.u8())?),
            1 => GgufArray::I8(many(self, n, 1, |c| Ok(c.u8()? as i8))?),
            2 => GgufArray::U16(many(self, n, 2, |c| Ok(u16::from_le_bytes(c.arr()?)))?),
            3 => GgufArray::I16(many(self, n, 2, |c| Ok(i16::from_le_bytes(c.arr()?)))?),
            4 => GgufArray::U32(many(self, n, 4, |c| c.u32())?),
            5 => GgufArray::I32(many(self, n, 4, |c| Ok(i32::from_le_bytes(c.arr()?)))?),
            6 => GgufArray::F32(many(self, n, 4, |c| Ok(f32::from_le_bytes(c.arr()?)))?),
            7 => GgufArray::Bool(many(self, n, 1, |c| c.bool())?),
            TYPE_STRING => {
                let n = self.fits(n, 8)?;
                let mut l = StrList::with_capacity(n);
                for _ in 0..n {
                    l.push(&self.string()?);
                }
                l.shrink_to_fit();
                GgufArray::String(l)
            }
            TYPE_ARRAY => return Err(ReadErr::Bad("nested arrays are not supported".into())),
            10 => GgufArray::U64(many(self, n, 8, |c| c.u64())?),
            11 => GgufArray::I64(many(self, n, 8, |c| Ok(i64::from_le_bytes(c.arr()?)))?),
            12 => GgufArray::F64(many(self, n, 8, |c| Ok(f64::from_le_bytes(c.arr()?)))?),
            t => return Err(ReadErr::Bad(format!("unknown array element type {t}"))),
        })
    }
}

/// Turn a read failure into a reason: truncation reads "truncated {what}", anything
/// else "{what}: {problem}".
fn ctx(what: impl Fn() -> String) -> impl Fn(ReadErr) -> String {
    move |e| match e {
        ReadErr::Truncated => format!("truncated {}", what()),
        ReadErr::Bad(m) => format!("{}: {m}", what()),
    }
}

/// Parse and validate a GGUF header from the whole file's bytes. Returns a one-line
/// reason on failure. Never panics, and allocates only in proportion to `bytes`.
pub fn parse_header(bytes: &[u8]) -> Result<ParsedHeader, String> {
    let mut c = Cursor { buf: bytes, pos: 0 };
    let magic = c.arr::<4>().map_err(ctx(|| "header".into()))?;
    if &magic != b"GGUF" {
        return Err("bad magic (not a GGUF file)".into());
    }
    let version = c.u32().map_err(ctx(|| "header".into()))?;
    if version != 2 && version != 3 {
        return Err(format!("unsupported GGUF version {version} (need 2 or 3)"));
    }
    let n_tensors = c.u64().map_err(ctx(|| "header".into()))?;
    let n_kv = c.u64().map_err(ctx(|| "header".into()))?;
    // Each KV and tensor info occupies some minimum number of bytes, so the counts
    // are bounded by the file size before anything is allocated.
    let need = n_kv.checked_mul(MIN_KV_BYTES).and_then(|a| {
        n_tensors
            .checked_mul(MIN_TENSOR_BYTES)
            .and_then(|b| a.checked_add(b))
    });
    if need.is_none_or(|n| n > c.remaining()) {
        return Err(format!(
            "{n_kv} metadata keys and {n_tensors} tensors cannot fit in a {} byte file",
            bytes.len()
        ));
    }

    let mut meta = Vec::with_capacity(n_kv as usize);
    let mut keys = HashSet::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string().map_err(ctx(|| format!("metadata key {i}")))?;
        let ty = c
            .u32()
            .map_err(ctx(|| format!("metadata value for key {key}")))?;
        let v = c
            .value(ty)
            .map_err(ctx(|| format!("metadata value for key {key}")))?;
        if !keys.insert(key.clone()) {
            return Err(format!("duplicate metadata key {key}"));
        }
        meta.push((key, v));
    }

    let alignment = match super::meta_get(&meta, "general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            _ => return Err(format!("general.alignment {v:?} is not a power of two")),
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let trunc = ctx(|| format!("tensor info for tensor {i}"));
        let name = c.string().map_err(&trunc)?;
        let n_dims = c.u32().map_err(&trunc)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!(
                "tensor {name} has {n_dims} dimensions (need 1..={MAX_DIMS})"
            ));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(c.u64().map_err(&trunc)?);
        }
        let ty_id = c.u32().map_err(&trunc)?;
        let offset = c.u64().map_err(&trunc)?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| format!("unsupported ggml type {ty_id} for tensor {name}"))?;
        // ggml stores ne as int64; each dimension and the element count must fit.
        let numel = ne.iter().try_fold(1u64, |a, &d| {
            (d <= i64::MAX as u64).then_some(())?;
            a.checked_mul(d)
        });
        if numel.is_none_or(|n| n > i64::MAX as u64) {
            return Err(format!("tensor {name}: element count of {ne:?} overflows"));
        }
        let row = ty.row_bytes(ne[0]).ok_or_else(|| {
            format!(
                "tensor {name}: ne[0] = {} is not a multiple of the {ty:?} block size {}",
                ne[0],
                ty.block().0
            )
        })?;
        let n_bytes = ne[1..]
            .iter()
            .try_fold(row, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("tensor {name}: byte size of {ne:?} overflows"))?;
        if offset % alignment != 0 {
            return Err(format!(
                "tensor {name}: data offset {offset} is not a multiple of the alignment {alignment}"
            ));
        }
        if !names.insert(name.clone()) {
            return Err(format!("duplicate tensor name {name}"));
        }
        tensors.push(GgufTensorInfo {
            name,
            ne,
            ty,
            offset,
            n_bytes,
        });
    }

    let header_end = c.pos as u64;
    let data_offset = header_end
        .checked_next_multiple_of(alignment)
        .ok_or("data section offset overflows")?;
    let file_len = bytes.len() as u64;
    for t in &tensors {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes));
        if end.is_none_or(|e| e > file_len) {
            return Err(format!(
                "tensor {} data (offset {}, {} bytes) extends past the end of the file ({} bytes, data section at {})",
                t.name, t.offset, t.n_bytes, file_len, data_offset
            ));
        }
    }
    Ok(ParsedHeader {
        version,
        meta,
        tensors,
        alignment,
        data_offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufHeader;

    /// A small valid file with every value type and two tensors.
    pub(crate) fn sample() -> (GgufHeader, Vec<u8>) {
        let meta = vec![
            (
                "general.architecture".to_string(),
                GgufValue::String("llama".into()),
            ),
            ("a.u8".into(), GgufValue::U8(7)),
            ("a.i8".into(), GgufValue::I8(-7)),
            ("a.u16".into(), GgufValue::U16(700)),
            ("a.i16".into(), GgufValue::I16(-700)),
            ("a.u32".into(), GgufValue::U32(70000)),
            ("a.i32".into(), GgufValue::I32(-70000)),
            ("a.f32".into(), GgufValue::F32(1.5)),
            ("a.bool".into(), GgufValue::Bool(true)),
            ("a.u64".into(), GgufValue::U64(1 << 40)),
            ("a.i64".into(), GgufValue::I64(-(1 << 40))),
            ("a.f64".into(), GgufValue::F64(-2.25)),
            (
                "a.strs".into(),
                GgufValue::Array(GgufArray::String(
                    vec!["x".to_string(), "".into(), "yz".into()].into(),
                )),
            ),
            ("a.empty".into(), GgufValue::Array(GgufArray::F32(vec![]))),
            (
                "a.i32s".into(),
                GgufValue::Array(GgufArray::I32(vec![1, -2, 3])),
            ),
            (
                "a.bools".into(),
                GgufValue::Array(GgufArray::Bool(vec![true, false])),
            ),
        ];
        let h = GgufHeader::new(
            meta,
            vec![
                ("token_embd.weight".into(), vec![64, 3], GgmlType::Q8_0),
                ("output_norm.weight".into(), vec![5], GgmlType::F32),
            ],
            32,
        );
        let mut bytes = h.to_bytes();
        let data = h.data_size() as usize;
        bytes.extend((0..data).map(|i| (i % 251) as u8));
        (h, bytes)
    }

    #[test]
    fn round_trip_with_writer() {
        let (h, bytes) = sample();
        let p = parse_header(&bytes).unwrap();
        assert_eq!(p.version, 3);
        assert_eq!(p.meta, h.meta);
        assert_eq!(p.alignment, 32);
        assert_eq!(p.data_offset, h.to_bytes().len() as u64);
        assert_eq!(p.data_offset % 32, 0);
        assert_eq!(p.tensors.len(), 2);
        for (a, b) in p.tensors.iter().zip(&h.tensors) {
            assert_eq!(
                (&a.name, &a.ne, a.ty, a.offset, a.n_bytes),
                (&b.name, &b.ne, b.ty, b.offset, b.n_bytes)
            );
        }
        assert_eq!(p.tensors[0].n_bytes, 2 * 34 * 3);
        // Through a real file and the mmap too.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.tensor_data(1).len(), 20);
        let s = f.data_offset as usize + f.tensors[1].offset as usize;
        assert_eq!(f.tensor_data(1), &bytes[s..s + 20]);
    }

    #[test]
    fn every_truncation_errors() {
        let (h, bytes) = sample();
        let data_size = h.data_size() as usize;
        // Any prefix that cuts into the header or into tensor data must fail; only the
        // final alignment padding after the last tensor may be missing.
        let last_end = h
            .tensors
            .iter()
            .map(|t| t.offset + t.n_bytes)
            .max()
            .unwrap() as usize;
        let min_ok = bytes.len() - data_size + last_end;
        for n in 0..bytes.len() {
            let r = parse_header(&bytes[..n]);
            if n < min_ok {
                assert!(r.is_err(), "prefix {n} accepted");
            }
        }
        let e = parse_header(&bytes[..400]).unwrap_err();
        assert!(e.starts_with("truncated"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.gguf");
        std::fs::write(&path, b"").unwrap();
        assert!(GgufFile::open(&path).is_err());
    }

    /// Corrupting any single byte of a valid file never panics.
    #[test]
    fn single_byte_corruptions_never_panic() {
        let (_, bytes) = sample();
        let mut b = bytes.clone();
        for i in 0..bytes.len() {
            for v in [0x00, 0x01, 0x7f, 0x80, 0xff, bytes[i] ^ 0x10] {
                b[i] = v;
                let _ = parse_header(&b);
            }
            b[i] = bytes[i];
        }
    }

    /// Header with the given counts followed by `tail`.
    fn header(n_tensors: u64, n_kv: u64, tail: &[u8]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&n_tensors.to_le_bytes());
        b.extend_from_slice(&n_kv.to_le_bytes());
        b.extend_from_slice(tail);
        b
    }

    #[test]
    fn hostile_inputs() {
        let e = parse_header(b"GGML\x03\0\0\0").unwrap_err();
        assert!(e.contains("bad magic"), "{e}");
        let e = parse_header(&header(u64::MAX, u64::MAX, &[0; 64])).unwrap_err();
        assert!(e.contains("cannot fit"), "{e}");
        let e = parse_header(&header(1 << 40, 0, &[0; 64])).unwrap_err();
        assert!(e.contains("cannot fit"), "{e}");
        // A string length far beyond the file.
        let mut kv = u64::MAX.to_le_bytes().to_vec();
        kv.extend_from_slice(&[0; 16]);
        let e = parse_header(&header(0, 1, &kv)).unwrap_err();
        assert_eq!(e, "truncated metadata key 0");
        // An array claiming 2^60 elements.
        let mut kv = 1u64.to_le_bytes().to_vec();
        kv.push(b'k');
        kv.extend_from_slice(&9u32.to_le_bytes());
        kv.extend_from_slice(&4u32.to_le_bytes());
        kv.extend_from_slice(&(1u64 << 60).to_le_bytes());
        let e = parse_header(&header(0, 1, &kv)).unwrap_err();
        assert_eq!(e, "truncated metadata value for key k");
        // Nested array.
        let mut kv = 1u64.to_le_bytes().to_vec();
        kv.push(b'k');
        kv.extend_from_slice(&9u32.to_le_bytes());
        kv.extend_from_slice(&9u32.to_le_bytes());
        kv.extend_from_slice(&0u64.to_le_bytes());
        let e = parse_header(&header(0, 1, &kv)).unwrap_err();
        assert!(e.contains("nested arrays"), "{e}");
        // Unknown tensor type.
        let mut t = 5u64.to_le_bytes().to_vec();
        t.extend_from_slice(b"blk.x");
        t.extend_from_slice(&1u32.to_le_bytes());
        t.extend_from_slice(&32u64.to_le_bytes());
        t.extend_from_slice(&24u32.to_le_bytes());
        t.extend_from_slice(&0u64.to_le_bytes());
        let e = parse_header(&header(1, 0, &t)).unwrap_err();
        assert_eq!(e, "unsupported ggml type 24 for tensor blk.x");
    }

    #[test]
    fn bad_tensor_infos() {
        let build = |ne: &[u64], ty: GgmlType, off: u64, data: usize| {
            let mut t = 1u64.to_le_bytes().to_vec();
            t.push(b't');
            t.extend_from_slice(&(ne.len() as u32).to_le_bytes());
            for d in ne {
                t.extend_from_slice(&d.to_le_bytes());
            }
            t.extend_from_slice(&ty.id().to_le_bytes());
            t.extend_from_slice(&off.to_le_bytes());
            let mut b = header(1, 0, &t);
            b.resize(b.len().next_multiple_of(32) + data, 0);
            parse_header(&b)
        };
        assert!(build(&[32, 2], GgmlType::Q8_0, 0, 68).is_ok());
        let e = build(&[32, 2], GgmlType::Q8_0, 0, 67).unwrap_err();
        assert!(e.contains("past the end"), "{e}");
        let e = build(&[33], GgmlType::Q8_0, 0, 100).unwrap_err();
        assert!(e.contains("not a multiple"), "{e}");
        let e = build(&[32], GgmlType::Q8_0, 16, 100).unwrap_err();
        assert!(e.contains("alignment"), "{e}");
        let e = build(&[32, u64::MAX], GgmlType::Q8_0, 0, 100).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
        let e = build(&[32], GgmlType::F32, u64::MAX - 31, 100).unwrap_err();
        assert!(e.contains("past the end"), "{e}");
        let e = build(&[1, 1, 1, 1, 1], GgmlType::F32, 0, 100).unwrap_err();
        assert!(e.contains("dimensions"), "{e}");
    }
}

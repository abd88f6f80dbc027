//! A strict reader and writer of `.npy` headers (docs/NPYDIR.md §3). Only what npy-dirs
//! use: little-endian scalar dtypes, C order. Everything else is an error that says why.

use crate::model::{PlainType, SourceType};

/// Each dtype but f16 and f32 and the plain type it holds, for both directions.
const PLAIN: [(Dtype, PlainType); 10] = [
    (Dtype::I8, PlainType::I8),
    (Dtype::U8, PlainType::U8),
    (Dtype::I32, PlainType::I32),
    (Dtype::I64, PlainType::I64),
    (Dtype::Bool, PlainType::Bool),
    (Dtype::I16, PlainType::I16),
    (Dtype::U16, PlainType::U16),
    (Dtype::U32, PlainType::U32),
    (Dtype::U64, PlainType::U64),
    (Dtype::F64, PlainType::F64),
];

/// Element types an npy-dir file may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    I8,
    U8,
    F16,
    F32,
    I32,
    I64,
    Bool,
    I16,
    U16,
    U32,
    U64,
    F64,
}

impl Dtype {
    pub fn size(self) -> u64 {
        match self {
            Dtype::I8 | Dtype::U8 | Dtype::Bool => 1,
            Dtype::F16 | Dtype::I16 | Dtype::U16 => 2,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }
    /// The `descr` numpy writes for this type.
    pub fn descr(self) -> &'static str {
        match self {
            Dtype::I8 => "|i1",
            Dtype::U8 => "|u1",
            Dtype::F16 => "<f2",
            Dtype::F32 => "<f4",
            Dtype::I32 => "<i4",
            Dtype::I64 => "<i8",
            Dtype::Bool => "|b1",
            Dtype::I16 => "<i2",
            Dtype::U16 => "<u2",
            Dtype::U32 => "<u4",
            Dtype::U64 => "<u8",
            Dtype::F64 => "<f8",
        }
    }
    /// The model's type of a passthrough file of this dtype: f16 and f32 are float
    /// weights, every other dtype a plain tensor served as its bytes.
    pub fn source(self) -> SourceType {
        match self {
            Dtype::F16 => SourceType::F16,
            Dtype::F32 => SourceType::F32,
            other => SourceType::Plain(
                PLAIN
                    .iter()
                    .find(|(d, _)| *d == other)
                    .map(|(_, p)| *p)
                    .expect("every dtype but f16 and f32 is in PLAIN"),
            ),
        }
    }

    /// The dtype a passthrough file of a tensor of type `t` is written in; None for
    /// fp8, which numpy has no dtype for.
    pub fn of_plain(t: PlainType) -> Option<Dtype> {
        PLAIN.iter().find(|(_, p)| *p == t).map(|(d, _)| *d)
    }

    /// Every dtype a passthrough (`__pt`) file may have.
    pub const PASSTHROUGH: [Dtype; 12] = [
        Dtype::F16,
        Dtype::F32,
        Dtype::I8,
        Dtype::U8,
        Dtype::I32,
        Dtype::I64,
        Dtype::Bool,
        Dtype::I16,
        Dtype::U16,
        Dtype::U32,
        Dtype::U64,
        Dtype::F64,
    ];

    fn parse(d: &str) -> Result<Dtype, String> {
        Ok(match d {
            "|i1" | "<i1" => Dtype::I8,
            "|u1" | "<u1" => Dtype::U8,
            "<f2" => Dtype::F16,
            "<f4" => Dtype::F32,
            "<i4" => Dtype::I32,
            "<i8" => Dtype::I64,
            "|b1" => Dtype::Bool,
            "<i2" => Dtype::I16,
            "<u2" => Dtype::U16,
            "<u4" => Dtype::U32,
            "<u8" => Dtype::U64,
            "<f8" => Dtype::F64,
            _ if d.starts_with('>') => {
                return Err(format!("big-endian dtype {d:?} is not supported"))
            }
            _ => return Err(format!("unsupported dtype {d:?}")),
        })
    }
}

/// A parsed npy header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Offset of the first data byte (= length of magic + version + length + header text).
    pub data_offset: u64,
}

/// Largest element count accepted (as for `.cawsf` tensors).
pub const MAX_ELEMS: u64 = 1 << 40;
/// Largest header text accepted; numpy's own are a few hundred bytes.
const MAX_HEADER: u64 = 1 << 20;

impl Header {
    pub fn numel(&self) -> u64 {
        // Checked at parse time not to overflow.
        self.shape.iter().product()
    }
    pub fn data_len(&self) -> u64 {
        self.numel() * self.dtype.size()
    }
}

/// How many leading bytes [`parse`] may need: call it with at least
/// `min(file_len, header_prefix_len(first 12 bytes))` bytes.
pub fn header_len(prefix: &[u8]) -> Result<u64, String> {
    if prefix.len() < 10 || &prefix[..6] != b"\x93NUMPY" {
        return Err("not an npy file (bad magic)".into());
    }
    let (major, minor) = (prefix[6], prefix[7]);
    let (fixed, hlen) = match (major, minor) {
        (1, 0) => (10u64, u16::from_le_bytes([prefix[8], prefix[9]]) as u64),
        (2, 0) | (3, 0) => {
            let b = prefix
                .get(8..12)
                .ok_or_else(|| "truncated npy header".to_string())?;
            (12u64, u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64)
        }
        _ => return Err(format!("unsupported npy version {major}.{minor}")),
    };
    if hlen > MAX_HEADER {
        return Err(format!("npy header of {hlen} bytes is too large"));
    }
    Ok(fixed + hlen)
}

/// Parse the header at the start of `bytes` (which must hold at least the whole header).
pub fn parse(bytes: &[u8]) -> Result<Header, String> {
    let total = header_len(bytes)?;
    let fixed = if bytes[6] == 1 { 10 } else { 12 };
    let text = bytes
        .get(fixed..total as usize)
        .ok_or_else(|| "truncated npy header".to_string())?;
    let text = std::str::from_utf8(text).map_err(|_| "npy header is not text".to_string())?;
    if bytes[6] < 3 && !text.is_ascii() {
        return Err("npy header is not ASCII".into());
    }
    let body = text
        .strip_suffix('\n')
        .ok_or_else(|| "npy header does not end with a newline".to_string())?;
    let (dtype, fortran, shape) = parse_dict(body.trim_end_matches(' '))?;
    if fortran {
        return Err("Fortran-order arrays are not supported (fortran_order: True)".into());
    }
    let mut n: u64 = 1;
    for &d in &shape {
        n = n
            .checked_mul(d)
            .filter(|&n| n <= MAX_ELEMS)
            .ok_or_else(|| format!("shape {shape:?} has too many elements"))?;
    }
    Ok(Header {
        dtype,
        shape,
        data_offset: total,
    })
}

/// A tiny tokenizer over the dict literal numpy writes.
struct Lex<'a> {
    s: &'a [u8],
    i: usize,
}

impl Lex<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i] == b' ' {
            self.i += 1;
        }
    }
    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("npy header: expected '{}'", c as char))
        }
    }
    fn string(&mut self) -> Result<String, String> {
        self.ws();
        let q = *self.s.get(self.i).ok_or("npy header: unexpected end")?;
        if q != b'\'' && q != b'"' {
            return Err("npy header: expected a string".into());
        }
        let start = self.i + 1;
        let end = self.s[start..]
            .iter()
            .position(|&c| c == q)
            .ok_or("npy header: unterminated string")?;
        self.i = start + end + 1;
        Ok(String::from_utf8_lossy(&self.s[start..start + end]).into_owned())
    }
    fn word(&mut self) -> &str {
        self.ws();
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_alphanumeric() {
            self.i += 1;
        }
        std::str::from_utf8(&self.s[start..self.i]).unwrap_or("")
    }
}

fn parse_dict(text: &str) -> Result<(Dtype, bool, Vec<u64>), String> {
    let mut lx = Lex {
        s: text.as_bytes(),
        i: 0,
    };
    lx.expect(b'{')?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        if lx.eat(b'}') {
            break;
        }
        let key = lx.string()?;
        lx.expect(b':')?;
        match key.as_str() {
            "descr" if descr.is_none() => {
                lx.ws();
                if lx.s.get(lx.i) == Some(&b'[') {
                    return Err("structured dtypes are not supported".into());
                }
                descr = Some(Dtype::parse(&lx.string()?)?);
            }
            "fortran_order" if fortran.is_none() => {
                fortran = Some(match lx.word() {
                    "True" => true,
                    "False" => false,
                    w => return Err(format!("npy header: fortran_order {w:?} is not a bool")),
                });
            }
            "shape" if shape.is_none() => {
                lx.expect(b'(')?;
                let mut dims = Vec::new();
                loop {
                    if lx.eat(b')') {
                        break;
                    }
                    let w = lx.word();
                    let d: u64 = w
                        .parse()
                        .map_err(|_| format!("npy header: shape entry {w:?} is not a size"))?;
                    dims.push(d);
                    if !lx.eat(b',') {
                        lx.expect(b')')?;
                        break;
                    }
                }
                if dims.len() > 32 {
                    return Err("npy header: more than 32 dimensions".into());
                }
                shape = Some(dims);
            }
            k => return Err(format!("npy header: unexpected or repeated key {k:?}")),
        }
        if !lx.eat(b',') {
            lx.expect(b'}')?;
            break;
        }
    }
    lx.ws();
    if lx.i != lx.s.len() {
        return Err("npy header: trailing characters after the dict".into());
    }
    match (descr, fortran, shape) {
        (Some(d), Some(f), Some(s)) => Ok((d, f, s)),
        _ => Err("npy header: missing descr, fortran_order or shape".into()),
    }
}

/// The header numpy 1.x/2.x `np.save` writes for a C-order array: version 1.0, the dict,
/// spaces and `\n` padding the whole header to a multiple of 64 bytes.
pub fn write_header(dtype: Dtype, shape: &[u64]) -> Vec<u8> {
    let dims = match shape {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {dims}, }}",
        dtype.descr()
    );
    let unpadded = 10 + dict.len() + 1;
    dict.extend(std::iter::repeat_n(' ', (64 - unpadded % 64) % 64));
    dict.push('\n');
    let mut out = Vec::with_capacity(10 + dict.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn passthrough_dtypes_and_plain_types_map_both_ways() {
        use crate::model::{PlainType, SourceType};
        for d in Dtype::PASSTHROUGH {
            match d.source() {
                SourceType::Plain(p) => assert_eq!(Dtype::of_plain(p), Some(d)),
                s => assert!(matches!(
                    (d, s),
                    (Dtype::F16, SourceType::F16) | (Dtype::F32, SourceType::F32)
                )),
            }
            assert_eq!(Dtype::parse(d.descr()).unwrap(), d);
        }
        assert_eq!(Dtype::of_plain(PlainType::F8E4M3), None);
    }

    use super::*;

    fn v1(text: &str) -> Vec<u8> {
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(text.len() as u16).to_le_bytes());
        b.extend_from_slice(text.as_bytes());
        b
    }

    #[test]
    fn roundtrip_numpy_style() {
        for (dt, shape) in [
            (Dtype::I8, vec![576, 1536]),
            (Dtype::F32, vec![7]),
            (Dtype::I64, vec![]),
            (Dtype::U8, vec![2, 3, 4]),
        ] {
            let h = write_header(dt, &shape);
            assert_eq!(h.len() % 64, 0);
            let p = parse(&h).unwrap();
            assert_eq!(
                (p.dtype, p.shape.clone(), p.data_offset),
                (dt, shape, h.len() as u64)
            );
        }
        // Exactly what numpy 1.26/2.x writes for np.save(np.zeros((2,3), np.float16)).
        let h = write_header(Dtype::F16, &[2, 3]);
        assert_eq!(
            &h[10..],
            format!(
                "{{'descr': '<f2', 'fortran_order': False, 'shape': (2, 3), }}{}\n",
                " ".repeat(58)
            )
            .as_bytes()
        );
    }

    #[test]
    fn versions_and_spellings() {
        let p = parse(&v1(
            "{\"descr\":\"<i8\",\"fortran_order\":False,\"shape\":(3,)}\n",
        ))
        .unwrap();
        assert_eq!((p.dtype, p.shape), (Dtype::I64, vec![3]));
        let text = "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 5), }    \n";
        let mut b = b"\x93NUMPY\x02\x00".to_vec();
        b.extend_from_slice(&(text.len() as u32).to_le_bytes());
        b.extend_from_slice(text.as_bytes());
        let p = parse(&b).unwrap();
        assert_eq!(
            (p.dtype, p.shape, p.data_offset),
            (Dtype::F32, vec![4, 5], b.len() as u64)
        );
        b[6] = 3;
        assert!(parse(&b).is_ok());
    }

    #[test]
    fn rejects_bad_headers() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "magic"),
            (b"\x93NUMPX\x01\x00\x10\x00", "magic"),
            (b"\x93NUMPY\x04\x00\x10\x00", "version"),
            (b"\x93NUMPY\x01\x00\xff\x00{'descr'", "truncated"),
        ];
        for (b, want) in cases {
            let e = parse(b).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let bad = [
            (
                "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }\n",
                "Fortran",
            ),
            (
                "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }\n",
                "big-endian",
            ),
            (
                "{'descr': '<c8', 'fortran_order': False, 'shape': (2, 3), }\n",
                "unsupported dtype",
            ),
            (
                "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }\n",
                "structured",
            ),
            ("{'descr': '<f4', 'shape': (2, 3), }\n", "missing"),
            (
                "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\n",
                "repeated",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }\n",
                "not a size",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                "newline",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } x\n",
                "trailing",
            ),
            (
                "{'descr': '<f4', 'fortran_order': 0, 'shape': (2,), }\n",
                "bool",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }\n",
                "too many",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)\n",
                "expected",
            ),
            ("{'descr': '<f4\n", "unterminated"),
        ];
        for (text, want) in bad {
            let e = parse(&v1(text)).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn never_panics_on_prefixes_and_flips() {
        let h = write_header(Dtype::F32, &[3, 4]);
        for n in 0..h.len() {
            let _ = parse(&h[..n]);
        }
        for i in 0..h.len() {
            for bit in 0..8 {
                let mut b = h.clone();
                b[i] ^= 1 << bit;
                let _ = parse(&b);
            }
        }
    }
}

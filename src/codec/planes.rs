//! Planes: a row block of ggml blocks stored as planes compressed apart, so each kind
//! of byte gets its own entropy model (docs/CODECS.md, "ggml blocks in planes"). A
//! block's scale bytes (each byte of an f16 apart: exponent and mantissa bits differ in
//! spread), its sub-block scales and its codes are separate planes; 5-bit codes are
//! unpacked to one byte each, since their fifth bit sits in another field.

use std::cell::RefCell;

use super::CodecError;
use crate::gguf::GgmlType;

/// zstd's level for the planes: higher levels gain under 0.2 % on them (measured) and
/// encode several times slower.
const LEVEL: i32 = 3;

/// Bit 31 of a plane's length: the plane is stored as it is (compression did not pay).
const RAW: u32 = 1 << 31;

/// One plane: what it takes from each ggml block.
#[derive(Clone, Copy)]
enum Plane {
    /// Bytes `lo..hi` of the block.
    Bytes(usize, usize),
    /// The 32 five-bit codes of a Q5_0/Q5_1 block, one per byte: low four bits from
    /// the nibbles at `qs` (code i in byte i % 16, high nibble for i ≥ 16), the fifth
    /// from bit i of the little-endian u32 at `qh`.
    Codes5 { qh: usize, qs: usize },
}

impl Plane {
    fn width(self) -> usize {
        match self {
            Plane::Bytes(lo, hi) => hi - lo,
            Plane::Codes5 { .. } => 32,
        }
    }
}

use Plane::{Bytes as B, Codes5};

/// The planes of a type's blocks, covering every byte of a block once.
fn planes_of(ty: GgmlType) -> Option<&'static [Plane]> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 | IQ4_NL => &[B(0, 1), B(1, 2), B(2, 18)],
        Q8_0 => &[B(0, 1), B(1, 2), B(2, 34)],
        Q4_1 => &[B(0, 1), B(1, 2), B(2, 3), B(3, 4), B(4, 20)],
        Q5_0 => &[B(0, 1), B(1, 2), Codes5 { qh: 2, qs: 6 }],
        Q5_1 => &[B(0, 1), B(1, 2), B(2, 3), B(3, 4), Codes5 { qh: 4, qs: 8 }],
        Q2_K => &[
            B(0, 16),
            B(16, 80),
            B(80, 81),
            B(81, 82),
            B(82, 83),
            B(83, 84),
        ],
        Q3_K => &[B(0, 32), B(32, 96), B(96, 108), B(108, 109), B(109, 110)],
        Q4_K => &[B(0, 1), B(1, 2), B(2, 3), B(3, 4), B(4, 16), B(16, 144)],
        Q5_K => &[
            B(0, 1),
            B(1, 2),
            B(2, 3),
            B(3, 4),
            B(4, 16),
            B(16, 48),
            B(48, 176),
        ],
        Q6_K => &[
            B(0, 128),
            B(128, 192),
            B(192, 208),
            B(208, 209),
            B(209, 210),
        ],
        IQ4_XS => &[B(0, 1), B(1, 2), B(2, 4), B(4, 8), B(8, 136)],
        IQ3_XXS => &[B(0, 1), B(1, 2), B(2, 66), B(66, 98)],
        IQ3_S => &[
            B(0, 1),
            B(1, 2),
            B(2, 66),
            B(66, 74),
            B(74, 106),
            B(106, 110),
        ],
        IQ2_S => &[B(0, 1), B(1, 2), B(2, 34), B(34, 66), B(66, 74), B(74, 82)],
        _ => return None,
    })
}

/// Whether `ty`'s blocks can be stored in planes.
pub fn has_planes(ty: GgmlType) -> bool {
    planes_of(ty).is_some()
}

fn layout(ty: GgmlType) -> Result<(&'static [Plane], usize), CodecError> {
    let planes = planes_of(ty)
        .ok_or_else(|| CodecError::Params(format!("{ty:?} blocks have no plane layout")))?;
    Ok((planes, ty.block().1 as usize))
}

/// Plane `p` of the blocks `blocks` (whole blocks of `bs` bytes) into `out`.
fn gather(p: Plane, blocks: &[u8], bs: usize, out: &mut Vec<u8>) {
    for b in blocks.chunks_exact(bs) {
        match p {
            Plane::Bytes(lo, hi) => out.extend_from_slice(&b[lo..hi]),
            Plane::Codes5 { qh, qs } => {
                let h = u32::from_le_bytes(b[qh..qh + 4].try_into().expect("4 bytes"));
                let q = &b[qs..qs + 16];
                out.extend((0..32).map(|i| {
                    let lo = if i < 16 { q[i] & 15 } else { q[i - 16] >> 4 };
                    lo | (((h >> i) & 1) as u8) << 4
                }));
            }
        }
    }
}

/// Plane `p` (`plane`, one entry per block) written back into `blocks`.
fn scatter(p: Plane, plane: &[u8], blocks: &mut [u8], bs: usize) -> Result<(), CodecError> {
    let w = p.width();
    for (b, src) in blocks.chunks_exact_mut(bs).zip(plane.chunks_exact(w)) {
        match p {
            Plane::Bytes(lo, hi) => b[lo..hi].copy_from_slice(src),
            Plane::Codes5 { qh, qs } => {
                if let Some(c) = src.iter().find(|&&c| c > 31) {
                    return Err(CodecError::Corrupt(format!("5-bit code plane holds {c}")));
                }
                let mut h = 0u32;
                for (i, &c) in src.iter().enumerate() {
                    h |= ((c >> 4) as u32) << i;
                }
                b[qh..qh + 4].copy_from_slice(&h.to_le_bytes());
                for i in 0..16 {
                    b[qs + i] = (src[i] & 15) | (src[i + 16] & 15) << 4;
                }
            }
        }
    }
    Ok(())
}

/// `blocks` (whole blocks of `ty`) as planes: a byte with the plane count, each plane's
/// stored length (u32 LE, bit 31 set when it is stored as it is), then the planes,
/// each a zstd frame or its bytes.
pub fn pack(ty: GgmlType, blocks: &[u8]) -> Result<Vec<u8>, CodecError> {
    let (planes, bs) = layout(ty)?;
    if blocks.len() % bs != 0 {
        return Err(CodecError::Params(format!(
            "{} bytes are not whole {ty:?} blocks",
            blocks.len()
        )));
    }
    let mut head = vec![planes.len() as u8];
    let mut body = Vec::with_capacity(blocks.len());
    let mut plane = Vec::with_capacity(blocks.len());
    for &p in planes {
        plane.clear();
        gather(p, blocks, bs, &mut plane);
        let z = zstd::bulk::compress(&plane, LEVEL)
            .map_err(|e| CodecError::Params(format!("zstd: {e}")))?;
        let (len, bytes) = if z.len() < plane.len() {
            (z.len() as u32, &z[..])
        } else {
            (plane.len() as u32 | RAW, &plane[..])
        };
        head.extend_from_slice(&len.to_le_bytes());
        body.extend_from_slice(bytes);
    }
    head.extend_from_slice(&body);
    Ok(head)
}

thread_local! {
    static DCTX: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// The `n_blocks` blocks of `ty` that [`pack`] made `payload` from; anything else (a
/// wrong plane count, lengths that do not add up, a plane of the wrong size, a code out
/// of range) is corrupt.
pub fn unpack(ty: GgmlType, payload: &[u8], n_blocks: usize) -> Result<Vec<u8>, CodecError> {
    let (planes, bs) = layout(ty)?;
    let corrupt = |why: String| CodecError::Corrupt(format!("{ty:?} planes: {why}"));
    let head = 1 + 4 * planes.len();
    if payload.len() < head || payload[0] as usize != planes.len() {
        return Err(corrupt(format!(
            "header does not name {} planes ({} bytes)",
            planes.len(),
            payload.len()
        )));
    }
    let total = n_blocks
        .checked_mul(bs)
        .ok_or_else(|| corrupt(format!("{n_blocks} blocks overflow")))?;
    let mut out = vec![0u8; total];
    let mut plane = Vec::new();
    let mut at = head;
    for (k, &p) in planes.iter().enumerate() {
        let len = u32::from_le_bytes(payload[1 + 4 * k..5 + 4 * k].try_into().expect("4"));
        let (raw, n) = (len & RAW != 0, (len & !RAW) as usize);
        let Some(stored) = payload.get(at..at.saturating_add(n)) else {
            return Err(corrupt(format!(
                "plane {k} of {n} bytes runs past the payload"
            )));
        };
        at += n;
        let want = n_blocks * p.width();
        let bytes: &[u8] = if raw {
            stored
        } else {
            plane.clear();
            plane.reserve(want);
            DCTX.with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() {
                    *d = Some(zstd::bulk::Decompressor::new().map_err(|e| corrupt(e.to_string()))?);
                }
                let d = d.as_mut().expect("just set");
                d.decompress_to_buffer(stored, &mut plane)
                    .map_err(|e| corrupt(format!("plane {k}: {e}")))
            })?;
            &plane
        };
        if bytes.len() != want {
            return Err(corrupt(format!(
                "plane {k} holds {} bytes, {n_blocks} blocks need {want}",
                bytes.len()
            )));
        }
        scatter(p, bytes, &mut out, bs)?;
    }
    if at != payload.len() {
        return Err(corrupt(format!(
            "{} bytes after the last plane",
            payload.len() - at
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type's planes cover each byte of a block exactly once.
    #[test]
    fn planes_cover_each_block_byte_once() {
        use GgmlType::*;
        for ty in [
            Q4_0, IQ4_NL, Q8_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS,
            IQ3_S, IQ2_S,
        ] {
            let (planes, bs) = layout(ty).unwrap();
            let mut seen = vec![0u32; bs];
            for &p in planes {
                match p {
                    Plane::Bytes(lo, hi) => (lo..hi).for_each(|i| seen[i] += 1),
                    Plane::Codes5 { qh, qs } => {
                        (qh..qh + 4).chain(qs..qs + 16).for_each(|i| seen[i] += 1)
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{ty:?}: {seen:?}");
        }
    }

    /// Blocks of arbitrary bytes come back byte for byte, compressible or not, and the
    /// planes of skewed codes are smaller than the blocks.
    #[test]
    fn round_trip_any_bytes() {
        use GgmlType::*;
        let mut s = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for ty in [
            Q4_0, IQ4_NL, Q8_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS,
            IQ3_S, IQ2_S,
        ] {
            let bs = ty.block().1 as usize;
            for n in [0usize, 1, 7, 300] {
                let random: Vec<u8> = (0..n * bs).map(|_| next() as u8).collect();
                let skewed: Vec<u8> = (0..n * bs).map(|_| (next() % 3) as u8 * 0x11).collect();
                for blocks in [random, skewed] {
                    let p = pack(ty, &blocks).unwrap();
                    assert_eq!(unpack(ty, &p, n).unwrap(), blocks, "{ty:?} × {n}");
                }
            }
            let skewed: Vec<u8> = (0..300 * bs).map(|_| (next() % 3) as u8 * 0x11).collect();
            let n = pack(ty, &skewed).unwrap().len();
            assert!(n < skewed.len() * 6 / 10, "{ty:?}: {n} of {}", skewed.len());
        }
    }

    /// A payload cut short, lengthened, with another block count, a wrong plane count
    /// or an out-of-range 5-bit code is refused, never unpacked into other bytes.
    #[test]
    fn damaged_payloads_are_refused() {
        let ty = GgmlType::Q5_0;
        let blocks: Vec<u8> = (0..22 * 50).map(|i| (i * 37 % 251) as u8).collect();
        let p = pack(ty, &blocks).unwrap();
        assert!(unpack(ty, &p[..p.len() - 1], 50).is_err());
        assert!(unpack(ty, &[&p[..], &[0]].concat(), 50).is_err());
        assert!(unpack(ty, &p, 49).is_err());
        assert!(unpack(ty, &p, 51).is_err());
        assert!(unpack(ty, &p[..3], 50).is_err());
        let mut q = p.clone();
        q[0] = 2;
        assert!(unpack(ty, &q, 50).is_err());
        assert!(unpack(GgmlType::Q4_0, &p, 50).is_err());
        // The code plane stored raw with a code of 32 in it.
        let mut raw = vec![3u8];
        let planes: Vec<Vec<u8>> = vec![vec![1; 50], vec![2; 50], vec![32; 50 * 32]];
        for pl in &planes {
            raw.extend_from_slice(&(pl.len() as u32 | RAW).to_le_bytes());
        }
        planes.iter().for_each(|pl| raw.extend_from_slice(pl));
        let e = unpack(ty, &raw, 50).unwrap_err().to_string();
        assert!(e.contains("code plane holds 32"), "{e}");
        assert!(pack(GgmlType::Q8_K, &[0; 292]).is_err());
        assert!(pack(ty, &blocks[..21]).is_err());
    }
}

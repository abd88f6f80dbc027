//! Little-endian element slices to and from f32: the byte order of every codec payload
//! and npy file (docs/CODECS.md, docs/NPYDIR.md §3). On little-endian hosts these are
//! `bytemuck` casts plus `half`'s slice conversions (F16C/NEON when the CPU has them,
//! the same instructions `f16::to_f32`/`from_f32` use, so results are bit-identical);
//! big-endian hosts swap bytes.

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Values converted per step when the input cannot be cast in place: payloads in an
/// mmap or after an npy header need not be 2- or 4-byte aligned.
const CHUNK: usize = 1024;

/// Little-endian f16 values into f32 (`out.len()` values; extra bytes ignored).
pub fn f16s_to_f32(bytes: &[u8], out: &mut [f32]) {
    halfs_to_f32::<f16>(bytes, out)
}

/// Little-endian bf16 values into f32 (`out.len()` values; extra bytes ignored).
pub fn bf16s_to_f32(bytes: &[u8], out: &mut [f32]) {
    halfs_to_f32::<bf16>(bytes, out)
}

fn halfs_to_f32<H: Pod>(bytes: &[u8], out: &mut [f32])
where
    [H]: HalfFloatSliceExt,
{
    let n = out.len().min(bytes.len() / 2);
    let (bytes, out) = (&bytes[..2 * n], &mut out[..n]);
    if cfg!(target_endian = "little") {
        if let Ok(h) = bytemuck::try_cast_slice::<u8, H>(bytes) {
            h.convert_to_f32_slice(out);
            return;
        }
    }
    let mut buf = [0u16; CHUNK];
    for (src, dst) in bytes.chunks(2 * CHUNK).zip(out.chunks_mut(CHUNK)) {
        let bits = &mut buf[..dst.len()];
        bytemuck::cast_slice_mut::<u16, u8>(bits).copy_from_slice(src);
        if cfg!(target_endian = "big") {
            bits.iter_mut().for_each(|b| *b = u16::from_le(*b));
        }
        bytemuck::cast_slice::<u16, H>(bits).convert_to_f32_slice(dst);
    }
}

/// Little-endian f32 values (`out.len()` values; extra bytes ignored).
pub fn f32s_from_le(bytes: &[u8], out: &mut [f32]) {
    let n = out.len().min(bytes.len() / 4);
    let out = &mut out[..n];
    // Copying into the aligned output works whatever the input's alignment.
    bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(&bytes[..4 * n]);
    if cfg!(target_endian = "big") {
        out.iter_mut()
            .for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
    }
}

/// f32 values rounded to f16 (round to nearest even, as `f16::from_f32`).
pub fn to_f16s(vals: &[f32]) -> Vec<f16> {
    let mut h = vec![f16::ZERO; vals.len()];
    h.convert_from_f32_slice(vals);
    h
}

/// Append plain-old-data values (f16, f32, integers) as little-endian bytes.
pub fn push_le<T: Pod>(vals: &[T], out: &mut Vec<u8>) {
    let bytes: &[u8] = bytemuck::cast_slice(vals);
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytes);
    } else {
        let n = std::mem::size_of::<T>();
        out.extend(bytes.chunks_exact(n).flat_map(|c| c.iter().rev().copied()));
    }
}

/// Plain-old-data values as little-endian bytes.
pub fn le_bytes<T: Pod>(vals: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(std::mem::size_of_val(vals));
    push_le(vals, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 / bf16 bit pattern, at every byte offset, converts exactly as the
    /// scalar conversion does (the slice path must not change a single bit).
    #[test]
    fn slice_conversions_match_scalar() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        for off in [0usize, 1] {
            // A fresh allocation is aligned; one byte in, a cast is impossible.
            let mut raw = vec![0u8; off];
            raw.extend(all.iter().flat_map(|b| b.to_le_bytes()));
            let bytes = &raw[off..];
            let mut out = vec![0f32; all.len()];
            f16s_to_f32(bytes, &mut out);
            for (b, o) in all.iter().zip(&out) {
                assert_eq!(o.to_bits(), f16::from_bits(*b).to_f32().to_bits(), "{b:#x}");
            }
            bf16s_to_f32(bytes, &mut out);
            for (b, o) in all.iter().zip(&out) {
                assert_eq!(
                    o.to_bits(),
                    bf16::from_bits(*b).to_f32().to_bits(),
                    "{b:#x}"
                );
            }
        }
        let vals: Vec<f32> = (0..100_000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .collect();
        let h = to_f16s(&vals);
        for (v, h) in vals.iter().zip(&h) {
            assert_eq!(h.to_bits(), f16::from_f32(*v).to_bits(), "{v}");
        }
        let bytes = le_bytes(&vals);
        let mut raw = vec![0u8];
        raw.extend_from_slice(&bytes);
        let mut back = vec![0f32; vals.len()];
        f32s_from_le(&raw[1..], &mut back);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&vals));
    }

    #[test]
    fn short_input_fills_only_what_it_holds() {
        let mut out = [7f32; 3];
        f16s_to_f32(&f16::ONE.to_le_bytes(), &mut out);
        assert_eq!(out, [1.0, 7.0, 7.0]);
        f32s_from_le(&2f32.to_le_bytes(), &mut out);
        assert_eq!(out, [2.0, 7.0, 7.0]);
    }
}

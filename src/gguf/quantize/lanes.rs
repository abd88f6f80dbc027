//! 16 lanes of f32 for the K-quant searches (one lane per sub-block), with exactly the
//! operations they need, each one IEEE-exact lane by lane. Two implementations:
//! [`Avx2`] (two 256-bit registers, explicit intrinsics, for CPUs with AVX2) and
//! [`Arr`] (a plain array, for any CPU). Explicit intrinsics, not arrays left to the
//! auto-vectorizer: given arrays, LLVM vectorized some loops along the element axis
//! instead, with gathers and scatters.

use std::ops::{Add, BitAnd, BitOr, Div, Mul, Neg, Sub};

use super::nearest_int;

/// Lanes per vector.
pub(super) const W: usize = 16;

const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23

/// The lane operations. Comparisons follow Rust's (false with a NaN, except `ne`).
pub(super) trait Lanes:
    Copy
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    type Mask: Copy + BitAnd<Output = Self::Mask> + BitOr<Output = Self::Mask>;
    fn splat(v: f32) -> Self;
    fn load(a: &[f32; W]) -> Self;
    fn store(self, a: &mut [f32; W]);
    fn abs(self) -> Self;
    fn sqrt(self) -> Self;
    /// Round to nearest, ties to even: `nearest_int` for |v| < 2^22.
    fn round(self) -> Self;
    /// `nearest_int(v).clamp(lo, hi)` for any v, bit trick included.
    fn nearest_int_clamped(self, lo: i32, hi: i32) -> Self;
    /// `self < o ? self : o`, as x86's `minps` (the second operand when unordered).
    fn min(self, o: Self) -> Self;
    /// `self > o ? self : o`, as x86's `maxps`.
    fn max(self, o: Self) -> Self;
    /// C's float-to-int conversion as x86 does it (`cvttps2dq`): truncation, and
    /// i32::MIN for NaN or out of range (`super::c_f32_to_i32`).
    fn cvtt(self) -> [i32; W];
    /// Round half away from zero (`roundf`).
    fn round_away(self) -> Self;
    fn lt(self, o: Self) -> Self::Mask;
    fn gt(self, o: Self) -> Self::Mask;
    fn le(self, o: Self) -> Self::Mask;
    fn ge(self, o: Self) -> Self::Mask;
    fn ne(self, o: Self) -> Self::Mask;
    /// `a` where `m` is set, else `b`.
    fn sel(m: Self::Mask, a: Self, b: Self) -> Self;
    fn all() -> Self::Mask;
    fn none() -> Self::Mask;
    fn any(m: Self::Mask) -> bool;
    /// Bit k set where lane k is not set.
    fn unset_bits(m: Self::Mask) -> u32;

    /// W sub-blocks of N elements (`src`, sub-block k at `N·k`) into lane layout:
    /// lane k of `x[i]` is element i of sub-block k. `src.len()` must be `W·N`.
    #[inline(always)]
    fn from_subblocks<const N: usize>(src: &[f32], x: &mut [Self; N]) {
        for (i, xi) in x.iter_mut().enumerate() {
            let mut a = [0f32; W];
            for (k, v) in a.iter_mut().enumerate() {
                *v = src[N * k + i];
            }
            *xi = Self::load(&a);
        }
    }
    /// The reverse of `from_subblocks` for levels (small non-negative integers), as
    /// bytes: `out[N·k + i]` = lane k of `x[i]`. `out.len()` must be `W·N`.
    #[inline(always)]
    fn to_subblocks<const N: usize>(x: &[Self; N], out: &mut [u8]) {
        for (i, xi) in x.iter().enumerate() {
            for (k, v) in xi.to_array().iter().enumerate() {
                out[N * k + i] = *v as u8;
            }
        }
    }
    #[inline(always)]
    fn to_array(self) -> [f32; W] {
        let mut a = [0f32; W];
        self.store(&mut a);
        a
    }
    /// Lanes that are neither infinite nor NaN.
    #[inline(always)]
    fn finite(self) -> Self::Mask {
        self.abs().le(Self::splat(f32::MAX))
    }
}

// ---------------------------------------------------------------------------------
// Any CPU: arrays.

#[derive(Clone, Copy)]
pub(super) struct Arr([f32; W]);

#[derive(Clone, Copy)]
pub(super) struct ArrMask([bool; W]);

macro_rules! arr_map {
    ($ty:ident, $el:ty, |$k:ident| $body:expr) => {{
        let mut r = [<$el>::default(); W];
        for $k in 0..W {
            r[$k] = $body;
        }
        $ty(r)
    }};
}

macro_rules! arr_op {
    ($tr:ident, $f:ident, $op:tt) => {
        impl $tr for Arr {
            type Output = Arr;
            #[inline(always)]
            fn $f(self, o: Arr) -> Arr {
                arr_map!(Arr, f32, |k| self.0[k] $op o.0[k])
            }
        }
    };
}
arr_op!(Add, add, +);
arr_op!(Sub, sub, -);
arr_op!(Mul, mul, *);
arr_op!(Div, div, /);

impl Neg for Arr {
    type Output = Arr;
    #[inline(always)]
    fn neg(self) -> Arr {
        arr_map!(Arr, f32, |k| -self.0[k])
    }
}

impl BitAnd for ArrMask {
    type Output = ArrMask;
    #[inline(always)]
    fn bitand(self, o: ArrMask) -> ArrMask {
        arr_map!(ArrMask, bool, |k| self.0[k] & o.0[k])
    }
}

impl BitOr for ArrMask {
    type Output = ArrMask;
    #[inline(always)]
    fn bitor(self, o: ArrMask) -> ArrMask {
        arr_map!(ArrMask, bool, |k| self.0[k] | o.0[k])
    }
}

impl Lanes for Arr {
    type Mask = ArrMask;
    #[inline(always)]
    fn splat(v: f32) -> Arr {
        Arr([v; W])
    }
    #[inline(always)]
    fn load(a: &[f32; W]) -> Arr {
        Arr(*a)
    }
    #[inline(always)]
    fn store(self, a: &mut [f32; W]) {
        *a = self.0;
    }
    #[inline(always)]
    fn abs(self) -> Arr {
        arr_map!(Arr, f32, |k| self.0[k].abs())
    }
    #[inline(always)]
    fn sqrt(self) -> Arr {
        arr_map!(Arr, f32, |k| self.0[k].sqrt())
    }
    #[inline(always)]
    fn round(self) -> Arr {
        // Adding 1.5·2^23 rounds to an integer exactly as `nearest_int`'s addition
        // does, without needing a rounding instruction.
        arr_map!(Arr, f32, |k| (self.0[k] + MAGIC) - MAGIC)
    }
    #[inline(always)]
    fn nearest_int_clamped(self, lo: i32, hi: i32) -> Arr {
        arr_map!(Arr, f32, |k| nearest_int(self.0[k]).clamp(lo, hi) as f32)
    }
    #[inline(always)]
    fn cvtt(self) -> [i32; W] {
        self.0.map(super::c_f32_to_i32)
    }
    #[inline(always)]
    fn round_away(self) -> Arr {
        arr_map!(Arr, f32, |k| self.0[k].round())
    }
    #[inline(always)]
    fn min(self, o: Arr) -> Arr {
        arr_map!(Arr, f32, |k| if self.0[k] < o.0[k] {
            self.0[k]
        } else {
            o.0[k]
        })
    }
    #[inline(always)]
    fn max(self, o: Arr) -> Arr {
        arr_map!(Arr, f32, |k| if self.0[k] > o.0[k] {
            self.0[k]
        } else {
            o.0[k]
        })
    }
    #[inline(always)]
    fn lt(self, o: Arr) -> ArrMask {
        arr_map!(ArrMask, bool, |k| self.0[k] < o.0[k])
    }
    #[inline(always)]
    fn gt(self, o: Arr) -> ArrMask {
        arr_map!(ArrMask, bool, |k| self.0[k] > o.0[k])
    }
    #[inline(always)]
    fn le(self, o: Arr) -> ArrMask {
        arr_map!(ArrMask, bool, |k| self.0[k] <= o.0[k])
    }
    #[inline(always)]
    fn ge(self, o: Arr) -> ArrMask {
        arr_map!(ArrMask, bool, |k| self.0[k] >= o.0[k])
    }
    #[inline(always)]
    fn ne(self, o: Arr) -> ArrMask {
        arr_map!(ArrMask, bool, |k| self.0[k] != o.0[k])
    }
    #[inline(always)]
    fn sel(m: ArrMask, a: Arr, b: Arr) -> Arr {
        arr_map!(Arr, f32, |k| if m.0[k] { a.0[k] } else { b.0[k] })
    }
    #[inline(always)]
    fn all() -> ArrMask {
        ArrMask([true; W])
    }
    #[inline(always)]
    fn none() -> ArrMask {
        ArrMask([false; W])
    }
    #[inline(always)]
    fn any(m: ArrMask) -> bool {
        m.0.iter().any(|&b| b)
    }
    #[inline(always)]
    fn unset_bits(m: ArrMask) -> u32 {
        let mut bits = 0;
        for (k, &b) in m.0.iter().enumerate() {
            bits |= (!b as u32) << k;
        }
        bits
    }
}

// ---------------------------------------------------------------------------------
// AVX2: two 256-bit registers.

#[cfg(target_arch = "x86_64")]
pub(super) use avx2::Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Values of these types exist only inside functions compiled with AVX2 enabled
    //! and called after `is_x86_feature_detected!("avx2")` (`fast`'s `multiversion!`):
    //! that is what makes the `unsafe` intrinsic calls below sound. Every method is
    //! `inline(always)`, so the intrinsics land in that AVX2 code.

    use super::*;
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub(in crate::gguf::quantize) struct Avx2([__m256; 2]);

    #[derive(Clone, Copy)]
    pub(in crate::gguf::quantize) struct Avx2Mask([__m256; 2]);

    macro_rules! both {
        ($ty:ident, |$a:ident| $e:expr) => {
            // SAFETY: see the module doc.
            $ty([
                {
                    let $a = 0;
                    unsafe { $e }
                },
                {
                    let $a = 1;
                    unsafe { $e }
                },
            ])
        };
    }

    macro_rules! avx_op {
        ($tr:ident, $f:ident, $intr:ident) => {
            impl $tr for Avx2 {
                type Output = Avx2;
                #[inline(always)]
                fn $f(self, o: Avx2) -> Avx2 {
                    both!(Avx2, |h| $intr(self.0[h], o.0[h]))
                }
            }
        };
    }
    avx_op!(Add, add, _mm256_add_ps);
    avx_op!(Sub, sub, _mm256_sub_ps);
    avx_op!(Mul, mul, _mm256_mul_ps);
    avx_op!(Div, div, _mm256_div_ps);

    impl Neg for Avx2 {
        type Output = Avx2;
        #[inline(always)]
        fn neg(self) -> Avx2 {
            both!(Avx2, |h| _mm256_xor_ps(self.0[h], _mm256_set1_ps(-0.0)))
        }
    }

    impl BitAnd for Avx2Mask {
        type Output = Avx2Mask;
        #[inline(always)]
        fn bitand(self, o: Avx2Mask) -> Avx2Mask {
            both!(Avx2Mask, |h| _mm256_and_ps(self.0[h], o.0[h]))
        }
    }

    impl BitOr for Avx2Mask {
        type Output = Avx2Mask;
        #[inline(always)]
        fn bitor(self, o: Avx2Mask) -> Avx2Mask {
            both!(Avx2Mask, |h| _mm256_or_ps(self.0[h], o.0[h]))
        }
    }

    impl Avx2 {
        #[inline(always)]
        fn cmp<const P: i32>(self, o: Avx2) -> Avx2Mask {
            both!(Avx2Mask, |h| _mm256_cmp_ps::<P>(self.0[h], o.0[h]))
        }
    }

    impl Avx2Mask {
        #[inline(always)]
        fn bits(self) -> u32 {
            // SAFETY: see the module doc.
            unsafe {
                (_mm256_movemask_ps(self.0[0]) as u32)
                    | ((_mm256_movemask_ps(self.0[1]) as u32) << 8)
            }
        }
    }

    /// Rows r0..r8 into columns: `out[j]` holds `r[0][j], .., r[7][j]`.
    #[inline(always)]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        // SAFETY: see the module doc.
        unsafe {
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            [
                _mm256_permute2f128_ps::<0x20>(s0, s4),
                _mm256_permute2f128_ps::<0x20>(s1, s5),
                _mm256_permute2f128_ps::<0x20>(s2, s6),
                _mm256_permute2f128_ps::<0x20>(s3, s7),
                _mm256_permute2f128_ps::<0x31>(s0, s4),
                _mm256_permute2f128_ps::<0x31>(s1, s5),
                _mm256_permute2f128_ps::<0x31>(s2, s6),
                _mm256_permute2f128_ps::<0x31>(s3, s7),
            ]
        }
    }

    impl Lanes for Avx2 {
        type Mask = Avx2Mask;
        #[inline(always)]
        fn from_subblocks<const N: usize>(src: &[f32], x: &mut [Avx2; N]) {
            let src = &src[..W * N];
            for g in 0..2 {
                for c in 0..N / 8 {
                    // SAFETY: see the module doc.
                    let mut rows = unsafe { [_mm256_setzero_ps(); 8] };
                    for (r, row) in rows.iter_mut().enumerate() {
                        let at = &src[(8 * g + r) * N + 8 * c..][..8];
                        // SAFETY: `at` holds 8 floats; see the module doc.
                        *row = unsafe { _mm256_loadu_ps(at.as_ptr()) };
                    }
                    for (j, col) in transpose8(rows).into_iter().enumerate() {
                        x[8 * c + j].0[g] = col;
                    }
                }
            }
        }
        #[inline(always)]
        fn to_subblocks<const N: usize>(x: &[Avx2; N], out: &mut [u8]) {
            let out = &mut out[..W * N];
            for g in 0..2 {
                for c in 0..N / 8 {
                    // SAFETY: see the module doc.
                    let mut rows = unsafe { [_mm256_setzero_ps(); 8] };
                    for (j, row) in rows.iter_mut().enumerate() {
                        *row = x[8 * c + j].0[g];
                    }
                    let cols = transpose8(rows);
                    for (r, row) in cols.into_iter().enumerate() {
                        // SAFETY: see the module doc. The levels are small non-negative
                        // integers: the conversion and both packs are exact.
                        let (lo, hi) = unsafe {
                            let z = _mm256_setzero_si256();
                            let i = _mm256_cvttps_epi32(row);
                            let b = _mm256_packus_epi16(_mm256_packs_epi32(i, z), z);
                            (
                                _mm_cvtsi128_si32(_mm256_castsi256_si128(b)),
                                _mm_cvtsi128_si32(_mm256_extracti128_si256::<1>(b)),
                            )
                        };
                        let at = (8 * g + r) * N + 8 * c;
                        out[at..at + 4].copy_from_slice(&lo.to_le_bytes());
                        out[at + 4..at + 8].copy_from_slice(&hi.to_le_bytes());
                    }
                }
            }
        }
        #[inline(always)]
        fn splat(v: f32) -> Avx2 {
            both!(Avx2, |_h| _mm256_set1_ps(v))
        }
        #[inline(always)]
        fn load(a: &[f32; W]) -> Avx2 {
            both!(Avx2, |h| _mm256_loadu_ps(a.as_ptr().add(8 * h)))
        }
        #[inline(always)]
        fn store(self, a: &mut [f32; W]) {
            for h in 0..2 {
                // SAFETY: 8 floats at 8·h are within the 16 of `a`; see the module doc.
                unsafe { _mm256_storeu_ps(a.as_mut_ptr().add(8 * h), self.0[h]) }
            }
        }
        #[inline(always)]
        fn abs(self) -> Avx2 {
            both!(Avx2, |h| _mm256_andnot_ps(_mm256_set1_ps(-0.0), self.0[h]))
        }
        #[inline(always)]
        fn sqrt(self) -> Avx2 {
            both!(Avx2, |h| _mm256_sqrt_ps(self.0[h]))
        }
        #[inline(always)]
        fn round(self) -> Avx2 {
            both!(Avx2, |h| _mm256_round_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(self.0[h]))
        }
        #[inline(always)]
        fn nearest_int_clamped(self, lo: i32, hi: i32) -> Avx2 {
            both!(Avx2, |h| {
                let bits = _mm256_castps_si256(_mm256_add_ps(self.0[h], _mm256_set1_ps(MAGIC)));
                let i = _mm256_sub_epi32(
                    _mm256_and_si256(bits, _mm256_set1_epi32(0x007f_ffff)),
                    _mm256_set1_epi32(0x0040_0000),
                );
                let i = _mm256_min_epi32(
                    _mm256_max_epi32(i, _mm256_set1_epi32(lo)),
                    _mm256_set1_epi32(hi),
                );
                _mm256_cvtepi32_ps(i)
            })
        }
        #[inline(always)]
        fn cvtt(self) -> [i32; W] {
            let mut a = [0i32; W];
            for h in 0..2 {
                // SAFETY: 8 ints at 8·h are within the 16 of `a`; see the module doc.
                unsafe {
                    let v = _mm256_cvttps_epi32(self.0[h]);
                    _mm256_storeu_si256(a.as_mut_ptr().add(8 * h).cast(), v)
                }
            }
            a
        }
        #[inline(always)]
        fn round_away(self) -> Avx2 {
            // trunc(x + copysign(0.49999997, x)), how LLVM lowers `roundf` for vectors:
            // exact, the addition's own rounding settles the halves.
            both!(Avx2, |h| {
                let sign = _mm256_and_ps(self.0[h], _mm256_set1_ps(-0.0));
                let half = _mm256_or_ps(sign, _mm256_set1_ps(f32::from_bits(0x3eff_ffff)));
                _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(_mm256_add_ps(
                    self.0[h], half,
                ))
            })
        }
        #[inline(always)]
        fn min(self, o: Avx2) -> Avx2 {
            both!(Avx2, |h| _mm256_min_ps(self.0[h], o.0[h]))
        }
        #[inline(always)]
        fn max(self, o: Avx2) -> Avx2 {
            both!(Avx2, |h| _mm256_max_ps(self.0[h], o.0[h]))
        }
        #[inline(always)]
        fn lt(self, o: Avx2) -> Avx2Mask {
            self.cmp::<_CMP_LT_OQ>(o)
        }
        #[inline(always)]
        fn gt(self, o: Avx2) -> Avx2Mask {
            self.cmp::<_CMP_GT_OQ>(o)
        }
        #[inline(always)]
        fn le(self, o: Avx2) -> Avx2Mask {
            self.cmp::<_CMP_LE_OQ>(o)
        }
        #[inline(always)]
        fn ge(self, o: Avx2) -> Avx2Mask {
            self.cmp::<_CMP_GE_OQ>(o)
        }
        #[inline(always)]
        fn ne(self, o: Avx2) -> Avx2Mask {
            self.cmp::<_CMP_NEQ_UQ>(o)
        }
        #[inline(always)]
        fn sel(m: Avx2Mask, a: Avx2, b: Avx2) -> Avx2 {
            both!(Avx2, |h| _mm256_blendv_ps(b.0[h], a.0[h], m.0[h]))
        }
        #[inline(always)]
        fn all() -> Avx2Mask {
            both!(Avx2Mask, |_h| _mm256_castsi256_ps(_mm256_set1_epi32(-1)))
        }
        #[inline(always)]
        fn none() -> Avx2Mask {
            both!(Avx2Mask, |_h| _mm256_setzero_ps())
        }
        #[inline(always)]
        fn any(m: Avx2Mask) -> bool {
            m.bits() != 0
        }
        #[inline(always)]
        fn unset_bits(m: Avx2Mask) -> u32 {
            !m.bits() & 0xFFFF
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::quantize::c_f32_to_i32;

    /// Values where rounding and conversion have edges: specials, halves and their
    /// neighbours, the ends of the ranges, and a sweep over every exponent.
    fn edge_values() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-45,
            4_194_304.0,
            8_388_608.0,
            2_147_483_520.0,
            2_147_483_648.0,
            -2_147_483_648.0,
            -2_147_483_904.0,
        ];
        for n in 0..300 {
            let h = n as f32 + 0.5;
            for x in [
                h,
                f32::from_bits(h.to_bits() - 1),
                f32::from_bits(h.to_bits() + 1),
            ] {
                v.extend([x, -x]);
            }
        }
        let mut bits = 0u32;
        while let Some(b) = bits.checked_add(40_961) {
            v.push(f32::from_bits(b));
            bits = b;
        }
        let pad = v.len().next_multiple_of(W) - v.len();
        v.extend(std::iter::repeat_n(0.0, pad));
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    fn check<L: Lanes>() {
        for chunk in edge_values().chunks_exact(W) {
            let v = L::load(chunk.try_into().unwrap());
            let (away, cvtt) = (v.round_away().to_array(), v.cvtt());
            let (even, near) = (v.round().to_array(), v.nearest_int_clamped(-40, 40));
            for (k, &x) in chunk.iter().enumerate() {
                assert!(same(away[k], x.round()), "round_away({x:e})");
                assert_eq!(cvtt[k], c_f32_to_i32(x), "cvtt({x:e})");
                let want = nearest_int(x).clamp(-40, 40) as f32;
                assert_eq!(near.to_array()[k], want, "nearest_int_clamped({x:e})");
                if x.abs() < 4_194_304.0 {
                    assert_eq!(even[k], nearest_int(x) as f32, "round({x:e})");
                }
            }
        }
    }

    #[test]
    fn lane_operations_match_the_scalar_ones() {
        check::<Arr>();
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            check::<Avx2>();
        }
    }
}

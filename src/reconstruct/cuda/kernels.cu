// Reconstruction kernels, compiled at run time by NVRTC (src/reconstruct/cuda/mod.rs).
//
// Every kernel computes exactly what the CPU decoder in src/codec (and src/gguf/quant.rs)
// computes, operation for operation: each multiply and add is an explicit
// round-to-nearest intrinsic (__fmul_rn, __fadd_rn, __fsub_rn), which the compiler may
// not contract into a fused multiply-add, and each element's sum runs in the CPU's order.
// The module is also compiled with --fmad=false. docs/CUDA.md lists the order per codec.
//
// Outputs are f32 (what the archive's row reader returns) or, for the benchmark, f16
// (round to nearest even, as `half` rounds).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

// No headers: NVRTC need not find cuda_fp16.h. Conversions are single PTX instructions.
__device__ __forceinline__ float cvt_h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 cvt_f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// f16 bits to f32 as the `half` crate does: exact for every number, NaN quieted with
// its payload kept (the hardware conversion leaves NaN payloads unspecified).
__device__ __forceinline__ float h2f(u16 h) {
    if ((h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0u) {
        return __uint_as_float(((u32)(h & 0x8000u) << 16) | 0x7FC00000u | ((u32)(h & 0x03FFu) << 13));
    }
    return cvt_h2f(h);
}

// bf16 bits to f32 as the `half` crate does (NaN quieted).
__device__ __forceinline__ float bf2f(u16 h) {
    if ((h & 0x7FFFu) > 0x7F80u) {
        return __uint_as_float(((u32)h | 0x0040u) << 16);
    }
    return __uint_as_float((u32)h << 16);
}

// ggml's bf16 (passthrough ggml type BF16): a plain shift, NaN payloads as they are.
__device__ __forceinline__ float ggml_bf2f(u16 h) { return __uint_as_float((u32)h << 16); }

__device__ __forceinline__ u16 ld16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ u32 ld32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ void store(float* o, size_t i, float v) { o[i] = v; }
__device__ __forceinline__ void store(u16* o, size_t i, float v) { o[i] = cvt_f2h(v); }

#define ROWS 8      // rows per thread in the low-rank kernels (accumulators in registers)
#define TILE 128    // columns per thread block in the low-rank kernels
#define KT 256      // U values per row staged in shared memory at a time (any rank fits)

// acc[r] += u[i0+r, k] * vt[k, j] for k = 0..rank, in that order (`add_low_rank` on the
// CPU). U (f16 bits, R × rank) goes through shared memory KT columns at a time, so the
// shared memory a launch needs is ROWS × min(rank, KT) floats whatever the rank. Every
// thread of the block reaches the barriers; `live` says whether column j exists.
__device__ __forceinline__ void add_lowrank(float* acc, u32 nr, u32 i0, u32 j, bool live,
                                            u32 cols, u32 rank, const float* __restrict__ vt,
                                            const u16* __restrict__ u) {
    extern __shared__ float sh[];           // ROWS × kt: the launch's size
    const u32 kt = min((u32)KT, rank);
    for (u32 k0 = 0; k0 < rank; k0 += kt) {
        const u32 kn = min(kt, rank - k0);
        __syncthreads();                    // the previous piece is used up
        for (u32 t = threadIdx.x; t < nr * kn; t += blockDim.x) {
            const u32 r = t / kn, k = t % kn;
            sh[r * kt + k] = h2f(u[(size_t)(i0 + r) * rank + k0 + k]);
        }
        __syncthreads();
        if (!live) continue;
        for (u32 k = 0; k < kn; k++) {
            const float v = vt[(size_t)(k0 + k) * cols + j];
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (r < nr) acc[r] = __fadd_rn(acc[r], __fmul_rn(sh[r * kt + k], v));
            }
        }
    }
}

// Code j of a row of `bits`-bit codes packed LSB first (src/codec/sq.rs `code`).
__device__ __forceinline__ u32 sq_code(const u8* row, u32 bits, u32 j) {
    const u32 bit = j * bits;
    const u32 lo = row[bit / 8];
    const u32 hi = (bit % 8 + bits > 8) ? row[bit / 8 + 1] : 0u;
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1u << bits) - 1u);
}

// NDSQ rows: acc = 0; acc += u[i,k] * svt[k,j] for k = 0..rank; acc += R's value;
// acc += diagonal (where the row has one at column j); acc += outlier (where row i has
// one at column j). R is PQ (sqbits 0: `codes` R × cstride centroid indices into
// `codebook`) or scalar groups (sqbits 1..8: `codes` R × cstride packed codes, `params`
// R × cols/sqgroup [scale, min] f16 pairs, value min + scale·q). `u` is f16 bits
// (R × rank), `diag_col` -1 for none, outliers per row: [ostart[i], ostart[i+1]) into
// ocol (ascending) / oval.
template <typename T>
__device__ void ndsq_rows(T* __restrict__ out, u32 R, u32 cols, u32 rank, u32 d, u32 cstride,
                          u32 sqbits, u32 sqgroup, const float* __restrict__ svt,
                          const float* __restrict__ codebook, const u16* __restrict__ u,
                          const u8* __restrict__ codes, const u8* __restrict__ params,
                          const int* __restrict__ diag_col, const float* __restrict__ diag_val,
                          const u32* __restrict__ ostart, const u32* __restrict__ ocol,
                          const float* __restrict__ oval) {
    const u32 j = blockIdx.x * TILE + threadIdx.x;
    const u32 i0 = blockIdx.y * ROWS;
    const u32 nr = min((u32)ROWS, R - i0);
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    add_lowrank(acc, nr, i0, j, j < cols, cols, rank, svt, u);
    if (j >= cols) return;
    const u32 ngroups = sqbits ? cols / sqgroup : 0u;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (r >= nr) break;
        const u32 i = i0 + r;
        const u8* crow = codes + (size_t)i * cstride;
        float rv;
        if (sqbits == 0) {
            rv = codebook[(size_t)crow[j / d] * d + j % d];
        } else {
            const u8* pg = params + ((size_t)i * ngroups + j / sqgroup) * 4;
            const float sc = h2f(ld16(pg)), mn = h2f(ld16(pg + 2));
            rv = __fadd_rn(mn, __fmul_rn(sc, (float)sq_code(crow, sqbits, j)));
        }
        float a = __fadd_rn(acc[r], rv);
        if (diag_col[i] == (int)j) a = __fadd_rn(a, diag_val[i]);
        // Outlier columns ascend: binary search for j.
        u32 lo = ostart[i], hi = ostart[i + 1];
        while (lo < hi) {
            const u32 mid = (lo + hi) >> 1;
            const u32 cm = ocol[mid];
            if (cm < j) lo = mid + 1; else hi = mid;
        }
        if (lo < ostart[i + 1] && ocol[lo] == j) a = __fadd_rn(a, oval[lo]);
        store(out, (size_t)i * cols + j, a);
    }
}

// Delta rows: acc = base[i,j] (f32, decoded by the host once per shared base block and
// kept resident; `base_rows[i]` is row i's device address); acc += u[i,k] * vt[k,j]
// for k = 0..rank.
template <typename T>
__device__ void lowrank_rows(T* __restrict__ out, u32 R, u32 cols, u32 rank,
                             const float* __restrict__ vt, const u16* __restrict__ u,
                             const unsigned long long* __restrict__ base_rows) {
    const u32 j = blockIdx.x * TILE + threadIdx.x;
    const u32 i0 = blockIdx.y * ROWS;
    const u32 nr = min((u32)ROWS, R - i0);
    const bool live = j < cols;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        acc[r] = (live && r < nr) ? ((const float*)base_rows[i0 + r])[j] : 0.0f;
    }
    add_lowrank(acc, nr, i0, j, live, cols, rank, vt, u);
    if (!live) return;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (r < nr) store(out, (size_t)(i0 + r) * cols + j, acc[r]);
    }
}

// Squish int8 / int4 rows (npy-dir): `g` scale groups of cols/g columns per row.
template <typename T>
__device__ void intq_rows(T* __restrict__ out, size_t n, u32 cols, u32 g, int bits,
                          const u8* __restrict__ q, const float* __restrict__ s) {
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const size_t i = e / cols;
    const u32 j = (u32)(e % cols);
    const float sc = s[i * g + j / (cols / g)];
    float v;
    if (bits == 8) {
        v = __fmul_rn((float)(i8)q[e], sc);
    } else {
        const u8 b = q[i * (cols / 2) + j / 2];
        const int nib = (j & 1) ? (b >> 4) : (b & 0x0F);
        v = __fmul_rn((float)(nib - 7), sc);
    }
    store(out, e, v);
}

// ggml type ids (GGUF numbering).
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30

__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* s, int* m) {
    if (j < 4) {
        *s = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *s = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Element `t` (0..block elements) of one ggml block `b`, as src/gguf/quant.rs computes it.
__device__ float ggml_elem(int ty, const u8* b, int t) {
    switch (ty) {
    case T_F32: return __uint_as_float(ld32(b));
    case T_F16: return h2f(ld16(b));
    case T_BF16: return ggml_bf2f(ld16(b));
    case T_Q4_0: {
        const float d = h2f(ld16(b));
        const u8 q = b[2 + (t & 15)];
        const int v = (t < 16 ? (q & 0x0F) : (q >> 4)) - 8;
        return __fmul_rn((float)v, d);
    }
    case T_Q4_1: {
        const float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
        const u8 q = b[4 + (t & 15)];
        const int v = t < 16 ? (q & 0x0F) : (q >> 4);
        return __fadd_rn(__fmul_rn((float)v, d), m);
    }
    case T_Q5_0: {
        const float d = h2f(ld16(b));
        const u32 qh = ld32(b + 2);
        const int jj = t & 15;
        const u8 q = b[6 + jj];
        int v;
        if (t < 16) v = (q & 0x0F) | (((qh >> jj) << 4) & 0x10);
        else v = (q >> 4) | ((qh >> (jj + 12)) & 0x10);
        return __fmul_rn((float)(v - 16), d);
    }
    case T_Q5_1: {
        const float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
        const u32 qh = ld32(b + 4);
        const int jj = t & 15;
        const u8 q = b[8 + jj];
        int v;
        if (t < 16) v = (q & 0x0F) | (((qh >> jj) << 4) & 0x10);
        else v = (q >> 4) | ((qh >> (jj + 12)) & 0x10);
        return __fadd_rn(__fmul_rn((float)v, d), m);
    }
    case T_Q8_0: {
        const float d = h2f(ld16(b));
        return __fmul_rn((float)(i8)b[2 + t], d);
    }
    case T_Q2_K: {
        // o = n*128 + shift*32 + half*16 + l (shift index s in 0..4)
        const int n = t >> 7, s = (t >> 5) & 3, half = (t >> 4) & 1, l = t & 15;
        const u8 sc = b[n * 8 + s * 2 + half];
        const float d = h2f(ld16(b + 80)), mn = h2f(ld16(b + 82));
        const float dl = __fmul_rn(d, (float)(sc & 0x0F));
        const float ml = __fmul_rn(mn, (float)(sc >> 4));
        const int v = (b[16 + 32 * n + l + 16 * half] >> (2 * s)) & 3;
        return __fsub_rn(__fmul_rn(dl, (float)v), ml);
    }
    case T_Q3_K: {
        const int n = t >> 7, s = (t >> 5) & 3, half = (t >> 4) & 1, l = t & 15;
        const u8* sc = b + 96;
        const int is = n * 8 + s * 2 + half;
        const int lo = (sc[is % 8] >> (4 * (is / 8))) & 0x0F;
        const int hi = (sc[8 + is % 4] >> (2 * (is / 4))) & 0x03;
        const int scale = (lo | (hi << 4)) - 32;
        const float dl = __fmul_rn(h2f(ld16(b + 108)), (float)scale);
        const int k = l + 16 * half;
        const u8 mbit = (u8)(1u << (n * 4 + s));
        const int v = ((b[32 + 32 * n + k] >> (2 * s)) & 3) - ((b[k] & mbit) ? 0 : 4);
        return __fmul_rn(dl, (float)v);
    }
    case T_Q4_K: {
        const int c = t >> 6, w = t & 63, l = w & 31;
        const float d = h2f(ld16(b)), mn = h2f(ld16(b + 2));
        int sc, m;
        scale_min_k4(2 * c + (w >> 5), b + 4, &sc, &m);
        const u8 q = b[16 + 32 * c + l];
        const int v = w < 32 ? (q & 0x0F) : (q >> 4);
        return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)v), __fmul_rn(mn, (float)m));
    }
    case T_Q5_K: {
        const int c = t >> 6, w = t & 63, l = w & 31;
        const float d = h2f(ld16(b)), mn = h2f(ld16(b + 2));
        int sc, m;
        scale_min_k4(2 * c + (w >> 5), b + 4, &sc, &m);
        const u8 ql = b[48 + 32 * c + l];
        const u8 qh = b[16 + l];
        const u8 ubit = (u8)((w < 32 ? 1u : 2u) << (2 * c));
        const int v = (w < 32 ? (ql & 0x0F) : (ql >> 4)) + ((qh & ubit) ? 16 : 0);
        return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)v), __fmul_rn(mn, (float)m));
    }
    case T_Q6_K: {
        const int n = t >> 7, w = t & 127, part = w >> 5, l = w & 31;
        const float d = h2f(ld16(b + 208));
        const u8* ql = b + 64 * n;
        const u8 qh = b[128 + 32 * n + l];
        const i8 sc = (i8)b[192 + 8 * n + l / 16 + 2 * part];
        int v;
        switch (part) {
        case 0: v = (ql[l] & 0x0F) | ((qh & 3) << 4); break;
        case 1: v = (ql[l + 32] & 0x0F) | (((qh >> 2) & 3) << 4); break;
        case 2: v = (ql[l] >> 4) | (((qh >> 4) & 3) << 4); break;
        default: v = (ql[l + 32] >> 4) | (((qh >> 6) & 3) << 4); break;
        }
        return __fmul_rn(__fmul_rn(d, (float)sc), (float)(v - 32));
    }
    }
    return __int_as_float(0x7FC00000); // unreachable: the host sends supported types only
}

// Raw rows of a passthrough tensor: `n` elements of type `ty`, `be` elements and `bb`
// bytes per ggml block (1 element of 4 or 2 bytes for f32 / f16 / bf16). Source f16 and
// bf16 (safetensors sources) use the `half` crate's conversions, ggml types ggml's.
template <typename T>
__device__ void raw_rows(T* __restrict__ out, size_t n, int ty, int src_half, u32 be, u32 bb,
                         const u8* __restrict__ src) {
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const size_t blk = e / be;
    const int t = (int)(e % be);
    const u8* b = src + blk * bb;
    float v;
    if (src_half == 1) v = h2f(ld16(b));
    else if (src_half == 2) v = bf2f(ld16(b));
    else v = ggml_elem(ty, b, t);
    store(out, e, v);
}

#define INSTANTIATE(SUFFIX, T)                                                                  \
extern "C" __global__ void ndsq_##SUFFIX(T* out, u32 R, u32 cols, u32 rank, u32 d, u32 cs,     \
    u32 sqbits, u32 sqgroup, const float* svt, const float* codebook, const u16* u,             \
    const u8* codes, const u8* params, const int* dc, const float* dv, const u32* os,           \
    const u32* oc, const float* ov) {                                                           \
    ndsq_rows<T>(out, R, cols, rank, d, cs, sqbits, sqgroup, svt, codebook, u, codes, params,   \
                 dc, dv, os, oc, ov);                                                           \
}                                                                                               \
extern "C" __global__ void lowrank_##SUFFIX(T* out, u32 R, u32 cols, u32 rank, const float* vt, \
    const u16* u, const unsigned long long* base_rows) {                                        \
    lowrank_rows<T>(out, R, cols, rank, vt, u, base_rows);                                      \
}                                                                                               \
extern "C" __global__ void intq_##SUFFIX(T* out, unsigned long long n, u32 cols, u32 g,        \
    int bits, const u8* q, const float* s) {                                                    \
    intq_rows<T>(out, (size_t)n, cols, g, bits, q, s);                                          \
}                                                                                               \
extern "C" __global__ void raw_##SUFFIX(T* out, unsigned long long n, int ty, int src_half,    \
    u32 be, u32 bb, const u8* src) {                                                            \
    raw_rows<T>(out, (size_t)n, ty, src_half, be, bb, src);                                     \
}

INSTANTIATE(f32, float)
INSTANTIATE(f16, u16)

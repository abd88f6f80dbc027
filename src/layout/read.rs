//! Reading a tensor piece of a virtual file: the source rows a byte window needs, into
//! reused row buffers, encoded into the window (floats or ggml blocks).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::{Fill, TensorPiece, SCRATCH_F32_BYTES};
use crate::gguf::quantize::quantize;
use crate::gguf::GgmlType;
use crate::model::{ReadError, RowSource};

/// Values converted per step of [`encode_window`] (a 4 KiB stack buffer for f32, four
/// 256-value K blocks).
const ENCODE_STEP: usize = 1024;

/// Write bytes `[skip, skip + out.len())` of `vals` encoded as `ty` (little-endian
/// floats or ggml blocks) into `out`, encoding only the values (whole blocks) that
/// overlap the window, through a small stack buffer rather than an encoded copy of the
/// whole run. `vals` is a whole number of `ty`'s blocks. `half` rounds to nearest even,
/// as torch, numpy and ggml do.
fn encode_window(vals: &[f32], ty: GgmlType, skip: usize, out: &mut [u8]) -> Result<(), ReadError> {
    let (be, bb) = ty.block();
    let (be, bb) = (be as usize, bb as usize);
    let end = skip + out.len();
    debug_assert!(vals.len() % be == 0 && end <= vals.len() / be * bb);
    let mut buf = [0u8; ENCODE_STEP * 4];
    let step_blocks = (ENCODE_STEP / be).max(1);
    let mut k = skip / bb;
    while k * bb < end {
        let n = step_blocks.min(vals.len() / be - k);
        let step = &vals[k * be..(k + n) * be];
        let bytes = &mut buf[..n * bb];
        match ty {
            GgmlType::F16 => {
                let mut h = [f16::ZERO; ENCODE_STEP];
                h[..n].convert_from_f32_slice(step);
                for (b, v) in bytes.chunks_exact_mut(2).zip(&h[..n]) {
                    b.copy_from_slice(&v.to_le_bytes());
                }
            }
            GgmlType::BF16 => {
                let mut h = [bf16::ZERO; ENCODE_STEP];
                h[..n].convert_from_f32_slice(step);
                for (b, v) in bytes.chunks_exact_mut(2).zip(&h[..n]) {
                    b.copy_from_slice(&v.to_le_bytes());
                }
            }
            _ => quantize(ty, step, bytes).map_err(|e| {
                ReadError::Io(std::io::Error::other(format!("encoding {ty:?}: {e}")))
            })?,
        }
        // Intersect this step's bytes [k*bb, (k+n)*bb) with the window.
        let (a, b) = ((k * bb).max(skip), ((k + n) * bb).min(end));
        out[a - skip..b - skip].copy_from_slice(&bytes[a - k * bb..b - k * bb]);
        k += n;
    }
    Ok(())
}

/// Rows of a tensor piece read from the archive: f32 values to encode, or the stored
/// source bytes to copy.
enum Rows {
    Values(Vec<f32>),
    Raw(Vec<u8>),
}

impl Rows {
    /// Rows `s0..s1` of the piece's tensor into this buffer.
    fn read(
        &mut self,
        src: &dyn RowSource,
        t: &TensorPiece,
        s0: u64,
        s1: u64,
    ) -> Result<(), ReadError> {
        self.read_part(src, t, (s0, s1), (s0, s1))
    }

    /// Rows `x0..x1` of the piece's tensor into this buffer of rows `s0..s1` (which
    /// holds them), leaving its other rows as they were.
    fn read_part(
        &mut self,
        src: &dyn RowSource,
        t: &TensorPiece,
        (s0, s1): (u64, u64),
        (x0, x1): (u64, u64),
    ) -> Result<(), ReadError> {
        debug_assert!(s0 <= x0 && x0 <= x1 && x1 <= s1);
        match self {
            // A buffer keeps its length between reads and only what it grows by is
            // zeroed: every source writes all of `out` (the `RowSource` contract), and
            // zeroing the f32 rows of every read was 6 % of a first pass's CPU.
            Rows::Values(v) => {
                let n = ((s1 - s0) * t.cols) as usize;
                if v.len() < n {
                    // The whole scratch size at once, so that the buffer kept for the
                    // next read (`give_scratch`) never moves: only its touched pages are
                    // resident.
                    v.reserve_exact(n.max((SCRATCH_F32_BYTES / 4) as usize) - v.len());
                    v.resize(n, 0.0);
                }
                let at = |r: u64| ((r - s0) * t.cols) as usize;
                src.read_rows(t.tensor, x0, x1, &mut v[at(x0)..at(x1)])
            }
            Rows::Raw(v) => {
                let n = ((s1 - s0) * t.row_bytes) as usize;
                if v.len() < n {
                    v.resize(n, 0);
                }
                let at = |r: u64| ((r - s0) * t.row_bytes) as usize;
                src.read_raw_rows(t.tensor, x0, x1, &mut v[at(x0)..at(x1)])
            }
        }
    }

    /// Bytes `[skip, skip + out.len())` of rows `i0..i1` of this buffer, served.
    fn place(
        &self,
        t: &TensorPiece,
        (i0, i1): (u64, u64),
        skip: usize,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        match self {
            Rows::Values(v) => {
                let rows = &v[(i0 * t.cols) as usize..(i1 * t.cols) as usize];
                let Fill::Encode(ty) = t.fill else {
                    unreachable!("read_tensor reads copied pieces as bytes")
                };
                encode_window(rows, ty, skip, out)
            }
            Rows::Raw(v) => {
                let at = (i0 * t.row_bytes) as usize + skip;
                out.copy_from_slice(&v[at..at + out.len()]);
                Ok(())
            }
        }
    }
}

/// Copy bytes `[rel, rel + out.len())` of a tensor piece's data into `out`, reading
/// runs of at most [`SCRATCH_F32_BYTES`] of rows from the source.
pub(super) fn read_tensor(
    src: &dyn RowSource,
    t: &TensorPiece,
    rel: u64,
    out: &mut [u8],
) -> Result<(), ReadError> {
    let end = rel + out.len() as u64;
    let mut rows = if t.fill.is_copy() {
        Rows::Raw(Vec::new())
    } else {
        Rows::Values(take_scratch())
    };
    let result = read_tensor_rows(src, t, (rel, end), &mut rows, out);
    if let Rows::Values(v) = rows {
        give_scratch(v);
    }
    result
}

/// f32 row buffers of finished reads, for the next: a fresh one per chunk was a fresh
/// mapping, page faults and zeroing included (a tenth of a cold read's CPU). Shared
/// rather than per thread because the mount loads the chunks of one read on threads
/// spawned for it. Each holds at most [`SCRATCH_F32_BYTES`], of which only the pages a
/// read touched are resident; how many are kept is [`keep_scratch_buffers`]'s.
static SCRATCH: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

static SCRATCH_KEPT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(16);

/// Keep at most `n` row buffers between reads (16 by default; 0 keeps none), for a
/// process whose memory outside its cache budget is bounded (the mount keeps a
/// sixty-fourth of its budget).
pub fn keep_scratch_buffers(n: usize) {
    SCRATCH_KEPT.store(n, std::sync::atomic::Ordering::Relaxed);
    let mut pool = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
    pool.truncate(n);
}

/// The largest buffer [`keep_scratch_buffers`] counts with.
pub const SCRATCH_BUFFER_BYTES: u64 = SCRATCH_F32_BYTES;

fn take_scratch() -> Vec<f32> {
    let mut pool = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
    pool.pop().unwrap_or_default()
}

fn give_scratch(v: Vec<f32>) {
    // A run is at most SCRATCH_F32_BYTES unless one row (or head) is larger; such a
    // buffer is not kept.
    if v.capacity() > 0 && v.capacity() * 4 <= SCRATCH_F32_BYTES as usize {
        let mut pool = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < SCRATCH_KEPT.load(std::sync::atomic::Ordering::Relaxed) {
            pool.push(v);
        }
    }
}

fn read_tensor_rows(
    src: &dyn RowSource,
    t: &TensorPiece,
    (rel, end): (u64, u64),
    rows: &mut Rows,
    out: &mut [u8],
) -> Result<(), ReadError> {
    if t.transpose {
        return read_transposed(src, t, (rel, end), out);
    }
    // A permuted 1-D tensor: one small row whose elements are reordered.
    if let (Some(heads), 1, Fill::Encode(ty)) = (t.permute, t.rows, t.fill) {
        let mut vals = vec![0f32; t.cols as usize];
        src.read_rows(t.tensor, 0, 1, &mut vals)?;
        let perm: Vec<f32> = (0..t.cols)
            .map(|g| vals[crate::model::names::gguf_row_to_hf(g, t.cols, heads) as usize])
            .collect();
        return encode_window(&perm, ty, rel as usize, out);
    }

    let row_bytes = t.row_bytes;
    let first = rel / row_bytes;
    let last = end.div_ceil(row_bytes).min(t.rows);
    // Read granularity: one row, or one whole head of a permuted tensor (its rows are
    // interleaved from both halves of the head).
    let unit = match t.permute {
        Some(h) => t.rows / h as u64,
        None => 1,
    };
    let row_f32 = t.cols * 4;
    let units_per_run = (SCRATCH_F32_BYTES / (row_f32 * unit)).max(1);
    let mut r = first;
    // Rows i0..i1 of the buffer are bytes [from, to) of the tensor's data: the part of
    // them inside the window goes to its place in `out`.
    let place = |rows: &Rows, out: &mut [u8], (i0, i1): (u64, u64), from: u64, to: u64| {
        let (a, b) = (rel.max(from), end.min(to));
        if a < b {
            let dst = &mut out[(a - rel) as usize..(b - rel) as usize];
            rows.place(t, (i0, i1), (a - from) as usize, dst)?;
        }
        Ok::<(), ReadError>(())
    };
    while r < last {
        // GGUF (output) rows r..r_end, source rows s0..s1.
        let (r_end, s0, s1) = match t.permute {
            None => {
                let r_end = (r + units_per_run).min(last);
                (r_end, r, r_end)
            }
            Some(_) => {
                let h0 = r / unit;
                let r_end = ((h0 + units_per_run) * unit).min(last);
                let h1 = r_end.div_ceil(unit);
                (r_end, h0 * unit, h1 * unit)
            }
        };
        match t.permute {
            None => rows.read(src, t, s0, s1)?,
            // Only the source rows of output rows r..r_end: a window that ends inside a
            // head needs part of each half of it, and reading the whole head decoded
            // its blocks again for the next window (a sequential pass of a 1 B model's
            // GGUF read 1.05x the archive's bytes).
            Some(heads) => {
                for (x0, x1) in source_runs(r..r_end, t.rows, heads) {
                    rows.read_part(src, t, (s0, s1), (x0, x1))?;
                }
            }
        }
        if let (Rows::Values(v), true) = (&mut *rows, t.add != 0.0) {
            let n = ((s1 - s0) * t.cols) as usize;
            v[..n].iter_mut().for_each(|x| *x += t.add);
        }
        match t.permute {
            None => place(rows, out, (0, s1 - s0), r * row_bytes, r_end * row_bytes)?,
            Some(heads) => {
                for g in r..r_end {
                    let s = crate::model::names::gguf_row_to_hf(g, t.rows, heads) - s0;
                    place(rows, out, (s, s + 1), g * row_bytes, (g + 1) * row_bytes)?;
                }
            }
        }
        r = r_end;
    }
    Ok(())
}

/// The source rows of output rows `g` of a head-permuted tensor, as ascending runs
/// `[x0, x1)` (two per partly covered head: one in each half).
pub(super) fn source_runs(g: std::ops::Range<u64>, rows: u64, heads: u32) -> Vec<(u64, u64)> {
    let mut src: Vec<u64> = g
        .map(|g| crate::model::names::gguf_row_to_hf(g, rows, heads))
        .collect();
    src.sort_unstable();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for s in src {
        match runs.last_mut() {
            Some(run) if run.1 == s => run.1 += 1,
            _ => runs.push((s, s + 1)),
        }
    }
    runs
}

/// Bytes `[rel, end)` of a transposed piece: output row `r` is column `r` of the stored
/// tensor, so any output row needs every stored row: the whole tensor is read (bounded
/// by [`MAX_TRANSPOSED_F32_BYTES`] when the layout is built) and the window's rows
/// gathered from it.
fn read_transposed(
    src: &dyn RowSource,
    t: &TensorPiece,
    (rel, end): (u64, u64),
    out: &mut [u8],
) -> Result<(), ReadError> {
    let Fill::Encode(ty) = t.fill else {
        unreachable!("transposed pieces are built encoded")
    };
    let (rows, cols) = (t.rows as usize, t.cols as usize);
    let mut stored = vec![0f32; rows * cols];
    src.read_rows(t.tensor, 0, t.cols, &mut stored)?;
    let first = rel / t.row_bytes;
    let last = end.div_ceil(t.row_bytes).min(t.rows);
    let mut vals = Vec::with_capacity((last - first) as usize * cols);
    for r in first as usize..last as usize {
        vals.extend((0..cols).map(|c| stored[c * rows + r] + t.add));
    }
    encode_window(&vals, ty, (rel - first * t.row_bytes) as usize, out)
}

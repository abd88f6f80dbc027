//! Packing a batch's inputs into one buffer and launching the kernels on it.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use super::{Cuda, GpuError, OutType, ALIGN, KT, ROWS, THREADS_1D, TILE};
use crate::codec::BlockParts;
use crate::model::SourceType;
use crate::reconstruct::Work;

impl Cuda {
    /// Lays the batch's inputs out in `p` and says what to launch.
    pub(super) fn pack<'w>(
        &self,
        first: &Work<'_>,
        jobs: &[(&Work<'w>, usize)],
        p: &mut Packer,
    ) -> Result<Launch, GpuError> {
        let rows: usize = jobs.iter().map(|(w, _)| rows_of(w)).sum();
        use std::borrow::Cow;
        // Resident uploads finish (on a stream of their own) before the batch starts.
        let stream = self.ctx.default_stream();
        match first {
            Work::Block(BlockParts::Ndsq(f)) => {
                let (rank, cols, d, cstride) = (f.rank(), f.cols(), f.sub_dim(), f.code_stride());
                let (sqbits, sqgroup) = f.scalar_shape().unwrap_or((0, 0));
                let cb_off = f.svt().len() * 4;
                let global = self.resident(&stream, f.global_key(), || {
                    let mut g = Vec::with_capacity(cb_off + f.codebook().len() * 4);
                    g.extend_from_slice(bytemuck::cast_slice(f.svt()));
                    g.extend_from_slice(bytemuck::cast_slice(f.codebook()));
                    Cow::Owned(g)
                })?;
                let each = |fun: &mut dyn FnMut(&crate::codec::NdsqParts<'_>)| {
                    for (w, _) in jobs {
                        if let Work::Block(BlockParts::Ndsq(q)) = w {
                            fun(q)
                        }
                    }
                };
                let u = p.start();
                each(&mut |q| p.put(q.u_f16()));
                let codes = p.start();
                each(&mut |q| p.put(q.codes()));
                let params = p.start();
                each(&mut |q| p.put(q.scalar_params()));
                let dc = p.start();
                each(&mut |q| {
                    for i in 0..q.rows() {
                        let c = q.diagonal(i).map_or(-1i32, |(c, _)| c as i32);
                        p.put(&c.to_le_bytes());
                    }
                });
                let dv = p.start();
                each(&mut |q| {
                    for i in 0..q.rows() {
                        let v = q.diagonal(i).map_or(0f32, |(_, v)| v);
                        p.put(&v.to_le_bytes());
                    }
                });
                let os = p.start();
                let mut total = 0u32;
                each(&mut |q| {
                    for i in 0..q.rows() {
                        p.put(&total.to_le_bytes());
                        total += q.outliers(i).count() as u32;
                    }
                });
                p.put(&total.to_le_bytes());
                let oc = p.start();
                each(&mut |q| {
                    for i in 0..q.rows() {
                        for (c, _) in q.outliers(i) {
                            p.put(&(c as u32).to_le_bytes());
                        }
                    }
                });
                let ov = p.start();
                each(&mut |q| {
                    for i in 0..q.rows() {
                        for (_, v) in q.outliers(i) {
                            p.put(&v.to_le_bytes());
                        }
                    }
                });
                p.start();
                Ok(Launch::Ndsq {
                    rows,
                    cols,
                    rank,
                    d,
                    cstride,
                    sq: (sqbits, sqgroup),
                    global,
                    cb_off,
                    offs: [u, codes, params, dc, dv, os, oc, ov],
                })
            }
            Work::LowRank(f) => {
                let (rank, cols) = (f.rank, f.cols);
                let vt = self.resident(&stream, f.vt_key, || {
                    Cow::Borrowed(bytemuck::cast_slice(f.vt))
                })?;
                let u = p.start();
                for (w, _) in jobs {
                    if let Work::LowRank(l) = w {
                        p.put(l.u_f16);
                    }
                }
                // Each row's base row by device address: blocks' bases are resident
                // apart, and one launch covers them all.
                let mut bases = Vec::new();
                let base_rows = p.start();
                for (w, _) in jobs {
                    if let Work::LowRank(l) = w {
                        let base = self.resident(&stream, l.base_key, || {
                            Cow::Borrowed(bytemuck::cast_slice(l.base))
                        })?;
                        let ptr = base.device_ptr(&stream).0;
                        for r in 0..l.rows {
                            let row = ptr + ((l.base_row0 + r) * cols * 4) as u64;
                            p.put(&row.to_le_bytes());
                        }
                        bases.push(base);
                    }
                }
                p.start();
                Ok(Launch::LowRank {
                    rows,
                    cols,
                    rank,
                    vt,
                    _bases: bases,
                    offs: [u, base_rows],
                })
            }
            Work::IntQ(f) => {
                let (bits, cols, groups) = (f.bits, f.cols, f.groups);
                let q = p.start();
                for (w, _) in jobs {
                    if let Work::IntQ(x) = w {
                        p.put(x.q);
                    }
                }
                let s = p.start();
                for (w, _) in jobs {
                    if let Work::IntQ(x) = w {
                        p.put(bytemuck::cast_slice(x.scales));
                    }
                }
                p.start();
                Ok(Launch::IntQ {
                    n: rows * cols,
                    cols,
                    groups,
                    bits,
                    offs: [q, s],
                })
            }
            Work::Block(BlockParts::Raw { format, cols, .. }) => {
                let (ty, half, be, bb) = raw_params(*format);
                let src = p.start();
                for (w, _) in jobs {
                    if let Work::Block(BlockParts::Raw { bytes, .. }) = w {
                        p.put(bytes);
                    }
                }
                p.start();
                Ok(Launch::Raw {
                    n: rows * cols,
                    ty,
                    half,
                    be,
                    bb,
                    src,
                })
            }
        }
    }

    pub(super) fn launch(
        &self,
        stream: &Arc<CudaStream>,
        l: &Launch,
        din: &CudaSlice<u8>,
        dout: &mut CudaSlice<u8>,
        out: OutType,
    ) -> Result<(), GpuError> {
        let o = out.idx();
        let os = out.size();
        match l {
            Launch::Ndsq {
                rows,
                cols,
                rank,
                d,
                cstride,
                sq,
                global,
                cb_off,
                offs,
            } => {
                let [cols32, rank32, d32, cs32, sqb32, sqg32] =
                    [*cols, *rank, *d, *cstride, sq.0, sq.1].map(|v| v as u32);
                let svt = global.slice(..);
                let cb = global.slice(*cb_off..);
                // Bytes of scalar params per row.
                let pb = if sq.0 > 0 { cols / sq.1 * 4 } else { 0 };
                // gridDim.y is at most 65535: very tall batches in several launches.
                let step = (ROWS as usize) * 65535;
                let mut r0 = 0usize;
                while r0 < *rows {
                    let nr = (*rows - r0).min(step);
                    let v = |off: usize, per_row: usize| din.slice(off + r0 * per_row..);
                    let (u, codes, params) =
                        (v(offs[0], rank * 2), v(offs[1], *cstride), v(offs[2], pb));
                    let (dc, dv, osv) = (v(offs[3], 4), v(offs[4], 4), v(offs[5], 4));
                    let (oc, ov) = (din.slice(offs[6]..), din.slice(offs[7]..));
                    let mut outv = dout.slice_mut(r0 * cols * os..);
                    let nr32 = nr as u32;
                    let cfg = low_rank_config(cols32, nr32, rank32);
                    let mut b = stream.launch_builder(&self.k.ndsq[o]);
                    b.arg(&mut outv)
                        .arg(&nr32)
                        .arg(&cols32)
                        .arg(&rank32)
                        .arg(&d32)
                        .arg(&cs32)
                        .arg(&sqb32)
                        .arg(&sqg32)
                        .arg(&svt)
                        .arg(&cb)
                        .arg(&u)
                        .arg(&codes)
                        .arg(&params)
                        .arg(&dc)
                        .arg(&dv)
                        .arg(&osv)
                        .arg(&oc)
                        .arg(&ov);
                    // SAFETY: arguments match ndsq_* in kernels.cu; every array holds
                    // the rows the grid covers (packed above), offsets are in bounds.
                    unsafe { b.launch(cfg) }?;
                    r0 += nr;
                }
            }
            Launch::LowRank {
                rows,
                cols,
                rank,
                vt,
                _bases: _,
                offs,
            } => {
                let (cols32, rank32) = (*cols as u32, *rank as u32);
                let vtv = vt.slice(..);
                let step = (ROWS as usize) * 65535;
                let mut r0 = 0usize;
                while r0 < *rows {
                    let nr = (*rows - r0).min(step);
                    let nr32 = nr as u32;
                    let uv = din.slice(offs[0] + r0 * rank * 2..);
                    let bv = din.slice(offs[1] + r0 * 8..);
                    let mut outv = dout.slice_mut(r0 * cols * os..);
                    let cfg = low_rank_config(cols32, nr32, rank32);
                    let mut b = stream.launch_builder(&self.k.lowrank[o]);
                    b.arg(&mut outv)
                        .arg(&nr32)
                        .arg(&cols32)
                        .arg(&rank32)
                        .arg(&vtv)
                        .arg(&uv)
                        .arg(&bv);
                    // SAFETY: arguments match lowrank_* in kernels.cu; the row table
                    // holds addresses inside the resident bases `bases` keeps alive.
                    unsafe { b.launch(cfg) }?;
                    r0 += nr;
                }
            }
            Launch::IntQ {
                n,
                cols,
                groups,
                bits,
                offs,
            } => {
                let (n64, cols32, g32, bits32) =
                    (*n as u64, *cols as u32, *groups as u32, *bits as i32);
                let (q, s) = (din.slice(offs[0]..), din.slice(offs[1]..));
                let cfg = LaunchConfig::for_num_elems_1d(*n, THREADS_1D);
                let mut b = stream.launch_builder(&self.k.intq[o]);
                b.arg(&mut *dout)
                    .arg(&n64)
                    .arg(&cols32)
                    .arg(&g32)
                    .arg(&bits32)
                    .arg(&q)
                    .arg(&s);
                // SAFETY: arguments match intq_* in kernels.cu.
                unsafe { b.launch(cfg) }?;
            }
            Launch::Raw {
                n,
                ty,
                half,
                be,
                bb,
                src,
            } => {
                let n64 = *n as u64;
                let s = din.slice(*src..);
                let cfg = LaunchConfig::for_num_elems_1d(*n, THREADS_1D);
                let mut b = stream.launch_builder(&self.k.raw[o]);
                b.arg(&mut *dout)
                    .arg(&n64)
                    .arg(ty)
                    .arg(half)
                    .arg(be)
                    .arg(bb)
                    .arg(&s);
                // SAFETY: arguments match raw_* in kernels.cu.
                unsafe { b.launch(cfg) }?;
            }
        }
        Ok(())
    }
}

/// A launch of the ndsq / lowrank kernels over `rows` rows: TILE columns by ROWS rows per
/// thread block, U staged in shared memory KT values per row at a time.
fn low_rank_config(cols: u32, rows: u32, rank: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(TILE), rows.div_ceil(ROWS), 1),
        block_dim: (TILE, 1, 1),
        shared_mem_bytes: ROWS * rank.min(KT) * 4,
    }
}

trait OneD {
    fn for_num_elems_1d(n: usize, threads: u32) -> LaunchConfig;
}

impl OneD for LaunchConfig {
    fn for_num_elems_1d(n: usize, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((n as u64).div_ceil(threads as u64).max(1) as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// What a packed batch launches; device buffers it needs are held until it is done.
pub(super) enum Launch {
    Ndsq {
        rows: usize,
        cols: usize,
        rank: usize,
        d: usize,
        /// Bytes of codes per row.
        cstride: usize,
        /// Scalar R's (bits, group); (0, 0) for PQ.
        sq: (usize, usize),
        global: Arc<CudaSlice<u8>>,
        cb_off: usize,
        /// u, codes, scalar params, diag col, diag val, outlier starts, outlier cols,
        /// outlier vals.
        offs: [usize; 8],
    },
    LowRank {
        rows: usize,
        cols: usize,
        rank: usize,
        vt: Arc<CudaSlice<u8>>,
        /// The blocks' bases the row table points into, held until the batch is done.
        _bases: Vec<Arc<CudaSlice<u8>>>,
        /// u, base row addresses.
        offs: [usize; 2],
    },
    IntQ {
        n: usize,
        cols: usize,
        groups: usize,
        bits: u8,
        offs: [usize; 2],
    },
    Raw {
        n: usize,
        ty: i32,
        half: i32,
        be: u32,
        bb: u32,
        src: usize,
    },
}

/// Inputs laid out one after another, each array starting at an aligned offset.
pub(super) struct Packer {
    pub(super) buf: Vec<u8>,
}

impl Packer {
    pub(super) fn new(mut buf: Vec<u8>) -> Packer {
        buf.clear();
        Packer { buf }
    }
    /// Pads to the alignment and returns the offset the next array starts at.
    pub(super) fn start(&mut self) -> usize {
        let n = self.buf.len().next_multiple_of(ALIGN);
        self.buf.resize(n, 0);
        n
    }
    pub(super) fn put(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
}

fn rows_of(w: &Work<'_>) -> usize {
    match w {
        Work::Block(p) => p.rows(),
        Work::LowRank(l) => l.rows,
        Work::IntQ(q) => q.rows,
    }
}

/// (ggml type id, source half kind (0 none, 1 f16, 2 bf16), elements and bytes per
/// block) for the raw kernel.
pub(super) fn raw_params(format: SourceType) -> (i32, i32, u32, u32) {
    match format {
        SourceType::F32 => (0, 0, 1, 4),
        SourceType::F16 => (1, 1, 1, 2),
        SourceType::BF16 => (30, 2, 1, 2),
        SourceType::Ggml(t) => {
            let (be, bb) = t.block();
            (t.id() as i32, 0, be as u32, bb as u32)
        }
        // Never batched for the GPU (`batchable_prefix`): the kernel has no such type.
        SourceType::Plain(p) => (-1, 0, 1, p.size() as u32),
    }
}

/// How many jobs from the front form one GPU batch, and whether the GPU should run
/// them at all (f32 passthrough is a copy: the CPU does it).
pub fn batchable_prefix(jobs: &[(Work<'_>, &mut [f32])]) -> (usize, bool) {
    let Some((first, _)) = jobs.first() else {
        return (0, false);
    };
    let alike = |w: &Work<'_>| match (first, w) {
        (Work::Block(BlockParts::Ndsq(a)), Work::Block(BlockParts::Ndsq(b))) => {
            a.global_key() == b.global_key() && a.cols() == b.cols()
        }
        (
            Work::Block(BlockParts::Raw {
                format: fa,
                cols: ca,
                ..
            }),
            Work::Block(BlockParts::Raw {
                format: fb,
                cols: cb,
                ..
            }),
        ) => fa == fb && ca == cb,
        (Work::LowRank(a), Work::LowRank(b)) => {
            a.vt_key == b.vt_key && a.rank == b.rank && a.cols == b.cols
        }
        (Work::IntQ(a), Work::IntQ(b)) => {
            a.bits == b.bits && a.groups == b.groups && a.cols == b.cols
        }
        _ => false,
    };
    let n = jobs.iter().take_while(|(w, _)| alike(w)).count();
    // F32 rows are a copy; plain types (integers, fp8 ...) are small and rare; the
    // kernel has no IQ grids.
    let gpu = match first {
        Work::Block(BlockParts::Raw { format, .. }) => match format {
            SourceType::F32 | SourceType::Plain(_) => false,
            SourceType::Ggml(t) => !t.has_table(),
            SourceType::F16 | SourceType::BF16 => true,
        },
        _ => true,
    };
    (n, gpu)
}

//! The CUDA backend. `cudarc` loads libcuda and libnvrtc when a GPU is asked for, so
//! the same binary builds without a toolkit and runs where there is none; the kernels
//! (kernels.cu) are compiled by NVRTC for the device at first use.
//!
//! A batch (jobs alike: one tensor's blocks, see [`batchable_prefix`]) is packed into
//! one pinned host buffer, copied in with one transfer, computed by one launch (a few
//! for very tall batches) and copied out with one transfer, on a stream of its own:
//! concurrent readers' batches overlap each other's copies and compute. Tensor-wide
//! data (NDSQ's Σ·Vᵀ and codebook, a delta tensor's Vᵀ and its base blocks) stays
//! resident under `--vram-budget`, keyed by content, least recently used first out.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, PinnedHostSlice,
};

use super::Work;

mod batch;

pub use batch::batchable_prefix;
use batch::Packer;

const KERNELS: &str = include_str!("kernels.cu");
/// Must match ROWS, TILE and KT in kernels.cu.
const ROWS: u32 = 8;
const TILE: u32 = 128;
const KT: u32 = 256;
const THREADS_1D: u32 = 256;
/// Concurrent batches (streams with their buffers), unless `CAWSFS_CUDA_STREAMS` (1-64)
/// says otherwise: a tuning knob for the cold-read benchmark (docs/CUDA.md).
const MAX_SLOTS: usize = 4;
const ALIGN: usize = 256;
/// Values per parallel piece when results are copied out of pinned memory.
const COPY_PIECE: usize = 1 << 18;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("CUDA: {0}")]
    Driver(#[from] DriverError),
    #[error("CUDA: {0}")]
    Other(String),
}

/// Output element type of a launch: f32 for reads, f16 for the benchmark.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum OutType {
    F32,
    F16,
}

impl OutType {
    fn size(self) -> usize {
        match self {
            OutType::F32 => 4,
            OutType::F16 => 2,
        }
    }
    fn idx(self) -> usize {
        match self {
            OutType::F32 => 0,
            OutType::F16 => 1,
        }
    }
}

struct Kernels {
    ndsq: [CudaFunction; 2],
    lowrank: [CudaFunction; 2],
    intq: [CudaFunction; 2],
    raw: [CudaFunction; 2],
}

/// One stream and its staging buffers.
struct Slot {
    stream: Arc<CudaStream>,
    pack: Vec<u8>,
    host_in: Option<PinnedHostSlice<u8>>,
    dev_in: Option<CudaSlice<u8>>,
    host_out: Option<PinnedHostSlice<u8>>,
    dev_out: Option<CudaSlice<u8>>,
}

struct Pool {
    idle: Vec<Slot>,
    made: usize,
    max: usize,
}

struct ResidentEntry {
    data: Arc<CudaSlice<u8>>,
    tick: u64,
}

#[derive(Default)]
struct Resident {
    map: HashMap<u128, ResidentEntry>,
    bytes: u64,
    tick: u64,
}

pub struct Cuda {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    k: Kernels,
    pool: Mutex<Pool>,
    pool_cv: Condvar,
    resident: Mutex<Resident>,
    budget: u64,
    fail_every: Option<u64>,
    batches: std::sync::atomic::AtomicU64,
}

/// Timings of one profiled batch, seconds (CUDA events).
#[derive(Clone, Copy, Debug, Default)]
pub struct BenchTiming {
    pub copy_in: f64,
    pub compute: f64,
    /// The f16-output kernels on the same input (output then overwritten).
    pub compute_f16: f64,
    pub copy_out: f64,
    /// Bytes copied in and out.
    pub bytes_in: usize,
    pub bytes_out: usize,
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    crate::error::panic_text(&*p)
}

/// Makes a library findable by the name cudarc asks the dynamic loader for: where the
/// loader's own search misses it, a copy at a toolkit's usual place is loaded by path
/// (a later dlopen by soname then finds it loaded).
fn preload(lib: &str, present: impl Fn() -> bool) -> bool {
    if present() {
        return true;
    }
    let mut dirs: Vec<std::path::PathBuf> = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|d| std::path::PathBuf::from(d).join("lib64"))
        .collect();
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    for dir in dirs {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut names: Vec<_> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("lib{lib}.so")))
            })
            .collect();
        names.sort();
        for p in names {
            let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
                continue;
            };
            // SAFETY: loading a shared library by path; the handle is kept for the
            // process's life (never closed), as the loaded functions are used.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if !h.is_null() && present() {
                return true;
            }
        }
    }
    false
}

impl Cuda {
    /// Opens device `ordinal` and compiles the kernels; an error says why a GPU cannot
    /// be used (no driver, no NVRTC, no such device, compile failure).
    pub fn new(ordinal: usize, budget: Option<u64>) -> Result<Cuda, String> {
        match std::panic::catch_unwind(|| Self::try_new(ordinal, budget)) {
            Ok(r) => r,
            Err(p) => Err(panic_text(p)),
        }
    }

    fn try_new(ordinal: usize, budget: Option<u64>) -> Result<Cuda, String> {
        // SAFETY (both): probing for a shared library only loads it.
        if !preload("cuda", || unsafe {
            cudarc::driver::sys::is_culib_present()
        }) {
            return Err("the NVIDIA driver library (libcuda.so) is not installed".into());
        }
        if !preload("nvrtc", || unsafe {
            cudarc::nvrtc::sys::is_culib_present()
        }) {
            return Err(
                "CUDA's run-time compiler (libnvrtc.so) was not found: install it or add its directory to LD_LIBRARY_PATH"
                    .into(),
            );
        }
        let count = CudaContext::device_count().map_err(|e| format!("no CUDA device: {e}"))?;
        if ordinal >= count.max(0) as usize {
            return Err(format!("no CUDA device {ordinal} ({count} present)"));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| e.to_string())?;
        // Our batches synchronize their own streams; per-slice event tracking would add
        // an event record and wait to every copy and launch.
        // SAFETY: no slice exists yet, and every batch synchronizes its stream before
        // its buffers are reused or dropped.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().map_err(|e| e.to_string())?;
        let (maj, min) = ctx.compute_capability().map_err(|e| e.to_string())?;
        let opts = cudarc::nvrtc::CompileOptions {
            fmad: Some(false),
            options: vec![format!("--gpu-architecture=compute_{maj}{min}")],
            name: Some("cawsfs_kernels.cu".into()),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts)
            .map_err(|e| format!("compiling the kernels: {e}"))?;
        let module = ctx.load_module(ptx).map_err(|e| e.to_string())?;
        let f = |n: &str| module.load_function(n).map_err(|e| format!("{n}: {e}"));
        let k = Kernels {
            ndsq: [f("ndsq_f32")?, f("ndsq_f16")?],
            lowrank: [f("lowrank_f32")?, f("lowrank_f16")?],
            intq: [f("intq_f32")?, f("intq_f16")?],
            raw: [f("raw_f32")?, f("raw_f16")?],
        };
        let budget = match budget {
            Some(b) => b,
            None => {
                let (free, _) = ctx.mem_get_info().map_err(|e| e.to_string())?;
                (free as u64 / 4).min(8 << 30)
            }
        };
        Ok(Cuda {
            ctx,
            ordinal,
            name,
            k,
            pool: Mutex::new(Pool {
                idle: Vec::new(),
                made: 0,
                max: std::env::var("CAWSFS_CUDA_STREAMS")
                    .ok()
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|n| (1..=64).contains(n))
                    .unwrap_or(MAX_SLOTS),
            }),
            pool_cv: Condvar::new(),
            resident: Mutex::new(Resident::default()),
            budget,
            fail_every: std::env::var("CAWSFS_CUDA_FAIL_EVERY")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&n| n > 0),
            batches: Default::default(),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn budget(&self) -> u64 {
        self.budget
    }
    pub fn resident_bytes(&self) -> u64 {
        self.resident.lock().expect("resident lock").bytes
    }

    /// `CAWSFS_CUDA_FAIL_EVERY=N` fails every Nth batch before it reaches the GPU: the
    /// fallback path, tested on a GPU machine (scripts/test-cuda.sh).
    fn inject_failure(&self) -> bool {
        let Some(n) = self.fail_every else {
            return false;
        };
        self.batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % n
            == 0
    }

    fn take_slot(&self) -> Result<Slot, GpuError> {
        let mut p = self.pool.lock().expect("pool lock");
        loop {
            if let Some(s) = p.idle.pop() {
                return Ok(s);
            }
            if p.made < p.max {
                p.made += 1;
                drop(p);
                return match self.ctx.new_stream() {
                    Ok(stream) => Ok(Slot {
                        stream,
                        pack: Vec::new(),
                        host_in: None,
                        dev_in: None,
                        host_out: None,
                        dev_out: None,
                    }),
                    Err(e) => {
                        self.pool.lock().expect("pool lock").made -= 1;
                        self.pool_cv.notify_one();
                        Err(e.into())
                    }
                };
            }
            p = self.pool_cv.wait(p).expect("pool lock");
        }
    }

    fn put_slot(&self, s: Slot) {
        self.pool.lock().expect("pool lock").idle.push(s);
        self.pool_cv.notify_one();
    }

    /// A slot after a failure is not reused: its stream may be in an error state.
    fn drop_slot(&self, s: Slot) {
        drop(s);
        self.pool.lock().expect("pool lock").made -= 1;
        self.pool_cv.notify_one();
    }

    /// Computes `jobs` (a batch: see [`batchable_prefix`]) into their f32 slices.
    pub fn decode(&self, jobs: &mut [(Work<'_>, &mut [f32])]) -> Result<(), GpuError> {
        if self.inject_failure() {
            return Err(GpuError::Other(
                "injected failure (CAWSFS_CUDA_FAIL_EVERY)".into(),
            ));
        }
        let mut slot = self.take_slot()?;
        let mut timing = super::profiling().then(BenchTiming::default);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.run(&mut slot, jobs, OutType::F32, timing.as_mut())
        }));
        match r {
            Ok(Ok(())) => {
                if let Some(t) = &timing {
                    super::add_gpu_profile(t, jobs.iter().map(|(_, o)| o.len()).sum());
                }
                let host = slot.host_out.as_ref().expect("run allocated it");
                let host: &[f32] = bytemuck::cast_slice(host.as_slice()?);
                let mut pieces = Vec::with_capacity(jobs.len());
                let mut at = 0;
                for (_, out) in jobs.iter_mut() {
                    let n = out.len();
                    pieces.push((&host[at..at + n], &mut **out));
                    at += n;
                }
                // Out of pinned memory in parallel: one thread copies a few GB/s, less
                // than the GPU delivers.
                use rayon::prelude::*;
                pieces
                    .into_par_iter()
                    .flat_map(|(src, dst)| {
                        src.par_chunks(COPY_PIECE)
                            .zip(dst.par_chunks_mut(COPY_PIECE))
                    })
                    .for_each(|(s, d)| d.copy_from_slice(s));
                self.put_slot(slot);
                Ok(())
            }
            Ok(Err(e)) => {
                self.drop_slot(slot);
                Err(e)
            }
            Err(p) => {
                self.drop_slot(slot);
                Err(GpuError::Other(panic_text(p)))
            }
        }
    }

    fn run(
        &self,
        slot: &mut Slot,
        jobs: &[(Work<'_>, &mut [f32])],
        out: OutType,
        timing: Option<&mut BenchTiming>,
    ) -> Result<(), GpuError> {
        let j: Vec<(&Work<'_>, usize)> = jobs.iter().map(|(w, o)| (w, o.len())).collect();
        self.run_refs(slot, &j, out, timing)
    }

    /// Packs, copies in, launches, copies out into `slot.host_out` and waits.
    fn run_refs(
        &self,
        slot: &mut Slot,
        jobs: &[(&Work<'_>, usize)],
        out: OutType,
        timing: Option<&mut BenchTiming>,
    ) -> Result<(), GpuError> {
        let Some(&(first, _)) = jobs.first() else {
            return Ok(());
        };
        let values: usize = jobs.iter().map(|(w, _)| w.values()).sum();
        let out_bytes = values * out.size();
        let mut p = Packer::new(std::mem::take(&mut slot.pack));
        let launch = self.pack(first, jobs, &mut p)?;
        let in_bytes = p.buf.len().max(ALIGN);
        grow_pinned(&self.ctx, &mut slot.host_in, in_bytes, true)?;
        grow_dev(&slot.stream, &mut slot.dev_in, in_bytes)?;
        grow_pinned(&self.ctx, &mut slot.host_out, out_bytes.max(ALIGN), false)?;
        grow_dev(&slot.stream, &mut slot.dev_out, out_bytes.max(ALIGN))?;
        let stream = slot.stream.clone();
        let host_in = slot.host_in.as_mut().expect("grown");
        host_in.as_mut_slice()?[..p.buf.len()].copy_from_slice(&p.buf);
        let dev_in = slot.dev_in.as_mut().expect("grown");
        let dev_out = slot.dev_out.as_mut().expect("grown");
        let ev = |s: &Arc<CudaStream>| -> Result<_, GpuError> {
            let e = self
                .ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            e.record(s)?;
            Ok(e)
        };
        let timed = timing.is_some();
        let e0 = if timed { Some(ev(&stream)?) } else { None };
        stream.memcpy_htod(
            &host_in.as_slice()?[..in_bytes],
            &mut dev_in.slice_mut(..in_bytes),
        )?;
        let e1 = if timed { Some(ev(&stream)?) } else { None };
        // Profiled: one untimed launch first, so that neither timed one pays for caches
        // the copy-in left cold; then the f16 kernels, then the f32 ones (their output
        // is the one copied out).
        let e1h = if timed {
            self.launch(&stream, &launch, dev_in, dev_out, OutType::F32)?;
            let warm = ev(&stream)?;
            self.launch(&stream, &launch, dev_in, dev_out, OutType::F16)?;
            let e = ev(&stream)?;
            Some((warm, e))
        } else {
            None
        };
        self.launch(&stream, &launch, dev_in, dev_out, out)?;
        let e2 = if timed { Some(ev(&stream)?) } else { None };
        let host_out = slot.host_out.as_mut().expect("grown");
        stream.memcpy_dtoh(
            &dev_out.slice(..out_bytes),
            &mut host_out.as_mut_slice()?[..out_bytes],
        )?;
        let e3 = if timed { Some(ev(&stream)?) } else { None };
        stream.synchronize()?;
        if let (Some(t), Some(e0), Some(e1), Some(e1h), Some(e2), Some(e3)) =
            (timing, e0, e1, e1h, e2, e3)
        {
            let (warm, e1h) = e1h;
            t.copy_in = e0.elapsed_ms(&e1)? as f64 / 1e3;
            t.compute_f16 = warm.elapsed_ms(&e1h)? as f64 / 1e3;
            t.compute = e1h.elapsed_ms(&e2)? as f64 / 1e3;
            t.copy_out = e2.elapsed_ms(&e3)? as f64 / 1e3;
            t.bytes_in = in_bytes;
            t.bytes_out = out_bytes;
        }
        // Resident data the launch used is held by `launch` until here.
        drop(launch);
        slot.pack = p.buf;
        Ok(())
    }

    /// Tensor-wide data resident on the device under `key`, uploaded by `upload` the
    /// first time. Too large for the budget: uploaded for this batch only.
    fn resident<'b>(
        &self,
        stream: &Arc<CudaStream>,
        key: u128,
        bytes: impl FnOnce() -> std::borrow::Cow<'b, [u8]>,
    ) -> Result<Arc<CudaSlice<u8>>, GpuError> {
        {
            let mut r = self.resident.lock().expect("resident lock");
            r.tick += 1;
            let tick = r.tick;
            if let Some(e) = r.map.get_mut(&key) {
                e.tick = tick;
                return Ok(e.data.clone());
            }
        }
        let bytes = bytes();
        let data = Arc::new(stream.clone_htod(&*bytes)?);
        // Other streams may use it as soon as it is in the map: wait for the copy.
        stream.synchronize()?;
        let size = bytes.len() as u64;
        if size <= self.budget / 2 {
            let mut r = self.resident.lock().expect("resident lock");
            let tick = r.tick;
            if r.map
                .insert(
                    key,
                    ResidentEntry {
                        data: data.clone(),
                        tick,
                    },
                )
                .is_none()
            {
                r.bytes += size;
            }
            while r.bytes > self.budget {
                let Some((&old, _)) = r.map.iter().min_by_key(|(_, e)| e.tick) else {
                    break;
                };
                if let Some(e) = r.map.remove(&old) {
                    r.bytes -= e.data.len() as u64;
                }
            }
        }
        Ok(data)
    }
}

fn grow_pinned(
    ctx: &Arc<CudaContext>,
    buf: &mut Option<PinnedHostSlice<u8>>,
    need: usize,
    write_combined: bool,
) -> Result<(), GpuError> {
    if buf.as_ref().is_some_and(|b| b.len() >= need) {
        return Ok(());
    }
    *buf = None;
    let n = need.next_power_of_two();
    // Write-combined memory is fast for the GPU to read and slow for the CPU to read:
    // only for what goes in.
    let flags = if write_combined {
        cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED
    } else {
        0
    };
    // SAFETY: the bytes are written before they are read (packed in, or copied out).
    *buf = Some(unsafe { ctx.alloc_pinned_with_flags::<u8>(n, flags) }?);
    Ok(())
}

fn grow_dev(
    stream: &Arc<CudaStream>,
    buf: &mut Option<CudaSlice<u8>>,
    need: usize,
) -> Result<(), GpuError> {
    if buf.as_ref().is_some_and(|b| b.len() >= need) {
        return Ok(());
    }
    *buf = None;
    // SAFETY: written (copied in, or computed) before it is read.
    *buf = Some(unsafe { stream.alloc::<u8>(need.next_power_of_two()) }?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::batch::raw_params;
    use super::*;
    use crate::model::SourceType;

    /// Without a driver (CI) opening a GPU is an error that says what is missing, never
    /// a panic; with one, the device has a name and the kernels compiled.
    #[test]
    fn opening_a_gpu_says_why_it_cannot() {
        match Cuda::new(0, Some(1 << 20)) {
            Ok(c) => {
                assert!(!c.name().is_empty());
                assert_eq!(c.budget(), 1 << 20);
            }
            Err(e) => assert!(
                e.contains("libcuda") || e.contains("libnvrtc") || e.contains("CUDA device"),
                "{e}"
            ),
        }
        // A device number past any machine's is refused whether or not a GPU is present.
        let e = Cuda::new(1 << 20, None).err().expect("no such device");
        assert!(!e.is_empty());
    }

    #[test]
    fn packed_arrays_start_aligned() {
        let mut p = Packer::new(Vec::new());
        assert_eq!(p.start(), 0);
        p.put(&[1, 2, 3]);
        assert_eq!(p.start(), ALIGN);
        p.put(&[0; ALIGN + 1]);
        assert_eq!(p.start(), 3 * ALIGN);
        assert_eq!(p.buf[..3], [1, 2, 3]);
        assert!(p.buf[3..ALIGN].iter().all(|&b| b == 0));
    }

    #[test]
    fn raw_kernel_parameters_follow_ggml_blocks() {
        use crate::gguf::GgmlType;
        assert_eq!(raw_params(SourceType::F32), (0, 0, 1, 4));
        assert_eq!(raw_params(SourceType::F16), (1, 1, 1, 2));
        assert_eq!(raw_params(SourceType::BF16), (30, 2, 1, 2));
        assert_eq!(raw_params(SourceType::Ggml(GgmlType::Q4_1)), (3, 0, 32, 20));
        assert_eq!(
            raw_params(SourceType::Ggml(GgmlType::Q6_K)),
            (14, 0, 256, 210)
        );
        // ggml's own f16 and bf16 go through ggml's conversions (src_half 0).
        assert_eq!(raw_params(SourceType::Ggml(GgmlType::BF16)), (30, 0, 1, 2));
    }
}

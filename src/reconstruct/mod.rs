//! Reconstruction backends: the one interface through which the archive kinds turn
//! checked block parts into f32 rows, with a CPU and a CUDA implementation.
//!
//! The kinds read, checksum and decompress payloads and let the codecs check and split
//! them ([`codec::BlockParts`]); what is left cannot fail and is pure arithmetic, which
//! [`decode`] runs on the CPU (rayon, one task per block) or on a GPU ([`cuda`]) batched
//! per call. Both give the same bits: the GPU kernels perform each codec's operations
//! in the CPU's order with explicitly rounded multiplies and adds (docs/CUDA.md). A GPU
//! failure (out of memory, a launch error, a lost device) sends that batch to the CPU
//! with one log line and a count in `stat`; nothing waits on a GPU that is gone.
//!
//! The backend is chosen once per process ([`init`], from `--device`); until then, and
//! in every test of the library, the CPU runs.

mod breaker;
pub mod cuda;

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::codec::{self, BlockParts};

/// `--device`: where reconstruction runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The first CUDA GPU if one (and its libraries) is usable, else the CPU.
    Auto,
    Cpu,
    /// CUDA device `N`; an error when it cannot be used.
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
                _ => Err(format!(
                    "unknown device {s:?}: expected auto, cpu, cuda or cuda:N"
                )),
            },
        }
    }
}

/// One unit of reconstruction: rows of one block, computed into an f32 slice of
/// `rows × cols` values.
pub enum Work<'a> {
    /// Rows of a `.cawsf` block (NDSQ or passthrough), or of any passthrough block.
    Block(BlockParts<'a>),
    /// A whole delta block: base + U·Vᵀ.
    LowRank(LowRank<'a>),
    /// npy-dir int8 / int4 rows.
    IntQ(IntQ<'a>),
}

/// Rows of a delta block: `out = base; out += U·Vᵀ` in [`codec::add_low_rank`]'s
/// order.
pub struct LowRank<'a> {
    /// The whole block's rows of its shared base, decoded (`block rows × cols`); the
    /// job's rows start at `base_row0`.
    pub base: &'a [f32],
    pub base_row0: usize,
    /// Names `base`'s contents, so that a GPU may keep it resident.
    pub base_key: u128,
    /// U, f16 little-endian, `rows × rank`.
    pub u_f16: &'a [u8],
    /// Vᵀ, `rank × cols`.
    pub vt: &'a [f32],
    pub vt_key: u128,
    pub rank: usize,
    pub rows: usize,
    pub cols: usize,
}

/// Squish int8 (per row or group) or int4 (per group, nibble-packed) rows.
pub struct IntQ<'a> {
    pub bits: u8,
    /// int8: `rows × cols` bytes; int4: `rows × cols/2`.
    pub q: &'a [u8],
    /// `rows × groups` scales.
    pub scales: &'a [f32],
    pub groups: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Work<'_> {
    pub fn values(&self) -> usize {
        match self {
            Work::Block(p) => p.values(),
            Work::LowRank(l) => l.rows * l.cols,
            Work::IntQ(q) => q.rows * q.cols,
        }
    }

    /// On this thread, on the CPU.
    pub fn decode_cpu(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.values(), "Work::decode_cpu output length");
        match self {
            Work::Block(p) => p.decode(out),
            Work::LowRank(l) => {
                out.copy_from_slice(&l.base[l.base_row0 * l.cols..(l.base_row0 + l.rows) * l.cols]);
                if l.rank > 0 {
                    let mut u = vec![0f32; l.rows * l.rank];
                    codec::le::f16s_to_f32(l.u_f16, &mut u);
                    codec::add_low_rank(out, &u, l.vt, l.rank, l.cols);
                }
            }
            Work::IntQ(q) => match q.bits {
                8 => codec::intq::dequantize_int8(q.q, q.scales, q.cols, q.groups, out),
                _ => codec::intq::dequantize_int4(q.q, q.scales, q.cols, q.groups, out),
            },
        }
    }
}

/// A key for a pair of (archive identity, item): names shared data such as a delta
/// base block by what it is, not where it sits in memory.
pub fn item_key(archive: u128, item: u64) -> u128 {
    let mut b = [0u8; 24];
    b[..16].copy_from_slice(&archive.to_le_bytes());
    b[16..].copy_from_slice(&item.to_le_bytes());
    xxhash_rust::xxh3::xxh3_128(&b)
}

const MODE_CPU: u8 = 0;
const MODE_CUDA: u8 = 1;

static MODE: AtomicU8 = AtomicU8::new(MODE_CPU);
static CUDA: OnceLock<cuda::Cuda> = OnceLock::new();

/// Counters for `stat`.
static GPU_BATCHES: AtomicU64 = AtomicU64::new(0);
static GPU_BYTES: AtomicU64 = AtomicU64::new(0);
static GPU_NANOS: AtomicU64 = AtomicU64::new(0);
static FALLBACKS: AtomicU64 = AtomicU64::new(0);
static BREAKER: breaker::Breaker = breaker::Breaker::new();
static CPU_BYTES: AtomicU64 = AtomicU64::new(0);

/// Profiling (device checks and benchmarks): GPU batches time their copies and their
/// kernels with CUDA events and also run the f16-output kernel; the CPU's decode time
/// is summed. Off in normal use.
static PROFILE: AtomicBool = AtomicBool::new(false);
static P_COPY_IN: AtomicU64 = AtomicU64::new(0);
static P_F32: AtomicU64 = AtomicU64::new(0);
static P_F16: AtomicU64 = AtomicU64::new(0);
static P_COPY_OUT: AtomicU64 = AtomicU64::new(0);
static P_BYTES_IN: AtomicU64 = AtomicU64::new(0);
static P_GPU_VALUES: AtomicU64 = AtomicU64::new(0);
static P_CPU: AtomicU64 = AtomicU64::new(0);
static P_CPU_VALUES: AtomicU64 = AtomicU64::new(0);

/// Sums since [`profile`] was turned on (nanoseconds, bytes, values).
#[derive(Clone, Copy, Debug, Default)]
pub struct Profile {
    pub copy_in_ns: u64,
    /// Kernels writing f32 (what reads use).
    pub compute_f32_ns: u64,
    /// The same kernels writing f16.
    pub compute_f16_ns: u64,
    pub copy_out_ns: u64,
    pub bytes_in: u64,
    pub gpu_values: u64,
    /// Wall time of CPU decodes (all cores).
    pub cpu_ns: u64,
    pub cpu_values: u64,
}

/// Turns profiling on (counters reset) or off.
pub fn profile(on: bool) {
    for c in [
        &P_COPY_IN,
        &P_F32,
        &P_F16,
        &P_COPY_OUT,
        &P_BYTES_IN,
        &P_GPU_VALUES,
        &P_CPU,
        &P_CPU_VALUES,
    ] {
        c.store(0, Ordering::Relaxed);
    }
    PROFILE.store(on, Ordering::Release);
}

pub fn profile_now() -> Profile {
    let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
    Profile {
        copy_in_ns: l(&P_COPY_IN),
        compute_f32_ns: l(&P_F32),
        compute_f16_ns: l(&P_F16),
        copy_out_ns: l(&P_COPY_OUT),
        bytes_in: l(&P_BYTES_IN),
        gpu_values: l(&P_GPU_VALUES),
        cpu_ns: l(&P_CPU),
        cpu_values: l(&P_CPU_VALUES),
    }
}

fn profiling() -> bool {
    PROFILE.load(Ordering::Relaxed)
}

fn add_gpu_profile(t: &cuda::BenchTiming, values: usize) {
    let ns = |s: f64| (s * 1e9) as u64;
    P_COPY_IN.fetch_add(ns(t.copy_in), Ordering::Relaxed);
    P_F32.fetch_add(ns(t.compute), Ordering::Relaxed);
    P_F16.fetch_add(ns(t.compute_f16), Ordering::Relaxed);
    P_COPY_OUT.fetch_add(ns(t.copy_out), Ordering::Relaxed);
    P_BYTES_IN.fetch_add(t.bytes_in as u64, Ordering::Relaxed);
    P_GPU_VALUES.fetch_add(values as u64, Ordering::Relaxed);
}

/// What [`init`] settled on, for a one-line report.
#[derive(Clone, Debug)]
pub enum Active {
    Cpu {
        /// Why `auto` did not use a GPU (None when `cpu` was asked for).
        why_not_gpu: Option<String>,
    },
    Cuda {
        ordinal: usize,
        name: String,
    },
}

impl std::fmt::Display for Active {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Active::Cpu { why_not_gpu: None } => write!(f, "cpu"),
            Active::Cpu {
                why_not_gpu: Some(w),
            } => write!(f, "cpu (no usable GPU: {w})"),
            Active::Cuda { ordinal, name } => write!(f, "cuda:{ordinal} ({name})"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("--device cuda:{ordinal}: {reason}")]
    Cuda { ordinal: usize, reason: String },
    #[error("--device: a CUDA device is already in use in this process (cuda:{0})")]
    Twice(usize),
}

/// Chooses the backend for this process. `vram_budget` bounds what stays resident on
/// the GPU (None: a share of its free memory).
pub fn init(choice: DeviceChoice, vram_budget: Option<u64>) -> Result<Active, InitError> {
    let ordinal = match choice {
        DeviceChoice::Cpu => {
            MODE.store(MODE_CPU, Ordering::Release);
            return Ok(Active::Cpu { why_not_gpu: None });
        }
        DeviceChoice::Auto => 0,
        DeviceChoice::Cuda(n) => n,
    };
    if let Some(c) = CUDA.get() {
        if c.ordinal() != ordinal {
            return Err(InitError::Twice(c.ordinal()));
        }
    } else {
        match cuda::Cuda::new(ordinal, vram_budget) {
            Ok(c) => {
                let _ = CUDA.set(c);
            }
            Err(reason) if choice == DeviceChoice::Auto => {
                MODE.store(MODE_CPU, Ordering::Release);
                return Ok(Active::Cpu {
                    why_not_gpu: Some(reason),
                });
            }
            Err(reason) => return Err(InitError::Cuda { ordinal, reason }),
        }
    }
    let c = CUDA.get().expect("set above");
    MODE.store(MODE_CUDA, Ordering::Release);
    Ok(Active::Cuda {
        ordinal: c.ordinal(),
        name: c.name().to_string(),
    })
}

/// Switches between the CPU and an initialized GPU (device checks compare the two in
/// one process). Returns false when no GPU was initialized.
pub fn use_gpu(on: bool) -> bool {
    if on && CUDA.get().is_none() {
        return false;
    }
    MODE.store(if on { MODE_CUDA } else { MODE_CPU }, Ordering::Release);
    true
}

fn gpu() -> Option<&'static cuda::Cuda> {
    if MODE.load(Ordering::Acquire) == MODE_CUDA {
        CUDA.get()
    } else {
        None
    }
}

/// Computes every job's rows into its slice, on the chosen backend.
pub fn decode(jobs: Vec<(Work<'_>, &mut [f32])>) {
    if jobs.is_empty() {
        return;
    }
    if let Some(g) = gpu().filter(|_| BREAKER.allows(clock())) {
        let mut jobs = jobs;
        // Batches of jobs the GPU runs in one launch: consecutive and alike.
        while !jobs.is_empty() {
            let (n, on_gpu) = cuda::batchable_prefix(&jobs);
            let rest = jobs.split_off(n);
            if !on_gpu {
                decode_cpu(jobs);
                jobs = rest;
                continue;
            }
            let bytes: usize = jobs.iter().map(|(w, _)| w.values() * 4).sum();
            let t0 = std::time::Instant::now();
            match g.decode(&mut jobs) {
                Ok(()) => {
                    BREAKER.success();
                    GPU_BATCHES.fetch_add(1, Ordering::Relaxed);
                    GPU_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
                    GPU_NANOS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    let n = FALLBACKS.fetch_add(1, Ordering::Relaxed);
                    // One line per failed batch, up to a point: a dead GPU must not
                    // flood the log with a line per read.
                    if n < 20 {
                        tracing::warn!(
                            "GPU reconstruction failed, computed on the CPU instead: {e}"
                        );
                    } else if n == 20 {
                        tracing::warn!("GPU reconstruction keeps failing; further failures are only counted (`cawsfs stat`)");
                    }
                    if let Some(rest) = BREAKER.failure(clock()) {
                        // Rare by construction: at most one line per rest.
                        let why = if rest == breaker::FIRST_REST {
                            format!("failed {} batches in a row", breaker::STREAK)
                        } else {
                            "failed again after resting".to_string()
                        };
                        tracing::warn!(
                            "the GPU {why}: reconstructing on the CPU for {} s, then trying it again",
                            rest.as_secs()
                        );
                    }
                    decode_cpu(jobs);
                }
            }
            jobs = rest;
            // A rest begun by this call's failure sends its other batches to the CPU.
            if !BREAKER.allows(clock()) {
                decode_cpu(jobs);
                return;
            }
        }
        return;
    }
    decode_cpu(jobs)
}

/// Nanoseconds since the first call: the breaker's clock.
fn clock() -> u64 {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}

/// The CPU backend: one rayon task per job when there are several.
pub fn decode_cpu(jobs: Vec<(Work<'_>, &mut [f32])>) {
    let values: usize = jobs.iter().map(|(w, _)| w.values()).sum();
    CPU_BYTES.fetch_add(values as u64 * 4, Ordering::Relaxed);
    let t0 = profiling().then(std::time::Instant::now);
    if jobs.len() == 1 {
        jobs.into_iter().for_each(|(w, out)| w.decode_cpu(out));
    } else {
        jobs.into_par_iter().for_each(|(w, out)| w.decode_cpu(out));
    }
    if let Some(t0) = t0 {
        P_CPU.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        P_CPU_VALUES.fetch_add(values as u64, Ordering::Relaxed);
    }
}

/// Counters shown by `cawsfs stat`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DeviceStats {
    /// "cpu" or "cuda:N (name)".
    pub device: String,
    pub gpu_batches: u64,
    /// f32 bytes the GPU produced.
    pub gpu_bytes: u64,
    /// Wall time of GPU batches (copy in, compute, copy out), nanoseconds.
    pub gpu_nanos: u64,
    /// Batches the GPU failed and the CPU computed.
    pub fallbacks: u64,
    /// Times the GPU failed so often that it rested (batches went to the CPU untried).
    #[serde(default)]
    pub rests: u64,
    /// f32 bytes the CPU produced.
    pub cpu_bytes: u64,
    /// Bytes kept resident on the GPU, and its budget.
    pub resident_bytes: u64,
    pub vram_budget: u64,
}

pub fn stats() -> DeviceStats {
    let (device, resident_bytes, vram_budget) = match gpu() {
        Some(g) => (
            format!("cuda:{} ({})", g.ordinal(), g.name()),
            g.resident_bytes(),
            g.budget(),
        ),
        None => ("cpu".to_string(), 0, 0),
    };
    DeviceStats {
        device,
        gpu_batches: GPU_BATCHES.load(Ordering::Relaxed),
        gpu_bytes: GPU_BYTES.load(Ordering::Relaxed),
        gpu_nanos: GPU_NANOS.load(Ordering::Relaxed),
        fallbacks: FALLBACKS.load(Ordering::Relaxed),
        rests: BREAKER.rests(),
        cpu_bytes: CPU_BYTES.load(Ordering::Relaxed),
        resident_bytes,
        vram_budget,
    }
}

/// The GPU, when one was initialized (device checks and benchmarks use it directly).
pub fn cuda_backend() -> Option<&'static cuda::Cuda> {
    CUDA.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_choices_parse() {
        assert_eq!("auto".parse(), Ok(DeviceChoice::Auto));
        assert_eq!("cpu".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let e = bad.parse::<DeviceChoice>().unwrap_err();
            assert!(
                e.contains("expected auto, cpu, cuda or cuda:N"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn item_keys_differ_by_archive_and_item() {
        let a = item_key(1, 2);
        assert_eq!(a, item_key(1, 2));
        assert_ne!(a, item_key(1, 3));
        assert_ne!(a, item_key(2, 2));
    }

    #[test]
    fn low_rank_work_is_base_plus_u_vt_in_order() {
        // 2 rows × 3 cols, rank 2: out = base + u·vt, computed per element as
        // ((base + u0·v0) + u1·v1).
        let base = [1.0f32, 2.0, 3.0, -1.0, 0.5, 0.0];
        let [a, b, c, d] = [0.5f32, 2.0, -1.0, 0.25];
        let u: Vec<u8> = [a, b, c, d]
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect();
        let vt = [1.0f32, 0.0, 2.0, 0.5, 4.0, -1.0];
        let w = Work::LowRank(LowRank {
            base: &base,
            base_row0: 0,
            base_key: 0,
            u_f16: &u,
            vt: &vt,
            vt_key: 0,
            rank: 2,
            rows: 2,
            cols: 3,
        });
        let mut out = [0f32; 6];
        w.decode_cpu(&mut out);
        let want: Vec<f32> = (0..6)
            .map(|e| {
                let (i, j) = (e / 3, e % 3);
                let (u0, u1) = if i == 0 { (a, b) } else { (c, d) };
                base[e] + u0 * vt[j] + u1 * vt[3 + j]
            })
            .collect();
        assert_eq!(out.to_vec(), want);
    }

    #[test]
    fn without_init_the_cpu_runs_and_counts() {
        let q = [1u8, 0xFF, 3, 4];
        let s = [0.5f32, 2.0];
        let mut out = [0f32; 4];
        let before = stats().cpu_bytes;
        decode(vec![(
            Work::IntQ(IntQ {
                bits: 8,
                q: &q,
                scales: &s,
                groups: 1,
                rows: 2,
                cols: 2,
            }),
            &mut out[..],
        )]);
        assert_eq!(out, [0.5, -0.5, 6.0, 8.0]);
        assert!(stats().cpu_bytes >= before + 16);
        assert!(!use_gpu(true), "no GPU was initialized");
    }
}

//! Chunk cache: a byte-budgeted LRU of *virtual-file bytes* in fixed-size chunks, with
//! single-flight loading, pinning, and a low-priority prefetch queue.
//!
//! The FUSE mount asks [`ChunkCache::read`] for any `(offset, len)` of a virtual file;
//! the cache serves it from the chunks covering it and produces missing chunks through
//! a loader closure (in the mount: `|i, buf| vf.read_at(src, i * chunk_size, buf)`).
//!
//! Why bytes and not decoded f32 rows: the warm path is then a `memcpy` out of a
//! resident chunk (no conversion to f16/bf16/GGUF on every read), and the budget is
//! exactly what is resident — a chunk's size is the bytes the reader sees, not a
//! larger intermediate. Invariant 3 ("budgets hold") is therefore checkable here.
//!
//! Design (the file that implements each part in parentheses):
//! - **Keys** are [`ChunkKey`] `{ file, index }`; chunk `index` covers bytes
//!   `index*chunk_size .. min(size, (index+1)*chunk_size)`. Values are `Arc<Chunk>`
//!   (page-aligned bytes, `chunk.rs`; full-size ones in huge-page blocks, `slots.rs`), so a
//!   reader keeps its chunk alive while copying even if it is evicted meanwhile (the
//!   "plus chunks being handed to readers" slack of the memory invariant).
//! - **Budget** (`lru.rs`). One mutex guards an unbounded `lru::LruCache` of unpinned
//!   chunks plus a map of pinned chunks, with our own byte accounting:
//!   `unpinned_bytes + pinned_reserved <= budget` always, and resident bytes
//!   (`unpinned_bytes + pinned_resident`) are at most that. Inserting evicts
//!   least-recently-used unpinned chunks until the new one fits. A chunk larger than the
//!   unpinned room is returned to its reader but not retained. Pinned chunks live
//!   outside the LRU, so eviction never walks past them. Bookkeeping per entry (LRU node,
//!   hash slot, `Arc` header, key) is outside the budget: about
//!   [`ENTRY_OVERHEAD_BYTES`] per chunk, 0.06% at 256 KiB chunks. A load in flight
//!   counts against the budget too, as its chunk's length times
//!   [`CacheConfig::load_work_factor`] (the chunk plus the loader's working memory):
//!   resident chunks are evicted to make room for it when it starts. A load whose
//!   working memory does not fit beside the pins, charges and the loads already
//!   running waits until one of them ends (`room_waits`; prefetches also wait behind
//!   such demand loads); one load always runs. Outside the budget: chunks still
//!   referenced by readers copying out of them after eviction, and a lone load larger
//!   than what pins and charges leave.
//! - **Single-flight** (`flight.rs`). A miss registers a flight for its key and loads
//!   *without* the global lock; concurrent misses on the same key wait on the flight's
//!   condvar and get the same `Arc` (or a copy of the same error). Errors are never
//!   cached: the flight is removed first, so the next read retries. A panicking loader
//!   fails its waiters instead of hanging them. Different chunks load in parallel; a
//!   read that misses more than one chunk loads them on scoped threads (never on rayon
//!   workers, which must not block on a flight whose loader itself needs rayon).
//! - **Pinning** (`lru.rs`). [`ChunkCache::pin`] reserves a chunk's bytes (it may be
//!   loaded later, by a read or a prefetch) and refuses when pinned bytes would exceed
//!   the budget. Pins nest; [`ChunkCache::unpin`] returns a resident chunk to the LRU as
//!   most recent.
//! - **Prefetch** (`prefetch.rs`). [`ChunkCache::start_prefetcher`] starts N workers
//!   draining a bounded, de-duplicated FIFO of `(chunk, loader)` jobs. Demand reads
//!   have priority: a demand load in progress (or a demand read waiting on a load)
//!   increments `demand_waiting`, and a worker about to start a job waits on a condvar
//!   until it is zero (polling it in 200 µs sleeps cost 2 % of a first pass's CPU).
//!   Loads already running are not interrupted. Read-ahead jobs (below) are not held
//!   back: their reader always has a demand load running. A chunk loaded by prefetch is marked; the first demand lookup it
//!   serves counts as a prefetch hit (a demand read that joined the prefetch's flight
//!   counts as a coalesced miss and clears the mark).
//! - **Read-ahead** (`prefetch.rs`). Per file, `read` remembers where the previous read
//!   ended; a read starting exactly there is sequential and queues the next
//!   `readahead_chunks` chunks (default 16) after the last one it touched, using the
//!   loader given to [`ChunkCache::register_file`]. Each chunk is queued once per
//!   sequential run.
//! - **Route hints** (router-aware eviction, `lru.rs`). [`ChunkCache::set_hints`] names
//!   the chunks a pending route says will be needed soon. Resident hinted chunks live in
//!   a second LRU that is evicted only when the ordinary one is empty; a demand read of
//!   a hinted chunk consumes its hint (it moves to the ordinary LRU as most recent).
//!   With `router_eviction` off hints are ignored: plain LRU, for comparison.
//! - **Trace** (`trace.rs`). [`ChunkCache::trace_start`] records every demand chunk
//!   lookup (file, chunk, time, hit / prefetch hit / miss) in order into a bounded
//!   in-memory list ([`TRACE_CAP`] events; later ones are counted as dropped) until
//!   [`ChunkCache::trace_stop`] returns it.
//! - **Statistics** (`stats.rs`) are relaxed atomics plus a log2 µs latency histogram;
//!   [`ChunkCache::stats`] returns a serializable [`CacheStats`] snapshot.
//!
//! This file holds the public types, the shared state and the demand read path.

mod chunk;
mod experts;
mod flight;
mod lru;
mod prefetch;
mod resident;
mod slots;
mod stats;
mod sync;
mod trace;

// The unit tests use real threads and time, which shuttle's primitives refuse outside
// a shuttle execution; with the feature on, only the schedule-exploring tests run.
#[cfg(all(test, feature = "shuttle"))]
mod shuttle_tests;
#[cfg(all(test, not(feature = "shuttle")))]
mod tests;

pub use chunk::{Chunk, Keeper, CHUNK_ALIGN};
pub use experts::{ExpertMap, ExpertMode, ExpertStats};
pub use resident::Residency;
pub use stats::{CacheStats, FileStats, LatencyStats};
pub use trace::{TraceEvent, TraceOutcome};

// `self::` because `lru` alone would also name the `lru` crate.
use self::lru::State;
use crate::model::ReadError;
use prefetch::Queue;
use stats::{add, bump, Counters, FileCounters, Histogram};
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, PoisonError};
use std::time::Instant;
use sync::thread::JoinHandle;
use sync::{AtomicBool, AtomicU64, Condvar, Mutex, MutexGuard, RwLock};
use trace::Trace;

/// Default chunk size: 256 KiB (two default FUSE read requests).
pub const DEFAULT_CHUNK_SIZE: u64 = 256 * 1024;
/// Default read-ahead depth in chunks for sequential readers: 16 MiB of 256 KiB chunks.
/// On a 16-core machine a cold sequential pass ran at 0.46 x the FUSE ceiling with 16
/// and 0.80 x with 64 (decoding on the prefetch workers' own threads; docs/CUDA.md).
/// Never more than a sixteenth of the budget (`ChunkCache::readahead`).
pub const DEFAULT_READAHEAD_CHUNKS: u64 = 64;
/// Default bound on queued prefetch jobs; requests beyond it are dropped (counted).
pub const DEFAULT_PREFETCH_QUEUE_CAP: usize = 4096;
/// Estimated per-entry bookkeeping outside the budget: LRU node (key, value, two
/// links) ~64 B, hash slot ~24 B, `Arc<Chunk>` (counts and fields) 40 B, flags/padding;
/// rounded up.
pub const ENTRY_OVERHEAD_BYTES: u64 = 160;
/// Most events one trace keeps (24 bytes each: 24 MiB at most).
pub const TRACE_CAP: usize = 1 << 20;

/// One chunk of one virtual file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey {
    pub file: u32,
    pub index: u64,
}

/// Fills `buf` (exactly the chunk's length) with chunk `index`'s bytes and returns how
/// many it wrote; anything but `buf.len()` is an error. Shared with background threads.
pub type ChunkLoader = Arc<dyn Fn(u64, &mut [u8]) -> Result<usize, ReadError> + Send + Sync>;

/// Borrowed loader for demand reads (may capture non-`'static` state).
pub type LoadFn<'a> = dyn Fn(u64, &mut [u8]) -> Result<usize, ReadError> + Sync + 'a;

/// Configuration and pin errors (read errors are [`ReadError`]).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("chunk size {0} is not a power of two")]
    BadChunkSize(u64),
    #[error("cannot pin chunk {index} of file {file}: {needed} bytes more would exceed the cache budget ({pinned} of {budget} bytes already pinned or charged)")]
    PinOverBudget {
        file: u32,
        index: u64,
        needed: u64,
        pinned: u64,
        budget: u64,
    },
    #[error("{what} needs {needed} bytes of the cache budget ({budget} bytes, {reserved} already pinned or charged)")]
    ChargeOverBudget {
        what: String,
        needed: u64,
        reserved: u64,
        budget: u64,
    },
    #[error("chunk {index} of file {file} is not pinned")]
    NotPinned { file: u32, index: u64 },
    #[error("chunk {index} is past the end of file {file} ({size} bytes)")]
    OutOfRange { file: u32, index: u64, size: u64 },
}

/// Cache parameters.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    pub budget_bytes: u64,
    /// Power of two.
    pub chunk_size: u64,
    /// Chunks queued after a sequential read; 0 disables read-ahead.
    pub readahead_chunks: u64,
    pub prefetch_queue_cap: usize,
    /// Evict chunks named by route hints after all other unpinned chunks.
    pub router_eviction: bool,
    /// What a load in flight may hold, as a multiple of its chunk's length: the
    /// chunk itself plus the loader's working memory (1: the chunk only). Counted
    /// against the budget while the load runs, so resident chunks make room for it.
    pub load_work_factor: u64,
}

impl CacheConfig {
    pub fn new(budget_bytes: u64, chunk_size: u64) -> Self {
        CacheConfig {
            budget_bytes,
            chunk_size,
            readahead_chunks: DEFAULT_READAHEAD_CHUNKS,
            prefetch_queue_cap: DEFAULT_PREFETCH_QUEUE_CAP,
            router_eviction: true,
            load_work_factor: 1,
        }
    }
}

/// How one chunk lookup was satisfied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Hit,
    PrefetchHit,
    Loaded,
    Coalesced,
}

#[derive(Default)]
struct FileState {
    counters: FileCounters,
    /// End offset of the previous read (u64::MAX before the first).
    last_end: AtomicU64,
    /// First chunk not yet queued for read-ahead in the current sequential run.
    readahead_next: AtomicU64,
    /// Where the current sequential run began.
    run_start: AtomicU64,
    loader: Mutex<Option<ChunkLoader>>,
    /// The file's expert predictor, for a mixture of experts (experts.rs).
    experts: std::sync::OnceLock<experts::Predictor>,
    /// Which of its pages the kernel holds, so that predicted experts queue only the
    /// chunks it will ask for (resident.rs).
    residency: std::sync::OnceLock<Residency>,
    /// Told of every chunk of this file a loader produced ([`ChunkCache::set_keeper`]).
    keeper: std::sync::OnceLock<Keeper>,
}

/// Everything the cache shares with its prefetch workers (they hold an `Arc` of it).
struct Shared {
    cfg: CacheConfig,
    trace: Trace,
    state: Mutex<State>,
    files: RwLock<HashMap<u32, Arc<FileState>>>,
    counters: Counters,
    latency: Histogram,
    /// Time inside each chunk loader (flight.rs).
    load_latency: Histogram,
    /// Demand loads running or waited on; prefetch workers start no load while it is
    /// non-zero, and `demand_cv` tells them when it drops to zero.
    demand_waiting: Mutex<u64>,
    demand_cv: Condvar,
    queue: Mutex<Queue>,
    queue_cv: Condvar,
    idle_cv: Condvar,
    /// Signalled when a load ends (its working memory is free) or a room waiter leaves.
    room_cv: Condvar,
    shutdown: AtomicBool,
}

/// The chunk cache. Share it behind an `Arc`; every method takes `&self`.
pub struct ChunkCache {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// Residency checks of predicted experts, off the read path (resident.rs).
    checker: resident::Checker,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere never leaves our maps half-updated in a way that matters more
    // than refusing all further reads would.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The resident chunks that a read's range `offset .. end` lies in, in order.
struct Covering {
    chunks: Vec<Arc<Chunk>>,
    /// Index of the first chunk.
    first: u64,
    /// Where the range ends (clipped to the file).
    end: u64,
}

impl Covering {
    /// The part of each chunk that bytes `offset .. end` of file `file` occupy; an error
    /// if a chunk is shorter than its place in the file says (a loader bug or a changed
    /// file size), never a short answer.
    fn parts(&self, file: u32, cs: u64, offset: u64) -> Result<Vec<&[u8]>, ReadError> {
        let end = self.end;
        self.chunks
            .iter()
            .zip(self.first..)
            .map(|(data, index)| {
                let cstart = index * cs;
                let lo = offset.max(cstart);
                let hi = end.min(cstart + cs);
                data.get((lo - cstart) as usize..(hi - cstart) as usize)
                    .ok_or_else(|| {
                        io_err(
                            std::io::ErrorKind::InvalidData,
                            format!(
                                "chunk {index} of file {file} holds {} bytes, fewer than the read needs (file size changed?)",
                                data.len()
                            ),
                        )
                    })
            })
            .collect()
    }
}

fn io_err(kind: std::io::ErrorKind, msg: String) -> ReadError {
    ReadError::Io(std::io::Error::new(kind, msg))
}

impl Shared {
    fn chunk_count(&self, size: u64) -> u64 {
        size.div_ceil(self.cfg.chunk_size)
    }

    /// Length of chunk `index` of a file of `size` bytes; None past the end.
    fn chunk_len(&self, size: u64, index: u64) -> Option<u64> {
        let start = index.checked_mul(self.cfg.chunk_size)?;
        if start >= size {
            return None;
        }
        Some((size - start).min(self.cfg.chunk_size))
    }

    fn file_state(&self, file: u32) -> Arc<FileState> {
        if let Some(f) = self
            .files
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&file)
        {
            return f.clone();
        }
        self.files
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(file)
            .or_insert_with(|| {
                Arc::new(FileState {
                    last_end: AtomicU64::new(u64::MAX),
                    ..FileState::default()
                })
            })
            .clone()
    }
}

impl ChunkCache {
    /// A cache of `budget_bytes` chunk bytes in chunks of `chunk_size` (a power of two;
    /// [`DEFAULT_CHUNK_SIZE`] is a good choice).
    pub fn new(budget_bytes: u64, chunk_size: u64) -> Result<Self, CacheError> {
        Self::with_config(CacheConfig::new(budget_bytes, chunk_size))
    }

    pub fn with_config(cfg: CacheConfig) -> Result<Self, CacheError> {
        if !cfg.chunk_size.is_power_of_two() {
            return Err(CacheError::BadChunkSize(cfg.chunk_size));
        }
        // Evicted chunks' memory kept for the next loads: a 64th of the budget, at most
        // 16 MiB (the pool's own 1 MiB for small budgets).
        slots::reserve_at_least((cfg.budget_bytes / 64).min(16 << 20));
        Ok(ChunkCache {
            shared: Arc::new(Shared {
                cfg,
                trace: Trace::default(),
                state: Mutex::new(State::new()),
                files: RwLock::new(HashMap::new()),
                counters: Counters::default(),
                latency: Histogram::default(),
                load_latency: Histogram::default(),
                demand_waiting: Mutex::new(0),
                demand_cv: Condvar::new(),
                queue: Mutex::new(Queue::default()),
                queue_cv: Condvar::new(),
                idle_cv: Condvar::new(),
                room_cv: Condvar::new(),
                shutdown: AtomicBool::new(false),
            }),
            workers: Mutex::new(Vec::new()),
            checker: resident::Checker::default(),
        })
    }

    pub fn chunk_size(&self) -> u64 {
        self.shared.cfg.chunk_size
    }

    pub fn budget(&self) -> u64 {
        self.shared.cfg.budget_bytes
    }

    /// Number of chunks of a file of `size` bytes.
    pub fn chunk_count(&self, size: u64) -> u64 {
        self.shared.chunk_count(size)
    }

    /// Chunk bytes resident now (unpinned + pinned).
    pub fn bytes_used(&self) -> u64 {
        let st = lock(&self.shared.state);
        st.unpinned_bytes + st.pinned_resident
    }

    /// Whether chunk `key` is resident (does not touch LRU order).
    pub fn contains(&self, key: ChunkKey) -> bool {
        let st = lock(&self.shared.state);
        st.lru.contains(&key)
            || st.hinted.contains(&key)
            || st.pinned.get(&key).is_some_and(|s| s.entry.is_some())
    }

    /// Chunk `key`'s bytes if resident, without touching LRU order or counting a hit
    /// (for copies made on the side, such as the disk tier's refill).
    pub fn resident(&self, key: ChunkKey) -> Option<Arc<Chunk>> {
        let st = lock(&self.shared.state);
        if let Some(e) = st.pinned.get(&key).and_then(|s| s.entry.as_ref()) {
            return Some(e.data.clone());
        }
        st.lru
            .peek(&key)
            .or_else(|| st.hinted.peek(&key))
            .map(|e| e.data.clone())
    }

    /// Give the cache a `'static` loader for `file` so sequential reads of it can be
    /// read ahead in the background. Without one, sequential reads are not read ahead.
    pub fn register_file(&self, file: u32, loader: ChunkLoader) {
        *lock(&self.shared.file_state(file).loader) = Some(loader);
    }

    /// Serve `buf.len()` bytes of file `file` (`file_size` bytes long) at `offset`,
    /// loading missing chunks through `load` (called with a chunk index and a buffer of
    /// exactly that chunk's length). Returns the bytes written: short only at EOF, 0 at
    /// or past it.
    pub fn read(
        &self,
        file: u32,
        file_size: u64,
        offset: u64,
        buf: &mut [u8],
        load: &LoadFn<'_>,
    ) -> Result<usize, ReadError> {
        self.read_with(file, file_size, offset, buf.len(), load, |parts| {
            let mut at = 0;
            for p in parts {
                buf[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
            at
        })
    }

    /// Like [`read`](Self::read) for `len` bytes, but hands `reply` the bytes where
    /// they lie: one slice per chunk the range touches, in order (short only at EOF,
    /// none at or past it). A read inside one chunk is thus answered straight from the
    /// resident chunk, without a copy into a reply buffer (the FUSE read path).
    pub fn read_with<R>(
        &self,
        file: u32,
        file_size: u64,
        offset: u64,
        len: usize,
        load: &LoadFn<'_>,
        reply: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, ReadError> {
        let t0 = Instant::now();
        let sh = &*self.shared;
        let fstate = sh.file_state(file);
        let r = self.read_inner(file, file_size, offset, len, load, &fstate);
        bump(&sh.counters.reads);
        bump(&fstate.counters.reads);
        let r = r.and_then(|covering| {
            let parts = covering.parts(file, sh.cfg.chunk_size, offset)?;
            let end = covering.end;
            let n = end.saturating_sub(offset);
            add(&sh.counters.bytes_served, n);
            add(&fstate.counters.bytes_served, n);
            let prev = fstate.last_end.swap(offset + n, Relaxed);
            if n > 0 {
                if prev == offset {
                    self.readahead(file, file_size, end, &fstate);
                } else {
                    // A new run: forget what the previous run queued.
                    fstate.readahead_next.store(0, Relaxed);
                    fstate.run_start.store(offset, Relaxed);
                }
                if let Some(p) = fstate.experts.get() {
                    self.queue_experts(p, file, file_size, offset, n, &fstate);
                }
            }
            Ok(reply(&parts))
        });
        if r.is_err() {
            bump(&sh.counters.read_errors);
        }
        sh.latency
            .record(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX));
        r
    }

    /// The chunks covering `offset .. offset + len` (clipped to the file).
    fn read_inner(
        &self,
        file: u32,
        file_size: u64,
        offset: u64,
        len: usize,
        load: &LoadFn<'_>,
        fstate: &FileState,
    ) -> Result<Covering, ReadError> {
        let sh = &*self.shared;
        if offset >= file_size || len == 0 {
            return Ok(Covering {
                chunks: Vec::new(),
                first: 0,
                end: offset,
            });
        }
        let end = offset.saturating_add(len as u64).min(file_size);
        let cs = sh.cfg.chunk_size;
        let first = offset / cs;
        let last = (end - 1) / cs;
        let count = (last - first + 1) as usize;
        let mut chunks: Vec<Option<Arc<Chunk>>> = vec![None; count];
        let mut missing: Vec<u64> = Vec::new();
        {
            let mut st = lock(&sh.state);
            for (slot, index) in chunks.iter_mut().zip(first..=last) {
                match st.lookup(&ChunkKey { file, index }, true) {
                    Some((data, outcome)) => {
                        self.count(outcome, fstate);
                        self.trace(file, index, outcome);
                        *slot = Some(data);
                    }
                    None => missing.push(index),
                }
            }
        }
        if missing.is_empty() {
            return Ok(Covering {
                chunks: chunks.into_iter().flatten().collect(),
                first,
                end,
            });
        }
        // The read waits for reconstruction: a stall (docs/MOE.md).
        let t_stall = Instant::now();
        let fetch_one = |index: u64| -> Result<Arc<Chunk>, ReadError> {
            let len = sh
                .chunk_len(file_size, index)
                .expect("index below chunk count");
            let (data, outcome) = sh.fetch(ChunkKey { file, index }, len, load, true)?;
            self.count(outcome, fstate);
            self.trace(file, index, outcome);
            Ok(data)
        };
        // Scoped threads, not rayon: a load may block on another load's flight, and a
        // blocked rayon worker can starve the rayon jobs that the archive's decoder
        // (running in a prefetch worker) is waiting for — a deadlock seen on a mount.
        let loaded: Vec<Result<Arc<Chunk>, ReadError>> = if missing.len() > 1 {
            sync::thread::scope(|s| {
                let handles: Vec<_> = missing
                    .iter()
                    .map(|&i| (i, s.spawn(move || fetch_one(i))))
                    .collect();
                handles
                    .into_iter()
                    .map(|(i, h)| {
                        h.join().unwrap_or_else(|_| {
                            Err(io_err(
                                std::io::ErrorKind::Other,
                                format!("loader for chunk {i} of file {file} panicked"),
                            ))
                        })
                    })
                    .collect()
            })
        } else {
            missing.iter().map(|&i| fetch_one(i)).collect()
        };
        bump(&sh.counters.stalls);
        bump(&fstate.counters.stalls);
        add(
            &sh.counters.stall_us,
            u64::try_from(t_stall.elapsed().as_micros()).unwrap_or(u64::MAX),
        );
        for (index, r) in missing.iter().zip(loaded) {
            chunks[(index - first) as usize] = Some(r?);
        }
        let chunks = chunks
            .into_iter()
            .map(|c| c.expect("every chunk filled"))
            .collect();
        Ok(Covering { chunks, first, end })
    }

    fn count(&self, outcome: Outcome, f: &FileState) {
        let (g, p) = (&self.shared.counters, &f.counters);
        match outcome {
            Outcome::Hit => {
                bump(&g.hits);
                bump(&p.hits);
            }
            Outcome::PrefetchHit => {
                bump(&g.prefetch_hits);
                bump(&p.prefetch_hits);
            }
            Outcome::Loaded | Outcome::Coalesced => {
                bump(&g.misses);
                bump(&p.misses);
                if outcome == Outcome::Coalesced {
                    bump(&g.coalesced);
                }
            }
        }
    }

    /// Add archive bytes decoded to produce chunks (reported by the loader's owner).
    pub fn record_decoded(&self, bytes: u64) {
        add(&self.shared.counters.archive_bytes_decoded, bytes);
    }

    /// Give file `file` an expert predictor over `map` (docs/MOE.md, "One step
    /// ahead"); false if it has one already.
    pub fn set_experts(&self, file: u32, map: ExpertMap, mode: ExpertMode) -> bool {
        self.shared
            .file_state(file)
            .experts
            .set(experts::Predictor::new(map, mode))
            .is_ok()
    }

    /// Let file `file`'s predicted experts queue only the chunks whose pages
    /// `residency` says the kernel no longer holds; false if it has a check already.
    pub fn set_residency(&self, file: u32, residency: Residency) -> bool {
        self.shared
            .file_state(file)
            .residency
            .set(residency)
            .is_ok()
    }

    /// What file `file`'s predictor learned, to keep under `key` (docs/MOE.md,
    /// "Learned transitions"); None without a predictor or when nothing changed since
    /// the last save or load.
    pub fn save_experts(&self, file: u32, key: u128) -> Option<Vec<u8>> {
        self.shared.file_state(file).experts.get()?.save(key)
    }

    /// Take back what [`save_experts`](Self::save_experts) returned; an error says why
    /// the bytes do not fit this file (nothing is taken then).
    pub fn load_experts(&self, file: u32, key: u128, bytes: &[u8]) -> Result<(), String> {
        match self.shared.file_state(file).experts.get() {
            Some(p) => p.load(key, bytes),
            None => Err(format!("file {file} has no expert predictor")),
        }
    }

    /// Tell `p` of a demand read and queue the experts it predicts.
    fn queue_experts(
        &self,
        p: &experts::Predictor,
        file: u32,
        size: u64,
        offset: u64,
        n: u64,
        f: &FileState,
    ) {
        let ranges = p.observe(f.run_start.load(Relaxed), offset, n);
        if ranges.is_empty() || lock(&self.shared.queue).workers == 0 {
            return;
        }
        let Some(loader) = lock(&f.loader).clone() else {
            return;
        };
        if f.residency.get().is_some() {
            let job = resident::Job {
                file,
                size,
                ranges,
                loader,
            };
            return self.checker.send(&self.shared, job);
        }
        let cs = self.shared.cfg.chunk_size;
        let mut queued = 0;
        for r in ranges {
            // Beside demand loads, as read-ahead: the next layer's experts are needed
            // within the time this layer's take.
            queued +=
                self.shared
                    .enqueue(file, size, r.start / cs..r.end.div_ceil(cs), &loader, true);
        }
        p.queued(queued as u64);
    }
}

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
//! Design:
//! - **Keys** are [`ChunkKey`] `{ file, index }`; chunk `index` covers bytes
//!   `index*chunk_size .. min(size, (index+1)*chunk_size)`. Values are `Arc<[u8]>`, so a
//!   reader keeps its chunk alive while copying even if it is evicted meanwhile (the
//!   "plus chunks being handed to readers" slack of the memory invariant).
//! - **Budget.** One mutex guards an unbounded `lru::LruCache` of unpinned chunks plus a
//!   map of pinned chunks, with our own byte accounting:
//!   `unpinned_bytes + pinned_reserved <= budget` always, and resident bytes
//!   (`unpinned_bytes + pinned_resident`) are at most that. Inserting evicts
//!   least-recently-used unpinned chunks until the new one fits. A chunk larger than the
//!   unpinned room is returned to its reader but not retained. Pinned chunks live
//!   outside the LRU, so eviction never walks past them. Bookkeeping per entry (LRU node,
//!   hash slot, `Arc` header, key) is outside the budget: about
//!   [`ENTRY_OVERHEAD_BYTES`] per chunk, 0.06% at 256 KiB chunks. Also outside it:
//!   chunks still referenced by readers copying out of them after eviction, and the
//!   buffers of loads in flight (at most one per concurrent reader or prefetch
//!   worker, each at most one chunk) — so resident memory is bounded by
//!   `budget + (readers + workers) * chunk_size + entries * overhead`.
//! - **Single-flight.** A miss registers a `Flight` for its key and loads *without* the
//!   global lock; concurrent misses on the same key wait on the flight's condvar and get
//!   the same `Arc` (or a copy of the same error). Errors are never cached: the flight is
//!   removed first, so the next read retries. A panicking loader fails its waiters
//!   instead of hanging them. Different chunks load in parallel; a read that misses
//!   more than one chunk loads them on scoped threads (never on rayon workers, which
//!   must not block on a flight whose loader itself needs rayon).
//! - **Pinning.** [`ChunkCache::pin`] reserves a chunk's bytes (it may be loaded later,
//!   by a read or a prefetch) and refuses when pinned bytes would exceed the budget.
//!   Pins nest; [`ChunkCache::unpin`] returns a resident chunk to the LRU as most recent.
//! - **Prefetch.** [`ChunkCache::start_prefetcher`] starts N workers draining a bounded,
//!   de-duplicated FIFO of `(chunk, loader)` jobs. Demand reads have priority: a
//!   demand load in progress (or a demand read waiting on a load) increments
//!   `demand_waiting`, and a worker about to start a job sleeps in
//!   [`PREFETCH_BACKOFF`] steps while it is non-zero. Loads already running are not
//!   interrupted. A chunk loaded by prefetch is marked; the first demand lookup it
//!   serves counts as a prefetch hit (a demand read that joined the prefetch's flight
//!   counts as a coalesced miss and clears the mark).
//! - **Read-ahead.** Per file, `read` remembers where the previous read ended; a read
//!   starting exactly there is sequential and queues the next `readahead_chunks` chunks
//!   (default 4) after the last one it touched, using the loader given to
//!   [`ChunkCache::register_file`]. Each chunk is queued once per sequential run.
//! - **Route hints (router-aware eviction).** [`ChunkCache::set_hints`] names the
//!   chunks a pending route says will be needed soon. Resident hinted chunks live in a
//!   second LRU that is evicted only when the ordinary one is empty; a demand read of a
//!   hinted chunk consumes its hint (it moves to the ordinary LRU as most recent). With
//!   `router_eviction` off hints are ignored: plain LRU, for comparison.
//! - **Trace.** [`ChunkCache::trace_start`] records every demand chunk lookup (file,
//!   chunk, time, hit / prefetch hit / miss) in order into a bounded in-memory list
//!   ([`TRACE_CAP`] events; later ones are counted as dropped) until
//!   [`ChunkCache::trace_stop`] returns it.
//! - **Statistics** are relaxed atomics plus a log2 µs latency histogram;
//!   [`ChunkCache::stats`] returns a serializable [`CacheStats`] snapshot.

mod stats;

#[cfg(test)]
mod tests;

pub use stats::{CacheStats, FileStats, LatencyStats};

use crate::model::ReadError;
use lru::LruCache;
use stats::{add, bump, Counters, FileCounters, Histogram};
use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default chunk size: 256 KiB (two default FUSE read requests).
pub const DEFAULT_CHUNK_SIZE: u64 = 256 * 1024;
/// Default read-ahead depth in chunks for sequential readers.
pub const DEFAULT_READAHEAD_CHUNKS: u64 = 4;
/// Default bound on queued prefetch jobs; requests beyond it are dropped (counted).
pub const DEFAULT_PREFETCH_QUEUE_CAP: usize = 4096;
/// Estimated per-entry bookkeeping outside the budget: LRU node (key, value, two
/// links) ~64 B, hash slot ~24 B, `Arc<[u8]>` header 16 B, flags/padding; rounded up.
pub const ENTRY_OVERHEAD_BYTES: u64 = 160;
/// Most events one trace keeps (24 bytes each: 24 MiB at most).
pub const TRACE_CAP: usize = 1 << 20;
/// How long a prefetch worker sleeps before re-checking for waiting demand loads.
pub const PREFETCH_BACKOFF: Duration = Duration::from_micros(200);

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
    #[error("cannot pin chunk {index} of file {file}: {needed} bytes more would exceed the cache budget ({pinned} of {budget} bytes already pinned)")]
    PinOverBudget {
        file: u32,
        index: u64,
        needed: u64,
        pinned: u64,
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
}

impl CacheConfig {
    pub fn new(budget_bytes: u64, chunk_size: u64) -> Self {
        CacheConfig {
            budget_bytes,
            chunk_size,
            readahead_chunks: DEFAULT_READAHEAD_CHUNKS,
            prefetch_queue_cap: DEFAULT_PREFETCH_QUEUE_CAP,
            router_eviction: true,
        }
    }
}

/// How a traced demand chunk lookup was satisfied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceOutcome {
    Hit,
    PrefetchHit,
    /// Loaded (or joined a load in flight) for this read.
    Miss,
}

/// One traced chunk lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    pub file: u32,
    pub index: u64,
    /// Microseconds since the trace started.
    pub t_us: u64,
    pub outcome: TraceOutcome,
}

#[derive(Default)]
struct Trace {
    on: AtomicBool,
    inner: Mutex<TraceBuf>,
}

#[derive(Default)]
struct TraceBuf {
    start: Option<Instant>,
    events: Vec<TraceEvent>,
    dropped: u64,
}

/// How one chunk lookup was satisfied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Hit,
    PrefetchHit,
    Loaded,
    Coalesced,
}

struct Entry {
    data: Arc<[u8]>,
    /// Loaded by prefetch and not yet served to a demand read.
    prefetched: bool,
}

struct PinSlot {
    count: u32,
    len: u64,
    entry: Option<Entry>,
}

type FlightResult = Result<Arc<[u8]>, ReadError>;

/// One in-progress load that others may wait on.
struct Flight {
    slot: Mutex<Option<FlightResult>>,
    cv: Condvar,
    prefetch: bool,
    /// A demand read joined this (prefetch) load; set and read under the state lock.
    demand_joined: AtomicBool,
}

impl Flight {
    fn wait(&self) -> FlightResult {
        let mut slot = lock(&self.slot);
        loop {
            if let Some(r) = slot.as_ref() {
                return match r {
                    Ok(d) => Ok(d.clone()),
                    Err(e) => Err(clone_read_error(e)),
                };
            }
            slot = self.cv.wait(slot).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn publish(&self, r: FlightResult) {
        *lock(&self.slot) = Some(r);
        self.cv.notify_all();
    }
}

struct State {
    lru: LruCache<ChunkKey, Entry>,
    /// Resident unpinned chunks named by a route hint; evicted after `lru`.
    hinted: LruCache<ChunkKey, Entry>,
    hints: HashSet<ChunkKey>,
    unpinned_bytes: u64,
    pinned: HashMap<ChunkKey, PinSlot>,
    pinned_reserved: u64,
    pinned_resident: u64,
    inflight: HashMap<ChunkKey, Arc<Flight>>,
}

impl State {
    /// Resident chunk for `key`; a demand lookup promotes it and consumes its
    /// prefetch mark.
    fn lookup(&mut self, key: &ChunkKey, demand: bool) -> Option<(Arc<[u8]>, Outcome)> {
        if demand && self.hints.remove(key) {
            // The route's prediction came true: an ordinary chunk from now on.
            if let Some(e) = self.hinted.pop(key) {
                self.lru.push(*key, e);
            }
        }
        let entry = match self.pinned.get_mut(key) {
            Some(slot) => slot.entry.as_mut(),
            None => match self.lru.get_mut(key) {
                Some(e) => Some(e),
                None => self.hinted.get_mut(key),
            },
        }?;
        let outcome = if demand && entry.prefetched {
            entry.prefetched = false;
            Outcome::PrefetchHit
        } else {
            Outcome::Hit
        };
        Some((entry.data.clone(), outcome))
    }

    fn is_present(&self, key: &ChunkKey) -> bool {
        self.inflight.contains_key(key)
            || self.lru.contains(key)
            || self.hinted.contains(key)
            || self.pinned.get(key).is_some_and(|s| s.entry.is_some())
    }

    /// Evict LRU unpinned chunks until `unpinned_bytes + extra` fits beside the pins.
    fn make_room(&mut self, budget: u64, extra: u64, counters: &Counters) {
        let room = budget.saturating_sub(self.pinned_reserved);
        while self.unpinned_bytes.saturating_add(extra) > room {
            match self.lru.pop_lru().or_else(|| self.hinted.pop_lru()) {
                Some((_, e)) => {
                    self.unpinned_bytes -= e.data.len() as u64;
                    bump(&counters.evictions);
                }
                None => break,
            }
        }
    }

    fn insert(&mut self, key: ChunkKey, entry: Entry, budget: u64, counters: &Counters) {
        let len = entry.data.len() as u64;
        if let Some(slot) = self.pinned.get_mut(&key) {
            // Its bytes are already reserved by the pin.
            if slot.entry.is_none() {
                self.pinned_resident += len;
                slot.entry = Some(entry);
            }
            return;
        }
        if let Some(old) = self.pop_unpinned(&key) {
            self.unpinned_bytes -= old.data.len() as u64;
        }
        if len > budget.saturating_sub(self.pinned_reserved) {
            bump(&counters.not_retained);
            return;
        }
        self.make_room(budget, len, counters);
        self.push_unpinned(key, entry);
        self.unpinned_bytes += len;
    }

    /// Remove an unpinned resident chunk from whichever LRU holds it.
    fn pop_unpinned(&mut self, key: &ChunkKey) -> Option<Entry> {
        self.lru.pop(key).or_else(|| self.hinted.pop(key))
    }

    /// Put an unpinned chunk in the LRU its hint says, as most recent.
    fn push_unpinned(&mut self, key: ChunkKey, entry: Entry) {
        if self.hints.contains(&key) {
            self.hinted.push(key, entry);
        } else {
            self.lru.push(key, entry);
        }
    }
}

#[derive(Default)]
struct FileState {
    counters: FileCounters,
    /// End offset of the previous read (u64::MAX before the first).
    last_end: AtomicU64,
    /// First chunk not yet queued for read-ahead in the current sequential run.
    readahead_next: AtomicU64,
    loader: Mutex<Option<ChunkLoader>>,
}

struct Job {
    key: ChunkKey,
    len: u64,
    loader: ChunkLoader,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    queued: HashSet<ChunkKey>,
    active: usize,
    workers: usize,
}

struct Shared {
    cfg: CacheConfig,
    trace: Trace,
    state: Mutex<State>,
    files: RwLock<HashMap<u32, Arc<FileState>>>,
    counters: Counters,
    latency: Histogram,
    demand_waiting: AtomicU64,
    queue: Mutex<Queue>,
    queue_cv: Condvar,
    idle_cv: Condvar,
    shutdown: AtomicBool,
}

/// The chunk cache. Share it behind an `Arc`; every method takes `&self`.
pub struct ChunkCache {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere never leaves our maps half-updated in a way that matters more
    // than refusing all further reads would.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `ReadError` is not `Clone` (it holds an `io::Error`); waiters of a failed flight get
/// an equivalent copy.
fn clone_read_error(e: &ReadError) -> ReadError {
    match e {
        ReadError::Checksum {
            tensor,
            block,
            stored,
            computed,
        } => ReadError::Checksum {
            tensor: tensor.clone(),
            block: *block,
            stored: *stored,
            computed: *computed,
        },
        ReadError::Corrupt {
            tensor,
            block,
            reason,
        } => ReadError::Corrupt {
            tensor: tensor.clone(),
            block: *block,
            reason: reason.clone(),
        },
        ReadError::OutOfRange { tensor, r0, r1 } => ReadError::OutOfRange {
            tensor: tensor.clone(),
            r0: *r0,
            r1: *r1,
        },
        ReadError::Io(io) => ReadError::Io(std::io::Error::new(io.kind(), io.to_string())),
    }
}

fn io_err(kind: std::io::ErrorKind, msg: String) -> ReadError {
    ReadError::Io(std::io::Error::new(kind, msg))
}

/// Counts a demand load (or a demand wait on one) for the prefetchers' back-off.
struct DemandGuard<'a>(&'a AtomicU64);

impl<'a> DemandGuard<'a> {
    fn new(c: &'a AtomicU64) -> Self {
        c.fetch_add(1, Relaxed);
        DemandGuard(c)
    }
}

impl Drop for DemandGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Completes a flight with an error if the loader unwinds, so waiters never hang.
struct FlightGuard<'a> {
    shared: &'a Shared,
    key: ChunkKey,
    flight: Arc<Flight>,
    armed: bool,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.shared.state).inflight.remove(&self.key);
            bump(&self.shared.counters.load_errors);
            self.flight.publish(Err(io_err(
                std::io::ErrorKind::Other,
                format!(
                    "loader for chunk {} of file {} panicked",
                    self.key.index, self.key.file
                ),
            )));
        }
    }
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

    /// Produce chunk `key` (`len` bytes) into a fresh allocation.
    fn run_loader(&self, key: ChunkKey, len: u64, load: &LoadFn<'_>) -> FlightResult {
        let len_usize = usize::try_from(len).map_err(|_| {
            io_err(
                std::io::ErrorKind::InvalidInput,
                format!("chunk {} of file {}: {len} bytes", key.index, key.file),
            )
        })?;
        // `repeat_n` is TrustedLen, so this allocates the Arc once, without a copy.
        let mut data: Arc<[u8]> = std::iter::repeat_n(0u8, len_usize).collect();
        let buf = Arc::get_mut(&mut data).expect("fresh Arc is unique");
        // A loader bug (a panic) fails this read with EIO instead of taking down the
        // mount's thread.
        let n = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(key.index, buf)))
            .map_err(|_| {
            io_err(
                std::io::ErrorKind::Other,
                format!(
                    "loader for chunk {} of file {} panicked",
                    key.index, key.file
                ),
            )
        })??;
        if n != len_usize {
            return Err(io_err(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "chunk {} of file {}: loader produced {n} of {len} bytes",
                    key.index, key.file
                ),
            ));
        }
        Ok(data)
    }

    /// Resident chunk, or join the in-flight load, or load it (single-flight).
    fn fetch(
        &self,
        key: ChunkKey,
        len: u64,
        load: &LoadFn<'_>,
        demand: bool,
    ) -> Result<(Arc<[u8]>, Outcome), ReadError> {
        let flight = {
            let mut st = lock(&self.state);
            if let Some(found) = st.lookup(&key, demand) {
                return Ok(found);
            }
            if let Some(f) = st.inflight.get(&key) {
                if demand {
                    f.demand_joined.store(true, Relaxed);
                }
                let f = f.clone();
                drop(st);
                let _g = demand.then(|| DemandGuard::new(&self.demand_waiting));
                return f.wait().map(|d| (d, Outcome::Coalesced));
            }
            let f = Arc::new(Flight {
                slot: Mutex::new(None),
                cv: Condvar::new(),
                prefetch: !demand,
                demand_joined: AtomicBool::new(false),
            });
            st.inflight.insert(key, f.clone());
            f
        };
        let _g = demand.then(|| DemandGuard::new(&self.demand_waiting));
        let mut guard = FlightGuard {
            shared: self,
            key,
            flight: flight.clone(),
            armed: true,
        };
        bump(&self.counters.loads);
        let result = self.run_loader(key, len, load);
        guard.armed = false;
        {
            let mut st = lock(&self.state);
            st.inflight.remove(&key);
            match &result {
                Ok(data) => {
                    add(&self.counters.bytes_loaded, data.len() as u64);
                    let prefetched = flight.prefetch && !flight.demand_joined.load(Relaxed);
                    let entry = Entry {
                        data: data.clone(),
                        prefetched,
                    };
                    st.insert(key, entry, self.cfg.budget_bytes, &self.counters);
                }
                Err(_) => bump(&self.counters.load_errors),
            }
        }
        let shared_result = match &result {
            Ok(d) => Ok(d.clone()),
            Err(e) => Err(clone_read_error(e)),
        };
        flight.publish(shared_result);
        result.map(|d| (d, Outcome::Loaded))
    }

    fn enqueue(&self, file: u32, size: u64, chunks: Range<u64>, loader: &ChunkLoader) -> usize {
        let end = chunks.end.min(self.chunk_count(size));
        let mut q = lock(&self.queue);
        let mut queued = 0;
        for index in chunks.start..end {
            let key = ChunkKey { file, index };
            if q.queued.contains(&key) {
                continue;
            }
            if q.jobs.len() >= self.cfg.prefetch_queue_cap {
                bump(&self.counters.prefetch_dropped);
                continue;
            }
            let Some(len) = self.chunk_len(size, index) else {
                break;
            };
            q.queued.insert(key);
            q.jobs.push_back(Job {
                key,
                len,
                loader: loader.clone(),
            });
            queued += 1;
        }
        drop(q);
        if queued > 0 {
            add(&self.counters.prefetch_queued, queued as u64);
            self.queue_cv.notify_all();
        }
        queued
    }

    fn worker(self: Arc<Self>) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if self.shutdown.load(Relaxed) {
                        return;
                    }
                    if let Some(job) = q.jobs.pop_front() {
                        q.queued.remove(&job.key);
                        q.active += 1;
                        break job;
                    }
                    q = self
                        .queue_cv
                        .wait(q)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            // Demand first: don't start a prefetch load while a reader waits on one.
            while self.demand_waiting.load(Relaxed) > 0 && !self.shutdown.load(Relaxed) {
                std::thread::sleep(PREFETCH_BACKOFF);
            }
            let present = lock(&self.state).is_present(&job.key);
            if present {
                bump(&self.counters.prefetch_skipped);
            } else {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.fetch(job.key, job.len, &*job.loader, false)
                }));
                match r {
                    Ok(Ok((_, Outcome::Loaded))) => bump(&self.counters.prefetch_loads),
                    Ok(Ok(_)) => bump(&self.counters.prefetch_skipped),
                    Ok(Err(_)) | Err(_) => bump(&self.counters.prefetch_errors),
                }
            }
            drop(job);
            let mut q = lock(&self.queue);
            q.active -= 1;
            if q.jobs.is_empty() && q.active == 0 {
                self.idle_cv.notify_all();
            }
        }
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
        Ok(ChunkCache {
            shared: Arc::new(Shared {
                cfg,
                trace: Trace::default(),
                state: Mutex::new(State {
                    lru: LruCache::unbounded(),
                    hinted: LruCache::unbounded(),
                    hints: HashSet::new(),
                    unpinned_bytes: 0,
                    pinned: HashMap::new(),
                    pinned_reserved: 0,
                    pinned_resident: 0,
                    inflight: HashMap::new(),
                }),
                files: RwLock::new(HashMap::new()),
                counters: Counters::default(),
                latency: Histogram::default(),
                demand_waiting: AtomicU64::new(0),
                queue: Mutex::new(Queue::default()),
                queue_cv: Condvar::new(),
                idle_cv: Condvar::new(),
                shutdown: AtomicBool::new(false),
            }),
            workers: Mutex::new(Vec::new()),
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
        let t0 = Instant::now();
        let sh = &*self.shared;
        let fstate = sh.file_state(file);
        let r = self.read_inner(file, file_size, offset, buf, load, &fstate);
        bump(&sh.counters.reads);
        bump(&fstate.counters.reads);
        match &r {
            Ok(n) => {
                add(&sh.counters.bytes_served, *n as u64);
                add(&fstate.counters.bytes_served, *n as u64);
                let end = offset + *n as u64;
                let prev = fstate.last_end.swap(end, Relaxed);
                if *n > 0 {
                    if prev == offset {
                        self.readahead(file, file_size, (end - 1) / sh.cfg.chunk_size, &fstate);
                    } else {
                        // A new run: forget what the previous run queued.
                        fstate.readahead_next.store(0, Relaxed);
                    }
                }
            }
            Err(_) => bump(&sh.counters.read_errors),
        }
        sh.latency
            .record(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX));
        r
    }

    fn read_inner(
        &self,
        file: u32,
        file_size: u64,
        offset: u64,
        buf: &mut [u8],
        load: &LoadFn<'_>,
        fstate: &FileState,
    ) -> Result<usize, ReadError> {
        let sh = &*self.shared;
        if offset >= file_size || buf.is_empty() {
            return Ok(0);
        }
        let end = offset.saturating_add(buf.len() as u64).min(file_size);
        let cs = sh.cfg.chunk_size;
        let first = offset / cs;
        let last = (end - 1) / cs;
        let count = (last - first + 1) as usize;
        let mut chunks: Vec<Option<Arc<[u8]>>> = vec![None; count];
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
        let fetch_one = |index: u64| -> Result<Arc<[u8]>, ReadError> {
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
        let loaded: Vec<Result<Arc<[u8]>, ReadError>> = if missing.len() > 1 {
            std::thread::scope(|s| {
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
        for (index, r) in missing.iter().zip(loaded) {
            chunks[(index - first) as usize] = Some(r?);
        }
        for (data, index) in chunks.iter().zip(first..=last) {
            let data = data.as_ref().expect("every chunk filled");
            let cstart = index * cs;
            let lo = offset.max(cstart);
            let hi = end.min(cstart + cs);
            let src = data
                .get((lo - cstart) as usize..(hi - cstart) as usize)
                .ok_or_else(|| {
                    io_err(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "chunk {index} of file {file} holds {} bytes, fewer than the read needs (file size changed?)",
                            data.len()
                        ),
                    )
                })?;
            buf[(lo - offset) as usize..(hi - offset) as usize].copy_from_slice(src);
        }
        Ok((end - offset) as usize)
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

    fn readahead(&self, file: u32, size: u64, last_chunk: u64, f: &FileState) {
        let sh = &*self.shared;
        let k = sh.cfg.readahead_chunks;
        if k == 0 || lock(&sh.queue).workers == 0 {
            return;
        }
        let Some(loader) = lock(&f.loader).clone() else {
            return;
        };
        let from = (last_chunk + 1).max(f.readahead_next.load(Relaxed));
        let to = last_chunk
            .saturating_add(1)
            .saturating_add(k)
            .min(sh.chunk_count(size));
        if from >= to {
            return;
        }
        f.readahead_next.fetch_max(to, Relaxed);
        bump(&sh.counters.readahead_triggers);
        sh.enqueue(file, size, from..to, &loader);
    }

    /// Start `threads` background prefetch workers (adds to any already running).
    pub fn start_prefetcher(&self, threads: usize) {
        let mut handles = lock(&self.workers);
        for i in 0..threads {
            let sh = self.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("cawsfs-prefetch-{i}"))
                .spawn(move || sh.worker())
                .expect("spawn prefetch worker");
            handles.push(h);
        }
        lock(&self.shared.queue).workers += threads;
    }

    /// Queue chunks `chunks` of file `file` (`size` bytes) for background loading
    /// through `loader`. Chunks past EOF are ignored; already queued ones are not
    /// queued twice; resident ones are skipped when their turn comes. Returns how
    /// many were queued. Jobs run once [`start_prefetcher`](Self::start_prefetcher) has.
    pub fn prefetch(&self, file: u32, size: u64, chunks: Range<u64>, loader: ChunkLoader) -> usize {
        self.shared.enqueue(file, size, chunks, &loader)
    }

    /// Like [`prefetch`](Self::prefetch) with the loader given to
    /// [`register_file`](Self::register_file); 0 when `file` has none.
    pub fn prefetch_registered(&self, file: u32, size: u64, chunks: Range<u64>) -> usize {
        let loader = lock(&self.shared.file_state(file).loader).clone();
        match loader {
            Some(l) => self.shared.enqueue(file, size, chunks, &l),
            None => 0,
        }
    }

    /// Wait until the prefetch queue is empty and no prefetch load runs, up to
    /// `timeout`. True when idle.
    pub fn wait_prefetch_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut q = lock(&self.shared.queue);
        while !(q.jobs.is_empty() && q.active == 0) {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            q = self
                .shared
                .idle_cv
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Pin chunk `key` of a file of `file_size` bytes: it is never evicted, and its
    /// bytes count against the budget from now on, resident or not (a later read or
    /// prefetch makes it resident). Pins nest. Fails if pinned bytes would exceed the
    /// budget; unpinned chunks are evicted to make room.
    pub fn pin(&self, key: ChunkKey, file_size: u64) -> Result<(), CacheError> {
        let sh = &*self.shared;
        let len = sh
            .chunk_len(file_size, key.index)
            .ok_or(CacheError::OutOfRange {
                file: key.file,
                index: key.index,
                size: file_size,
            })?;
        let mut st = lock(&sh.state);
        if let Some(slot) = st.pinned.get_mut(&key) {
            slot.count += 1;
            return Ok(());
        }
        let budget = sh.cfg.budget_bytes;
        if st.pinned_reserved.saturating_add(len) > budget {
            return Err(CacheError::PinOverBudget {
                file: key.file,
                index: key.index,
                needed: len,
                pinned: st.pinned_reserved,
                budget,
            });
        }
        let entry = st.pop_unpinned(&key);
        if let Some(e) = &entry {
            st.unpinned_bytes -= e.data.len() as u64;
        }
        if entry.is_some() {
            st.pinned_resident += len;
        }
        st.pinned_reserved += len;
        st.pinned.insert(
            key,
            PinSlot {
                count: 1,
                len,
                entry,
            },
        );
        st.make_room(budget, 0, &sh.counters);
        Ok(())
    }

    /// Drop one pin of `key`; the last one returns a resident chunk to the LRU as most
    /// recently used.
    pub fn unpin(&self, key: ChunkKey) -> Result<(), CacheError> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state);
        let Some(slot) = st.pinned.get_mut(&key) else {
            return Err(CacheError::NotPinned {
                file: key.file,
                index: key.index,
            });
        };
        slot.count -= 1;
        if slot.count > 0 {
            return Ok(());
        }
        let slot = st.pinned.remove(&key).expect("present");
        st.pinned_reserved -= slot.len;
        if let Some(e) = slot.entry {
            st.pinned_resident -= slot.len;
            st.unpinned_bytes += e.data.len() as u64;
            st.push_unpinned(key, e);
        }
        Ok(())
    }

    /// Whether `key` is pinned.
    pub fn is_pinned(&self, key: ChunkKey) -> bool {
        lock(&self.shared.state).pinned.contains_key(&key)
    }

    /// Drop every unpinned chunk; returns the bytes freed.
    pub fn evict_all_unpinned(&self) -> u64 {
        let mut st = lock(&self.shared.state);
        let freed = st.unpinned_bytes;
        add(
            &self.shared.counters.evictions,
            (st.lru.len() + st.hinted.len()) as u64,
        );
        st.lru.clear();
        st.hinted.clear();
        st.unpinned_bytes = 0;
        freed
    }

    /// Drop these chunks if they are resident and unpinned; returns the bytes freed.
    pub fn evict(&self, keys: impl IntoIterator<Item = ChunkKey>) -> u64 {
        let mut st = lock(&self.shared.state);
        let mut freed = 0;
        for k in keys {
            if let Some(e) = st.pop_unpinned(&k) {
                let len = e.data.len() as u64;
                st.unpinned_bytes -= len;
                freed += len;
                bump(&self.shared.counters.evictions);
            }
        }
        freed
    }

    /// Replace the route hints: `keys` are the chunks a pending route will need, to be
    /// evicted after every other unpinned chunk. Ignored (returns 0) when the cache was
    /// configured for plain LRU. Returns the number of hints set.
    pub fn set_hints(&self, keys: impl IntoIterator<Item = ChunkKey>) -> usize {
        if !self.shared.cfg.router_eviction {
            return 0;
        }
        let mut st = lock(&self.shared.state);
        let new: HashSet<ChunkKey> = keys.into_iter().collect();
        // Chunks that lose their hint go back to the ordinary LRU, ...
        let old: Vec<ChunkKey> = st
            .hints
            .iter()
            .filter(|k| !new.contains(k))
            .copied()
            .collect();
        st.hints = new;
        for k in old {
            if let Some(e) = st.hinted.pop(&k) {
                st.lru.push(k, e);
            }
        }
        // ... and resident chunks that gain one move to the hinted LRU.
        let gained: Vec<ChunkKey> = st
            .hints
            .iter()
            .filter(|k| st.lru.contains(k))
            .copied()
            .collect();
        for k in gained {
            if let Some(e) = st.lru.pop(&k) {
                st.hinted.push(k, e);
            }
        }
        st.hints.len()
    }

    /// Number of chunks hinted now (resident or not).
    pub fn hint_count(&self) -> usize {
        lock(&self.shared.state).hints.len()
    }

    /// Start (or restart, clearing) the read trace.
    pub fn trace_start(&self) {
        let t = &self.shared.trace;
        let mut b = lock(&t.inner);
        *b = TraceBuf {
            start: Some(Instant::now()),
            ..TraceBuf::default()
        };
        t.on.store(true, Relaxed);
    }

    /// Stop the trace; returns its events in order and how many did not fit.
    pub fn trace_stop(&self) -> (Vec<TraceEvent>, u64) {
        let t = &self.shared.trace;
        let mut b = lock(&t.inner);
        t.on.store(false, Relaxed);
        let b = std::mem::take(&mut *b);
        (b.events, b.dropped)
    }

    /// Whether a trace is running.
    pub fn tracing(&self) -> bool {
        self.shared.trace.on.load(Relaxed)
    }

    fn trace(&self, file: u32, index: u64, outcome: Outcome) {
        let t = &self.shared.trace;
        if !t.on.load(Relaxed) {
            return;
        }
        let mut b = lock(&t.inner);
        let Some(start) = b.start else { return };
        if b.events.len() >= TRACE_CAP {
            b.dropped += 1;
            return;
        }
        let outcome = match outcome {
            Outcome::Hit => TraceOutcome::Hit,
            Outcome::PrefetchHit => TraceOutcome::PrefetchHit,
            Outcome::Loaded | Outcome::Coalesced => TraceOutcome::Miss,
        };
        let t_us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        b.events.push(TraceEvent {
            file,
            index,
            t_us,
            outcome,
        });
    }

    /// Add archive bytes decoded to produce chunks (reported by the loader's owner).
    pub fn record_decoded(&self, bytes: u64) {
        add(&self.shared.counters.archive_bytes_decoded, bytes);
    }

    /// A snapshot of all statistics.
    pub fn stats(&self) -> CacheStats {
        let sh = &*self.shared;
        let c = &sh.counters;
        let (unpinned, pinned_reserved, pinned_resident, entries, pinned_entries, inflight) = {
            let st = lock(&sh.state);
            let pinned_res = st.pinned.values().filter(|s| s.entry.is_some()).count();
            (
                st.unpinned_bytes,
                st.pinned_reserved,
                st.pinned_resident,
                (st.lru.len() + st.hinted.len() + pinned_res) as u64,
                st.pinned.len() as u64,
                st.inflight.len() as u64,
            )
        };
        let (queue_len, workers) = {
            let q = lock(&sh.queue);
            (q.jobs.len() as u64, q.workers as u64)
        };
        let mut files: Vec<FileStats> = sh
            .files
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(id, f)| f.counters.snapshot(*id))
            .collect();
        files.sort_by_key(|f| f.file);
        let hits = c.hits.load(Relaxed);
        let prefetch_hits = c.prefetch_hits.load(Relaxed);
        let misses = c.misses.load(Relaxed);
        let lookups = hits + prefetch_hits + misses;
        let bytes_served = c.bytes_served.load(Relaxed);
        let decoded = c.archive_bytes_decoded.load(Relaxed);
        CacheStats {
            budget_bytes: sh.cfg.budget_bytes,
            chunk_size: sh.cfg.chunk_size,
            bytes_used: unpinned + pinned_resident,
            unpinned_bytes: unpinned,
            pinned_bytes: pinned_reserved,
            pinned_resident_bytes: pinned_resident,
            entries,
            pinned_entries,
            entry_overhead_bytes: ENTRY_OVERHEAD_BYTES,
            loads_in_flight: inflight,
            reads: c.reads.load(Relaxed),
            read_errors: c.read_errors.load(Relaxed),
            hits,
            prefetch_hits,
            misses,
            coalesced: c.coalesced.load(Relaxed),
            hit_rate: if lookups == 0 {
                0.0
            } else {
                (hits + prefetch_hits) as f64 / lookups as f64
            },
            bytes_served,
            bytes_loaded: c.bytes_loaded.load(Relaxed),
            loads: c.loads.load(Relaxed),
            load_errors: c.load_errors.load(Relaxed),
            evictions: c.evictions.load(Relaxed),
            not_retained: c.not_retained.load(Relaxed),
            archive_bytes_decoded: decoded,
            decoded_per_served: if bytes_served == 0 {
                0.0
            } else {
                decoded as f64 / bytes_served as f64
            },
            readahead_triggers: c.readahead_triggers.load(Relaxed),
            prefetch_workers: workers,
            prefetch_queue_len: queue_len,
            prefetch_queued: c.prefetch_queued.load(Relaxed),
            prefetch_loads: c.prefetch_loads.load(Relaxed),
            prefetch_skipped: c.prefetch_skipped.load(Relaxed),
            prefetch_dropped: c.prefetch_dropped.load(Relaxed),
            prefetch_errors: c.prefetch_errors.load(Relaxed),
            latency_us: sh.latency.snapshot(),
            files,
        }
    }
}

impl Drop for ChunkCache {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Relaxed);
        {
            // Notify under the queue lock so no worker misses the wake-up between its
            // shutdown check and its wait.
            let _q = lock(&self.shared.queue);
            self.shared.queue_cv.notify_all();
        }
        for h in lock(&self.workers).drain(..) {
            let _ = h.join();
        }
    }
}

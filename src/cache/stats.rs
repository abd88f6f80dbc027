//! Cache statistics: lock-free counters updated on the read path and a serializable
//! snapshot ([`CacheStats`]) for the control socket and `cawsfs stat`.

use super::{lock, ExpertStats, ENTRY_OVERHEAD_BYTES};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::PoisonError;

/// Global counters. Relaxed atomics: each is an independent tally, a snapshot need not
/// be a consistent cut across them.
#[derive(Default)]
pub(crate) struct Counters {
    pub reads: AtomicU64,
    pub read_errors: AtomicU64,
    pub hits: AtomicU64,
    pub prefetch_hits: AtomicU64,
    pub misses: AtomicU64,
    pub coalesced: AtomicU64,
    pub bytes_served: AtomicU64,
    pub bytes_loaded: AtomicU64,
    pub loads: AtomicU64,
    pub load_errors: AtomicU64,
    pub evictions: AtomicU64,
    pub not_retained: AtomicU64,
    pub room_waits: AtomicU64,
    pub archive_bytes_decoded: AtomicU64,
    pub readahead_triggers: AtomicU64,
    pub prefetch_queued: AtomicU64,
    pub prefetch_loads: AtomicU64,
    pub prefetch_skipped: AtomicU64,
    pub prefetch_dropped: AtomicU64,
    pub prefetch_errors: AtomicU64,
    pub stalls: AtomicU64,
    pub stall_us: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

/// Per-file tallies (kept in the cache's per-file state).
#[derive(Default)]
pub(crate) struct FileCounters {
    pub reads: AtomicU64,
    pub hits: AtomicU64,
    pub prefetch_hits: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_served: AtomicU64,
    pub stalls: AtomicU64,
}

impl FileCounters {
    pub fn snapshot(&self, file: u32) -> FileStats {
        FileStats {
            file,
            reads: self.reads.load(Relaxed),
            hits: self.hits.load(Relaxed),
            prefetch_hits: self.prefetch_hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            bytes_served: self.bytes_served.load(Relaxed),
            stalls: self.stalls.load(Relaxed),
        }
    }
}

/// Number of log2 buckets: bucket 0 holds 0 µs, bucket b ≥ 1 holds [2^(b-1), 2^b) µs;
/// the last bucket also takes everything longer (2^38 µs is about three days).
const BUCKETS: usize = 40;

/// Latency histogram (reads, chunk loads), log2-bucketed in microseconds. Percentiles are reported as
/// the upper edge of the bucket they fall in (so within a factor of two, never below
/// the truth), capped by the exact maximum.
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    count: AtomicU64,
    sum_us: AtomicU64,
    max_us: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
            max_us: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn record(&self, us: u64) {
        let b = ((u64::BITS - us.leading_zeros()) as usize).min(BUCKETS - 1);
        self.buckets[b].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
        self.max_us.fetch_max(us, Relaxed);
    }

    pub fn snapshot(&self) -> LatencyStats {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        let max = self.max_us.load(Relaxed);
        let pct = |p: f64| -> u64 {
            if total == 0 {
                return 0;
            }
            let target = ((p * total as f64).ceil() as u64).clamp(1, total);
            let mut acc = 0u64;
            for (b, &c) in counts.iter().enumerate() {
                acc += c;
                if acc >= target {
                    let upper = if b == 0 { 0 } else { (1u64 << b) - 1 };
                    return upper.min(max);
                }
            }
            max
        };
        let count = self.count.load(Relaxed);
        LatencyStats {
            count,
            mean_us: if count == 0 {
                0.0
            } else {
                self.sum_us.load(Relaxed) as f64 / count as f64
            },
            p50_us: pct(0.50),
            p90_us: pct(0.90),
            p99_us: pct(0.99),
            max_us: max,
        }
    }
}

/// Read latency summary (whole `read` calls, hits and misses together).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyStats {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

/// Per-file counters in a snapshot.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FileStats {
    pub file: u32,
    pub reads: u64,
    pub hits: u64,
    pub prefetch_hits: u64,
    pub misses: u64,
    pub bytes_served: u64,
    /// Reads that waited for at least one chunk to be reconstructed.
    #[serde(default)]
    pub stalls: u64,
}

/// A snapshot of the cache's state and counters.
///
/// `hits`, `prefetch_hits` and `misses` count *chunk lookups*: a read spanning three
/// chunks makes three. A miss either ran the loader or waited on someone else's load
/// of the same chunk (`coalesced`, a subset of `misses`). A prefetch hit is the first
/// demand lookup served by a chunk that a prefetch or read-ahead loaded.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheStats {
    pub budget_bytes: u64,
    pub chunk_size: u64,
    /// Chunk bytes resident now (unpinned + pinned); never above `budget_bytes`.
    pub bytes_used: u64,
    pub unpinned_bytes: u64,
    /// Bytes reserved by pins (resident or not yet loaded); they count against the budget.
    pub pinned_bytes: u64,
    pub pinned_resident_bytes: u64,
    /// Bytes held outside the cache on its budget's account (the router's tokenizer).
    pub charged_bytes: u64,
    /// Bytes the loads in flight count against the budget now.
    pub working_bytes: u64,
    pub entries: u64,
    pub pinned_entries: u64,
    /// Estimated fixed bookkeeping per resident entry, outside the budget.
    pub entry_overhead_bytes: u64,
    pub loads_in_flight: u64,
    pub reads: u64,
    pub read_errors: u64,
    pub hits: u64,
    pub prefetch_hits: u64,
    pub misses: u64,
    pub coalesced: u64,
    /// (hits + prefetch_hits) / lookups, 0 when there were none.
    pub hit_rate: f64,
    pub bytes_served: u64,
    /// Chunk bytes produced by loaders (demand and prefetch).
    pub bytes_loaded: u64,
    pub loads: u64,
    pub load_errors: u64,
    pub evictions: u64,
    /// Chunks loaded but not kept because they alone exceed the unpinned budget.
    pub not_retained: u64,
    /// Loads that waited for room for their working memory before starting
    /// (pins, charges and the loads already running left too little of the budget).
    #[serde(default)]
    pub room_waits: u64,
    /// Archive (compressed) bytes decoded, reported by the mount via `record_decoded`.
    pub archive_bytes_decoded: u64,
    /// archive_bytes_decoded / bytes_served (invariant 2's measure), 0 when nothing served.
    pub decoded_per_served: f64,
    pub readahead_triggers: u64,
    pub prefetch_workers: u64,
    pub prefetch_queue_len: u64,
    pub prefetch_queued: u64,
    pub prefetch_loads: u64,
    /// Prefetch jobs skipped because the chunk was already resident or loading.
    pub prefetch_skipped: u64,
    /// Prefetch requests refused because the queue was full.
    pub prefetch_dropped: u64,
    pub prefetch_errors: u64,
    pub latency_us: LatencyStats,
    /// Time each chunk load (reconstruction of one chunk, demand or prefetch) took.
    #[serde(default)]
    pub load_latency_us: LatencyStats,
    pub files: Vec<FileStats>,
    /// Reads that waited for at least one chunk to be reconstructed (or to finish
    /// loading), and the time they waited in all.
    #[serde(default)]
    pub stalls: u64,
    #[serde(default)]
    pub stall_us: u64,
    /// The expert predictors' counters (docs/MOE.md), zero without one.
    #[serde(default)]
    pub experts: super::ExpertStats,
}

// The snapshot is built here, beside what it reads, rather than in the cache's core.
impl super::ChunkCache {
    /// A snapshot of all statistics.
    pub fn stats(&self) -> CacheStats {
        let sh = &*self.shared;
        let c = &sh.counters;
        let (
            charged,
            working,
            unpinned,
            pinned_reserved,
            pinned_resident,
            entries,
            pinned_entries,
            inflight,
        ) = {
            let st = lock(&sh.state);
            let pinned_res = st.pinned.values().filter(|s| s.entry.is_some()).count();
            (
                st.charged,
                st.working,
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
            charged_bytes: charged,
            working_bytes: working,
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
            room_waits: c.room_waits.load(Relaxed),
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
            load_latency_us: sh.load_latency.snapshot(),
            files,
            stalls: c.stalls.load(Relaxed),
            stall_us: c.stall_us.load(Relaxed),
            experts: self.expert_stats(),
        }
    }

    fn expert_stats(&self) -> ExpertStats {
        let mut s = ExpertStats::default();
        for f in self
            .shared
            .files
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            if let Some(p) = f.experts.get() {
                p.add_stats(&mut s);
            }
        }
        s.finish();
        s
    }
}

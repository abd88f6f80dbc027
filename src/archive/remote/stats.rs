//! What one archive's requests did, for `stat`'s `fetch` section (docs/CONTROL.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Counters of one archive's requests (every object of it), for `stat`.
#[derive(Default)]
pub(super) struct FetchStats {
    pub(super) requests: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) part_hits: AtomicU64,
    pub(super) part_misses: AtomicU64,
    pub(super) readahead_bytes: AtomicU64,
    pub(super) refetched: AtomicU64,
    /// Request latencies in power-of-two buckets of microseconds.
    pub(super) latency: [AtomicU64; 32],
}

/// What [`FetchStats`] held at one moment (`stat`'s `fetch` section).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct FetchSnapshot {
    /// The archive's URL: the object, or the npy-dir's prefix.
    pub url: String,
    /// Bytes of the objects opened, and how many (1 for a `.cawsf`).
    pub object_bytes: u64,
    pub objects: u64,
    pub requests: u64,
    pub bytes_fetched: u64,
    /// Requests that failed for good (their retries spent, or not retryable).
    pub failed_requests: u64,
    /// Attempts made again after a transient failure (5xx, 429, timeouts, connection
    /// errors), by object_store's backoff.
    pub retries: u64,
    pub part_hits: u64,
    pub part_misses: u64,
    pub readahead_bytes: u64,
    /// Reads whose fetched bytes failed their block's checksum, fetched once more.
    pub refetched_blocks: u64,
    /// Latency percentiles (upper bounds of their buckets), microseconds.
    pub latency_p50_us: u64,
    pub latency_p90_us: u64,
    pub latency_p99_us: u64,
    /// The fetch cache on disk: bytes served from it, parts written to it, parts that
    /// failed their checksum there (fetched again); all 0 without one.
    pub fetch_cache_hit_bytes: u64,
    pub fetch_cache_written_bytes: u64,
    pub fetch_cache_bad_parts: u64,
}

impl FetchStats {
    pub(super) fn record(&self, bytes: u64, took: Duration, ok: bool) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if ok {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        let us = took.as_micros().max(1) as u64;
        let b = (63 - us.leading_zeros() as usize).min(31);
        self.latency[b].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn percentile(&self, q: f64) -> u64 {
        let counts: Vec<u64> = self
            .latency
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (b, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return 2u64 << b;
            }
        }
        2u64 << 31
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles_are_bucket_bounds() {
        let s = FetchStats::default();
        for _ in 0..90 {
            s.record(1, Duration::from_micros(300), true);
        }
        for _ in 0..10 {
            s.record(1, Duration::from_millis(20), true);
        }
        assert_eq!(s.percentile(0.5), 512);
        assert_eq!(s.percentile(0.99), 32768);
    }
}

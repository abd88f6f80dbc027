//! What the objects of one archive share: one `.cawsf` object, or every file of an
//! npy-dir under a prefix. One client, one bound on parts in memory, one pair of
//! request-slot pools, one set of counters for `stat`, and one "failing" flag, so a
//! server that goes away logs one line for the archive rather than one per file.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::ObjectStore;

use super::disk::DiskGroup;
use super::stats::{FetchSnapshot, FetchStats};
use super::{Pending, MEMORY};

/// A part of one object: (the object's number in its archive, the part's index).
pub(super) type PartKey = (u64, u64);

pub(super) struct Parts {
    pub ready: lru::LruCache<PartKey, Bytes>,
    pub loading: HashMap<PartKey, Arc<Pending>>,
}

pub(super) struct Shared {
    /// The archive's URL (the object, or the npy-dir's prefix) without credentials.
    pub display: String,
    /// The unit of fetching, for every object of the archive (a fetch-cache entry's
    /// records count in it).
    pub part: u64,
    pub readahead_max: u64,
    pub store: Arc<dyn ObjectStore>,
    pub parts: Mutex<Parts>,
    /// Request slots for readers and for read-ahead.
    pub slots: [tokio::sync::Semaphore; 2],
    pub stats: FetchStats,
    pub disk: Arc<DiskGroup>,
    /// Bytes of the objects opened, and the number the next one gets.
    pub object_bytes: AtomicU64,
    pub next_id: AtomicU64,
    pub failing: AtomicBool,
    /// Set once bytes that failed a checksum have been logged (one line per archive).
    pub bad_reported: AtomicBool,
    /// Attempts that failed transiently (5xx, 429, 408, connection errors), as the
    /// HTTP client saw them: object_store retries each unless its request is spent.
    pub transient: Arc<AtomicU64>,
}

impl Shared {
    /// `in_flight`: requests at most in flight for readers, and for read-ahead each;
    /// `part`: the unit of fetching; `readahead_max`: the widest read-ahead window.
    pub fn new(
        display: String,
        store: Arc<dyn ObjectStore>,
        transient: Arc<AtomicU64>,
        in_flight: usize,
        part: u64,
        readahead_max: u64,
    ) -> Shared {
        let ready = (MEMORY / part) as usize;
        Shared {
            part,
            readahead_max,
            display,
            store,
            parts: Mutex::new(Parts {
                ready: lru::LruCache::new(NonZeroUsize::new(ready).unwrap()),
                loading: HashMap::new(),
            }),
            slots: [(); 2].map(|_| tokio::sync::Semaphore::new(in_flight)),
            stats: FetchStats::default(),
            disk: Arc::new(DiskGroup::default()),
            object_bytes: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            failing: AtomicBool::new(false),
            bad_reported: AtomicBool::new(false),
            transient,
        }
    }

    pub fn snapshot(&self) -> FetchSnapshot {
        let s = &self.stats;
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let d = &self.disk;
        FetchSnapshot {
            url: self.display.clone(),
            object_bytes: l(&self.object_bytes),
            objects: l(&self.next_id),
            requests: l(&s.requests),
            bytes_fetched: l(&s.bytes),
            failed_requests: l(&s.failed),
            // A request that failed for good ended with a failed attempt not retried.
            retries: l(&self.transient).saturating_sub(l(&s.failed)),
            part_hits: l(&s.part_hits),
            part_misses: l(&s.part_misses),
            readahead_bytes: l(&s.readahead_bytes),
            refetched_blocks: l(&s.refetched),
            latency_p50_us: s.percentile(0.5),
            latency_p90_us: s.percentile(0.9),
            latency_p99_us: s.percentile(0.99),
            fetch_cache_hit_bytes: l(&d.hit_bytes),
            fetch_cache_written_bytes: l(&d.written_bytes),
            fetch_cache_bad_parts: l(&d.bad_parts),
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let s = self.snapshot();
        tracing::debug!(
            "{}: {} objects, {} requests, {} bytes fetched ({} read ahead), {} failed, {} retries, parts {} hits {} misses, latency p50 {} us p99 {} us",
            s.url, s.objects, s.requests, s.bytes_fetched, s.readahead_bytes, s.failed_requests,
            s.retries, s.part_hits, s.part_misses, s.latency_p50_us, s.latency_p99_us
        );
    }
}

/// object_store's own HTTP client, counting the attempts that fail transiently: its
/// retries happen inside, and this is where they can be seen.
#[derive(Debug)]
pub(super) struct CountingConnector(pub Arc<AtomicU64>);

impl HttpConnector for CountingConnector {
    fn connect(&self, options: &object_store::ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(Counting {
            inner,
            transient: self.0.clone(),
        }))
    }
}

#[derive(Debug)]
struct Counting {
    inner: HttpClient,
    transient: Arc<AtomicU64>,
}

#[async_trait]
impl HttpService for Counting {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let r = self.inner.execute(req).await;
        let failed = match &r {
            Ok(resp) => {
                let s = resp.status().as_u16();
                s >= 500 || s == 429 || s == 408
            }
            Err(_) => true,
        };
        if failed {
            self.transient.fetch_add(1, Ordering::Relaxed);
        }
        r
    }
}

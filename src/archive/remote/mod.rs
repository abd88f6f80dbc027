//! An archive file in object storage: `s3://BUCKET/KEY`, `https://HOST/PATH` or
//! `http://…`, read by byte range through `object_store` (docs/REMOTE.md).
//!
//! The object is pinned at open: its size and ETag (or, without one, its modification
//! time) from a HEAD request, or, for the files of an npy-dir under a prefix
//! ([`prefix`]), from the listing. Every GET carries `If-Match` and its answer is checked
//! against the pin, so a replaced object fails reads (EIO and one log line) instead of
//! serving a mix of two archives; the block checksums above catch the rest.
//!
//! Bytes are fetched in aligned parts of [`PART`] bytes, adjacent missing parts of one
//! read coalesced into one request of at most [`MAX_REQUEST`]. Fetched parts stay in a
//! small LRU in memory ([`MEMORY`], one per archive: [`shared`]) with single-flight: a
//! part being fetched is waited for, never fetched twice. A reader that continues where one of the last few streams
//! of reads ended gets read-ahead, a window that doubles from [`READAHEAD_MIN`] to
//! [`READAHEAD_MAX`] each time the stream continues, fetched in the background.
//!
//! Below memory, the fetch cache on disk ([`disk`]) keeps every fetched part (when
//! the CLI configured one), so a part leaves object storage once per machine.
//!
//! `object_store` is async: one small tokio runtime of this module runs every request;
//! readers (FUSE threads, `export`'s workers) block on a condition variable until the
//! parts they need arrive. Requests time out and are retried with exponential backoff
//! and jitter by `object_store` itself ([`retry_config`]); when the attempts are spent
//! that read fails with EIO, and the next read tries again.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore};

use crate::archive::ArchiveError;

mod disk;
mod prefix;
mod shared;
mod stats;
mod upload;
use disk::DiskParts;
pub use disk::{configure as configure_fetch_cache, FetchCacheOptions};
pub use prefix::RemotePrefix;
use shared::{CountingConnector, PartKey, Shared};
pub use stats::FetchSnapshot;
pub use upload::upload;

/// The unit of fetching and of the in-memory part cache.
pub const PART: u64 = 256 << 10;
/// The same for the files of an npy-dir: opening one reads its header, and a part of
/// each of hundreds of files must still fit in [`MEMORY`].
pub const PART_DIR: u64 = 64 << 10;
/// The longest single GET: adjacent missing parts coalesce up to this.
pub const MAX_REQUEST: u64 = 8 << 20;
/// Fetched parts kept in memory (read-ahead lands here until it is read).
pub const MEMORY: u64 = 64 << 20;
/// The first read-ahead window of a stream, and the most it grows to.
pub const READAHEAD_MIN: u64 = 1 << 20;
pub const READAHEAD_MAX: u64 = 32 << 20;
/// The most for each file of an npy-dir: hundreds of files share [`MEMORY`], and the
/// daemon reading ahead in a view reads several of them at once.
pub const READAHEAD_MAX_DIR: u64 = 4 << 20;
/// Requests in flight per object at most, for reads waiting and for read-ahead each
/// (so a reader never queues behind read-ahead); more wait their turn before they
/// start, so a queue never counts against a request's timeout.
const IN_FLIGHT: usize = 4;
/// The same for the files of an npy-dir under a prefix: its requests are small (a row
/// block of one file, a header at open), so more of them keep a link busy.
const IN_FLIGHT_DIR: usize = 16;
/// Streams of sequential reads followed at once (FUSE threads and prefetch workers
/// each read their own run of the archive).
const STREAMS: usize = 8;
/// A reader never waits longer than this for a part (the requests' own timeouts and
/// retries end well before; this only guards against a lost wake-up).
const WAIT_LIMIT: Duration = Duration::from_secs(600);

/// Whether an archive argument names an object rather than a local path.
pub fn is_url(path: &Path) -> bool {
    path.to_str().is_some_and(|s| {
        ["s3://", "http://", "https://"]
            .iter()
            .any(|p| s.len() > p.len() && s[..p.len()].eq_ignore_ascii_case(p))
    })
}

/// The runtime every request runs on: two workers are plenty for I/O-bound tasks.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("cawsfs-fetch")
            .enable_all()
            .build()
            .expect("starting the fetch runtime")
    })
}

/// Timeouts and retries for every request (object_store backs off exponentially with
/// jitter on 5xx, throttling and connection errors).
fn retry_config() -> object_store::RetryConfig {
    object_store::RetryConfig {
        backoff: object_store::BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
        },
        max_retries: env_u64("CAWSFS_FETCH_RETRIES", 6) as usize,
        retry_timeout: Duration::from_secs(env_u64("CAWSFS_FETCH_RETRY_TIMEOUT_S", 60)),
    }
}

fn client_options() -> object_store::ClientOptions {
    object_store::ClientOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(env_u64("CAWSFS_FETCH_TIMEOUT_S", 30)))
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One line about `shown` (a URL without credentials) as an archive error.
fn invalid(shown: &str, reason: impl Into<String>) -> ArchiveError {
    ArchiveError::Invalid {
        path: shown.to_string(),
        reason: reason.into(),
    }
}

/// The URL an archive argument holds, and how it is shown.
fn parse(path: &Path) -> Result<(url::Url, String), ArchiveError> {
    let raw = path.to_str().unwrap_or_default();
    let url = url::Url::parse(raw).map_err(|e| invalid(raw, format!("not a URL: {e}")))?;
    let display = redact(&url);
    Ok((url, display))
}

/// `url` without credentials or query: what logs, errors and `stat` show.
fn redact(url: &url::Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.set_query(None);
    u.set_fragment(None);
    u.to_string()
}

/// One line of an object_store error (its sources joined, newlines folded).
fn one_line(e: &object_store::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(x) = src {
        let t = x.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = x.source();
    }
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A store for a URL's bucket or host, and its counter of transient failures.
type StoreFor = (Arc<dyn ObjectStore>, Arc<AtomicU64>);

/// The store and the object's path in it, from a URL.
fn store_for(url: &url::Url) -> Result<(StoreFor, object_store::path::Path), String> {
    let key = url.path().trim_start_matches('/');
    if key.is_empty() || key.ends_with('/') {
        return Err("names no object (a key is needed after the bucket or host)".into());
    }
    let location =
        object_store::path::Path::parse(key).map_err(|e| format!("bad object path: {e}"))?;
    Ok((client_for(url)?, location))
}

/// The store serving a URL's bucket (s3) or host (http, https).
fn client_for(url: &url::Url) -> Result<StoreFor, String> {
    let transient = Arc::new(AtomicU64::new(0));
    let counting = CountingConnector(transient.clone());
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        "s3" => {
            let bucket = url.host_str().ok_or("no bucket in the URL")?;
            // The standard environment (AWS_ACCESS_KEY_ID, AWS_REGION, AWS_ENDPOINT_URL,
            // AWS_PROFILE's files, instance and container credentials).
            let mut b = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry_config())
                .with_client_options(client_options())
                .with_http_connector(counting);
            for (k, v) in super::aws_profile::settings() {
                b = b.with_config(k, v);
            }
            if let Some(e) = endpoint() {
                // An endpoint given as http:// is meant to be used (a local server).
                b = b.with_allow_http(e.starts_with("http://")).with_endpoint(e);
            }
            Arc::new(b.build().map_err(|e| one_line(&e))?)
        }
        "http" | "https" => {
            let base = format!(
                "{}://{}",
                url.scheme(),
                &url[url::Position::BeforeHost..url::Position::AfterPort]
            );
            let b = object_store::http::HttpBuilder::new()
                .with_url(base)
                .with_retry(retry_config())
                .with_client_options(client_options().with_allow_http(true))
                .with_http_connector(counting);
            Arc::new(b.build().map_err(|e| one_line(&e))?)
        }
        s => return Err(format!("unsupported scheme {s}:// (s3, http, https)")),
    };
    Ok((store, transient))
}

/// `--endpoint` (set by the CLI in CAWSFS_S3_ENDPOINT) or the standard variables.
fn endpoint() -> Option<String> {
    [
        "CAWSFS_S3_ENDPOINT",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
}

/// HEAD `location`: the object's size and pin.
fn head(
    store: &Arc<dyn ObjectStore>,
    location: &object_store::path::Path,
) -> Result<ObjectMeta, String> {
    let opts = GetOptions {
        head: true,
        ..Default::default()
    };
    runtime()
        .block_on(async { store.get_opts(location, opts).await })
        .map(|r| r.meta)
        .map_err(|e| match e {
            object_store::Error::NotFound { .. } => "no such object".to_string(),
            e => one_line(&e),
        })
}

/// The result a waiting reader gets for one part.
type PartResult = Result<Bytes, Failure>;

#[derive(Clone, Debug)]
pub enum Failure {
    /// The object is no longer the one opened.
    Changed(String),
    /// The request failed (after its retries).
    Fetch(String),
}

/// One part being fetched: readers wait on it.
struct Pending {
    done: Mutex<Option<PartResult>>,
    cv: Condvar,
}

impl Pending {
    fn new() -> Arc<Pending> {
        Arc::new(Pending {
            done: Mutex::new(None),
            cv: Condvar::new(),
        })
    }

    fn finish(&self, r: PartResult) {
        *self.done.lock().unwrap() = Some(r);
        self.cv.notify_all();
    }

    fn wait(&self) -> PartResult {
        let deadline = Instant::now() + WAIT_LIMIT;
        let mut g = self.done.lock().unwrap();
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Failure::Fetch("timed out waiting for the fetch".into()));
            }
            g = self.cv.wait_timeout(g, left).unwrap().0;
        }
    }
}

/// A stream of sequential reads: where it ends, how far ahead it is fetched, its window.
#[derive(Clone, Copy)]
struct Stream {
    next: u64,
    fetched_to: u64,
    window: u64,
    used: u64,
}

struct Inner {
    /// What the archive's objects share (client, parts in memory, slots, counters).
    shared: Arc<Shared>,
    /// This object's number in the archive (its parts' keys in memory).
    id: u64,
    display: String,
    location: object_store::path::Path,
    len: u64,
    etag: Option<String>,
    version: Option<String>,
    /// The modification time at open (seconds, nanoseconds): the pin without an ETag.
    modified: (i64, u32),
    streams: Mutex<(Vec<Stream>, u64)>,
    disk: Option<DiskParts>,
    changed: AtomicBool,
}

/// An object opened for range reads (see the module's text); clones share it.
#[derive(Clone)]
pub struct RemoteObject {
    inner: Arc<Inner>,
}

impl RemoteObject {
    /// HEAD the object and pin it. `path` is the URL as the user gave it.
    pub fn open(path: &Path) -> Result<RemoteObject, ArchiveError> {
        let (url, display) = parse(path)?;
        let ((store, transient), location) = store_for(&url).map_err(|r| invalid(&display, r))?;
        let meta = head(&store, &location).map_err(|r| invalid(&display, r))?;
        let shared = Arc::new(Shared::new(
            display.clone(),
            store,
            transient,
            IN_FLIGHT,
            PART,
            READAHEAD_MAX,
        ));
        Ok(RemoteObject::pinned(&shared, display, meta))
    }

    /// The object `meta` describes (from a HEAD or a listing), pinned as it says, one
    /// of the objects that share `shared`.
    fn pinned(shared: &Arc<Shared>, display: String, meta: ObjectMeta) -> RemoteObject {
        let modified = (
            meta.last_modified.timestamp(),
            meta.last_modified.timestamp_subsec_nanos(),
        );
        // The pin names the fetch cache's entry: a changed object is another entry.
        let identity = format!(
            "{display}\n{:?}\n{:?}\n{modified:?}\n{}\n{}",
            meta.e_tag, meta.version, meta.size, shared.part
        );
        let disk = DiskParts::open(&identity, meta.size, &shared.disk);
        shared.object_bytes.fetch_add(meta.size, Ordering::Relaxed);
        RemoteObject {
            inner: Arc::new(Inner {
                id: shared.next_id.fetch_add(1, Ordering::Relaxed),
                shared: shared.clone(),
                display,
                location: meta.location,
                len: meta.size,
                modified,
                etag: meta.e_tag,
                version: meta.version,
                streams: Mutex::new((Vec::new(), 0)),
                disk,
                changed: AtomicBool::new(false),
            }),
        }
    }

    /// The object's size when it was opened.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The URL without credentials.
    pub fn display(&self) -> &str {
        &self.inner.display
    }

    /// The counters of the archive this object belongs to (all its objects).
    pub fn snapshot(&self) -> FetchSnapshot {
        self.inner.shared.snapshot()
    }

    /// [`RemoteObject::read_into`] of a few bytes read once (a header at open): unless
    /// their part is at hand, one GET of just those bytes, kept nowhere. Opening an
    /// npy-dir reads a header from each of hundreds of files; whole parts of them
    /// would push out of memory the parts reads are about to use.
    pub fn read_once(&self, offset: u64, buf: &mut [u8]) -> Result<(), Failure> {
        let inner = &self.inner;
        let ps = inner.shared.part;
        let end = offset + buf.len() as u64;
        let at_hand = buf.is_empty() || end > inner.len || {
            let part = offset / ps;
            (end - 1) / ps == part
                && (inner
                    .shared
                    .parts
                    .lock()
                    .unwrap()
                    .ready
                    .contains(&(inner.id, part))
                    || inner.disk.as_ref().is_some_and(|d| d.has(part)))
        };
        if at_hand {
            return self.read_into(offset, buf);
        }
        let shared = &inner.shared;
        let got = runtime().block_on(async {
            let _slot = shared.slots[0].acquire().await;
            let t0 = Instant::now();
            let got = inner.get(offset, end).await;
            shared.stats.record(end - offset, t0.elapsed(), got.is_ok());
            got
        })?;
        buf.copy_from_slice(&got);
        Ok(())
    }

    /// Fill `buf` with the object's bytes at `offset` (the caller checked the range
    /// lies inside the object).
    pub fn read_into(&self, offset: u64, buf: &mut [u8]) -> Result<(), Failure> {
        if buf.is_empty() {
            return Ok(());
        }
        let inner = &self.inner;
        let shared = &inner.shared;
        let id = inner.id;
        let end = offset + buf.len() as u64;
        if end > inner.len {
            return Err(Failure::Fetch(format!(
                "{} bytes at {offset} run past the object's end ({} bytes)",
                buf.len(),
                inner.len
            )));
        }
        let part_size = shared.part;
        let (first, last) = (offset / part_size, (end - 1) / part_size);
        let mut have: Vec<(u64, Bytes)> = Vec::new();
        let mut waits: Vec<(u64, Arc<Pending>)> = Vec::new();
        let mut claimed: Vec<u64> = Vec::new();
        let on_disk = |part| inner.disk.as_ref().is_some_and(|d| d.has(part));
        let mut from_disk: Vec<u64> = Vec::new();
        let claim = |p: &mut shared::Parts, part, waits: &mut Vec<_>, claimed: &mut Vec<u64>| {
            let w = Pending::new();
            p.loading.insert((id, part), w.clone());
            waits.push((part, w));
            claimed.push(part);
        };
        {
            let mut p = shared.parts.lock().unwrap();
            for part in first..=last {
                if let Some(b) = p.ready.get(&(id, part)) {
                    have.push((part, b.clone()));
                } else if let Some(w) = p.loading.get(&(id, part)) {
                    waits.push((part, w.clone()));
                } else if on_disk(part) {
                    from_disk.push(part);
                } else {
                    claim(&mut p, part, &mut waits, &mut claimed);
                }
            }
        }
        // Found in memory (parts read from disk are counted as the disk's hit bytes).
        let memory_hits = have.len() as u64;
        // Parts on disk are read here, without the lock; one that fails its check is
        // fetched like any missing part.
        let mut bad = Vec::new();
        for part in from_disk {
            let d = inner.disk.as_ref().expect("parts on disk have a disk");
            match d.read(part, part * part_size, inner.part_len(part)) {
                Some(b) => {
                    let b = Bytes::from(b);
                    shared
                        .parts
                        .lock()
                        .unwrap()
                        .ready
                        .put((id, part), b.clone());
                    have.push((part, b));
                }
                None => bad.push(part),
            }
        }
        if !bad.is_empty() {
            let mut p = shared.parts.lock().unwrap();
            for part in bad {
                match p.loading.get(&(id, part)) {
                    Some(w) => waits.push((part, w.clone())),
                    None => claim(&mut p, part, &mut waits, &mut claimed),
                }
            }
            claimed.sort_unstable();
        }
        let s = &shared.stats;
        s.part_hits.fetch_add(memory_hits, Ordering::Relaxed);
        s.part_misses
            .fetch_add(waits.len() as u64, Ordering::Relaxed);
        spawn_runs(inner, &claimed, false);
        Inner::follow(inner, first, last);
        for (part, w) in waits {
            have.push((part, w.wait()?));
        }
        for (part, bytes) in have {
            let p0 = part * part_size;
            let from = offset.max(p0);
            let to = end.min(p0 + bytes.len() as u64);
            buf[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&bytes[(from - p0) as usize..(to - p0) as usize]);
        }
        Ok(())
    }
}

impl RemoteObject {
    /// Drop the parts behind `offset..offset + len` from memory and the fetch cache,
    /// so the next read fetches them again: their bytes failed a block's checksum.
    pub fn forget(&self, offset: u64, len: u64) {
        let inner = &self.inner;
        inner.shared.stats.refetched.fetch_add(1, Ordering::Relaxed);
        if !inner.shared.bad_reported.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{}: {len} bytes at {offset} failed their block's checksum as fetched; fetching them again",
                inner.display
            );
        }
        let ps = inner.shared.part;
        let (first, last) = (offset / ps, (offset + len.max(1) - 1) / ps);
        let mut p = inner.shared.parts.lock().unwrap();
        for part in first..=last {
            p.ready.pop(&(inner.id, part));
            if let Some(d) = &inner.disk {
                d.forget(part);
            }
        }
    }
}

/// Fetch `parts` (claimed, sorted) as runs of adjacent parts, each run one request.
fn spawn_runs(inner: &Arc<Inner>, parts: &[u64], ahead: bool) {
    let per = (MAX_REQUEST / inner.shared.part).max(1);
    let mut i = 0;
    while i < parts.len() {
        let mut j = i + 1;
        while j < parts.len() && parts[j] == parts[j - 1] + 1 && ((j - i) as u64) < per {
            j += 1;
        }
        let (first, n) = (parts[i], (j - i) as u64);
        let inner = inner.clone();
        runtime().spawn(async move { inner.fetch_run(first, n, ahead).await });
        i = j;
    }
}

impl Inner {
    /// Read-ahead: a read that continues one of the recent streams extends it, and the
    /// parts past what that stream has fetched are claimed and fetched in the background.
    fn follow(this: &Arc<Inner>, first: u64, last: u64) {
        let ps = this.shared.part;
        let nparts = this.len.div_ceil(ps);
        let (from, to) = {
            let mut g = this.streams.lock().unwrap();
            let (streams, clock) = &mut *g;
            *clock += 1;
            let now = *clock;
            // A stream continues when the read starts in or right after its last part.
            let hit = streams
                .iter_mut()
                .find(|s| first + 1 >= s.next && first <= s.next);
            let s = match hit {
                Some(s) => {
                    s.window = (s.window * 2).min(this.shared.readahead_max);
                    s
                }
                None => {
                    if streams.len() >= STREAMS {
                        let old = (0..streams.len()).min_by_key(|&i| streams[i].used).unwrap();
                        streams.swap_remove(old);
                    }
                    // A new stream gets no read-ahead until its second read.
                    streams.push(Stream {
                        next: last + 1,
                        fetched_to: last + 1,
                        window: READAHEAD_MIN / 2,
                        used: now,
                    });
                    return;
                }
            };
            s.used = now;
            s.next = last + 1;
            let want = (last + 1 + s.window / ps).min(nparts);
            let from = s.fetched_to.max(last + 1);
            if want <= from {
                return;
            }
            s.fetched_to = want;
            (from, want)
        };
        let mut claimed = Vec::new();
        {
            let mut p = this.shared.parts.lock().unwrap();
            for part in from..to {
                let key: PartKey = (this.id, part);
                let on_disk = this.disk.as_ref().is_some_and(|d| d.has(part));
                if !on_disk && !p.ready.contains(&key) && !p.loading.contains_key(&key) {
                    p.loading.insert(key, Pending::new());
                    claimed.push(part);
                }
            }
        }
        spawn_runs(this, &claimed, true);
    }

    /// One GET of `n` parts from `first`; every claimed part is finished either way.
    async fn fetch_run(self: Arc<Self>, first: u64, n: u64, ahead: bool) {
        let ps = self.shared.part;
        let start = first * ps;
        let end = ((first + n) * ps).min(self.len);
        let shared = &self.shared;
        let slot = shared.slots[ahead as usize].acquire().await;
        let t0 = Instant::now();
        let got = self.get(start, end).await;
        drop(slot);
        shared.stats.record(end - start, t0.elapsed(), got.is_ok());
        if got.is_ok() && ahead {
            shared
                .stats
                .readahead_bytes
                .fetch_add(end - start, Ordering::Relaxed);
        }
        match &got {
            Ok(_) => {
                if shared.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("{}: requests succeed again", shared.display);
                }
            }
            Err(Failure::Changed(m)) => {
                if !self.changed.swap(true, Ordering::Relaxed) {
                    tracing::error!("{}: {m}", self.display);
                }
            }
            Err(Failure::Fetch(m)) => {
                if !shared.failing.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        "{}: {m} (reads that need it fail until a request succeeds)",
                        self.display
                    );
                }
            }
        }
        if let (Ok(b), Some(d)) = (&got, &self.disk) {
            for part in first..first + n {
                let a = ((part - first) * ps) as usize;
                let e = (a + ps as usize).min(b.len());
                d.write(part, part * ps, &b[a..e]);
            }
        }
        let mut p = shared.parts.lock().unwrap();
        for part in first..first + n {
            let Some(w) = p.loading.remove(&(self.id, part)) else {
                continue;
            };
            let r = got.as_ref().map(|b| {
                let a = (part * ps - start) as usize;
                b.slice(a..(a + ps as usize).min(b.len()))
            });
            match r {
                Ok(b) => {
                    p.ready.put((self.id, part), b.clone());
                    w.finish(Ok(b));
                }
                Err(e) => w.finish(Err(e.clone())),
            }
        }
    }

    /// The length of part `part` (the last one may be short).
    fn part_len(&self, part: u64) -> usize {
        let ps = self.shared.part;
        (self.len - part * ps).min(ps) as usize
    }

    /// The bytes `start..end`, checked to come from the pinned object.
    async fn get(&self, start: u64, end: u64) -> Result<Bytes, Failure> {
        if self.changed.load(Ordering::Relaxed) {
            return Err(Failure::Changed(self.changed_msg("")));
        }
        let opts = GetOptions {
            range: Some(GetRange::Bounded(start..end)),
            if_match: self.etag.clone(),
            version: self.version.clone(),
            ..Default::default()
        };
        let r = match self.shared.store.get_opts(&self.location, opts).await {
            Ok(r) => r,
            Err(e @ object_store::Error::Precondition { .. }) => {
                return Err(Failure::Changed(self.changed_msg(&one_line(&e))))
            }
            Err(object_store::Error::NotFound { .. }) => {
                return Err(Failure::Changed(self.changed_msg("it is gone")))
            }
            Err(e) => return Err(Failure::Fetch(one_line(&e))),
        };
        let m = &r.meta;
        // Whole seconds: an HTTP date has no more, a listing's time may (milliseconds).
        let stamp = m.last_modified.timestamp();
        if m.size != self.len {
            let why = format!("its size went from {} to {} bytes", self.len, m.size);
            return Err(Failure::Changed(self.changed_msg(&why)));
        }
        match (&self.etag, &m.e_tag) {
            (Some(a), Some(b)) if a != b => {
                let why = format!("its ETag went from {a} to {b}");
                return Err(Failure::Changed(self.changed_msg(&why)));
            }
            (None, _) if stamp != self.modified.0 => {
                return Err(Failure::Changed(
                    self.changed_msg("its modification time moved"),
                ));
            }
            _ => {}
        }
        let bytes = r.bytes().await.map_err(|e| Failure::Fetch(one_line(&e)))?;
        if bytes.len() as u64 != end - start {
            return Err(Failure::Fetch(format!(
                "asked for {} bytes at {start}, got {}",
                end - start,
                bytes.len()
            )));
        }
        Ok(bytes)
    }

    fn changed_msg(&self, why: &str) -> String {
        let why = if why.is_empty() {
            String::new()
        } else {
            format!(" ({why})")
        };
        format!(
            "changed since it was opened{why}; reads that need it fail until it is opened again"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_told_from_paths() {
        for u in ["s3://b/k", "https://h/x.cawsf", "HTTP://h/x"] {
            assert!(is_url(Path::new(u)), "{u}");
        }
        for p in ["model.cawsf", "./s3://b", "/tmp/https:/x", "s3://"] {
            assert!(!is_url(Path::new(p)), "{p}");
        }
    }

    #[test]
    fn credentials_never_show() {
        let u = url::Url::parse("https://user:secret@h:8080/a/b.cawsf?X-Amz-Signature=s").unwrap();
        let d = redact(&u);
        assert_eq!(d, "https://h:8080/a/b.cawsf");
    }

    #[test]
    fn bad_urls_get_one_line() {
        for (u, want) in [
            ("s3://bucket/", "names no object"),
            ("https://h/", "names no object"),
        ] {
            let e = RemoteObject::open(Path::new(u)).err().unwrap().to_string();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains('\n'));
        }
    }
}

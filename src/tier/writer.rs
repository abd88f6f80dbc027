//! The background writer: copies of freshly reconstructed extents go into a bounded
//! queue and one thread writes them to their entries, publishing each entry's index
//! now and then, when the queue runs dry, and at [`Writer::flush`]. A full queue drops
//! the copy: the tier must never delay a read. Dropped extents are remembered
//! ([`Writer::take_dropped_when_idle`]) so the mount can make them again once the queue
//! is empty, and a file read whole becomes whole in the tier.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::Entry;

/// How long an entry's written extents may wait for their index.
const PUBLISH_EVERY: Duration = Duration::from_secs(2);

/// Dropped extents remembered for a later refill at most (16 bytes and a pointer each);
/// past it, `materialize` still fills what is missing.
const DROPPED_KEPT: usize = 1 << 16;

struct Job {
    entry: Arc<Entry>,
    extent: u64,
    bytes: PageBuf,
}

/// A copy's buffer: an anonymous mapping, so page-aligned, which lets the entry write
/// it with `O_DIRECT`.
struct PageBuf {
    map: memmap2::MmapMut,
    len: usize,
}

impl PageBuf {
    /// A buffer holding a copy of `bytes`, reusing `spare` when it is large enough.
    fn copy_of(bytes: &[u8], spare: Option<PageBuf>) -> std::io::Result<PageBuf> {
        let mut buf = match spare {
            Some(b) if b.map.len() >= bytes.len() => b,
            _ => PageBuf {
                map: memmap2::MmapMut::map_anon(
                    bytes.len().next_multiple_of(super::DIRECT_ALIGN).max(1),
                )?,
                len: 0,
            },
        };
        buf.map[..bytes.len()].copy_from_slice(bytes);
        buf.len = bytes.len();
        Ok(buf)
    }

    fn bytes(&self) -> &[u8] {
        &self.map[..self.len]
    }

    fn capacity(&self) -> u64 {
        self.map.len() as u64
    }
}

#[derive(Default)]
struct Queue {
    jobs: std::collections::VecDeque<Job>,
    bytes: u64,
    /// Buffers of written jobs, for the next copies (fresh ones cost page faults on
    /// every extent); with the queued ones they hold at most `max_bytes`.
    spare: Vec<PageBuf>,
    spare_bytes: u64,
    /// Extents whose copy a full queue dropped, to be made again when it is idle.
    dropped: Vec<(Arc<Entry>, u64)>,
    closed: bool,
    /// Bumped by `flush` callers; the thread publishes everything and echoes it.
    flush_asked: u64,
    flush_done: u64,
}

/// What the writer did since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriterStats {
    pub written_bytes: u64,
    pub written_extents: u64,
    /// Copies not queued because the queue was full.
    pub dropped_extents: u64,
    /// Copies not queued because the tier's size bound was reached.
    pub over_bound_extents: u64,
    pub errors: u64,
}

#[derive(Default)]
struct Counters {
    written_bytes: AtomicU64,
    written_extents: AtomicU64,
    dropped_extents: AtomicU64,
    over_bound_extents: AtomicU64,
    errors: AtomicU64,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    done: Condvar,
    /// Signalled when a job leaves the queue (room for `offer_wait`).
    taken: Condvar,
    max_bytes: u64,
    /// Disk bytes new extents may still take (the size bound less what is there).
    room: AtomicU64,
    counters: Counters,
}

pub struct Writer {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// A writer whose queue holds at most `max_queued_bytes` of copies and which writes
    /// at most `room` bytes of new extents.
    pub fn start(max_queued_bytes: u64, room: u64) -> std::io::Result<Writer> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            done: Condvar::new(),
            taken: Condvar::new(),
            max_bytes: max_queued_bytes,
            room: AtomicU64::new(room),
            counters: Counters::default(),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("cawsfs-tier".into())
            .spawn(move || run(&s))?;
        Ok(Writer {
            shared,
            thread: Some(thread),
        })
    }

    /// Queue a copy of extent `extent`'s bytes for `entry`; false when there is no room.
    pub fn offer(&self, entry: &Arc<Entry>, extent: u64, bytes: &[u8]) -> bool {
        self.enqueue(entry, extent, bytes, false)
    }

    /// Like [`Writer::offer`], but waits for room in the queue rather than dropping the
    /// copy (for `materialize`, which fills the tier on purpose and may wait); false
    /// when the size bound has no room or the writer is closing.
    pub fn offer_wait(&self, entry: &Arc<Entry>, extent: u64, bytes: &[u8]) -> bool {
        self.enqueue(entry, extent, bytes, true)
    }

    fn enqueue(&self, entry: &Arc<Entry>, extent: u64, bytes: &[u8], wait: bool) -> bool {
        let len = bytes.len() as u64;
        let charge = super::disk_charge(len);
        let reserved = self
            .shared
            .room
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
                r.checked_sub(charge)
            });
        if reserved.is_err() {
            self.shared
                .counters
                .over_bound_extents
                .fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let mut q = self.shared.queue.lock().unwrap();
        let full = |q: &Queue| q.bytes + len > self.shared.max_bytes;
        // Waiting, an extent larger than the whole queue goes in alone.
        while wait && !q.closed && q.bytes > 0 && full(&q) {
            q = self.shared.taken.wait(q).unwrap();
        }
        if q.closed || (!wait && full(&q)) {
            self.shared.room.fetch_add(charge, Ordering::Relaxed);
            if !wait {
                self.shared
                    .counters
                    .dropped_extents
                    .fetch_add(1, Ordering::Relaxed);
                if !q.closed && q.dropped.len() < DROPPED_KEPT {
                    q.dropped.push((entry.clone(), extent));
                }
            }
            return false;
        }
        let spare = q.spare.pop();
        if let Some(b) = &spare {
            q.spare_bytes -= b.capacity();
        }
        let copy = match PageBuf::copy_of(bytes, spare) {
            Ok(c) => c,
            Err(e) => {
                drop(q);
                self.shared.room.fetch_add(charge, Ordering::Relaxed);
                tracing::debug!("disk tier: no buffer for a copy ({e}); dropped");
                self.shared
                    .counters
                    .dropped_extents
                    .fetch_add(1, Ordering::Relaxed);
                return false;
            }
        };
        q.bytes += len;
        q.jobs.push_back(Job {
            entry: entry.clone(),
            extent,
            bytes: copy,
        });
        self.shared.wake.notify_one();
        true
    }

    /// The extents whose copies a full queue dropped since the last call, once the
    /// queue is empty (none while it is not: making them again then would only compete
    /// with fresh copies).
    pub fn take_dropped_when_idle(&self) -> Vec<(Arc<Entry>, u64)> {
        let mut q = self.shared.queue.lock().unwrap();
        if q.jobs.is_empty() {
            std::mem::take(&mut q.dropped)
        } else {
            Vec::new()
        }
    }

    /// Disk bytes new extents may still take under the size bound.
    pub fn room(&self) -> u64 {
        self.shared.room.load(Ordering::Relaxed)
    }

    /// Wait until everything queued so far is written and every entry published.
    pub fn flush(&self) {
        let mut q = self.shared.queue.lock().unwrap();
        q.flush_asked += 1;
        let want = q.flush_asked;
        self.shared.wake.notify_one();
        while q.flush_done < want && !q.closed {
            q = self.shared.done.wait(q).unwrap();
        }
    }

    pub fn stats(&self) -> WriterStats {
        let c = &self.shared.counters;
        WriterStats {
            written_bytes: c.written_bytes.load(Ordering::Relaxed),
            written_extents: c.written_extents.load(Ordering::Relaxed),
            dropped_extents: c.dropped_extents.load(Ordering::Relaxed),
            over_bound_extents: c.over_bound_extents.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Writer {
    /// Writes what is queued and publishes, then stops the thread.
    fn drop(&mut self) {
        self.flush();
        self.shared.queue.lock().unwrap().closed = true;
        self.shared.wake.notify_all();
        self.shared.taken.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Keep a written job's buffer for the next copy while queued and spare bytes stay
/// within the queue's bound.
fn keep_spare(s: &Shared, buf: PageBuf) {
    let mut q = s.queue.lock().unwrap();
    let cap = buf.capacity();
    if q.bytes + q.spare_bytes + cap <= s.max_bytes {
        q.spare_bytes += cap;
        q.spare.push(buf);
    }
}

fn run(s: &Shared) {
    // Entries written to since their last publish.
    let mut dirty: Vec<Arc<Entry>> = Vec::new();
    let mut last_publish = Instant::now();
    loop {
        let (job, flush): (Option<Job>, Option<u64>) = {
            let mut q = s.queue.lock().unwrap();
            loop {
                if let Some(job) = q.jobs.pop_front() {
                    q.bytes -= job.bytes.len as u64;
                    s.taken.notify_all();
                    break (Some(job), None);
                }
                if q.flush_asked > q.flush_done {
                    break (None, Some(q.flush_asked));
                }
                if q.closed {
                    return;
                }
                if !dirty.is_empty() {
                    // Idle with unpublished extents: publish soon rather than never.
                    let (g, t) = s.wake.wait_timeout(q, PUBLISH_EVERY / 4).unwrap();
                    q = g;
                    if t.timed_out() && q.jobs.is_empty() {
                        break (None, None);
                    }
                } else {
                    q = s.wake.wait(q).unwrap();
                }
            }
        };
        let wrote = job.is_some();
        if let Some(job) = job {
            let result = job.entry.write(job.extent, job.bytes.bytes());
            let len = job.bytes.len as u64;
            keep_spare(s, job.bytes);
            match result {
                Ok(()) => {
                    s.counters.written_bytes.fetch_add(len, Ordering::Relaxed);
                    s.counters.written_extents.fetch_add(1, Ordering::Relaxed);
                    if !dirty.iter().any(|e| Arc::ptr_eq(e, &job.entry)) {
                        dirty.push(job.entry.clone());
                    }
                }
                Err(e) => {
                    if s.counters.errors.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!("disk tier: {e} (further write errors are only counted)");
                    }
                }
            }
        }
        // Publishing syncs the data file: every PUBLISH_EVERY while writing, after a
        // quiet spell, and on flush; not after every extent.
        let quiet = !wrote && flush.is_none() && !dirty.is_empty();
        if flush.is_some() || quiet || last_publish.elapsed() >= PUBLISH_EVERY {
            for e in dirty.drain(..) {
                if let Err(err) = e.publish() {
                    if s.counters.errors.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!("disk tier: {err} (further write errors are only counted)");
                    }
                }
            }
            last_publish = Instant::now();
        }
        if let Some(n) = flush {
            let mut q = s.queue.lock().unwrap();
            q.flush_done = q.flush_done.max(n);
            s.done.notify_all();
        }
    }
}

//! The background writer: freshly reconstructed extents (shared, not copied) go into
//! a bounded queue and one thread writes them to their entries, consecutive ones in
//! one request of up to 64 MiB, publishing each entry's index now and then, when the
//! queue runs dry, and at [`Writer::flush`]. A full queue drops
//! the extent: the tier must never delay a read. Dropped extents are remembered
//! ([`Writer::take_dropped_when_idle`]) so the mount can make them again once the queue
//! is empty, and a file read whole becomes whole in the tier.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::Entry;

/// How long an entry's written extents may wait for their index while the writer is
/// busy. Each publish syncs the data file: syncs every 2 s during a first pass stalled
/// the writer (0.2–0.3 s each here, dropping copies) and left the file slower to read
/// cold (docs/TIER.md); a crash loses at most this much written work, never serves it.
const PUBLISH_EVERY: Duration = Duration::from_secs(30);

/// How long the writer must have been idle before it publishes what it wrote.
const QUIET: Duration = Duration::from_millis(500);
/// How long after a failed publish (a full disk, say) the writer tries again.
const RETRY: Duration = Duration::from_secs(2);
/// How long after a write failed for want of space its extents are made again: each
/// try reconstructs them, so not often while the disk stays full.
const RETRY_WRITES: Duration = Duration::from_secs(30);

/// Bytes of consecutive extents written in one request at most. Large: a file written
/// with `O_DIRECT` in 64 MiB requests read back cold 1.07× the time of one written
/// through the page cache on the bench VM, in 4 MiB requests 1.14×
/// (`scripts/compare-write-ways.py`, docs/TIER.md "Writing").
const RUN_BYTES: u64 = 64 << 20;

/// How long a started run waits for its next extent before it is written.
const RUN_WAIT: Duration = Duration::from_millis(20);

/// Dropped extents remembered for a later refill at most (16 bytes and a pointer each);
/// past it, `materialize` still fills what is missing.
const DROPPED_KEPT: usize = 1 << 16;

struct Job {
    entry: Arc<Entry>,
    extent: u64,
    bytes: ExtentBytes,
    /// The extent's checksum, taken by whoever offered it.
    sum: u64,
}

/// An extent's bytes as the writer holds them until written: shared, not copied (the
/// mount hands over its chunk cache's chunks, which are page-aligned, so they are
/// written with `O_DIRECT` as they are).
pub type ExtentBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

impl Job {
    fn bytes(&self) -> &[u8] {
        (*self.bytes).as_ref()
    }
}

#[derive(Default)]
struct Queue {
    jobs: std::collections::VecDeque<Job>,
    /// Bytes of the queued jobs and of the offers being checksummed.
    bytes: u64,
    /// Extents a full queue dropped, to be made again when it is idle.
    dropped: Vec<(Arc<Entry>, u64)>,
    /// Extents whose write failed for want of space, and when the last one failed:
    /// made again with the dropped ones once [`RETRY_WRITES`] has passed.
    no_space: Vec<(Arc<Entry>, u64)>,
    no_space_at: Option<Instant>,
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
    /// A writer whose queue holds at most `max_queued_bytes` of extents and which writes
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

    /// Queue extent `extent`'s bytes for `entry`; false when there is no room.
    pub fn offer(&self, entry: &Arc<Entry>, extent: u64, bytes: ExtentBytes) -> bool {
        self.enqueue(entry, extent, bytes, false)
    }

    /// Like [`Writer::offer`], but waits for room in the queue rather than dropping the
    /// extent (for `materialize`, which fills the tier on purpose and may wait); false
    /// when the size bound has no room or the writer is closing.
    pub fn offer_wait(&self, entry: &Arc<Entry>, extent: u64, bytes: ExtentBytes) -> bool {
        self.enqueue(entry, extent, bytes, true)
    }

    fn enqueue(&self, entry: &Arc<Entry>, extent: u64, bytes: ExtentBytes, wait: bool) -> bool {
        let len = (*bytes).as_ref().len() as u64;
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
        {
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
            // Its room in the queue is taken now, so that a full queue costs no hash.
            q.bytes += len;
        }
        // The checksum outside the lock, on the offering thread: a freshly loaded chunk
        // is still in its caches there, where the writer would read it from memory.
        let sum = super::extent_sum((*bytes).as_ref());
        let mut q = self.shared.queue.lock().unwrap();
        if q.closed {
            q.bytes -= len;
            drop(q);
            self.shared.room.fetch_add(charge, Ordering::Relaxed);
            self.shared.taken.notify_all();
            return false;
        }
        q.jobs.push_back(Job {
            entry: entry.clone(),
            extent,
            bytes,
            sum,
        });
        self.shared.wake.notify_one();
        true
    }

    /// The extents a full queue dropped since the last call, once the
    /// queue is empty (none while it is not: making them again then would only compete
    /// with fresh extents).
    pub fn take_dropped_when_idle(&self) -> Vec<(Arc<Entry>, u64)> {
        let mut q = self.shared.queue.lock().unwrap();
        if !q.jobs.is_empty() {
            return Vec::new();
        }
        let mut out = std::mem::take(&mut q.dropped);
        if q.no_space_at.is_some_and(|t| t.elapsed() >= RETRY_WRITES) || space_back(&q.no_space) {
            out.append(&mut q.no_space);
            q.no_space_at = None;
        }
        out
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

/// What the writer thread does next.
enum Step {
    /// Add this job to the run (it continues it, or the run is empty).
    Take(Job),
    /// Write the run: the next job does not continue it, or none came for a while.
    WriteRun,
    /// Write the run, publish every entry, then answer flush number `n`.
    Flush(u64),
    /// Idle with unpublished extents for a while: publish them.
    Quiet,
    /// Idle with entries made whole waiting for their files to settle: stamp them.
    Stamp,
    Close,
}

/// Consecutive extents of one entry held back to be written in one go, up to
/// `run_bytes`, and where the last one ended. Loads finish out of order; extents
/// written out of order, even in a file the file system lays out contiguously, were
/// slower to read cold on the VM the benchmarks ran on, like small requests, so the
/// writer keeps to ascending order where waiting a little allows it (docs/TIER.md).
struct Run {
    jobs: Vec<Job>,
    bytes: u64,
    /// The last extent taken (held or written) and when.
    tail: Option<(Arc<Entry>, u64)>,
    since: Instant,
}

impl Run {
    /// Whether `job` is the extent after the tail; an unaligned one (a file's short
    /// last extent) is written on its own, since it makes its whole run buffered.
    fn continued_by(&self, job: &Job) -> bool {
        job.bytes().len() % super::DIRECT_ALIGN == 0
            && self.tail.as_ref().is_some_and(|(e, i)| {
                Arc::ptr_eq(e, &job.entry) && i.checked_add(1) == Some(job.extent)
            })
    }
}

/// Whether the file system of the extents that failed for want of space now has room
/// for them all (then they are made again at once, not after [`RETRY_WRITES`]).
fn space_back(failed: &[(Arc<Entry>, u64)]) -> bool {
    let Some((e, _)) = failed.first() else {
        return false;
    };
    let need: u64 = failed
        .iter()
        .map(|(e, x)| super::disk_charge(e.extent_len(*x).unwrap_or(0) as u64))
        .sum();
    nix::sys::statvfs::fstatvfs(e.data_file())
        .is_ok_and(|v| v.blocks_available().saturating_mul(v.fragment_size()) > need)
}

fn run(s: &Shared) {
    // A run is at most a quarter of the queue: its bytes count against the queue's
    // bound until written, and fresh extents must still find room.
    let run_bytes = (s.max_bytes / 4).clamp(1, RUN_BYTES);
    // Where runs end early: `run_bytes` rounded down to a power of two.
    let run_align = 1u64 << run_bytes.ilog2();
    let mut held = Run {
        jobs: Vec::new(),
        bytes: 0,
        tail: None,
        since: Instant::now(),
    };
    // Entries written to since their last publish.
    let mut dirty: Vec<Arc<Entry>> = Vec::new();
    // Entries a publish made whole from bytes written here, whose stamp
    // (`Entry::stamp_vouched`) waits for their files to settle.
    let mut to_stamp: Vec<Arc<Entry>> = Vec::new();
    let mut last_publish = Instant::now();
    // When a publish last failed: its entries stay dirty and are tried again.
    let mut failed_at: Option<Instant> = None;
    loop {
        let step = {
            let mut q = s.queue.lock().unwrap();
            loop {
                if let Some(at) = q.jobs.iter().position(|j| held.continued_by(j)) {
                    break Step::Take(q.jobs.remove(at).expect("position is in range"));
                }
                // The next extent may still be being made: wait for it a little,
                // unless the queue fills or someone waits for the writer.
                let left = RUN_WAIT.saturating_sub(held.since.elapsed());
                let hurry = left.is_zero()
                    || q.closed
                    || q.flush_asked > q.flush_done
                    || q.bytes > s.max_bytes / 2;
                if !held.jobs.is_empty() {
                    if hurry {
                        break Step::WriteRun;
                    }
                    q = s.wake.wait_timeout(q, left).unwrap().0;
                    continue;
                }
                if !q.jobs.is_empty() {
                    if !hurry && held.tail.is_some() {
                        q = s.wake.wait_timeout(q, left).unwrap().0;
                        continue;
                    }
                    // A new run starts at the lowest extent queued for the first
                    // queued entry.
                    let first = q.jobs[0].entry.clone();
                    let at = (0..q.jobs.len())
                        .filter(|&i| Arc::ptr_eq(&q.jobs[i].entry, &first))
                        .min_by_key(|&i| q.jobs[i].extent)
                        .expect("the first job qualifies");
                    break Step::Take(q.jobs.remove(at).expect("position is in range"));
                }
                if q.flush_asked > q.flush_done {
                    break Step::Flush(q.flush_asked);
                }
                if q.closed {
                    break Step::Close;
                }
                if !dirty.is_empty() {
                    // Idle with unpublished extents: publish soon rather than never.
                    let wait = match failed_at {
                        Some(t) if t.elapsed() < RETRY => RETRY - t.elapsed(),
                        _ => QUIET,
                    };
                    let (g, t) = s.wake.wait_timeout(q, wait).unwrap();
                    q = g;
                    if t.timed_out() && q.jobs.is_empty() {
                        break Step::Quiet;
                    }
                } else if !to_stamp.is_empty() {
                    let (g, t) = s.wake.wait_timeout(q, super::stamp::SETTLED).unwrap();
                    q = g;
                    if t.timed_out() && q.jobs.is_empty() {
                        break Step::Stamp;
                    }
                } else {
                    q = s.wake.wait(q).unwrap();
                }
            }
        };
        let (flush, close) = match step {
            Step::Flush(n) => (Some(n), false),
            Step::Close => (None, true),
            _ => (None, false),
        };
        let publish_now = match step {
            Step::Take(job) => {
                held.bytes += job.bytes().len() as u64;
                // Runs also end at multiples of `run_align` in the file, so that a
                // pass's runs are whole, aligned requests rather than shifted ones.
                let ends_aligned = (job.extent + 1)
                    .checked_mul(job.entry.spec.extent)
                    .is_some_and(|end| end % run_align == 0);
                held.tail = Some((job.entry.clone(), job.extent));
                held.jobs.push(job);
                held.since = Instant::now();
                if held.bytes >= run_bytes || ends_aligned {
                    write_run(s, &mut held, &mut dirty);
                }
                false
            }
            Step::WriteRun => {
                write_run(s, &mut held, &mut dirty);
                false
            }
            Step::Flush(_) | Step::Close => {
                write_run(s, &mut held, &mut dirty);
                true
            }
            Step::Quiet => true,
            Step::Stamp => {
                to_stamp.retain(|e| e.stamp_vouched().is_some());
                false
            }
        };
        // Publishing syncs the data file: every PUBLISH_EVERY while writing, after a
        // quiet spell, and on flush; not after every extent.
        if publish_now || last_publish.elapsed() >= PUBLISH_EVERY {
            let mut failed = Vec::new();
            for e in dirty.drain(..) {
                if let Err(err) = e.publish() {
                    if s.counters.errors.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!("disk tier: {err} (further write errors are only counted; publishing is retried)");
                    }
                    failed.push(e);
                } else if e.stamp_vouched().is_some()
                    && !to_stamp.iter().any(|t| Arc::ptr_eq(t, &e))
                {
                    to_stamp.push(e);
                }
            }
            failed_at = (!failed.is_empty()).then(Instant::now);
            dirty = failed;
            last_publish = Instant::now();
        }
        if (flush.is_some() || close) && !to_stamp.is_empty() {
            // Worth the wait at an unmount: the next mount opens these files at once.
            std::thread::sleep(super::stamp::SETTLED);
            for e in to_stamp.drain(..) {
                let _ = e.stamp_vouched();
            }
        }
        if let Some(n) = flush {
            let mut q = s.queue.lock().unwrap();
            q.flush_done = q.flush_done.max(n);
            s.done.notify_all();
        }
        if close {
            return;
        }
    }
}

/// Write the held run to its entry, then free its bytes in the queue.
fn write_run(s: &Shared, held: &mut Run, dirty: &mut Vec<Arc<Entry>>) {
    let Some(first) = held.jobs.first() else {
        return;
    };
    let (entry, extent) = (first.entry.clone(), first.extent);
    let bufs: Vec<&[u8]> = held.jobs.iter().map(Job::bytes).collect();
    let sums: Vec<u64> = held.jobs.iter().map(|j| j.sum).collect();
    match entry.write_run_summed(extent, &bufs, &sums) {
        Ok(()) => {
            let c = &s.counters;
            c.written_bytes.fetch_add(held.bytes, Ordering::Relaxed);
            c.written_extents
                .fetch_add(held.jobs.len() as u64, Ordering::Relaxed);
            if !dirty.iter().any(|e| Arc::ptr_eq(e, &entry)) {
                dirty.push(entry);
            }
        }
        Err(e) => {
            if s.counters.errors.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!("disk tier: {e} (further write errors are only counted)");
            }
            // Nothing was kept: the bound gets its room back.
            let charge: u64 = bufs
                .iter()
                .map(|b| super::disk_charge(b.len() as u64))
                .sum();
            s.room.fetch_add(charge, Ordering::Relaxed);
            if e.is_no_space() {
                let mut q = s.queue.lock().unwrap();
                let room = DROPPED_KEPT.saturating_sub(q.no_space.len());
                let failed = held.jobs.iter().map(|j| (j.entry.clone(), j.extent));
                q.no_space.extend(failed.take(room));
                q.no_space_at = Some(Instant::now());
            }
        }
    }
    // The bytes go back to their owner (the chunk cache) outside the lock.
    drop(bufs);
    let jobs = std::mem::take(&mut held.jobs);
    let mut q = s.queue.lock().unwrap();
    q.bytes -= held.bytes;
    drop(q);
    drop(jobs);
    held.bytes = 0;
    s.taken.notify_all();
}

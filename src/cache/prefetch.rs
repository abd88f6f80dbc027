//! Background loading: a bounded, de-duplicated FIFO of prefetch jobs drained by
//! worker threads that yield to demand reads, plus sequential read-ahead, which is
//! the main producer of jobs. Separate because it is the only code that owns threads;
//! the workers load through the same single-flight path as demand reads.

use super::stats::{add, bump};
use super::sync::thread;
use super::{lock, ChunkCache, ChunkKey, ChunkLoader, FileState, Outcome, Shared};
use std::collections::{HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

/// One chunk to load in the background.
pub(super) struct Job {
    key: ChunkKey,
    len: u64,
    loader: ChunkLoader,
    /// Queued by sequential read-ahead: runs beside demand loads rather than after them.
    readahead: bool,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) jobs: VecDeque<Job>,
    /// Keys in `jobs`, so a chunk is queued at most once.
    queued: HashSet<ChunkKey>,
    /// Jobs taken by a worker and not yet finished.
    active: usize,
    pub(super) workers: usize,
}

impl Shared {
    pub(super) fn enqueue(
        &self,
        file: u32,
        size: u64,
        chunks: Range<u64>,
        loader: &ChunkLoader,
        readahead: bool,
    ) -> usize {
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
                readahead,
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
        // Each worker decodes its chunks on its own thread: a pool of one made of this
        // very thread, so the archive's parallel iterators run inline. Handing every
        // chunk's few blocks to rayon's global pool and sleeping until they were done
        // cost a wake-up per step, and on 16 cores the pool's threads spun between
        // those small jobs; concurrent workers are the parallelism instead
        // (docs/CUDA.md, "Cold reads"). `CAWSFS_PREFETCH_DECODE=pool` keeps the global
        // pool, for comparison. Not under shuttle, whose threads share one OS thread.
        #[cfg(not(feature = "shuttle"))]
        if std::env::var_os("CAWSFS_PREFETCH_DECODE").is_none_or(|v| v != "pool") {
            let own = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .use_current_thread()
                .build();
            if let Ok(pool) = own {
                return pool.install(|| self.work());
            }
        }
        self.work()
    }

    fn work(&self) {
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
            // Read-ahead is exempt: a sequential reader (the kernel's read-ahead keeps
            // one or two requests outstanding) always has a demand load running, so
            // gated read-ahead never ran ahead of it, and the chunks it queues are the
            // ones that reader asks for next.
            if !job.readahead {
                let mut n = lock(&self.demand_waiting);
                while *n > 0 && !self.shutdown.load(Relaxed) {
                    n = self
                        .demand_cv
                        .wait(n)
                        .unwrap_or_else(PoisonError::into_inner);
                }
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
    /// Queue the chunks after a sequential read that ended at byte `end`.
    pub(super) fn readahead(&self, file: u32, size: u64, end: u64, f: &FileState) {
        let sh = &*self.shared;
        let last_chunk = (end - 1) / sh.cfg.chunk_size;
        // A small cache keeps its other chunks (read-ahead past a share of the budget
        // would evict what it loaded before the reader got there), and the disk tier's
        // queue, a sixteenth of the budget, takes a read-ahead's copies without
        // dropping them.
        let k = sh
            .cfg
            .readahead_chunks
            .min((sh.cfg.budget_bytes / sh.cfg.chunk_size / 16).max(1));
        if k == 0 || lock(&sh.queue).workers == 0 {
            return;
        }
        let Some(loader) = lock(&f.loader).clone() else {
            return;
        };
        let from = (last_chunk + 1).max(f.readahead_next.load(Relaxed));
        let mut to = last_chunk
            .saturating_add(1)
            .saturating_add(k)
            .min(sh.chunk_count(size));
        // In a mixture of experts, a run inside an expert does not read ahead, and
        // one before the experts stops at the first (experts.rs, `fence`).
        if let Some(p) = f.experts.get() {
            if let Some(fence) = p.map().fence(f.run_start.load(Relaxed), end) {
                to = to.min(fence.div_ceil(sh.cfg.chunk_size));
            }
        }
        if from >= to {
            return;
        }
        f.readahead_next.fetch_max(to, Relaxed);
        bump(&sh.counters.readahead_triggers);
        sh.enqueue(file, size, from..to, &loader, true);
    }

    /// Start `threads` background prefetch workers (adds to any already running).
    pub fn start_prefetcher(&self, threads: usize) {
        let mut handles = lock(&self.workers);
        for i in 0..threads {
            let sh = self.shared.clone();
            let h = thread::Builder::new()
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
        self.shared.enqueue(file, size, chunks, &loader, false)
    }

    /// Like [`prefetch`](Self::prefetch) with the loader given to
    /// [`register_file`](Self::register_file); 0 when `file` has none.
    pub fn prefetch_registered(&self, file: u32, size: u64, chunks: Range<u64>) -> usize {
        let loader = lock(&self.shared.file_state(file).loader).clone();
        match loader {
            Some(l) => self.shared.enqueue(file, size, chunks, &l, false),
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
}

/// Dropping the cache stops and joins its prefetch workers.
impl Drop for ChunkCache {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Relaxed);
        {
            // Notify under the queue lock so no worker misses the wake-up between its
            // shutdown check and its wait.
            let _q = lock(&self.shared.queue);
            self.shared.queue_cv.notify_all();
        }
        {
            // Likewise for a worker waiting for demand loads to end.
            let _d = lock(&self.shared.demand_waiting);
            self.shared.demand_cv.notify_all();
        }
        for h in lock(&self.workers).drain(..) {
            let _ = h.join();
        }
    }
}

//! Queue only what the kernel no longer holds (docs/MOE.md, "One step ahead"). A
//! predicted expert is often partly still in the page cache: the kernel will ask for
//! the pages it dropped and nothing else, so reconstructing the whole expert wastes
//! the cores the demand loads need (1.8 x the routed bytes against 1.46 x without
//! queueing, on 2 cores). The mount layer says which pages are resident (it can look
//! at its own file); the cache keeps to chunks, so the question is asked off the read
//! path, on one thread of its own, and the answer becomes chunks to queue.

use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Weak};

use super::stats::bump;
use super::{ChunkLoader, Shared};

/// Which bytes of `ranges` of a file the page cache does not hold, in page-aligned
/// byte ranges; None when it cannot tell (then the whole ranges are queued). One call
/// per prediction, so that the file is looked at once for all of its pieces.
pub type Residency = Box<dyn Fn(&[Range<u64>]) -> Option<Vec<Range<u64>>> + Send + Sync>;

/// Predictions waiting for their residency check; more are dropped (counted as
/// dropped prefetches): a check that lags a layer behind is of no use.
const BACKLOG: usize = 16;

pub(super) struct Job {
    pub file: u32,
    pub size: u64,
    pub ranges: Vec<Range<u64>>,
    pub loader: ChunkLoader,
}

/// The checking thread's queue, started on first use.
#[derive(Default)]
pub(super) struct Checker {
    tx: std::sync::OnceLock<SyncSender<Job>>,
}

impl Checker {
    /// Hand `job` to the checking thread (which holds only a weak reference to the
    /// cache, and ends with it).
    pub(super) fn send(&self, shared: &Arc<Shared>, job: Job) {
        let tx = self.tx.get_or_init(|| {
            let (tx, rx) = sync_channel(BACKLOG);
            let weak = Arc::downgrade(shared);
            let spawned = std::thread::Builder::new()
                .name("cawsfs-resident".into())
                .spawn(move || run(weak, rx));
            if let Err(e) = spawned {
                tracing::warn!("no residency checks for expert prefetch: {e}");
            }
            tx
        });
        match tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                bump(&shared.counters.prefetch_dropped)
            }
        }
    }
}

fn run(weak: Weak<Shared>, rx: Receiver<Job>) {
    while let Ok(job) = rx.recv() {
        let Some(sh) = weak.upgrade() else { return };
        let f = sh.file_state(job.file);
        let (Some(p), Some(check)) = (f.experts.get(), f.residency.get()) else {
            continue;
        };
        let cs = sh.cfg.chunk_size;
        let missing = check(&job.ranges).unwrap_or(job.ranges);
        let mut queued = 0;
        for m in chunk_runs(&missing, cs) {
            queued += sh.enqueue(job.file, job.size, m, &job.loader, true);
        }
        p.queued(queued as u64);
    }
}

/// The chunks (of `cs` bytes) that byte ranges `missing` touch, in any order, as
/// sorted runs of chunk indices, each chunk once.
fn chunk_runs(missing: &[Range<u64>], cs: u64) -> Vec<Range<u64>> {
    let mut sorted: Vec<&Range<u64>> = missing.iter().filter(|m| !m.is_empty()).collect();
    sorted.sort_by_key(|m| m.start);
    let mut out: Vec<Range<u64>> = Vec::new();
    for m in sorted {
        let c = m.start / cs..m.end.div_ceil(cs);
        match out.last_mut() {
            Some(last) if c.start <= last.end => last.end = last.end.max(c.end),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::chunk_runs;

    #[test]
    fn missing_pages_become_each_chunk_once() {
        let cs = 1 << 18;
        assert_eq!(chunk_runs(&[], cs), vec![]);
        // Two pages in one chunk, one in the next but one.
        assert_eq!(
            chunk_runs(&[4096..8192, 16384..20480, 3 * cs..3 * cs + 4096], cs),
            vec![0..1, 3..4]
        );
        // A run across a chunk boundary, then one starting in its last chunk.
        assert_eq!(
            chunk_runs(&[cs - 4096..cs + 4096, cs + 8192..2 * cs + 1], cs),
            vec![0..3]
        );
        assert_eq!(chunk_runs(&[5..5, 7..7], cs), vec![]);
        // Two experts' pieces, the later one first: no run spans the gap between them.
        assert_eq!(
            chunk_runs(&[9 * cs..10 * cs, 2 * cs..3 * cs, 4 * cs..4 * cs + 1], cs),
            vec![2..3, 4..5, 9..10]
        );
    }
}

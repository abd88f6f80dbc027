//! Schedule-exploring concurrency tests of the chunk cache (feature `shuttle`).
//!
//! Under the feature every lock, condvar wait, atomic and thread of the cache is
//! shuttle's (`sync.rs`), so shuttle runs each scenario below many times, each under
//! another interleaving: uniformly random ones, then PCT ones (which find any bug that
//! needs at most `PCT_DEPTH` orderings between threads with a known probability per
//! run). Every schedule checks that each read returned the file's bytes, that no two
//! loads of one chunk overlapped (single-flight), and that the byte accounting and the
//! budget held. The test loader is itself a scheduling point between its start and its
//! end, so other threads read, pin, evict and prefetch while a load is in flight.
//!
//! `cargo test --release --features shuttle --lib cache::`

use super::*;
use shuttle::sync::atomic::AtomicUsize;
use shuttle::thread;
use std::sync::atomic::{AtomicU64 as StdU64, Ordering::SeqCst};
use std::time::Duration;

const FILE: u32 = 7;
const CS: u64 = 8;
/// Four chunks, the last one short.
const SIZE: u64 = 30;
const CHUNKS: u64 = 4;

/// Schedules per scheduler and scenario: all of them take 5-8 s on two cores.
/// `CAWSFS_SHUTTLE_ITERATIONS` sets another number for a longer run.
const DEFAULT_ITERATIONS: usize = 10_000;
const PCT_DEPTH: usize = 3;

/// Run `f` under many random schedules, then as many PCT ones.
fn explore(f: impl Fn() + Clone + Send + Sync + 'static) {
    let n = std::env::var("CAWSFS_SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ITERATIONS);
    shuttle::check_random(f.clone(), n);
    shuttle::check_pct(f, n, PCT_DEPTH);
}

fn byte(pos: u64) -> u8 {
    (pos.wrapping_mul(31) ^ 0x5a) as u8
}

fn key(index: u64) -> ChunkKey {
    ChunkKey { file: FILE, index }
}

#[derive(Clone, Copy)]
enum Faults {
    None,
    /// The first load of every chunk fails.
    FirstLoad,
    /// Every third load of a chunk fails, starting with its second.
    Sometimes,
}

/// The test's loader: the file's bytes, with injected failures, recording each load.
struct Source {
    faults: Faults,
    /// Loads of each chunk running now. Shuttle atomics: each update is a scheduling
    /// point, so a load in flight is seen by the other threads.
    running: Vec<AtomicUsize>,
    /// Loads of each chunk started so far.
    started: Vec<StdU64>,
    failed: StdU64,
}

impl Source {
    fn new(faults: Faults) -> Arc<Self> {
        Arc::new(Source {
            faults,
            running: (0..CHUNKS).map(|_| AtomicUsize::new(0)).collect(),
            started: (0..CHUNKS).map(|_| StdU64::new(0)).collect(),
            failed: StdU64::new(0),
        })
    }

    fn load(&self, index: u64, buf: &mut [u8]) -> Result<usize, ReadError> {
        let i = index as usize;
        let attempt = self.started[i].fetch_add(1, SeqCst);
        let before = self.running[i].fetch_add(1, SeqCst);
        assert_eq!(before, 0, "two loads of chunk {index} at once");
        for (j, b) in buf.iter_mut().enumerate() {
            *b = byte(index * CS + j as u64);
        }
        let fail = match self.faults {
            Faults::None => false,
            Faults::FirstLoad => attempt == 0,
            Faults::Sometimes => attempt % 3 == 1,
        };
        self.running[i].fetch_sub(1, SeqCst);
        if fail {
            self.failed.fetch_add(1, SeqCst);
            return Err(ReadError::Io(std::io::Error::other(format!(
                "injected failure of chunk {index}"
            ))));
        }
        Ok(buf.len())
    }

    fn loader(self: &Arc<Self>) -> ChunkLoader {
        let s = self.clone();
        Arc::new(move |i, b| s.load(i, b))
    }

    fn loads(&self, index: u64) -> u64 {
        self.started[index as usize].load(SeqCst)
    }

    fn all_loads(&self) -> u64 {
        (0..CHUNKS).map(|i| self.loads(i)).sum()
    }
}

/// Read `len` bytes at `off`, retrying after injected failures, and check the bytes.
/// Returns the chunks whose failures the reader met, in order.
fn read_until_ok(c: &ChunkCache, src: &Source, off: u64, len: usize) -> Vec<u64> {
    let mut failures = Vec::new();
    loop {
        let mut buf = vec![0u8; len];
        match c.read(FILE, SIZE, off, &mut buf, &|i, b| src.load(i, b)) {
            Ok(n) => {
                assert_eq!(n as u64, (len as u64).min(SIZE - off), "read at {off}");
                for (j, &b) in buf[..n].iter().enumerate() {
                    assert_eq!(b, byte(off + j as u64), "byte {}", off + j as u64);
                }
                return failures;
            }
            Err(e) => {
                let msg = e.to_string();
                let index = msg
                    .strip_prefix("injected failure of chunk ")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("unexpected read error: {msg}"));
                failures.push(index);
            }
        }
    }
}

/// Spawn one reader per `(offset, len)`; returns the failures each met.
fn spawn_readers(
    c: &Arc<ChunkCache>,
    src: &Arc<Source>,
    reads: &[(u64, usize)],
) -> Vec<thread::JoinHandle<Vec<u64>>> {
    reads
        .iter()
        .map(|&(off, len)| {
            let (c, src) = (c.clone(), src.clone());
            thread::spawn(move || read_until_ok(&c, &src, off, len))
        })
        .collect()
}

fn check(c: &ChunkCache) {
    lock(&c.shared.state).assert_consistent(c.budget());
}

#[test]
fn concurrent_reads_load_each_chunk_once() {
    explore(|| {
        let c = Arc::new(ChunkCache::new(64, CS).unwrap());
        let src = Source::new(Faults::None);
        // The whole file (four misses: loaded on scoped threads) and two reads
        // overlapping it and each other.
        let reads = [(0, 30), (5, 12), (20, 10)];
        for h in spawn_readers(&c, &src, &reads) {
            assert!(h.join().unwrap().is_empty());
        }
        for i in 0..CHUNKS {
            assert_eq!(src.loads(i), 1, "loads of chunk {i}");
        }
        let s = c.stats();
        assert_eq!(s.loads, CHUNKS);
        assert_eq!(s.hits + s.misses, 4 + 3 + 2, "chunk lookups");
        assert_eq!(s.misses, s.loads + s.coalesced);
        assert_eq!(s.loads_in_flight, 0);
        check(&c);
    });
}

#[test]
fn a_failed_load_fails_its_waiters_once_and_the_next_read_retries() {
    explore(|| {
        let c = Arc::new(ChunkCache::new(64, CS).unwrap());
        let src = Source::new(Faults::FirstLoad);
        // Three readers of chunk 1; the second also needs chunk 0.
        let reads = [(8, 8), (4, 8), (10, 4)];
        let seen: Vec<Vec<u64>> = spawn_readers(&c, &src, &reads)
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        for f in &seen {
            // One failed load per chunk, and its flight is gone before its error is
            // published: a reader never meets the same failure twice.
            let mut d = f.clone();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), f.len(), "a reader met one failure twice: {f:?}");
        }
        let met: usize = seen.iter().map(Vec::len).sum();
        assert!(met >= 1, "nobody met a failure");
        // Errors are not cached: one failed and one good load of each chunk read.
        assert_eq!((src.loads(0), src.loads(1)), (2, 2));
        assert_eq!(src.loads(2) + src.loads(3), 0);
        assert!(c.contains(key(0)) && c.contains(key(1)));
        let s = c.stats();
        assert_eq!((s.loads, s.load_errors), (4, 2));
        assert_eq!(s.read_errors, met as u64);
        check(&c);
    });
}

#[test]
fn pins_survive_evictions_and_reads_within_the_budget() {
    explore(|| {
        // Three chunks' worth: with pins held, the reader's misses keep evicting.
        let c = Arc::new(ChunkCache::new(3 * CS, CS).unwrap());
        let src = Source::new(Faults::Sometimes);
        let pinner = {
            let (c, src) = (c.clone(), src.clone());
            thread::spawn(move || {
                for index in [0, 2] {
                    c.pin(key(index), SIZE).unwrap();
                    read_until_ok(&c, &src, index * CS, CS as usize);
                    // Pinned and loaded: resident until unpinned, whatever else runs.
                    assert!(c.contains(key(index)));
                    thread::yield_now();
                    assert!(c.contains(key(index)));
                    c.unpin(key(index)).unwrap();
                }
            })
        };
        let reader = spawn_readers(&c, &src, &[(8, 8), (24, 6), (0, 30), (16, 8)]);
        let evictor = {
            let c = c.clone();
            thread::spawn(move || {
                c.evict_all_unpinned();
                // A pin taken while its chunk may be loading, then evictions around it.
                c.pin(key(3), SIZE).unwrap();
                c.evict((0..CHUNKS).map(key));
                c.set_hints([key(1), key(2)]);
                c.unpin(key(3)).unwrap();
                c.evict_all_unpinned();
                c.set_hints([key(2)]);
            })
        };
        // The accounting holds whenever the state lock is free, not only at the end.
        for _ in 0..3 {
            check(&c);
            thread::yield_now();
        }
        pinner.join().unwrap();
        for h in reader {
            h.join().unwrap();
        }
        evictor.join().unwrap();
        check(&c);
        let s = c.stats();
        assert_eq!((s.pinned_bytes, s.pinned_entries), (0, 0));
        assert!(s.bytes_used <= s.budget_bytes);
        assert_eq!(s.loads_in_flight, 0);
        assert_eq!(s.loads, src.all_loads());
        assert_eq!(s.load_errors, src.failed.load(SeqCst));
    });
}

#[test]
fn prefetch_and_read_ahead_race_demand_reads() {
    for faults in [Faults::None, Faults::FirstLoad] {
        explore(move || {
            let mut cfg = CacheConfig::new(64, CS);
            cfg.readahead_chunks = 2;
            let c = Arc::new(ChunkCache::with_config(cfg).unwrap());
            let src = Source::new(faults);
            c.register_file(FILE, src.loader());
            c.start_prefetcher(1);
            let prefetcher = {
                let (c, src) = (c.clone(), src.clone());
                thread::spawn(move || c.prefetch(FILE, SIZE, 0..CHUNKS, src.loader()))
            };
            // Sequential: the second read reads ahead chunks 2 and 3.
            let sequential = {
                let (c, src) = (c.clone(), src.clone());
                thread::spawn(move || {
                    read_until_ok(&c, &src, 0, 8);
                    read_until_ok(&c, &src, 8, 8);
                })
            };
            let tail = spawn_readers(&c, &src, &[(16, 14)]);
            prefetcher.join().unwrap();
            sequential.join().unwrap();
            for h in tail {
                h.join().unwrap();
            }
            // Shuttle has no time: this waits for idle, or reports a deadlock.
            assert!(c.wait_prefetch_idle(Duration::from_secs(60)));
            // Every chunk was read, and the budget holds them all: demand and prefetch
            // loads of a chunk were one (a failed one and a good one with faults).
            let per_chunk = match faults {
                Faults::FirstLoad => 2,
                _ => 1,
            };
            for i in 0..CHUNKS {
                assert!(c.contains(key(i)), "chunk {i} resident");
                assert_eq!(src.loads(i), per_chunk, "loads of chunk {i}");
            }
            let s = c.stats();
            assert_eq!(s.loads, per_chunk * CHUNKS);
            assert_eq!(s.load_errors, (per_chunk - 1) * CHUNKS);
            assert!(s.prefetch_hits <= s.prefetch_loads);
            if let Faults::None = faults {
                // Each load was either a prefetch's or a demand read's.
                assert_eq!(s.prefetch_loads + s.misses - s.coalesced, CHUNKS);
            }
            check(&c);
            // Dropping the last handle stops and joins the worker.
        });
    }
}

#[test]
fn dropping_the_cache_stops_busy_prefetchers() {
    explore(|| {
        let c = ChunkCache::new(2 * CS, CS).unwrap();
        let src = Source::new(Faults::Sometimes);
        c.start_prefetcher(2);
        c.prefetch(FILE, SIZE, 0..CHUNKS, src.loader());
        // Demand loads make the workers back off; some jobs may still be queued or
        // loading when the cache goes.
        read_until_ok(&c, &src, 8, 16);
        check(&c);
        drop(c);
        for i in 0..CHUNKS {
            assert_eq!(src.running[i as usize].load(SeqCst), 0, "chunk {i} loading");
        }
    });
}

#[test]
fn random_operations_keep_the_bytes_pins_and_budget() {
    use shuttle::rand::{thread_rng, Rng};
    explore(|| {
        // Two and a half chunks: pins can be refused, and every miss evicts. A load's
        // work is two chunks, so loads (demand and prefetch) also wait for room.
        let mut cfg = CacheConfig::new(2 * CS + CS / 2, CS);
        cfg.readahead_chunks = 1;
        cfg.load_work_factor = 2;
        let c = Arc::new(ChunkCache::with_config(cfg).unwrap());
        let src = Source::new(Faults::Sometimes);
        c.register_file(FILE, src.loader());
        c.start_prefetcher(1);
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let (c, src) = (c.clone(), src.clone());
                thread::spawn(move || {
                    // Shuttle's generator: the choices are part of the schedule, so a
                    // failure replays.
                    let mut rng = thread_rng();
                    for _ in 0..5 {
                        let index = rng.gen_range(0..CHUNKS);
                        match rng.gen_range(0..6) {
                            0 | 1 => {
                                let off = rng.gen_range(0..SIZE);
                                let len = rng.gen_range(1..=2 * CS as usize);
                                read_until_ok(&c, &src, off, len);
                            }
                            2 => match c.pin(key(index), SIZE) {
                                Ok(()) => {
                                    read_until_ok(&c, &src, index * CS, 1);
                                    assert!(c.contains(key(index)), "pinned chunk {index}");
                                    c.unpin(key(index)).unwrap();
                                }
                                Err(CacheError::PinOverBudget { .. }) => {}
                                Err(e) => panic!("{e}"),
                            },
                            3 => {
                                c.evict([key(index)]);
                            }
                            4 => {
                                c.set_hints([key(index), key((index + 1) % CHUNKS)]);
                            }
                            _ => {
                                c.prefetch_registered(FILE, SIZE, index..CHUNKS);
                            }
                        }
                    }
                })
            })
            .collect();
        check(&c);
        for t in threads {
            t.join().unwrap();
        }
        assert!(c.wait_prefetch_idle(Duration::from_secs(60)));
        check(&c);
        let s = c.stats();
        assert_eq!((s.pinned_bytes, s.loads_in_flight), (0, 0));
        assert_eq!(s.loads, src.all_loads());
        assert_eq!(s.load_errors, src.failed.load(SeqCst));
    });
}

//! Unit tests of the chunk cache against an in-memory reference "file".

use super::*;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::AtomicUsize;
use std::sync::Barrier;
use std::time::Duration;

fn byte(file: u32, pos: u64) -> u8 {
    (pos.wrapping_mul(31) ^ (pos >> 8) ^ (file as u64 * 97)) as u8
}

fn reference(file: u32, size: u64) -> Vec<u8> {
    (0..size).map(|p| byte(file, p)).collect()
}

/// A loader producing `reference(file, size)` chunk by chunk, counting its calls.
fn loader(
    file: u32,
    size: u64,
    cs: u64,
    calls: &AtomicU64,
) -> impl Fn(u64, &mut [u8]) -> Result<usize, ReadError> + Sync + '_ {
    move |index, buf| {
        calls.fetch_add(1, Relaxed);
        let start = index * cs;
        assert!(start < size);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = byte(file, start + i as u64);
        }
        Ok(buf.len())
    }
}

fn shared_loader(file: u32, size: u64, cs: u64, calls: Arc<AtomicU64>) -> ChunkLoader {
    Arc::new(move |index, buf| {
        calls.fetch_add(1, Relaxed);
        assert!(index * cs < size);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = byte(file, index * cs + i as u64);
        }
        Ok(buf.len())
    })
}

fn read_vec(
    c: &ChunkCache,
    file: u32,
    size: u64,
    off: u64,
    len: usize,
    load: &LoadFn<'_>,
) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let n = c.read(file, size, off, &mut buf, load).unwrap();
    buf.truncate(n);
    buf
}

fn key(file: u32, index: u64) -> ChunkKey {
    ChunkKey { file, index }
}

#[test]
fn bad_chunk_size_is_an_error() {
    assert!(ChunkCache::new(1024, 1000).is_err());
    assert!(ChunkCache::new(1024, 0).is_err());
    assert!(ChunkCache::new(1024, DEFAULT_CHUNK_SIZE).is_ok());
}

#[test]
fn the_keeper_sees_each_load_once_with_its_bytes_aligned_and_no_hit() {
    let (cs, size) = (4096, 5 * 4096 + 100);
    let c = ChunkCache::new(1 << 20, cs).unwrap();
    let kept = Arc::new(Mutex::new(Vec::<(u64, Vec<u8>)>::new()));
    let k = kept.clone();
    let keeper: Keeper = Box::new(move |i, chunk| {
        assert_eq!(chunk.as_ptr() as usize % CHUNK_ALIGN, 0);
        k.lock().unwrap().push((i, chunk.to_vec()));
    });
    assert!(c.set_keeper(1, keeper));
    assert!(
        !c.set_keeper(1, Box::new(|_, _| {})),
        "a second keeper is refused"
    );
    let calls = AtomicU64::new(0);
    let l = loader(1, size, cs, &calls);
    // Two demand reads of chunks 0-1, the second all hits; then a prefetch of 2..6.
    assert_eq!(
        read_vec(&c, 1, size, 10, 5000, &l),
        reference(1, size)[10..5010]
    );
    assert_eq!(
        read_vec(&c, 1, size, 0, 8192, &l),
        reference(1, size)[..8192]
    );
    c.register_file(1, shared_loader(1, size, cs, Arc::new(AtomicU64::new(0))));
    c.start_prefetcher(1);
    c.prefetch_registered(1, size, 2..6);
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    let mut got = kept.lock().unwrap().clone();
    got.sort();
    let want: Vec<(u64, Vec<u8>)> = (0..6)
        .map(|i| {
            let r = reference(1, size);
            let end = ((i + 1) * cs).min(size) as usize;
            (i, r[(i * cs) as usize..end].to_vec())
        })
        .collect();
    assert_eq!(got, want);
    // Another file has no keeper.
    let l2 = loader(2, size, cs, &calls);
    read_vec(&c, 2, size, 0, 100, &l2);
    assert_eq!(kept.lock().unwrap().len(), 6);
}

#[test]
fn hits_misses_and_evictions_are_counted() {
    let (cs, size) = (16, 200);
    let c = ChunkCache::new(64, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(1, size, cs, &calls);
    assert_eq!(read_vec(&c, 1, size, 0, 8, &l), reference(1, 200)[..8]);
    let s = c.stats();
    assert_eq!((s.hits, s.misses, s.loads, s.bytes_loaded), (0, 1, 1, 16));
    read_vec(&c, 1, size, 4, 8, &l);
    let s = c.stats();
    assert_eq!((s.hits, s.misses, s.bytes_served), (1, 1, 16));
    // Touch chunks 1..8: 4 fit, so 8 loaded chunks in all → 4 evictions.
    for i in 1..8u64 {
        read_vec(&c, 1, size, i * cs, 1, &l);
    }
    let s = c.stats();
    assert_eq!(s.misses, 8);
    assert_eq!(s.evictions, 4);
    assert_eq!(s.bytes_used, 64);
    assert_eq!(s.entries, 4);
    assert_eq!(calls.load(Relaxed), 8);
    assert_eq!(s.files.len(), 1);
    assert_eq!(s.files[0].misses, 8);
    assert_eq!(s.files[0].hits, 1);
    assert_eq!(s.files[0].bytes_served, 16 + 7);
    assert_eq!(s.reads, 9);
    assert!(s.latency_us.count == 9 && s.latency_us.p50_us <= s.latency_us.max_us);
}

#[test]
fn lru_evicts_least_recently_used() {
    let (cs, size) = (16, 160);
    let c = ChunkCache::new(48, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(0, size, cs, &calls);
    for i in 0..3 {
        read_vec(&c, 0, size, i * cs, 1, &l);
    }
    read_vec(&c, 0, size, 0, 1, &l); // chunk 0 is now most recent
    read_vec(&c, 0, size, 3 * cs, 1, &l); // evicts chunk 1
    assert!(c.contains(key(0, 0)));
    assert!(!c.contains(key(0, 1)));
    assert!(c.contains(key(0, 2)));
    assert!(c.contains(key(0, 3)));
    read_vec(&c, 0, size, 4 * cs, 1, &l); // evicts chunk 2
    assert!(!c.contains(key(0, 2)));
    assert!(c.contains(key(0, 0)));
}

#[test]
fn last_chunk_is_short_and_reads_stop_at_eof() {
    let (cs, size) = (16, 40);
    let c = ChunkCache::new(1024, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(2, size, cs, &calls);
    let r = reference(2, size);
    assert_eq!(read_vec(&c, 2, size, 30, 100, &l), r[30..]);
    assert_eq!(read_vec(&c, 2, size, 40, 10, &l), Vec::<u8>::new());
    assert_eq!(
        read_vec(&c, 2, size, u64::MAX - 3, 10, &l),
        Vec::<u8>::new()
    );
    assert_eq!(c.bytes_used(), 24); // chunk 1 (16) + chunk 2 (8)
}

#[test]
fn single_flight_runs_the_loader_once() {
    let (cs, size) = (1024, 4096);
    let c = ChunkCache::new(1 << 20, cs).unwrap();
    let calls = AtomicU64::new(0);
    let slow = |index: u64, buf: &mut [u8]| -> Result<usize, ReadError> {
        calls.fetch_add(1, Relaxed);
        std::thread::sleep(Duration::from_millis(150));
        for (i, b) in buf.iter_mut().enumerate() {
            *b = byte(3, index * cs + i as u64);
        }
        Ok(buf.len())
    };
    let barrier = Barrier::new(16);
    let r = reference(3, size);
    std::thread::scope(|s| {
        for t in 0..16u64 {
            let (c, slow, barrier, r) = (&c, &slow, &barrier, &r);
            s.spawn(move || {
                barrier.wait();
                let off = 1024 + t * 10;
                assert_eq!(
                    read_vec(c, 3, size, off, 50, slow),
                    r[off as usize..off as usize + 50]
                );
            });
        }
    });
    assert_eq!(calls.load(Relaxed), 1);
    let s = c.stats();
    assert_eq!((s.loads, s.misses, s.hits), (1, 16, 0));
    assert_eq!(s.coalesced, 15);
}

#[test]
fn errors_reach_every_waiter_and_are_not_cached() {
    let (cs, size) = (64, 256);
    let c = ChunkCache::new(1024, cs).unwrap();
    let calls = AtomicU64::new(0);
    let fail = AtomicBool::new(true);
    let l = |index: u64, buf: &mut [u8]| -> Result<usize, ReadError> {
        calls.fetch_add(1, Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        if fail.load(Relaxed) {
            return Err(ReadError::Checksum {
                tensor: "blk.0.attn_q.weight".into(),
                block: index as usize,
                stored: 1,
                computed: 2,
            });
        }
        buf.fill(7);
        Ok(buf.len())
    };
    let barrier = Barrier::new(4);
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (c, l, barrier) = (&c, &l, &barrier);
            s.spawn(move || {
                barrier.wait();
                let mut buf = [0u8; 8];
                let e = c.read(0, size, 70, &mut buf, l).unwrap_err();
                assert!(matches!(e, ReadError::Checksum { block: 1, .. }), "{e}");
            });
        }
    });
    assert_eq!(calls.load(Relaxed), 1);
    assert!(!c.contains(key(0, 1)));
    let s = c.stats();
    assert_eq!((s.load_errors, s.read_errors, s.bytes_used), (1, 4, 0));
    fail.store(false, Relaxed);
    assert_eq!(read_vec(&c, 0, size, 70, 8, &l), vec![7u8; 8]);
    assert_eq!(calls.load(Relaxed), 2);
}

#[test]
fn short_and_panicking_loaders_fail_the_read() {
    let c = ChunkCache::new(1024, 16).unwrap();
    let short = |_: u64, buf: &mut [u8]| -> Result<usize, ReadError> { Ok(buf.len() - 1) };
    let mut buf = [0u8; 4];
    let e = c.read(0, 100, 0, &mut buf, &short).unwrap_err();
    assert!(
        e.to_string().contains("loader produced 15 of 16 bytes"),
        "{e}"
    );
    let boom = |_: u64, _: &mut [u8]| -> Result<usize, ReadError> { panic!("codec bug") };
    let e = c.read(0, 100, 0, &mut buf, &boom).unwrap_err();
    assert!(e.to_string().contains("panicked"), "{e}");
    let calls = AtomicU64::new(0);
    let good = loader(0, 100, 16, &calls);
    assert_eq!(read_vec(&c, 0, 100, 0, 4, &good), reference(0, 100)[..4]);
    assert_eq!(c.stats().load_errors, 2);
}

#[test]
fn oversized_chunk_is_served_but_not_retained() {
    let (cs, size) = (64, 200);
    let c = ChunkCache::new(40, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(0, size, cs, &calls);
    assert_eq!(
        read_vec(&c, 0, size, 10, 100, &l),
        reference(0, size)[10..110]
    );
    let s = c.stats();
    assert_eq!((s.bytes_used, s.not_retained, s.loads), (0, 2, 2));
    // The 8-byte tail chunk fits.
    read_vec(&c, 0, size, 195, 5, &l);
    assert_eq!(c.bytes_used(), 8);
}

#[test]
fn pinned_chunks_survive_a_scan() {
    let (cs, size) = (16, 1600);
    let c = ChunkCache::new(64, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(0, size, cs, &calls);
    read_vec(&c, 0, size, 0, 1, &l);
    c.pin(key(0, 0), size).unwrap();
    c.pin(key(0, 5), size).unwrap(); // not resident yet: bytes reserved
    assert_eq!(c.stats().pinned_bytes, 32);
    for i in 0..100u64 {
        read_vec(&c, 0, size, i * cs, 16, &l);
        assert!(c.bytes_used() <= 64);
    }
    assert!(c.contains(key(0, 0)) && c.contains(key(0, 5)));
    c.evict_all_unpinned();
    assert!(c.contains(key(0, 0)) && c.contains(key(0, 5)));
    let s = c.stats();
    assert_eq!(
        (s.bytes_used, s.unpinned_bytes, s.pinned_resident_bytes),
        (32, 0, 32)
    );
    let before = calls.load(Relaxed);
    read_vec(&c, 0, size, 0, 16, &l);
    assert_eq!(calls.load(Relaxed), before);
    // Pins nest; the last unpin returns the chunk to the LRU, where it can be evicted.
    c.pin(key(0, 0), size).unwrap();
    c.unpin(key(0, 0)).unwrap();
    assert!(c.is_pinned(key(0, 0)));
    c.unpin(key(0, 0)).unwrap();
    assert!(!c.is_pinned(key(0, 0)));
    assert!(matches!(
        c.unpin(key(0, 0)),
        Err(CacheError::NotPinned { .. })
    ));
    c.evict_all_unpinned();
    assert!(!c.contains(key(0, 0)) && c.contains(key(0, 5)));
}

#[test]
fn pinning_beyond_the_budget_fails() {
    let (cs, size) = (16, 1000);
    let c = ChunkCache::new(64, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(0, size, cs, &calls);
    for i in 0..4 {
        read_vec(&c, 0, size, (10 + i) * cs, 1, &l);
    }
    for i in 0..4 {
        c.pin(key(0, i), size).unwrap();
        assert!(c.bytes_used() <= 64);
    }
    // Reserving 4 chunks left no room for unpinned ones.
    assert_eq!(c.stats().unpinned_bytes, 0);
    let e = c.pin(key(0, 4), size).unwrap_err();
    assert!(
        matches!(
            e,
            CacheError::PinOverBudget {
                needed: 16,
                pinned: 64,
                budget: 64,
                ..
            }
        ),
        "{e}"
    );
    assert!(matches!(
        c.pin(key(0, 63), size),
        Err(CacheError::OutOfRange { .. })
    ));
    // Re-pinning an already pinned chunk costs nothing.
    c.pin(key(0, 1), size).unwrap();
    // Unpinned chunks are still served, just not kept.
    assert_eq!(
        read_vec(&c, 0, size, 200, 4, &l),
        reference(0, size)[200..204]
    );
    assert!(c.bytes_used() <= 64);
}

#[test]
fn prefetched_chunk_counts_as_prefetch_hit_once() {
    let (cs, size) = (32, 320);
    let c = ChunkCache::new(1024, cs).unwrap();
    c.start_prefetcher(2);
    let calls = Arc::new(AtomicU64::new(0));
    let queued = c.prefetch(0, size, 2..100, shared_loader(0, size, cs, calls.clone()));
    assert_eq!(queued, 8); // chunks 2..10
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    assert_eq!(calls.load(Relaxed), 8);
    let demand = AtomicU64::new(0);
    let l = loader(0, size, cs, &demand);
    assert_eq!(read_vec(&c, 0, size, 70, 4, &l), reference(0, size)[70..74]);
    assert_eq!(read_vec(&c, 0, size, 72, 4, &l), reference(0, size)[72..76]);
    let s = c.stats();
    assert_eq!((s.prefetch_hits, s.hits, s.misses), (1, 1, 0));
    assert_eq!(s.prefetch_loads, 8);
    assert_eq!(demand.load(Relaxed), 0);
    // Prefetching resident chunks is skipped when their turn comes.
    c.prefetch(0, size, 2..4, shared_loader(0, size, cs, calls.clone()));
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    assert_eq!(calls.load(Relaxed), 8);
    assert_eq!(c.stats().prefetch_skipped, 2);
}

#[test]
fn sequential_reads_trigger_read_ahead() {
    let n = crate::cache::DEFAULT_READAHEAD_CHUNKS;
    let (cs, size) = (64, 64 * (n + 4));
    let c = ChunkCache::new(1 << 20, cs).unwrap();
    c.start_prefetcher(1);
    let bg = Arc::new(AtomicU64::new(0));
    c.register_file(4, shared_loader(4, size, cs, bg.clone()));
    let demand = AtomicU64::new(0);
    let l = loader(4, size, cs, &demand);
    let r = reference(4, size);
    // Two random reads: no read-ahead.
    read_vec(&c, 4, size, 500, 10, &l);
    read_vec(&c, 4, size, 100, 10, &l);
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    assert_eq!(bg.load(Relaxed), 0);
    // Sequential: 0..32 then 32..64 → chunks 1..=N queued (N of the file's N + 4).
    read_vec(&c, 4, size, 0, 32, &l);
    read_vec(&c, 4, size, 32, 32, &l);
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    assert_eq!(c.stats().readahead_triggers, 1);
    for i in 1..=n {
        assert!(c.contains(key(4, i)), "chunk {i}");
    }
    assert!(!c.contains(key(4, n + 1)));
    let demand_before = demand.load(Relaxed);
    // Continue sequentially through the file: every chunk after 0 comes from read-ahead.
    let mut off = 64u64;
    while off < size {
        assert_eq!(
            read_vec(&c, 4, size, off, 64, &l),
            r[off as usize..off as usize + 64]
        );
        off += 64;
        assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    }
    assert_eq!(demand.load(Relaxed), demand_before);
    let s = c.stats();
    // Chunks 1 and 7 were demand-loaded by the first two reads; the others after
    // chunk 0 came from read-ahead.
    assert_eq!(s.prefetch_hits, n + 4 - 3);
    // Each chunk was loaded exactly once: no duplicate read-ahead.
    assert_eq!(s.loads, n + 4);
    assert_eq!(bg.load(Relaxed), n + 4 - 3);
}

#[test]
fn read_ahead_keeps_to_a_sixteenth_of_the_budget() {
    // 128 chunks of budget: a sequential read queues 8, not the default depth.
    let (cs, size) = (64, 64 * 100);
    let c = ChunkCache::new(64 * 128, cs).unwrap();
    c.start_prefetcher(1);
    let bg = Arc::new(AtomicU64::new(0));
    c.register_file(4, shared_loader(4, size, cs, bg.clone()));
    let demand = AtomicU64::new(0);
    let l = loader(4, size, cs, &demand);
    read_vec(&c, 4, size, 0, 32, &l);
    read_vec(&c, 4, size, 32, 32, &l);
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    assert_eq!(bg.load(Relaxed), 8);
    assert!(c.contains(key(4, 8)) && !c.contains(key(4, 9)));
}

#[test]
fn multi_chunk_misses_load_in_parallel() {
    let (cs, size) = (4096, 4096 * 8);
    let c = ChunkCache::new(1 << 20, cs).unwrap();
    let running = AtomicUsize::new(0);
    let peak = AtomicUsize::new(0);
    let l = |index: u64, buf: &mut [u8]| -> Result<usize, ReadError> {
        let now = running.fetch_add(1, Relaxed) + 1;
        peak.fetch_max(now, Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        running.fetch_sub(1, Relaxed);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = byte(0, index * cs + i as u64);
        }
        Ok(buf.len())
    };
    assert_eq!(
        read_vec(&c, 0, size, 100, 4096 * 6, &l),
        reference(0, size)[100..100 + 4096 * 6]
    );
    assert!(peak.load(Relaxed) > 1);
}

#[test]
fn random_reads_match_the_reference() {
    let (cs, size) = (64, 1000);
    let c = ChunkCache::new(256, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(9, size, cs, &calls);
    let r = reference(9, size);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for _ in 0..3000 {
        let off = rng.random_range(0..1100u64);
        let len = rng.random_range(0..300usize);
        let got = read_vec(&c, 9, size, off, len, &l);
        let lo = (off as usize).min(r.len());
        let hi = (off as usize + len).min(r.len());
        assert_eq!(got, r[lo..hi], "off {off} len {len}");
        assert!(c.bytes_used() <= 256);
    }
}

#[test]
fn hammer_keeps_the_budget_and_the_bytes() {
    let cs = 64u64;
    let sizes = [1000u64, 333, 4096, 64];
    let budget = 300; // 4 full chunks fit, never 5
    let c = ChunkCache::new(budget, cs).unwrap();
    c.start_prefetcher(2);
    for (f, &size) in sizes.iter().enumerate() {
        c.register_file(
            f as u32,
            shared_loader(f as u32, size, cs, Arc::new(AtomicU64::new(0))),
        );
    }
    c.pin(key(2, 3), sizes[2]).unwrap();
    let refs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(f, &s)| reference(f as u32, s))
        .collect();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (c, refs) = (&c, &refs);
            s.spawn(move || {
                let mut rng = ChaCha8Rng::seed_from_u64(100 + t);
                let calls = AtomicU64::new(0);
                let mut seq_off = 0u64;
                for step in 0..1500 {
                    let f = rng.random_range(0..sizes.len());
                    let size = sizes[f];
                    let l = loader(f as u32, size, cs, &calls);
                    // Mix random reads with sequential runs (which trigger read-ahead).
                    let (off, len) = if step % 3 == 0 {
                        let o = seq_off % (size + 10);
                        seq_off = o + 40;
                        (o, 40)
                    } else {
                        (
                            rng.random_range(0..size + 10),
                            rng.random_range(0..200usize),
                        )
                    };
                    let got = read_vec(c, f as u32, size, off, len, &l);
                    let r = &refs[f];
                    let lo = (off as usize).min(r.len());
                    let hi = (off as usize + len).min(r.len());
                    assert_eq!(got, r[lo..hi]);
                    let st = c.stats();
                    assert!(st.bytes_used <= budget, "{} > {budget}", st.bytes_used);
                    if step % 500 == 0 {
                        c.evict_all_unpinned();
                    }
                }
            });
        }
    });
    assert!(c.wait_prefetch_idle(Duration::from_secs(20)));
    let s = c.stats();
    assert!(s.bytes_used <= budget);
    assert!(c.contains(key(2, 3)) || s.pinned_resident_bytes == 0);
    assert_eq!(s.reads, 8 * 1500);
    assert_eq!(s.load_errors, 0);
    lock(&c.shared.state).assert_consistent(budget);
}

#[test]
fn stats_serialize_to_json() {
    let c = ChunkCache::new(1024, 16).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(0, 100, 16, &calls);
    read_vec(&c, 0, 100, 0, 50, &l);
    c.record_decoded(123);
    let s = c.stats();
    let json = serde_json::to_string(&s).unwrap();
    assert!(json.contains("\"prefetch_hits\":0"));
    assert!(json.contains("\"archive_bytes_decoded\":123"));
    let back: CacheStats = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
    assert!((s.decoded_per_served - 123.0 / 50.0).abs() < 1e-9);
}

#[test]
fn latency_percentiles_bound_the_samples() {
    let h = Histogram::default();
    for us in [0u64, 1, 2, 3, 5, 100, 100, 100, 100, 5000] {
        h.record(us);
    }
    let s = h.snapshot();
    assert_eq!(s.count, 10);
    assert_eq!(s.max_us, 5000);
    assert!(s.p50_us >= 5 && s.p50_us <= 7, "{s:?}");
    assert!(s.p90_us >= 100 && s.p90_us <= 127, "{s:?}");
    assert_eq!(s.p99_us, 5000);
}

#[test]
fn cache_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<ChunkCache>();
    check::<CacheStats>();
}

/// A loader that fills chunks with 1 and notes when it was first called.
fn timed_loader() -> (ChunkLoader, Arc<Mutex<Option<Instant>>>) {
    let first = Arc::new(Mutex::new(None));
    let f = first.clone();
    let l: ChunkLoader = Arc::new(move |_, buf| {
        f.lock().unwrap().get_or_insert(Instant::now());
        buf.fill(1);
        Ok(buf.len())
    });
    (l, first)
}

/// Reads from chunk 0 of `file` with a loader that meets `started`, then takes `ms`
/// milliseconds, and notes in `done` when it ended.
fn slow_demand_read(
    c: &ChunkCache,
    file: u32,
    size: u64,
    ms: u64,
    started: &Barrier,
    done: &Mutex<Option<Instant>>,
) {
    let slow = |_: u64, buf: &mut [u8]| -> Result<usize, ReadError> {
        started.wait();
        std::thread::sleep(Duration::from_millis(ms));
        buf.fill(2);
        *done.lock().unwrap() = Some(Instant::now());
        Ok(buf.len())
    };
    c.read(file, size, 0, &mut [0u8; 4], &slow).unwrap();
}

#[test]
fn read_ahead_runs_beside_demand_loads() {
    // A sequential reader keeps a demand load of its own running (the kernel's read-ahead
    // sends the next request before the last is answered): read-ahead that waited for
    // demand loads, as explicit prefetch does, would never get ahead of it.
    let (cs, size) = (64, 64 * 20);
    let c = ChunkCache::new(1 << 20, cs).unwrap();
    c.start_prefetcher(1);
    let (bg, ra_start) = timed_loader();
    c.register_file(0, bg);
    let demand_done = Mutex::new(None);
    let started = Barrier::new(2);
    std::thread::scope(|s| {
        let (c, started, demand_done) = (&c, &started, &demand_done);
        // File 1: a demand load that takes 300 ms.
        s.spawn(move || slow_demand_read(c, 1, size, 300, started, demand_done));
        started.wait();
        // File 0, meanwhile: two sequential reads queue read-ahead.
        let fast = |_: u64, buf: &mut [u8]| -> Result<usize, ReadError> {
            buf.fill(1);
            Ok(buf.len())
        };
        c.read(0, size, 0, &mut [0u8; 32], &fast).unwrap();
        c.read(0, size, 32, &mut [0u8; 32], &fast).unwrap();
        assert_eq!(c.stats().readahead_triggers, 1);
        assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    });
    let start = ra_start.lock().unwrap().expect("read-ahead ran");
    let done = demand_done.lock().unwrap().unwrap();
    assert!(
        start < done,
        "read-ahead waited for another file's demand load"
    );
    assert!(c.contains(key(0, 2)));
}

#[test]
fn prefetch_waits_for_demand_loads() {
    let (cs, size) = (64, 640);
    let c = ChunkCache::new(1 << 20, cs).unwrap();
    c.start_prefetcher(1);
    let t0 = Instant::now();
    let demand_done = Mutex::new(None);
    let (bg, prefetch_start) = timed_loader();
    let started = Barrier::new(2);
    std::thread::scope(|s| {
        let (c, started, demand_done) = (&c, &started, &demand_done);
        s.spawn(move || slow_demand_read(c, 0, size, 150, started, demand_done));
        started.wait();
        c.prefetch(0, size, 3..4, bg.clone());
    });
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    let done = demand_done.lock().unwrap().unwrap();
    let start = prefetch_start.lock().unwrap().unwrap();
    assert!(
        start >= done,
        "prefetch began {:?} before the demand load ended",
        done - start
    );
    assert!(start.duration_since(t0) >= Duration::from_millis(150));
    assert_eq!(c.prefetch_registered(0, size, 0..2), 0);
    c.register_file(0, bg);
    assert_eq!(c.prefetch_registered(0, size, 4..6), 2);
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    assert!(c.contains(key(0, 4)) && c.contains(key(0, 5)));
}

#[test]
fn hinted_chunks_are_evicted_last_and_hints_are_consumed_by_reads() {
    let (cs, size) = (16, 320);
    for router in [true, false] {
        let mut cfg = CacheConfig::new(64, cs);
        cfg.router_eviction = router;
        let c = ChunkCache::with_config(cfg).unwrap();
        let calls = AtomicU64::new(0);
        let l = loader(0, size, cs, &calls);
        // Chunk 0 is read first (least recent) but a route says it is needed soon.
        read_vec(&c, 0, size, 0, 1, &l);
        assert_eq!(
            c.set_hints([key(0, 0), key(0, 9)]),
            if router { 2 } else { 0 }
        );
        for i in 1..8 {
            read_vec(&c, 0, size, i * cs, 1, &l);
        }
        // Budget of 4 chunks: plain LRU lost chunk 0, the router-aware cache kept it.
        assert_eq!(c.contains(key(0, 0)), router);
        assert!(c.stats().bytes_used <= 64);
        if router {
            // Reading it consumes the hint: from now on it ages like any chunk.
            read_vec(&c, 0, size, 0, 1, &l);
            assert_eq!(c.hint_count(), 1);
            for i in 10..14 {
                read_vec(&c, 0, size, i * cs, 1, &l);
            }
            assert!(!c.contains(key(0, 0)));
            // Replacing the hints moves hinted chunks back to the ordinary LRU.
            read_vec(&c, 0, size, 15 * cs, 1, &l);
            c.set_hints([key(0, 15)]);
            c.set_hints([]);
            for i in 16..20 {
                read_vec(&c, 0, size, i * cs, 1, &l);
            }
            assert!(!c.contains(key(0, 15)));
        }
    }
}

#[test]
fn evict_selected_chunks_spares_pins() {
    let (cs, size) = (16, 160);
    let c = ChunkCache::new(160, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(0, size, cs, &calls);
    read_vec(&c, 0, size, 0, 64, &l);
    c.pin(key(0, 1), size).unwrap();
    assert_eq!(c.evict([key(0, 0), key(0, 1), key(0, 7)]), 16);
    assert!(!c.contains(key(0, 0)));
    assert!(c.contains(key(0, 1)));
    assert!(c.contains(key(0, 2)));
}

#[test]
fn trace_records_demand_lookups_in_order() {
    let (cs, size) = (16, 160);
    let c = ChunkCache::new(160, cs).unwrap();
    c.start_prefetcher(1);
    let calls = Arc::new(AtomicU64::new(0));
    let l = shared_loader(0, size, cs, calls.clone());
    read_vec(&c, 0, size, 0, 1, &*l); // before the trace: not recorded
    c.trace_start();
    assert!(c.tracing());
    c.prefetch(0, size, 5..6, l.clone());
    assert!(c.wait_prefetch_idle(Duration::from_secs(5)));
    read_vec(&c, 0, size, 0, 1, &*l);
    read_vec(&c, 0, size, 3 * cs, 1, &*l);
    read_vec(&c, 0, size, 5 * cs, 1, &*l);
    let (ev, dropped) = c.trace_stop();
    assert!(!c.tracing());
    assert_eq!(dropped, 0);
    let got: Vec<(u64, TraceOutcome)> = ev.iter().map(|e| (e.index, e.outcome)).collect();
    assert_eq!(
        got,
        [
            (0, TraceOutcome::Hit),
            (3, TraceOutcome::Miss),
            (5, TraceOutcome::PrefetchHit)
        ]
    );
    assert!(ev.windows(2).all(|w| w[0].t_us <= w[1].t_us));
    read_vec(&c, 0, size, 6 * cs, 1, &*l);
    assert!(c.trace_stop().0.is_empty());
}

#[test]
fn loads_in_flight_count_against_the_budget() {
    // Budget of 8 chunks, each load may hold 3 chunks' worth while it runs.
    let cs = 64u64;
    let size = 64 * cs;
    let mut cfg = CacheConfig::new(8 * cs, cs);
    cfg.readahead_chunks = 0;
    cfg.load_work_factor = 3;
    let c = ChunkCache::with_config(cfg).unwrap();
    let calls = AtomicU64::new(0);
    let plain = loader(0, size, cs, &calls);
    // Loading one chunk at a time, each load makes room for its work first: of the
    // 8 chunks read, 6 stay (5 beside a load's 3, then the loaded one).
    for i in 0..8 {
        read_vec(&c, 0, size, i * cs, cs as usize, &plain);
    }
    assert_eq!(c.bytes_used(), 6 * cs);
    // While the 9th chunk loads, resident chunks leave room for its 3 chunks of work.
    let seen = AtomicU64::new(u64::MAX);
    let watching = |index: u64, buf: &mut [u8]| {
        seen.store(c.bytes_used(), Relaxed);
        plain(index, buf)
    };
    read_vec(&c, 0, size, 8 * cs, cs as usize, &watching);
    assert_eq!(seen.load(Relaxed), 5 * cs, "resident bytes during the load");
    // Afterwards the work is released: the new chunk joins the 5 others.
    assert_eq!(c.bytes_used(), 6 * cs);
    assert_eq!(lock(&c.shared.state).working, 0);
    lock(&c.shared.state).assert_consistent(8 * cs);
    // A failing load releases its work too.
    let failing = |_: u64, _: &mut [u8]| -> Result<usize, ReadError> {
        Err(ReadError::Io(std::io::Error::other("no")))
    };
    let mut buf = vec![0u8; cs as usize];
    assert!(c.read(0, size, 20 * cs, &mut buf, &failing).is_err());
    assert_eq!(lock(&c.shared.state).working, 0);
}

#[test]
fn charges_take_room_from_chunks_and_pins() {
    let cs = 64u64;
    let size = 64 * cs;
    let mut cfg = CacheConfig::new(8 * cs, cs);
    cfg.readahead_chunks = 0;
    let c = ChunkCache::with_config(cfg).unwrap();
    let calls = AtomicU64::new(0);
    let load = loader(0, size, cs, &calls);
    for i in 0..8 {
        read_vec(&c, 0, size, i * cs, cs as usize, &load);
    }
    assert_eq!(c.bytes_used(), 8 * cs);
    // A charge evicts what it needs at once and stays: later loads keep beside it.
    c.charge("a tokenizer", 3 * cs).unwrap();
    assert_eq!(c.bytes_used(), 5 * cs);
    read_vec(&c, 0, size, 20 * cs, cs as usize, &load);
    assert_eq!(c.bytes_used(), 5 * cs);
    assert_eq!(c.stats().charged_bytes, 3 * cs);
    // Pins share the rest; a charge beyond it is refused whole, naming the holder.
    c.pin(key(0, 30), size).unwrap();
    c.pin(key(0, 31), size).unwrap();
    let e = c.charge("the router's tokenizer", 4 * cs).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("the router's tokenizer") && msg.contains("320 already pinned or charged"),
        "{msg}"
    );
    assert_eq!(c.stats().charged_bytes, 3 * cs);
    assert!(c.pin(key(0, 32), size).is_ok());
    assert!(c.pin(key(0, 33), size).is_ok());
    assert!(c.pin(key(0, 34), size).is_ok());
    assert!(
        c.pin(key(0, 35), size).is_err(),
        "3 charged + 5 pinned fill the budget"
    );
    lock(&c.shared.state).assert_consistent(8 * cs);
}

#[test]
fn reservations_make_room_first_and_give_it_back() {
    let cs = 64u64;
    let size = 64 * cs;
    let mut cfg = CacheConfig::new(8 * cs, cs);
    cfg.readahead_chunks = 0;
    let c = ChunkCache::with_config(cfg).unwrap();
    let calls = AtomicU64::new(0);
    let load = loader(0, size, cs, &calls);
    for i in 0..8 {
        read_vec(&c, 0, size, i * cs, cs as usize, &load);
    }
    c.pin(key(0, 30), size).unwrap();
    c.charge("a tokenizer", 2 * cs).unwrap();
    // More than pins and charges leave: what is left is set aside, chunks evicted for it.
    assert_eq!(c.reserve(100 * cs), 5 * cs);
    assert_eq!(c.bytes_used(), 0);
    assert_eq!(c.stats().charged_bytes, 7 * cs);
    // Nothing is left for a charge now, and a second reservation gets nothing.
    assert!(c.charge("more", 1).is_err());
    assert_eq!(c.reserve(cs), 0);
    // Reads still work beside it (one load at a time), and keep nothing.
    let mut buf = vec![0u8; cs as usize];
    c.read(0, size, 40 * cs, &mut buf, &load).unwrap();
    assert_eq!(c.bytes_used(), 0);
    c.uncharge(5 * cs);
    assert_eq!(c.stats().charged_bytes, 2 * cs);
    for i in 0..8 {
        read_vec(&c, 0, size, i * cs, cs as usize, &load);
    }
    assert_eq!(c.bytes_used(), 5 * cs, "8 budget - 2 charged - 1 pinned");
    lock(&c.shared.state).assert_consistent(8 * cs);
}

#[test]
fn loads_wait_for_room_for_their_work() {
    // Budget of 8 chunks, 3 charged: room for one load's work (3 chunks) beside the
    // charge, not two. Eight readers of different chunks at once: never more than one
    // load runs, and every reader still gets its bytes.
    let cs = 64u64;
    let size = 64 * cs;
    let mut cfg = CacheConfig::new(8 * cs, cs);
    cfg.readahead_chunks = 0;
    cfg.load_work_factor = 3;
    let c = ChunkCache::with_config(cfg).unwrap();
    c.charge("a tokenizer", 3 * cs).unwrap();
    let calls = AtomicU64::new(0);
    let plain = loader(0, size, cs, &calls);
    let (running, most) = (AtomicU64::new(0), AtomicU64::new(0));
    let slow = |index: u64, buf: &mut [u8]| {
        let now = running.fetch_add(1, Relaxed) + 1;
        most.fetch_max(now, Relaxed);
        std::thread::sleep(Duration::from_millis(20));
        running.fetch_sub(1, Relaxed);
        plain(index, buf)
    };
    let start = Barrier::new(8);
    std::thread::scope(|s| {
        for i in 0..8u64 {
            let (c, slow, start) = (&c, &slow, &start);
            s.spawn(move || {
                start.wait();
                read_vec(c, 0, size, i * cs, cs as usize, slow);
            });
        }
    });
    assert_eq!(most.load(Relaxed), 1, "loads ran at once beyond the budget");
    assert_eq!(calls.load(Relaxed), 8);
    let st = c.stats();
    assert!(st.room_waits >= 1, "{st:?}");
    assert_eq!(lock(&c.shared.state).room_waiters, 0);
    lock(&c.shared.state).assert_consistent(8 * cs);
    // With room for two loads' work (no charge, budget 8 > 2 x 3), two run at once.
    let c = ChunkCache::with_config({
        let mut cfg = CacheConfig::new(8 * cs, cs);
        cfg.readahead_chunks = 0;
        cfg.load_work_factor = 3;
        cfg
    })
    .unwrap();
    most.store(0, Relaxed);
    let start = Barrier::new(8);
    std::thread::scope(|s| {
        for i in 0..8u64 {
            let (c, slow, start) = (&c, &slow, &start);
            s.spawn(move || {
                start.wait();
                read_vec(c, 0, size, i * cs, cs as usize, slow);
            });
        }
    });
    assert_eq!(most.load(Relaxed), 2);
}

#[test]
fn read_with_hands_out_one_part_per_chunk_touched() {
    let (cs, size) = (16, 100);
    let c = ChunkCache::new(1024, cs).unwrap();
    let calls = AtomicU64::new(0);
    let l = loader(3, size, cs, &calls);
    let want = reference(3, size);
    // (offset, len, parts): inside one chunk, across three, clipped at EOF, past EOF.
    for (off, len, parts) in [
        (17, 10, 1),
        (0, 16, 1),
        (10, 30, 3),
        (90, 50, 2),
        (100, 4, 0),
    ] {
        let got = c
            .read_with(3, size, off, len, &l, |p| {
                (
                    p.len(),
                    p.iter()
                        .flat_map(|s| s.iter().copied())
                        .collect::<Vec<u8>>(),
                )
            })
            .unwrap();
        let end = (off + len as u64).min(size).max(off) as usize;
        let expect = want.get(off as usize..end).unwrap_or(&[]);
        assert_eq!(got, (parts, expect.to_vec()), "read of {len} at {off}");
    }
    // The bytes served count what the parts held, not what was asked for.
    assert_eq!(c.stats().bytes_served, 10 + 16 + 30 + 10);
}

#[test]
fn expert_predictor_queues_the_next_layers_expert_and_read_ahead_stays_in_one() {
    // 3 layers of 4 experts, each expert 4 chunks, one after another.
    let (cs, per, layers, experts) = (64u64, 4u64, 3u32, 4u32);
    let size = cs * per * u64::from(layers * experts);
    let ext = |l: u32, e: u32| {
        let a = u64::from(l * experts + e) * per * cs;
        a..a + per * cs
    };
    let map = || {
        let all = (0..layers).flat_map(|l| (0..experts).map(move |e| (l, e, ext(l, e))));
        ExpertMap::new(experts, 1, all).unwrap()
    };
    let c = ChunkCache::new(1 << 20, cs).unwrap();
    c.start_prefetcher(1);
    c.register_file(5, shared_loader(5, size, cs, Arc::new(AtomicU64::new(0))));
    assert!(c.set_experts(5, map(), ExpertMode::Prefetch));
    assert!(
        !c.set_experts(5, map(), ExpertMode::Prefetch),
        "one per file"
    );
    let demand = AtomicU64::new(0);
    let l = loader(5, size, cs, &demand);
    let r = reference(5, size);
    // A sequential run inside expert 1 of layer 0 does not read ahead ...
    let (x, y) = (ext(0, 1), ext(0, 2));
    let at = x.start as usize;
    assert_eq!(read_vec(&c, 5, size, x.start, 32, &l), r[at..at + 32]);
    assert_eq!(
        read_vec(&c, 5, size, x.start + 32, 32, &l),
        r[at + 32..at + 64]
    );
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    assert!(
        !c.contains(key(5, x.start / cs + 1)),
        "read ahead inside an expert"
    );
    // ... until the run has read more whole experts than a token uses (one here: it
    // reads experts 1 and 2 whole): a reader of the whole file.
    let len = (y.end - x.start) as usize;
    assert_eq!(
        read_vec(&c, 5, size, x.start + 64, len, &l),
        r[at + 64..at + 64 + len]
    );
    assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    assert!(
        c.contains(key(5, y.end / cs + 1)),
        "no read-ahead for a whole-file reader"
    );
    // Tokens route layer l to expert (t + l) % 4, one read in each expert they use
    // (of a quarter of it: what counts as reading an expert).
    for t in 0..40 {
        for layer in 0..layers {
            let e = (t + layer) % experts;
            let off = ext(layer, e).start + cs + 8;
            let got = read_vec(&c, 5, size, off, 64, &l);
            assert_eq!(got, r[off as usize..off as usize + 64]);
        }
        assert!(c.wait_prefetch_idle(Duration::from_secs(10)));
    }
    let s = c.stats();
    let x = &s.experts;
    assert_eq!((x.files, x.prefetch), (1, true));
    assert!(x.precision > 0.9 && x.recall > 0.5, "{x:?}");
    assert!(x.queued_chunks >= x.predicted * per, "{x:?}");
    assert!(s.prefetch_hits > 0, "{s:?}");
    assert!(s.stalls > 0 && s.stalls <= s.misses, "{s:?}");
    assert!(s.stall_us > 0);
    // What it learned, taken back by another cache of the same file only.
    let saved = c.save_experts(5, 7).expect("learned");
    let c2 = ChunkCache::new(1 << 20, cs).unwrap();
    assert!(c2.load_experts(5, 7, &saved).is_err(), "no predictor yet");
    c2.set_experts(5, map(), ExpertMode::Learn);
    assert!(c2.load_experts(5, 8, &saved).is_err());
    c2.load_experts(5, 7, &saved).unwrap();
    assert!(c2.stats().experts.loaded_steps > 0);
    assert!(!c2.stats().experts.prefetch);
}

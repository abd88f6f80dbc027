//! Warm-path throughput of the chunk cache (a memcpy out of resident chunks).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use cawsfs::cache::{ChunkCache, DEFAULT_CHUNK_SIZE};

fn byte(file: u32, pos: u64) -> u8 {
    (pos.wrapping_mul(31) ^ (pos >> 8) ^ (file as u64 * 97)) as u8
}

pub fn warm_read_throughput() {
    let cs = DEFAULT_CHUNK_SIZE;
    let size = 64 << 20;
    let c = ChunkCache::new(128 << 20, cs).unwrap();
    let calls = AtomicU64::new(0);
    // The same reference "file" as the cache's unit tests, chunk by chunk.
    let l = |index: u64, buf: &mut [u8]| {
        calls.fetch_add(1, Relaxed);
        let start = index * cs;
        assert!(start < size);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = byte(0, start + i as u64);
        }
        Ok(buf.len())
    };
    let mut buf = vec![0u8; 128 << 10];
    for off in (0..size).step_by(buf.len()) {
        c.read(0, size, off, &mut buf, &l).unwrap();
    }
    let t = Instant::now();
    let rounds = 8;
    for _ in 0..rounds {
        for off in (0..size).step_by(buf.len()) {
            c.read(0, size, off, &mut buf, &l).unwrap();
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let s = c.stats();
    println!(
        "warm 128 KiB reads: {:.2} GB/s, p50 {} us, p99 {} us",
        (rounds * size) as f64 / secs / 1e9,
        s.latency_us.p50_us,
        s.latency_us.p99_us
    );
}

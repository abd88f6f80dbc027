//! PQ codebook training time (k-means), with and without Lloyd iterations.

use cawsfs::codec::bench_api::pq_train;

pub fn train_timing() {
    let data: Vec<f32> = (0..32768 * 4).map(|i| ((i as f32) * 0.618).sin()).collect();
    for iters in [0u32, 15] {
        let t = std::time::Instant::now();
        let _ = pq_train(&data, 4, 256, iters, 1);
        println!(
            "k-means, 32768 × d=4, k=256, {iters} iters: {:.2?}",
            t.elapsed()
        );
    }
}

//! `cawsfs device-check`: every tensor of an archive reconstructed on the CPU and on
//! the GPU, bytes compared; with `--bench N`, both timed per codec (scripts/test-cuda.sh,
//! docs/CUDA.md).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};

use cawsfs::reconstruct::{self, Active, DeviceChoice};

use super::args::DeviceArgs;

/// One timed round of a codec's tensors: (GPU profile, GPU read wall seconds, CPU
/// profile, CPU read wall seconds).
type Round = (reconstruct::Profile, f64, reconstruct::Profile, f64);

#[derive(Default)]
struct Row {
    tensors: usize,
    values: u64,
    /// Per timed round, summed over the codec's tensors.
    rounds: Vec<Round>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

pub fn cmd_device_check(path: &Path, bench: usize, d: &DeviceArgs) -> Result<()> {
    let choice = match d.device {
        DeviceChoice::Auto => DeviceChoice::Cuda(0),
        c => c,
    };
    let active = reconstruct::init(choice, d.vram_budget)?;
    let Active::Cuda { .. } = active else {
        bail!("device-check compares the CPU with a GPU: --device must name one");
    };
    eprintln!(
        "device-check on {active}, {} CPU threads",
        rayon::current_num_threads()
    );
    let ar = cawsfs::archive::open(path)?;
    let model = ar.model();
    let (mut differing, mut total) = (0u64, 0u64);
    let mut by_codec: BTreeMap<String, Row> = BTreeMap::new();
    let fallbacks0 = reconstruct::stats().fallbacks;
    for (t, desc) in model.tensors.iter().enumerate() {
        let (rows, cols) = (desc.rows(), desc.cols());
        let n = (rows * cols) as usize;
        let mut cpu = vec![0f32; n];
        // A sentinel the GPU must overwrite: a value it left alone shows up as a difference.
        let mut gpu = vec![f32::from_bits(0x7FBA_DBAD); n];
        reconstruct::use_gpu(false);
        ar.read_rows(t, 0, rows, &mut cpu)?;
        reconstruct::use_gpu(true);
        ar.read_rows(t, 0, rows, &mut gpu)?;
        let a: &[u8] = bytemuck::cast_slice(&cpu);
        let b: &[u8] = bytemuck::cast_slice(&gpu);
        let diff = a.iter().zip(b).filter(|(x, y)| x != y).count() as u64;
        if diff > 0 {
            let first = cpu
                .iter()
                .zip(&gpu)
                .position(|(x, y)| x.to_bits() != y.to_bits())
                .unwrap_or(0);
            eprintln!(
                "{}: {diff} bytes differ (first at value {first}: cpu {:e} gpu {:e})",
                desc.name, cpu[first], gpu[first]
            );
        }
        differing += diff;
        total += a.len() as u64;
        let label = ar.tensor_summary(t).codec;
        let codec = label.split('(').next().unwrap_or(&label).to_string();
        let row = by_codec.entry(codec).or_default();
        row.tensors += 1;
        row.values += n as u64;
        // Timed rounds, GPU and CPU interleaved.
        for r in 0..bench {
            reconstruct::use_gpu(true);
            reconstruct::profile(true);
            let t0 = Instant::now();
            ar.read_rows(t, 0, rows, &mut gpu)?;
            let gw = t0.elapsed().as_secs_f64();
            let gp = reconstruct::profile_now();
            reconstruct::use_gpu(false);
            reconstruct::profile(true);
            let t0 = Instant::now();
            ar.read_rows(t, 0, rows, &mut cpu)?;
            let cw = t0.elapsed().as_secs_f64();
            let cp = reconstruct::profile_now();
            reconstruct::profile(false);
            if row.rounds.len() <= r {
                row.rounds.push(Default::default());
            }
            let acc = &mut row.rounds[r];
            acc.0.copy_in_ns += gp.copy_in_ns;
            acc.0.compute_f32_ns += gp.compute_f32_ns;
            acc.0.compute_f16_ns += gp.compute_f16_ns;
            acc.0.copy_out_ns += gp.copy_out_ns;
            acc.0.bytes_in += gp.bytes_in;
            acc.0.gpu_values += gp.gpu_values;
            acc.1 += gw;
            acc.2.cpu_ns += cp.cpu_ns;
            acc.2.cpu_values += cp.cpu_values;
            acc.3 += cw;
        }
    }
    reconstruct::use_gpu(true);
    let fallbacks = reconstruct::stats().fallbacks - fallbacks0;
    println!(
        "{}: {} tensors, {differing} of {total} bytes differ between CPU and GPU, {fallbacks} GPU fallbacks",
        path.display(),
        model.tensors.len()
    );
    if bench > 0 {
        println!(
            "| codec | tensors | values | GPU f16 out, on device | GPU f32 out, on device | copy in+out share | CPU decode, all cores (f32) | read_rows GPU / CPU (wall) |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for (codec, r) in &by_codec {
            let gbs = |values: u64, bytes_per: f64, ns: u64| {
                if ns == 0 {
                    f64::NAN
                } else {
                    values as f64 * bytes_per / ns as f64
                }
            };
            let m = |f: &dyn Fn(&Round) -> f64| median(r.rounds.iter().map(f).collect());
            let f16 = m(&|x| gbs(x.0.gpu_values, 2.0, x.0.compute_f16_ns));
            let f32_ = m(&|x| gbs(x.0.gpu_values, 4.0, x.0.compute_f32_ns));
            let share = m(&|x| {
                let c = (x.0.copy_in_ns + x.0.copy_out_ns) as f64;
                c / (c + x.0.compute_f32_ns as f64)
            });
            let cpu = m(&|x| gbs(x.2.cpu_values, 4.0, x.2.cpu_ns));
            let wall = m(&|x| x.1 / x.3);
            println!(
                "| {codec} | {} | {} | {f16:.1} GB/s | {f32_:.1} GB/s | {:.0} % | {cpu:.2} GB/s | {wall:.2} |",
                r.tensors,
                r.values,
                share * 100.0
            );
        }
        println!("(medians of {bench} interleaved rounds; GB/s of reconstructed output)");
    }
    if differing > 0 || fallbacks > 0 {
        bail!("the GPU's bytes differ from the CPU's ({differing} bytes, {fallbacks} fallbacks)");
    }
    Ok(())
}

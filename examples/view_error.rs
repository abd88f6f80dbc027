//! The relative error ‖Q(Ŵ)−Ŵ‖/‖Ŵ‖ each ggml type adds to an archive's reconstructed
//! weights, per type over the 2-D tensors whose rows it fits: the measurement behind the
//! `auto` view's table (docs/MOUNT.md, "Views").
//!
//!     cargo run --release --example view_error -- ARCHIVE
use std::process::ExitCode;

use cawsfs::gguf::quant::dequantize;
use cawsfs::gguf::quantize::{can_quantize, quantize};
use cawsfs::gguf::GgmlType;

const TYPES: [GgmlType; 8] = [
    GgmlType::Q8_0,
    GgmlType::Q6_K,
    GgmlType::Q5_K,
    GgmlType::Q5_1,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q4_1,
    GgmlType::Q4_0,
];

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: view_error ARCHIVE");
        return ExitCode::FAILURE;
    };
    let ar = match cawsfs::archive::open(std::path::Path::new(&path)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let model = ar.model();
    // Per type: (Σ‖err‖², Σ‖W‖², tensors, per-tensor relative errors).
    let mut acc: Vec<(f64, f64, Vec<f64>)> = vec![(0.0, 0.0, Vec::new()); TYPES.len()];
    for (i, t) in model.tensors.iter().enumerate() {
        if t.shape.len() < 2 {
            continue;
        }
        let (rows, cols) = (t.rows(), t.cols());
        let mut w = vec![0f32; (rows * cols) as usize];
        if let Err(e) = ar.read_rows(i, 0, rows, &mut w) {
            eprintln!("{}: {e}", t.name);
            return ExitCode::FAILURE;
        }
        let norm: f64 = w.iter().map(|v| (*v as f64).powi(2)).sum();
        for (k, ty) in TYPES.iter().enumerate() {
            let Some(rb) = ty.row_bytes(cols).filter(|_| can_quantize(*ty)) else {
                continue;
            };
            let mut q = vec![0u8; (rb * rows) as usize];
            let mut back = vec![0f32; w.len()];
            quantize(*ty, &w, &mut q).expect("sizes match");
            dequantize(*ty, &q, &mut back).expect("sizes match");
            let err: f64 = w
                .iter()
                .zip(&back)
                .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
                .sum();
            acc[k].0 += err;
            acc[k].1 += norm;
            acc[k].2.push((err / norm.max(f64::MIN_POSITIVE)).sqrt());
        }
    }
    println!("type  bits/w  tensors  rel_err(all)  rel_err(median tensor)");
    for (ty, (e, n, per)) in TYPES.iter().zip(&mut acc) {
        if per.is_empty() {
            continue;
        }
        per.sort_by(f64::total_cmp);
        let (be, bb) = ty.block();
        println!(
            "{:<5} {:>6.3} {:>8} {:>13.5} {:>23.5}",
            format!("{ty:?}").to_lowercase(),
            bb as f64 * 8.0 / be as f64,
            per.len(),
            (*e / n.max(f64::MIN_POSITIVE)).sqrt(),
            per[per.len() / 2]
        );
    }
    ExitCode::SUCCESS
}

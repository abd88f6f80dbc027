//! `cawsfs::gguf::quantize` as a filter, for tests/clients/test_quantizers.py, which
//! compares its bytes with ggml's own quantizers.
//!
//! `quantize_rows TYPE < values.f32 > blocks.bin`: reads little-endian f32 values (a
//! whole number of TYPE's blocks) from stdin and writes TYPE's blocks to stdout. TYPE
//! is a ggml type name (F32, F16, BF16, Q8_0, Q4_K ...). Bad input: one line on
//! stderr, exit status 2.

use std::io::{Read, Write};

use cawsfs::gguf::quantize::{can_quantize, quantize};
use cawsfs::gguf::GgmlType;

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [name] = args.as_slice() else {
        return Err("usage: quantize_rows TYPE < f32 values > blocks".into());
    };
    let ty = (0..64)
        .filter_map(GgmlType::from_id)
        .find(|t| format!("{t:?}").eq_ignore_ascii_case(name) && can_quantize(*t))
        .ok_or_else(|| format!("quantize_rows: {name:?} is not a type it can quantize"))?;
    let mut raw = Vec::new();
    std::io::stdin()
        .read_to_end(&mut raw)
        .map_err(|e| format!("quantize_rows: reading stdin: {e}"))?;
    if raw.len() % 4 != 0 {
        return Err(format!(
            "quantize_rows: {} bytes of input are not whole f32 values",
            raw.len()
        ));
    }
    let src: Vec<f32> = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let (be, bb) = ty.block();
    let mut out = vec![0u8; src.len() / be as usize * bb as usize];
    quantize(ty, &src, &mut out).map_err(|e| format!("quantize_rows: {e}"))?;
    std::io::stdout()
        .write_all(&out)
        .map_err(|e| format!("quantize_rows: writing stdout: {e}"))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("{e}");
        std::process::exit(2);
    }
}

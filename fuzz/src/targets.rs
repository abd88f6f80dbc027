//! The body of every fuzz target, one function per target (the binaries in
//! `fuzz_targets/` hand AFL's input to these), so that `bench` can time them over the
//! seed corpus in a plain loop, without AFL.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use cawsfs::archive::npydir::npy;
use cawsfs::archive::{encode_routing, parse_routing};
use cawsfs::control::protocol::{Request, Response};
use cawsfs::control::{render, reply};
use serde::Deserialize;
use serde_json::Value;

use crate::{fresh_dir, open_archive, open_source, tiny, with_dir, with_dir_defaults, with_file};

/// The body of the target called `name`.
pub fn by_name(name: &str) -> Option<fn(&[u8])> {
    Some(match name {
        "cawsf" => cawsf,
        "delta" => delta,
        "npydir" => npydir,
        "npy_header" => npy_header,
        "gguf" => gguf,
        "safetensors" => safetensors,
        "hf_json" => hf_json,
        "routing" => routing,
        "control" => control,
        "imatrix" => imatrix,
        _ => return None,
    })
}

pub fn cawsf(data: &[u8]) {
    crate::init();
    with_file("input.cawsf", data, open_archive);
}

pub fn delta(data: &[u8]) {
    crate::init();
    with_file("input.cawsfd", data, open_archive);
}

pub fn npydir(data: &[u8]) {
    crate::init();
    with_dir(data, open_archive);
}

pub fn npy_header(data: &[u8]) {
    crate::init();
    let _ = npy::header_len(&data[..data.len().min(12)]);
    if let Ok(h) = npy::parse(data) {
        assert!(h.data_offset <= data.len() as u64);
        let again = npy::parse(&npy::write_header(h.dtype, &h.shape)).expect("own header");
        assert_eq!((again.dtype, &again.shape), (h.dtype, &h.shape));
    }
}

pub fn gguf(data: &[u8]) {
    crate::init();
    let _ = cawsfs::gguf::reader::parse_header(data);
    with_file("model.gguf", data, |p| open_source(p, true));
}

pub fn safetensors(data: &[u8]) {
    crate::init();
    // The tiny model's JSON, written once: only `model.safetensors` changes.
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = fresh_dir("safetensors");
        for (name, bytes) in tiny::json_files() {
            std::fs::write(dir.join(name), bytes).expect("write the tiny model's JSON");
        }
        dir
    });
    std::fs::write(dir.join("model.safetensors"), data).expect("write input");
    // The tokenizer is the tiny model's, the same in every execution: `hf_json` loads
    // the tokenizers its inputs hold.
    open_source(dir, false);
}

pub fn hf_json(data: &[u8]) {
    crate::init();
    static WEIGHTS: OnceLock<Vec<u8>> = OnceLock::new();
    let weights = WEIGHTS.get_or_init(tiny::safetensors_bytes);
    with_dir_defaults(data, &[("model.safetensors", weights)], |dir| {
        open_source(dir, true)
    });
}

pub fn routing(data: &[u8]) {
    crate::init();
    if let Ok(r) = parse_routing(data) {
        let once = encode_routing(&r);
        let back = parse_routing(&once).expect("encoded routing parses");
        assert_eq!(encode_routing(&back), once);
    }
}

pub fn imatrix(data: &[u8]) {
    crate::init();
    if let Ok(m) = cawsfs::import::imatrix::Imatrix::parse(data) {
        assert!(!m.is_empty());
        for (name, v) in m.entries() {
            assert!(
                !v.is_empty() && v.iter().all(|x| x.is_finite() && *x >= 0.0),
                "{name}"
            );
        }
        // Lookups by model name: a match of the wrong width is an error, never a panic.
        for name in ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight"] {
            let _ = m.for_tensor(name, 64);
        }
    }
}

pub fn control(data: &[u8]) {
    crate::init();
    if let Ok(req) = Request::parse_line(data) {
        let _ = req.verb();
        let back = Request::from_json(&req.to_json()).expect("own wire form parses");
        assert_eq!(back, req);
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(resp) = Response::parse_line(text) else {
        return;
    };
    let _ = Response::parse_line(&resp.to_line()).expect("own reply parses");
    let Response::Ok(fields) = resp else {
        return;
    };
    let payload = Value::Object(fields);
    let _ = reply::PingReply::deserialize(&payload);
    let _ = reply::RouteReply::deserialize(&payload);
    let _ = reply::TraceOffReply::deserialize(&payload);
    if let Ok(stat) = reply::StatReply::deserialize(&payload) {
        let _ = render::render_stat(&stat);
        let _ = render::render_prometheus(&stat);
        let _ = render::render_rates(&stat, &stat, Duration::from_millis(1500));
        let _ = render::render_rates(&stat, &stat, Duration::ZERO);
    }
}

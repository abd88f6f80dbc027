//! The body of every fuzz target, one function per target (the binaries in
//! `fuzz_targets/` hand AFL's input to these), so that `bench` can time them over the
//! seed corpus in a plain loop, without AFL.

use std::sync::OnceLock;
use std::time::Duration;

use cawsfs::archive::npydir::npy;
use cawsfs::archive::{encode_routing, parse_routing};
use cawsfs::control::protocol::{Request, Response};
use cawsfs::control::{render, reply};
use serde::Deserialize;
use serde_json::Value;

use crate::{open_archive, open_source, scratch, tiny, with_dir, with_file};

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
        _ => return None,
    })
}

pub fn cawsf(data: &[u8]) {
    with_file("input.cawsf", data, open_archive);
}

pub fn delta(data: &[u8]) {
    with_file("input.cawsfd", data, open_archive);
}

pub fn npydir(data: &[u8]) {
    with_dir(data, open_archive);
}

pub fn npy_header(data: &[u8]) {
    let _ = npy::header_len(&data[..data.len().min(12)]);
    if let Ok(h) = npy::parse(data) {
        assert!(h.data_offset <= data.len() as u64);
        let again = npy::parse(&npy::write_header(h.dtype, &h.shape)).expect("own header");
        assert_eq!((again.dtype, &again.shape), (h.dtype, &h.shape));
    }
}

pub fn gguf(data: &[u8]) {
    let _ = cawsfs::gguf::reader::parse_header(data);
    with_file("model.gguf", data, open_source);
}

pub fn safetensors(data: &[u8]) {
    static JSON: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    let json = JSON.get_or_init(tiny::json_files);
    let dir = scratch();
    for (name, bytes) in json {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    std::fs::write(dir.path().join("model.safetensors"), data).unwrap();
    open_source(dir.path());
}

pub fn hf_json(data: &[u8]) {
    static WEIGHTS: OnceLock<Vec<u8>> = OnceLock::new();
    let weights = WEIGHTS.get_or_init(tiny::safetensors_bytes);
    with_dir(data, |dir| {
        let st = dir.join("model.safetensors");
        if !st.exists() {
            let _ = std::fs::write(&st, weights);
        }
        open_source(dir);
    });
}

pub fn routing(data: &[u8]) {
    if let Ok(r) = parse_routing(data) {
        let once = encode_routing(&r);
        let back = parse_routing(&once).expect("encoded routing parses");
        assert_eq!(encode_routing(&back), once);
    }
}

pub fn control(data: &[u8]) {
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

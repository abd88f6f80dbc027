//! The control protocol (docs/CONTROL.md), both ends: the daemon's request line parser
//! (`Request::parse_line`; a parsed request must survive its own wire form unchanged)
//! and the client's reply side (`Response::parse_line`, then the payload read as each
//! typed reply the CLI decodes, and `stat`'s renderers run on a decoded `StatReply`).
use std::time::Duration;

use cawsfs::control::protocol::{Request, Response};
use cawsfs::control::{render, reply};
use serde::Deserialize;
use serde_json::Value;

fn main() {
    afl::fuzz!(|data: &[u8]| {
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
    });
}

//! Commands that talk to a running mount over its control socket: stat, prefetch, pin,
//! unpin, evict, route and trace.

use std::path::Path;

use anyhow::{bail, Result};

use super::args::RouteArgs;

pub fn cmd_stat(
    mp: &Path,
    socket: Option<&Path>,
    json: bool,
    prometheus: bool,
    watch: bool,
    interval: f64,
) -> Result<()> {
    use cawsfs::control::{self, Request};
    let sock = socket
        .map(Path::to_path_buf)
        .unwrap_or_else(|| control::find_socket(mp));
    let timeout = std::time::Duration::from_secs(5);
    if watch {
        if !(interval.is_finite() && interval >= 0.05) {
            bail!("--interval must be at least 0.05 seconds");
        }
        let mut client = control::ControlClient::connect(&sock, timeout)?;
        control::watch(
            std::time::Duration::from_secs_f64(interval),
            || Ok(client.call(&Request::Stat)?),
            &mut std::io::stdout(),
        )?;
        return Ok(());
    }
    let stats = control::request(&sock, &Request::Stat, timeout)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
    } else if prometheus {
        print!("{}", control::render_prometheus(&stats));
    } else {
        print!("{}", control::render_stat(&stats));
    }
    Ok(())
}

/// Send one control request and print the reply's payload.
pub fn control_call(mp: &Path, socket: Option<&Path>, req: cawsfs::control::Request) -> Result<()> {
    let sock = socket
        .map(Path::to_path_buf)
        .unwrap_or_else(|| cawsfs::control::find_socket(mp));
    let reply = cawsfs::control::request(&sock, &req, std::time::Duration::from_secs(30))?;
    let mut v = reply;
    if let Some(o) = v.as_object_mut() {
        o.remove("ok");
    }
    println!("{}", serde_json::to_string(&v)?);
    Ok(())
}

pub fn cmd_route(a: RouteArgs) -> Result<()> {
    use cawsfs::control::{self, Request};
    let sock = a
        .socket
        .clone()
        .unwrap_or_else(|| control::find_socket(&a.mountpoint));
    let req = Request::Route {
        prompt: a.prompt.clone(),
        top_k: a.top_k,
        budget_bytes: a.budget,
        prefetch: a.prefetch,
        file: a.file.clone(),
    };
    let v = control::request(&sock, &req, std::time::Duration::from_secs(30))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let toks: Vec<&str> = v["tokens"]
        .as_array()
        .map(|t| t.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    println!("prompt tokens: {}", toks.join(" "));
    println!(
        "{:>4}  {:<9} {:>6} {:>8}  {:>10}  {:>13}  tensor [rows]",
        "rank", "kind", "order", "score", "cost", "chunks"
    );
    for s in v["shards"].as_array().into_iter().flatten() {
        let score = s["score"]
            .as_f64()
            .map_or("-".to_string(), |x| format!("{x:.4}"));
        // serde_json values ignore width, so numbers go through to_string first.
        println!(
            "{:>4}  {:<9} {:>6} {:>8}  {:>10}  {:>13}  {} [{}..{}]",
            s["rank"].to_string(),
            s["kind"].as_str().unwrap_or("?"),
            s["order"].to_string(),
            score,
            s["cost"].to_string(),
            format!("{}..{}", s["chunks"][0], s["chunks"][1]),
            s["tensor"].as_str().unwrap_or("?"),
            s["rows"][0],
            s["rows"][1],
        );
    }
    print!(
        "the routed shards cover {} bytes of {} chunks",
        v["chunk_bytes"],
        v["file"].as_str().unwrap_or("?")
    );
    if a.prefetch {
        print!(
            "; queued {} chunks for prefetch, {} hinted",
            v["queued_chunks"], v["hinted_chunks"]
        );
    }
    println!();
    Ok(())
}

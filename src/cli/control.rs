//! Commands that talk to a running mount over its control socket: stat, prefetch, pin,
//! unpin, evict, route and trace.

use std::path::Path;

use anyhow::{bail, Result};
use cawsfs::control::reply::{
    EvictReply, MaterializeReply, PinReply, PrefetchReply, RouteReply, StatReply, TraceOffReply,
    TraceOnReply, UnpinReply,
};
use cawsfs::control::{self, Request};
use serde::de::DeserializeOwned;

use super::args::RouteArgs;

pub fn cmd_stat(
    mp: &Path,
    socket: Option<&Path>,
    json: bool,
    prometheus: bool,
    watch: bool,
    interval: f64,
) -> Result<()> {
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
            || match client.call_as::<StatReply>(&Request::Stat) {
                Ok(r) => Ok(r),
                Err(e @ control::ControlError::Daemon(_)) => Err(e.into()),
                // The daemon closes connections idle for long (an interval over its
                // idle timeout) or to make room: one fresh connection, then give up.
                Err(_) => {
                    client = control::ControlClient::connect(&sock, timeout)?;
                    Ok(client.call_as::<StatReply>(&Request::Stat)?)
                }
            },
            &mut std::io::stdout(),
        )?;
        return Ok(());
    }
    if json {
        // As the daemon sent it, not through `StatReply`: fields this client does not
        // know are shown too, and the key order stays as it always was.
        let stats = control::request(&sock, &Request::Stat, timeout)?;
        println!("{}", serde_json::to_string_pretty(&stats)?);
        return Ok(());
    }
    let stats: StatReply = control::request_as(&sock, &Request::Stat, timeout)?;
    if prometheus {
        print!("{}", control::render_prometheus(&stats));
    } else {
        print!("{}", control::render_stat(&stats));
    }
    Ok(())
}

/// Send one control request (prefetch, pin, unpin, evict, trace) and print the reply's
/// payload as one JSON line.
pub fn control_call(mp: &Path, socket: Option<&Path>, req: Request) -> Result<()> {
    let sock = socket
        .map(Path::to_path_buf)
        .unwrap_or_else(|| control::find_socket(mp));
    let line = match &req {
        Request::Prefetch(_) => echo::<PrefetchReply>(&sock, &req)?,
        Request::Pin(_) => echo::<PinReply>(&sock, &req)?,
        Request::Unpin(_) => echo::<UnpinReply>(&sock, &req)?,
        Request::Evict(_) => echo::<EvictReply>(&sock, &req)?,
        Request::Trace { on: true } => echo::<TraceOnReply>(&sock, &req)?,
        Request::Trace { on: false } => echo::<TraceOffReply>(&sock, &req)?,
        other => bail!("{} has its own command", other.verb()),
    };
    println!("{line}");
    Ok(())
}

/// The reply to `req` as one JSON line, after checking that it reads as `T` (the
/// verb's reply type), so that a malformed reply is an error here as for `stat` and
/// `route`. Printed as it came rather than re-serialized from `T`: the reply parser's
/// removal of `"ok"` moves the last key first (a trace's `dropped`), and this step
/// keeps every output byte-identical.
fn echo<T: DeserializeOwned>(sock: &Path, req: &Request) -> Result<String> {
    let v = control::request(sock, req, std::time::Duration::from_secs(30))?;
    control::decode::<T>(sock, req, &v)?;
    Ok(serde_json::to_string(&v)?)
}

/// Ask the mount to fill its tier with whole files, then follow its progress in `stat`
/// with a progress bar until it is done (unless `no_wait`).
pub fn cmd_materialize(
    mp: &Path,
    file: Option<String>,
    socket: Option<&Path>,
    no_wait: bool,
) -> Result<()> {
    let sock = socket
        .map(Path::to_path_buf)
        .unwrap_or_else(|| control::find_socket(mp));
    let timeout = std::time::Duration::from_secs(30);
    let r: MaterializeReply = control::request_as(&sock, &Request::Materialize { file }, timeout)?;
    let what = r.files.join(", ");
    if no_wait {
        println!(
            "materializing {what}: {} to reconstruct",
            human(r.missing_bytes)
        );
        return Ok(());
    }
    let pb = super::bar(
        r.missing_bytes,
        "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    );
    pb.set_message(what.clone());
    let mut client = control::ControlClient::connect(&sock, timeout)?;
    let m = loop {
        let st = client.call_as::<StatReply>(&Request::Stat)?;
        let m = st
            .tier
            .and_then(|t| t.materialize)
            .ok_or_else(|| anyhow::anyhow!("the mount stopped reporting its materialize"))?;
        pb.set_position(m.done_bytes.min(r.missing_bytes));
        if !m.running {
            break m;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    pb.finish_and_clear();
    if let Some(why) = m.error {
        bail!("materialize of {what}: {why}");
    }
    println!(
        "{what}: whole in the disk tier ({} reconstructed in {:.1} s); the next open of each is served from local disk",
        human(m.total_bytes),
        m.elapsed_s
    );
    Ok(())
}

pub(super) fn human(n: u64) -> String {
    bytesize::ByteSize::b(n).display().iec().to_string()
}

pub fn cmd_route(a: RouteArgs) -> Result<()> {
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
    let timeout = std::time::Duration::from_secs(30);
    if a.json {
        // As the daemon sent it (see `cmd_stat`).
        let v = control::request(&sock, &req, timeout)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let r: RouteReply = control::request_as(&sock, &req, timeout)?;
    println!("prompt tokens: {}", r.tokens.join(" "));
    println!(
        "{:>4}  {:<9} {:>6} {:>8}  {:>10}  {:>13}  tensor [rows]",
        "rank", "kind", "order", "score", "cost", "chunks"
    );
    for s in &r.shards {
        let score = s.score.map_or("-".to_string(), |x| format!("{x:.4}"));
        println!(
            "{:>4}  {:<9} {:>6} {:>8}  {:>10}  {:>13}  {} [{}..{}]",
            s.rank,
            s.kind,
            s.order,
            score,
            s.cost,
            format!("{}..{}", s.chunks[0], s.chunks[1]),
            s.tensor,
            s.rows[0],
            s.rows[1],
        );
    }
    print!(
        "the routed shards cover {} bytes of {} chunks",
        r.chunk_bytes, r.file
    );
    if a.prefetch {
        let n = |x: Option<u64>| x.map_or("-".to_string(), |n| n.to_string());
        print!(
            "; queued {} chunks for prefetch, {} hinted",
            n(r.queued_chunks),
            n(r.hinted_chunks)
        );
    }
    println!();
    Ok(())
}

//! `cawsfs stat` output: a top-like table, the Prometheus text format, and `--watch`.
//!
//! The stat reply's shape is documented in docs/CONTROL.md and typed as
//! [`StatReply`]; every field of it is optional (a missing one is shown as `-`, or left
//! out of the Prometheus output) so the renderers work with whatever the daemon's
//! cache reports today and tomorrow.

use std::fmt::Write as _;
use std::io::Write;
use std::time::{Duration, Instant};

use super::reply::{FileStat, LatencyStat, StatReply};

/// `1536` → `1.50 KiB`; bytes below 1 KiB are exact.
pub fn human_bytes(n: u64) -> String {
    // Not bytesize's IEC display: it prints one decimal everywhere ("1.5 KiB", "1.1 GiB"),
    // where this prints two below 10 ("1.50 KiB", "1.12 GiB").
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut x = n as f64 / 1024.0;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if x < 10.0 {
        format!("{x:.2} {}", UNITS[u])
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

/// A latency in microseconds as µs / ms / s.
pub fn human_latency_us(us: f64) -> String {
    if us < 1000.0 {
        format!("{us:.0} µs")
    } else if us < 1e6 {
        format!("{:.1} ms", us / 1e3)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

fn or_dash(x: Option<String>) -> String {
    x.unwrap_or_else(|| "-".into())
}

/// `device   cuda:0 (NVIDIA H100)  gpu 1.2 GiB in 340 batches (5.1 GB/s)  cpu 0 B  fallbacks 0  resident 12 MiB of 8 GiB`
fn device_line(d: &crate::reconstruct::DeviceStats) -> String {
    let mut line = format!("device   {}", d.device);
    if d.device != "cpu" || d.gpu_batches > 0 {
        let rate = if d.gpu_nanos > 0 {
            format!(" ({:.1} GB/s)", d.gpu_bytes as f64 / d.gpu_nanos as f64)
        } else {
            String::new()
        };
        line += &format!(
            "  gpu {} in {} batches{rate}  cpu {}  fallbacks {}  resident {} of {}",
            human_bytes(d.gpu_bytes),
            d.gpu_batches,
            human_bytes(d.cpu_bytes),
            d.fallbacks,
            human_bytes(d.resident_bytes),
            human_bytes(d.vram_budget)
        );
        // Only when it happened: a healthy GPU's line stays as it was.
        if d.rests > 0 {
            line += &format!("  rests {}", d.rests);
        }
    } else {
        line += &format!("  reconstructed {}", human_bytes(d.cpu_bytes));
    }
    line
}

fn count(n: Option<u64>) -> String {
    or_dash(n.map(|n| n.to_string()))
}

fn bytes(n: Option<u64>) -> String {
    or_dash(n.map(human_bytes))
}

fn ratio(hits: Option<u64>, misses: Option<u64>) -> String {
    match (hits, misses) {
        (Some(h), Some(m)) if h.saturating_add(m) > 0 => {
            format!("{:.1}%", 100.0 * h as f64 / (h as f64 + m as f64))
        }
        _ => "-".into(),
    }
}

/// The human `cawsfs stat` table: totals, then one row per file (most served first).
pub fn render_stat(stats: &StatReply) -> String {
    render_stat_with(stats, None)
}

fn render_stat_with(s: &StatReply, rates: Option<&str>) -> String {
    let mut out = String::new();
    let mut title = String::from("cawsfs");
    if let Some(m) = &s.mountpoint {
        let _ = write!(title, "  {m}");
    }
    if let Some(a) = &s.archive_path {
        let _ = write!(title, "  <- {a}");
    }
    if let Some(up) = s.uptime_s.filter(|x| x.is_finite()) {
        let _ = write!(title, "  up {}", human_duration(up));
    }
    let _ = writeln!(out, "{title}");

    let c = &s.cache;
    let _ = writeln!(
        out,
        "reads    hits {} (prefetch {})  misses {}  hit ratio {}",
        count(c.hits),
        count(c.prefetch_hits),
        count(c.misses),
        ratio(c.hits, c.misses)
    );
    let _ = writeln!(
        out,
        "bytes    served {}  reconstructed {}  archive read {}  archive decoded {}",
        bytes(c.bytes_served),
        bytes(c.bytes_loaded),
        bytes(s.archive.bytes_read),
        bytes(s.archive.bytes_decoded),
    );
    let used_pct = match (c.bytes_used, c.budget) {
        (Some(u), Some(b)) if b > 0 => format!(" ({:.1}%)", 100.0 * u as f64 / b as f64),
        _ => String::new(),
    };
    let _ = writeln!(
        out,
        "cache    used {} / {}{used_pct}  pinned {}  evictions {}",
        bytes(c.bytes_used),
        bytes(c.budget),
        bytes(c.pinned_bytes),
        count(c.evictions),
    );
    // Other memory on the budget's account, shown only when there is some.
    if let Some(n) = c.charged_bytes.filter(|&n| n > 0) {
        let _ = writeln!(
            out,
            "         + {} charged (the router's tokenizer)",
            bytes(Some(n))
        );
    }
    let lat = |us: Option<u64>| or_dash(us.map(|us| human_latency_us(us as f64)));
    let l = &c.latency_us;
    let _ = writeln!(
        out,
        "latency  p50 {}  p90 {}  p99 {}  max {}",
        lat(l.p50),
        lat(l.p90),
        lat(l.p99),
        lat(l.max)
    );
    // What producing one chunk takes (daemons before this field send none).
    if let Some(l) = c.load_latency_us.as_ref().filter(|l| l.count > Some(0)) {
        let _ = writeln!(
            out,
            "loads    mean {}  p50 {}  p90 {}  p99 {}  max {}  ({} chunks)",
            or_dash(l.mean.map(human_latency_us)),
            lat(l.p50),
            lat(l.p90),
            lat(l.p99),
            lat(l.max),
            count(l.count)
        );
    }
    if let Some(n) = c.stalls.filter(|&n| n > 0) {
        let waited = c.stall_us.unwrap_or(0) as f64;
        let _ = writeln!(
            out,
            "stalls   {n} reads waited for reconstruction, {} in all (mean {})",
            human_latency_us(waited),
            human_latency_us(waited / n as f64)
        );
    }
    if let Some(x) = &s.experts {
        let pct = |r: f64| format!("{:.1}%", 100.0 * r);
        let _ = writeln!(
            out,
            "experts  {} steps, {} after the layer before  predicted {}  read {} ({})  precision {}  recall {}  queued {} chunks  reconstructed {} experts, {} other{}{}",
            x.steps,
            x.transitions,
            x.predicted,
            x.read,
            human_bytes(x.read_bytes),
            pct(x.precision),
            pct(x.recall),
            x.queued_chunks,
            human_bytes(x.loaded_expert_bytes),
            human_bytes(x.loaded_infra_bytes),
            if x.prefetch { "" } else { "  (learning only)" },
            if x.loaded_steps > 0 {
                format!("  (learned before: {} steps)", x.loaded_steps)
            } else {
                String::new()
            },
        );
    }
    if let Some(f) = &s.fetch {
        let _ = writeln!(
            out,
            "fetch    {}{}  {} requests  {} fetched ({} read ahead)  {} failed  retries {}  latency p50 {} p90 {} p99 {}  parts {} hit {} missed  disk {} served {} kept{}",
            f.url,
            if f.objects > 1 {
                format!(" ({} objects)", f.objects)
            } else {
                String::new()
            },
            f.requests,
            human_bytes(f.bytes_fetched),
            human_bytes(f.readahead_bytes),
            f.failed_requests,
            f.retries,
            human_latency_us(f.latency_p50_us as f64),
            human_latency_us(f.latency_p90_us as f64),
            human_latency_us(f.latency_p99_us as f64),
            f.part_hits,
            f.part_misses,
            human_bytes(f.fetch_cache_hit_bytes),
            human_bytes(f.fetch_cache_written_bytes),
            if f.fetch_cache_bad_parts > 0 {
                format!(" {} bad", f.fetch_cache_bad_parts)
            } else {
                String::new()
            },
        );
    }
    if let Some(t) = &s.tier {
        let _ = writeln!(
            out,
            "tier     {} of {} present ({} whole)  served {}  written {}  dropped {} (refilled {})  bad {}  tampered {}  passthrough {} ({} opens)",
            bytes(t.present_bytes),
            bytes(t.max_bytes),
            count(t.whole_files),
            bytes(t.hit_bytes),
            bytes(t.written_bytes),
            count(t.dropped_extents),
            count(t.refilled_extents),
            count(t.bad_extents),
            count(t.tampered),
            t.passthrough.as_deref().unwrap_or("-"),
            count(t.passthrough_opens),
        );
    }
    if let Some(d) = &s.device {
        let _ = writeln!(out, "{}", device_line(d));
    }
    if let Some(r) = rates {
        let _ = writeln!(out, "{r}");
    }
    if !s.files.is_empty() {
        file_table(&mut out, &s.files);
    }
    out
}

/// The per-file rows of the stat table, most served first, under a header.
fn file_table(out: &mut String, files: &[FileStat]) {
    let mut rows: Vec<(String, u64, [String; 6])> = files
        .iter()
        .map(|f| {
            let name = clip(f.name.as_deref().unwrap_or("?"), 48);
            let cells = [
                bytes(f.size),
                count(f.hits),
                count(f.misses),
                ratio(f.hits, f.misses),
                bytes(f.bytes_served),
                // Who reads the file: the daemon, or the kernel from the tier file.
                match f.passthrough {
                    Some(true) => "kernel".into(),
                    Some(false) => "daemon".into(),
                    None => "-".into(),
                },
            ];
            (name, f.bytes_served.unwrap_or(0), cells)
        })
        .collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let w = rows
        .iter()
        .map(|r| r.0.chars().count())
        .max()
        .unwrap_or(0)
        .max(4);
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<w$}  {:>10}  {:>9}  {:>9}  {:>6}  {:>10}  {:>6}",
        "FILE", "SIZE", "HITS", "MISSES", "RATIO", "SERVED", "VIA"
    );
    for (name, _, [size, h, m, r, served, via]) in rows {
        let pad = w - name.chars().count();
        let _ = writeln!(
            out,
            "{name}{:pad$}  {size:>10}  {h:>9}  {m:>9}  {r:>6}  {served:>10}  {via:>6}",
            ""
        );
    }
}

fn clip(s: &str, max: usize) -> String {
    // Control characters in a name would garble the terminal.
    let clean: String = s
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if clean.chars().count() <= max {
        clean
    } else {
        let mut c: String = clean.chars().take(max - 1).collect();
        c.push('…');
        c
    }
}

fn human_duration(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..60 => format!("{secs:.1}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s / 60) % 60),
    }
}

/// The rates between two stat samples `dt` apart: bytes served / reconstructed /
/// read from the archive per second, and reads per second.
pub fn render_rates(prev: &StatReply, cur: &StatReply, dt: Duration) -> String {
    let secs = dt.as_secs_f64();
    let delta = |field: fn(&StatReply) -> Option<u64>| -> Option<f64> {
        let (a, b) = (field(prev)?, field(cur)?);
        // A counter going backwards means the daemon restarted: no rate.
        (b >= a && secs > 0.0).then(|| (b - a) as f64 / secs)
    };
    let bps = |field: fn(&StatReply) -> Option<u64>| {
        or_dash(delta(field).map(|r| format!("{}/s", human_bytes(r as u64))))
    };
    let reads = match (delta(|s| s.cache.hits), delta(|s| s.cache.misses)) {
        (Some(h), Some(m)) => format!("{:.0}/s", h + m),
        _ => "-".into(),
    };
    format!(
        "rates    served {}  reconstructed {}  archive read {}  reads {reads}",
        bps(|s| s.cache.bytes_served),
        bps(|s| s.cache.bytes_loaded),
        bps(|s| s.archive.bytes_read),
    )
}

/// A Prometheus label value, escaped as the text exposition format requires.
fn label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// Writes one metric family if it has samples: HELP, TYPE, then `name{labels} value`.
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, String)]) {
    if samples.is_empty() {
        return;
    }
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

/// One figure of a file in the stat reply, for the per-file metric families.
type FileField = fn(&FileStat) -> Option<u64>;

/// `cawsfs stat --prometheus`: the stat reply in the Prometheus text format 0.0.4
/// (metric names in docs/CONTROL.md).
pub fn render_prometheus(stats: &StatReply) -> String {
    let mut out = String::new();
    let (c, a) = (&stats.cache, &stats.archive);
    let t = stats.tier.clone().unwrap_or_default();
    let d = stats.device.as_ref();
    let x = stats.experts.as_ref();
    let f = stats.fetch.as_ref();
    let simple: [(&str, &str, &str, Option<u64>); 47] = [
        (
            "cawsfs_fetch_cache_hit_bytes_total",
            "counter",
            "Archive bytes served from the fetch cache on disk.",
            f.map(|f| f.fetch_cache_hit_bytes),
        ),
        (
            "cawsfs_fetch_cache_written_bytes_total",
            "counter",
            "Fetched archive bytes kept in the fetch cache on disk.",
            f.map(|f| f.fetch_cache_written_bytes),
        ),
        (
            "cawsfs_fetch_requests_total",
            "counter",
            "Range requests to the archive's object store.",
            f.map(|f| f.requests),
        ),
        (
            "cawsfs_fetch_bytes_total",
            "counter",
            "Bytes fetched from the archive's object store.",
            f.map(|f| f.bytes_fetched),
        ),
        (
            "cawsfs_fetch_readahead_bytes_total",
            "counter",
            "Bytes fetched ahead of sequential reads.",
            f.map(|f| f.readahead_bytes),
        ),
        (
            "cawsfs_fetch_failed_requests_total",
            "counter",
            "Requests that failed after their retries.",
            f.map(|f| f.failed_requests),
        ),
        (
            "cawsfs_fetch_retries_total",
            "counter",
            "Attempts made again after a transient failure (5xx, 429, timeouts, connection errors).",
            f.map(|f| f.retries),
        ),
        (
            "cawsfs_fetch_part_hits_total",
            "counter",
            "Archive parts found in memory, already fetched.",
            f.map(|f| f.part_hits),
        ),
        (
            "cawsfs_fetch_latency_p50_microseconds",
            "gauge",
            "Median request latency (upper bound of its power-of-two bucket).",
            f.map(|f| f.latency_p50_us),
        ),
        (
            "cawsfs_fetch_latency_p90_microseconds",
            "gauge",
            "90th percentile request latency (bucket upper bound).",
            f.map(|f| f.latency_p90_us),
        ),
        (
            "cawsfs_fetch_latency_p99_microseconds",
            "gauge",
            "99th percentile request latency (bucket upper bound).",
            f.map(|f| f.latency_p99_us),
        ),
        (
            "cawsfs_cache_hits_total",
            "counter",
            "Reads served entirely from the cache.",
            c.hits,
        ),
        (
            "cawsfs_cache_prefetch_hits_total",
            "counter",
            "Cache hits on chunks loaded by prefetch.",
            c.prefetch_hits,
        ),
        (
            "cawsfs_cache_misses_total",
            "counter",
            "Reads that reconstructed at least one chunk.",
            c.misses,
        ),
        (
            "cawsfs_read_stalls_total",
            "counter",
            "Reads that waited for reconstruction.",
            c.stalls,
        ),
        (
            "cawsfs_read_stall_microseconds_total",
            "counter",
            "Time reads waited for reconstruction.",
            c.stall_us,
        ),
        (
            "cawsfs_expert_steps_total",
            "counter",
            "Runs of reads in one layer's experts.",
            x.map(|x| x.steps),
        ),
        (
            "cawsfs_expert_predicted_total",
            "counter",
            "Experts the predictor chose for the next layer.",
            x.map(|x| x.predicted),
        ),
        (
            "cawsfs_expert_predicted_read_total",
            "counter",
            "Predicted experts that the next layer's reads then touched.",
            x.map(|x| x.predicted_read),
        ),
        (
            "cawsfs_expert_read_total",
            "counter",
            "Experts read in layers that followed the layer before (recall's denominator).",
            x.map(|x| x.read),
        ),
        (
            "cawsfs_expert_reconstructed_bytes_total",
            "counter",
            "Bytes reconstructed inside the experts' extents.",
            x.map(|x| x.loaded_expert_bytes),
        ),
        (
            "cawsfs_expert_infra_reconstructed_bytes_total",
            "counter",
            "Bytes reconstructed outside the experts' extents (the infrastructure's misses).",
            x.map(|x| x.loaded_infra_bytes),
        ),
        (
            "cawsfs_bytes_served_total",
            "counter",
            "Bytes returned to readers.",
            c.bytes_served,
        ),
        (
            "cawsfs_bytes_reconstructed_total",
            "counter",
            "Bytes reconstructed into the cache.",
            c.bytes_loaded,
        ),
        (
            "cawsfs_cache_evictions_total",
            "counter",
            "Chunks evicted from the cache.",
            c.evictions,
        ),
        (
            "cawsfs_cache_room_waits_total",
            "counter",
            "Loads that waited for room in the cache budget before starting.",
            c.room_waits,
        ),
        (
            "cawsfs_cache_used_bytes",
            "gauge",
            "Bytes held by the cache.",
            c.bytes_used,
        ),
        (
            "cawsfs_cache_pinned_bytes",
            "gauge",
            "Bytes held by pinned chunks.",
            c.pinned_bytes,
        ),
        (
            "cawsfs_cache_charged_bytes",
            "gauge",
            "Bytes held outside the cache on its budget's account.",
            c.charged_bytes,
        ),
        (
            "cawsfs_cache_working_bytes",
            "gauge",
            "Bytes the loads in flight count against the budget.",
            c.working_bytes,
        ),
        (
            "cawsfs_cache_budget_bytes",
            "gauge",
            "The cache's byte budget.",
            c.budget,
        ),
        (
            "cawsfs_archive_bytes_read_total",
            "counter",
            "Compressed bytes read from the archive.",
            a.bytes_read,
        ),
        (
            "cawsfs_archive_bytes_decoded_total",
            "counter",
            "Bytes decoded from archive blocks.",
            a.bytes_decoded,
        ),
        (
            "cawsfs_tier_hit_bytes_total",
            "counter",
            "Bytes served from the disk tier instead of reconstructed.",
            t.hit_bytes,
        ),
        (
            "cawsfs_tier_written_bytes_total",
            "counter",
            "Bytes written to the disk tier.",
            t.written_bytes,
        ),
        (
            "cawsfs_tier_dropped_extents_total",
            "counter",
            "Reconstructed extents the disk tier's writer had no room to queue.",
            t.dropped_extents,
        ),
        (
            "cawsfs_tier_refilled_extents_total",
            "counter",
            "Dropped extents made again and written once the writer's queue was empty.",
            t.refilled_extents,
        ),
        (
            "cawsfs_tier_bad_extents_total",
            "counter",
            "Disk tier extents that failed their checksum.",
            t.bad_extents,
        ),
        (
            "cawsfs_tier_tampered_total",
            "counter",
            "Sealed passthrough backing files found changed.",
            t.tampered,
        ),
        (
            "cawsfs_tier_present_bytes",
            "gauge",
            "Bytes of the mount's files present in the disk tier.",
            t.present_bytes,
        ),
        (
            "cawsfs_tier_max_bytes",
            "gauge",
            "The disk tier's size bound.",
            t.max_bytes,
        ),
        (
            "cawsfs_tier_passthrough_opens_total",
            "counter",
            "Opens answered with FUSE passthrough of a whole tier file.",
            t.passthrough_opens,
        ),
        (
            "cawsfs_device_gpu_bytes_total",
            "counter",
            "f32 bytes of rows the GPU reconstructed.",
            d.map(|d| d.gpu_bytes),
        ),
        (
            "cawsfs_device_cpu_bytes_total",
            "counter",
            "f32 bytes of rows the CPU reconstructed.",
            d.map(|d| d.cpu_bytes),
        ),
        (
            "cawsfs_device_fallbacks_total",
            "counter",
            "GPU batches that failed and were computed on the CPU.",
            d.map(|d| d.fallbacks),
        ),
        (
            "cawsfs_device_rests_total",
            "counter",
            "Times the GPU failed so many batches in a row that it rested (batches went to the CPU untried).",
            d.map(|d| d.rests),
        ),
        (
            "cawsfs_device_resident_bytes",
            "gauge",
            "Bytes kept resident on the GPU (of --vram-budget).",
            d.filter(|d| d.vram_budget > 0).map(|d| d.resident_bytes),
        ),
    ];
    for (name, kind, help, value) in simple {
        let samples: Vec<_> = value
            .map(|v| (String::new(), v.to_string()))
            .into_iter()
            .collect();
        family(&mut out, name, kind, help, &samples);
    }
    let secs = |us: Option<u64>| us.map(|us| (us as f64 / 1e6).to_string());
    let quantiles = |l: &LatencyStat| -> Vec<(String, String)> {
        [("0.5", l.p50), ("0.9", l.p90), ("0.99", l.p99)]
            .into_iter()
            .filter_map(|(q, us)| secs(us).map(|v| (format!("quantile=\"{q}\""), v)))
            .collect()
    };
    let l = &c.latency_us;
    family(
        &mut out,
        "cawsfs_read_latency_seconds",
        "gauge",
        "Read latency quantiles.",
        &quantiles(l),
    );
    let max: Vec<_> = secs(l.max)
        .map(|v| (String::new(), v))
        .into_iter()
        .collect();
    family(
        &mut out,
        "cawsfs_read_latency_max_seconds",
        "gauge",
        "Slowest read.",
        &max,
    );
    if let Some(l) = &c.load_latency_us {
        family(
            &mut out,
            "cawsfs_chunk_load_latency_seconds",
            "gauge",
            "Chunk load (reconstruction) time quantiles.",
            &quantiles(l),
        );
    }

    let per_file = |field: FileField| -> Vec<(String, String)> {
        stats
            .files
            .iter()
            .filter_map(|f| {
                let name = f.name.as_deref()?;
                Some((format!("file=\"{}\"", label(name)), field(f)?.to_string()))
            })
            .collect()
    };
    let file_metrics: [(&str, &str, &str, FileField); 4] = [
        (
            "cawsfs_file_size_bytes",
            "gauge",
            "Size of a virtual file.",
            |f| f.size,
        ),
        (
            "cawsfs_file_hits_total",
            "counter",
            "Cache hits per virtual file.",
            |f| f.hits,
        ),
        (
            "cawsfs_file_misses_total",
            "counter",
            "Cache misses per virtual file.",
            |f| f.misses,
        ),
        (
            "cawsfs_file_bytes_served_total",
            "counter",
            "Bytes served per virtual file.",
            |f| f.bytes_served,
        ),
    ];
    for (name, kind, help, field) in file_metrics {
        family(&mut out, name, kind, help, &per_file(field));
    }
    out
}

/// `cawsfs stat --watch`: fetches a sample every `interval` and redraws it in place
/// (ANSI: home, clear each line, clear below), with rates from the previous sample.
/// Runs until `fetch` fails; then writes `cawsfs stat: <error>` on one line and
/// returns that error (so the caller only sets the exit status).
pub fn watch<W: Write>(
    interval: Duration,
    mut fetch: impl FnMut() -> anyhow::Result<StatReply>,
    out: &mut W,
) -> anyhow::Result<()> {
    let mut prev: Option<(Instant, StatReply)> = None;
    write!(out, "\x1b[2J")?;
    loop {
        let v = match fetch() {
            Ok(v) => v,
            Err(e) => {
                let msg = format!("{e:#}").replace(['\n', '\r'], " ");
                writeln!(out, "\ncawsfs stat: {msg}")?;
                out.flush()?;
                return Err(e);
            }
        };
        let now = Instant::now();
        let rates = match &prev {
            Some((t, p)) => render_rates(p, &v, now - *t),
            None => "rates    (after the next sample)".into(),
        };
        let frame = render_stat_with(&v, Some(&rates));
        let mut buf = String::from("\x1b[H");
        for line in frame.lines() {
            buf.push_str(line);
            buf.push_str("\x1b[K\n");
        }
        buf.push_str("\x1b[J");
        out.write_all(buf.as_bytes())?;
        out.flush()?;
        prev = Some((now, v));
        std::thread::sleep(interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stats(v: serde_json::Value) -> StatReply {
        serde_json::from_value(v).unwrap()
    }

    fn sample_stats() -> StatReply {
        stats(json!({
            "mountpoint": "/mnt/m",
            "uptime_s": 125.0,
            "cache": {
                "hits": 1234, "prefetch_hits": 100, "misses": 56,
                "bytes_served": 1288490188u64, "bytes_loaded": 838860800u64, "evictions": 12,
                "bytes_used": 1610612736u64, "pinned_bytes": 104857600u64, "budget": 2147483648u64,
                "latency_us": {"p50": 120, "p90": 480, "p99": 2100, "max": 15000},
                "load_latency_us": {"count": 900, "mean": 1500.5, "p50": 1023, "p90": 4095, "p99": 8191, "max": 9000},
                "stalls": 40, "stall_us": 120000
            },
            "experts": {"files": 1, "prefetch": true, "steps": 900, "transitions": 700,
                        "predicted": 600, "predicted_read": 450, "read": 750,
                        "read_bytes": 3221225472u64, "precision": 0.75, "recall": 0.6,
                        "queued_chunks": 2400, "loaded_steps": 0,
                        "loaded_expert_bytes": 2147483648u64, "loaded_infra_bytes": 1048576},
            "archive": {"bytes_read": 314572800u64, "bytes_decoded": 838860800u64},
            "device": {"device": "cuda:0 (NVIDIA H100)", "gpu_batches": 340, "gpu_bytes": 1288490188u64,
                       "gpu_nanos": 250000000u64, "fallbacks": 2, "cpu_bytes": 4096,
                       "resident_bytes": 12582912u64, "vram_budget": 8589934592u64},
            "files": [
                {"name": "config.json", "size": 700, "hits": 3, "misses": 1, "bytes_served": 2100},
                {"name": "model.gguf", "size": 283115520u64, "hits": 1200, "misses": 50, "bytes_served": 1200000000u64, "passthrough": true}
            ]
        }))
    }

    #[test]
    fn sizes_and_latencies() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(300 << 20), "300.0 MiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
        assert_eq!(human_latency_us(120.0), "120 µs");
        assert_eq!(human_latency_us(2100.0), "2.1 ms");
        assert_eq!(human_latency_us(2.5e6), "2.50 s");
    }

    #[test]
    fn stat_table_has_the_figures() {
        let s = render_stat(&sample_stats());
        for want in [
            "cawsfs  /mnt/m  up 2m05s",
            "hits 1234 (prefetch 100)  misses 56  hit ratio 95.7%",
            "served 1.20 GiB",
            "reconstructed 800.0 MiB",
            "archive read 300.0 MiB",
            "used 1.50 GiB / 2.00 GiB (75.0%)",
            "pinned 100.0 MiB",
            "evictions 12",
            "p50 120 µs  p90 480 µs  p99 2.1 ms  max 15.0 ms",
            "loads    mean 1.5 ms  p50 1.0 ms  p90 4.1 ms  p99 8.2 ms  max 9.0 ms  (900 chunks)\n",
            "stalls   40 reads waited for reconstruction, 120.0 ms in all (mean 3.0 ms)\n",
            "experts  900 steps, 700 after the layer before  predicted 600  read 750 (3.00 GiB)  precision 75.0%  recall 60.0%  queued 2400 chunks  reconstructed 2.00 GiB experts, 1.00 MiB other\n",
            "device   cuda:0 (NVIDIA H100)  gpu 1.20 GiB in 340 batches (5.2 GB/s)  cpu 4.00 KiB  fallbacks 2  resident 12.0 MiB of 8.00 GiB\n",
        ] {
            assert!(s.contains(want), "missing {want:?} in\n{s}");
        }
        // A GPU that rested says so at the end of its line.
        let mut v = sample_stats();
        v.device.as_mut().unwrap().rests = 3;
        let s = render_stat(&v);
        assert!(s.contains("of 8.00 GiB  rests 3\n"), "{s}");
        assert!(render_prometheus(&v).contains("cawsfs_device_rests_total 3\n"));
        // Per-file rows, most served first.
        let gguf = s.find("model.gguf").unwrap();
        let cfg = s.find("config.json").unwrap();
        assert!(gguf < cfg, "{s}");
        let row = s.lines().find(|l| l.starts_with("model.gguf")).unwrap();
        for want in ["270.0 MiB", "1200", "50", "96.0%", "1.12 GiB", "kernel"] {
            assert!(row.contains(want), "{row}");
        }
        let header = s.lines().find(|l| l.starts_with("FILE")).unwrap();
        assert_eq!(header.len(), row.chars().count(), "columns line up");
    }

    #[test]
    fn stat_survives_missing_fields() {
        for v in [
            json!({}),
            json!({"cache": {"budget": 0, "latency_us": {}}, "files": []}),
            json!({"files": [{"name": "a\u{1b}[2Jb"}, {}]}),
        ] {
            let s = render_stat(&stats(v));
            assert!(s.contains("hit ratio"), "{s}");
            assert!(
                !s.contains('\u{1b}'),
                "control chars are not passed through"
            );
        }
        let s = render_stat(&stats(json!({})));
        assert!(
            s.contains("hits - (prefetch -)  misses -  hit ratio -"),
            "{s}"
        );
        assert!(!s.contains("FILE"));
        // Wrong types are no longer shown as `-`: they do not read as a stat reply (the
        // client reports a bad reply).
        for v in [
            json!(null),
            json!({"cache": "nope", "files": 3}),
            json!({"cache": {"hits": -1, "misses": 1.5, "latency_us": []}}),
            json!({"files": [1]}),
        ] {
            assert!(
                serde_json::from_value::<StatReply>(v.clone()).is_err(),
                "{v}"
            );
        }
    }

    #[test]
    fn prometheus_text() {
        let mut v = sample_stats();
        v.files[1].name = Some("we\"ird\\na\nme".into());
        let p = render_prometheus(&v);
        for want in [
            "# HELP cawsfs_cache_hits_total ",
            "# TYPE cawsfs_cache_hits_total counter\ncawsfs_cache_hits_total 1234\n",
            "cawsfs_cache_misses_total 56\n",
            "cawsfs_bytes_served_total 1288490188\n",
            "cawsfs_bytes_reconstructed_total 838860800\n",
            "# TYPE cawsfs_cache_budget_bytes gauge\ncawsfs_cache_budget_bytes 2147483648\n",
            "cawsfs_archive_bytes_read_total 314572800\n",
            "cawsfs_read_latency_seconds{quantile=\"0.5\"} 0.00012\n",
            "cawsfs_device_gpu_bytes_total 1288490188\n",
            "cawsfs_device_fallbacks_total 2\n",
            "# TYPE cawsfs_device_resident_bytes gauge\ncawsfs_device_resident_bytes 12582912\n",
            "cawsfs_read_latency_seconds{quantile=\"0.99\"} 0.0021\n",
            "cawsfs_read_latency_max_seconds 0.015\n",
            "cawsfs_chunk_load_latency_seconds{quantile=\"0.9\"} 0.004095\n",
            "cawsfs_read_stalls_total 40\n",
            "cawsfs_read_stall_microseconds_total 120000\n",
            "cawsfs_expert_predicted_total 600\n",
            "cawsfs_expert_predicted_read_total 450\n",
            "cawsfs_file_hits_total{file=\"config.json\"} 3\n",
            "cawsfs_file_bytes_served_total{file=\"we\\\"ird\\\\na\\nme\"} 1200000000\n",
        ] {
            assert!(p.contains(want), "missing {want:?} in\n{p}");
        }
        // Every non-comment line is `name{labels} value` with a parseable value.
        for l in p.lines().filter(|l| !l.starts_with('#')) {
            let (_, val) = l.rsplit_once(' ').unwrap();
            val.parse::<f64>().unwrap();
        }
        // Each family's HELP and TYPE appear once.
        assert_eq!(p.matches("# TYPE cawsfs_file_hits_total").count(), 1);
        // Missing fields leave their families out entirely.
        let p = render_prometheus(&stats(json!({"cache": {"hits": 1}})));
        assert_eq!(p.lines().count(), 3, "{p}");
    }

    #[test]
    fn rates_between_samples() {
        let a = stats(
            json!({"cache": {"bytes_served": 0, "hits": 10, "misses": 0}, "archive": {"bytes_read": 0}}),
        );
        let b = stats(
            json!({"cache": {"bytes_served": 20u64 << 20, "hits": 30, "misses": 20}, "archive": {"bytes_read": 4096}}),
        );
        let r = render_rates(&a, &b, Duration::from_secs(2));
        assert!(r.contains("served 10.0 MiB/s"), "{r}");
        assert!(r.contains("archive read 2.00 KiB/s"), "{r}");
        assert!(r.contains("reads 20/s"), "{r}");
        assert!(r.contains("reconstructed -"), "{r}");
        // A restarted daemon: counters went back, no rate.
        assert!(render_rates(&b, &a, Duration::from_secs(1)).contains("served -"));
    }

    #[test]
    fn watch_redraws_then_stops_on_error() {
        let mut n = 0u64;
        let mut out = Vec::new();
        let r = watch(
            Duration::from_millis(10),
            || {
                n += 1;
                if n > 3 {
                    anyhow::bail!("no cawsfs daemon at /x (is it mounted?)");
                }
                Ok(stats(
                    json!({"cache": {"bytes_served": n * 1_000_000, "hits": n, "misses": 0}}),
                ))
            },
            &mut out,
        );
        assert!(r.is_err());
        let s = String::from_utf8(out).unwrap();
        assert!(s.starts_with("\x1b[2J\x1b[H"));
        assert_eq!(s.matches("\x1b[H").count(), 3, "three frames");
        assert!(s.contains("(after the next sample)"));
        assert!(s.contains("MiB/s"), "{s}");
        assert!(s.ends_with("\ncawsfs stat: no cawsfs daemon at /x (is it mounted?)\n"));
    }
}

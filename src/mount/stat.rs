//! The `stat` reply: the mount's cache, archive and per-file figures as
//! [`StatReply`]. Here rather than in `fs` because `fs` sits below `control` and
//! cannot name its types; the figures are the same either way.

use std::path::Path;

use crate::control::reply::MaterializeStat;
use crate::control::{ArchiveStat, CacheStat, FileStat, LatencyStat, StatReply, TierStat};
use crate::fs::{file_id, MountFs};

/// Everything `cawsfs stat` shows, for the mount of `fs` at `mountpoint`.
pub(super) fn stat_reply(fs: &MountFs, mountpoint: &Path) -> StatReply {
    let cache = fs.cache();
    let c = cache.stats();
    let a = fs.archive().read_counters();
    let files = fs
        .entries()
        .map(|e| {
            let f = c.files.iter().find(|f| f.file == file_id(e.ino));
            FileStat {
                name: Some(e.name.clone()),
                size: Some(e.file.size),
                reads: Some(f.map_or(0, |f| f.reads)),
                hits: Some(f.map_or(0, |f| f.hits + f.prefetch_hits)),
                prefetch_hits: Some(f.map_or(0, |f| f.prefetch_hits)),
                misses: Some(f.map_or(0, |f| f.misses)),
                bytes_served: Some(f.map_or(0, |f| f.bytes_served)),
                passthrough: Some(fs.is_passthrough(e.ino)),
            }
        })
        .collect();
    StatReply {
        device: Some(crate::reconstruct::stats()),
        archive_kind: Some(fs.archive().kind().name().to_string()),
        archive_path: Some(fs.archive().path().display().to_string()),
        uptime_s: Some(fs.uptime().as_secs_f64()),
        cache: CacheStat {
            // The cache counts prefetch hits apart; the reply's hits include them.
            hits: Some(c.hits + c.prefetch_hits),
            prefetch_hits: Some(c.prefetch_hits),
            misses: Some(c.misses),
            coalesced: Some(c.coalesced),
            reads: Some(c.reads),
            read_errors: Some(c.read_errors),
            bytes_served: Some(c.bytes_served),
            bytes_loaded: Some(c.bytes_loaded),
            loads: Some(c.loads),
            evictions: Some(c.evictions),
            bytes_used: Some(c.bytes_used),
            pinned_bytes: Some(c.pinned_bytes),
            pinned_resident_bytes: Some(c.pinned_resident_bytes),
            charged_bytes: Some(c.charged_bytes),
            working_bytes: Some(c.working_bytes),
            room_waits: Some(c.room_waits),
            budget: Some(c.budget_bytes),
            chunk_size: Some(c.chunk_size),
            entries: Some(c.entries),
            entry_overhead_bytes: Some(c.entry_overhead_bytes),
            readahead_triggers: Some(c.readahead_triggers),
            prefetch_loads: Some(c.prefetch_loads),
            prefetch_queue_len: Some(c.prefetch_queue_len),
            prefetch_skipped: Some(c.prefetch_skipped),
            loads_in_flight: Some(c.loads_in_flight),
            route_hints: Some(cache.hint_count() as u64),
            tracing: Some(cache.tracing()),
            latency_us: latency(&c.latency_us),
            load_latency_us: Some(latency(&c.load_latency_us)),
            stalls: Some(c.stalls),
            stall_us: Some(c.stall_us),
        },
        archive: ArchiveStat {
            blocks_read: Some(a.blocks),
            bytes_read: Some(a.stored_bytes),
            bytes_decoded: Some(a.payload_bytes),
            read_per_served: Some(if c.bytes_served > 0 {
                a.stored_bytes as f64 / c.bytes_served as f64
            } else {
                0.0
            }),
        },
        files,
        mountpoint: Some(mountpoint.display().to_string()),
        experts: (c.experts.files > 0).then(|| c.experts.clone()),
        fetch: fs.archive().fetch_stats(),
        tier: fs.tier().map(|t| {
            let w = t.writer_stats();
            let tiered = fs.tensor_files().iter().filter_map(|e| e.tier.as_ref());
            TierStat {
                dir: Some(t.dir.display().to_string()),
                max_bytes: Some(t.max_bytes),
                hit_bytes: Some(t.hit_bytes()),
                written_bytes: Some(w.written_bytes),
                dropped_extents: Some(w.dropped_extents),
                refilled_extents: Some(t.refilled_extents()),
                over_bound_extents: Some(w.over_bound_extents),
                bad_extents: Some(t.bad_extents()),
                write_errors: Some(w.errors),
                present_bytes: Some(tiered.clone().map(|e| e.present_bytes()).sum()),
                whole_files: Some(tiered.filter(|e| e.is_whole()).count() as u64),
                passthrough: Some(t.passthrough().to_string()),
                passthrough_opens: Some(t.passthrough_opens()),
                tampered: Some(t.tampered()),
                materialize: t.materializing().map(|m| MaterializeStat {
                    files: m.files.clone(),
                    done_bytes: m.done_bytes.load(std::sync::atomic::Ordering::Relaxed),
                    total_bytes: m.total_bytes,
                    running: m.running.load(std::sync::atomic::Ordering::Acquire),
                    elapsed_s: m.elapsed_s(),
                    error: m.error.lock().unwrap().clone(),
                }),
            }
        }),
    }
}

fn latency(l: &crate::cache::LatencyStats) -> LatencyStat {
    LatencyStat {
        count: Some(l.count),
        mean: Some(l.mean_us),
        p50: Some(l.p50_us),
        p90: Some(l.p90_us),
        p99: Some(l.p99_us),
        max: Some(l.max_us),
    }
}

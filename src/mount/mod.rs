//! The mount daemon: opens an archive, serves its virtual files over FUSE, answers the
//! control socket, and unmounts cleanly on SIGINT/SIGTERM or an external unmount.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::archive::ArchiveError;
use crate::cache::ChunkKey;
use crate::control::{ControlError, ControlServer, Handler, Request, Target};
use crate::fs::{file_id, FsOptions, MountFs, SetupError};
use crate::fuse::FuseAdapter;

#[derive(Clone, Debug)]
pub struct MountOptions {
    pub fs: FsOptions,
    /// FUSE request threads.
    pub threads: usize,
    pub allow_other: bool,
    pub socket: Option<PathBuf>,
    /// Pin infrastructure at mount time (`--pin-infra`): every 1-D tensor (norms,
    /// biases) and every tensor of the first this-many layers, in `model.gguf`.
    pub pin_infra_layers: Option<u32>,
    /// With `pin_infra_layers`: also pin the embedding blocks holding this text's tokens.
    pub pin_prompt: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error(transparent)]
    CawsfArchive(#[from] ArchiveError),
    #[error("{0}")]
    Setup(#[from] SetupError),
    #[error("control socket: {0}")]
    Control(#[from] ControlError),
    #[error("{mountpoint}: {reason}")]
    Mount { mountpoint: String, reason: String },
}

/// Default cache budget: a quarter of physical memory, at least 256 MiB.
pub fn default_cache_bytes() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let total = (pages.max(0) as u64).saturating_mul(page.max(0) as u64);
    (total / 4).max(256 << 20)
}

/// Serve until a signal or an external unmount. Returns when unmounted.
pub fn run(archive_path: &Path, mountpoint: &Path, opts: &MountOptions) -> Result<(), MountError> {
    let mount_err = |reason: String| MountError::Mount {
        mountpoint: mountpoint.display().to_string(),
        reason,
    };
    if !mountpoint.is_dir() {
        return Err(mount_err("not a directory".into()));
    }
    // Scratch buffers of a few MiB (decoded rows, chunks) come and go on every miss;
    // glibc's adaptive mmap threshold would move them into arenas that keep the memory
    // after free, and the daemon's resident size would drift far above its budget.
    // A fixed threshold keeps them mmap-backed, returned to the system on free.
    // SAFETY: mallopt only changes allocator tuning parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_ARENA_MAX, 4);
    }
    // Block the signals before any thread starts so every thread inherits the mask
    // and only the wait below receives them.
    let sigs = blocked_signals();
    let archive = crate::archive::open(archive_path)?;
    let fs = Arc::new(MountFs::new(archive, &opts.fs)?);

    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName(format!("cawsfs:{}", archive_path.display())),
        fuser::MountOption::Subtype("cawsfs".into()),
        fuser::MountOption::RO,
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
    ];
    config.acl = if opts.allow_other {
        fuser::SessionACL::All
    } else {
        fuser::SessionACL::Owner
    };
    config.n_threads = Some(opts.threads.max(1));
    config.clone_fd = true;
    let session = fuser::spawn_mount(FuseAdapter::new(fs.clone()), mountpoint, &config)
        .map_err(|e| mount_err(format!("mount failed: {e}")))?;
    raise_readahead(mountpoint);

    let router =
        match crate::router::Router::open(fs.archive().model(), fs.archive().routing_bytes()) {
            Ok(r) => Ok(r),
            Err(e) => {
                tracing::warn!("router unavailable: {e}");
                Err(e)
            }
        };
    let handler = Arc::new(ControlHandler {
        fs: fs.clone(),
        mountpoint: mountpoint.to_path_buf(),
        router,
    });
    if let Some(n) = opts.pin_infra_layers {
        match handler.pin_infra(n, opts.pin_prompt.as_deref()) {
            Ok(bytes) => tracing::info!("--pin-infra: pinned {bytes} bytes"),
            Err(e) => {
                drop(session);
                return Err(mount_err(format!("--pin-infra: {e}")));
            }
        }
    }
    let mut server = match ControlServer::for_mount(mountpoint, opts.socket.as_deref(), handler) {
        Ok(s) => s,
        Err(e) => {
            drop(session);
            return Err(e.into());
        }
    };
    tracing::info!(
        "serving {} at {} (control socket {})",
        archive_path.display(),
        mountpoint.display(),
        server.path().display()
    );
    loop {
        if let Some(sig) = wait_signal(&sigs, Duration::from_millis(200)) {
            tracing::info!("signal {sig}: unmounting {}", mountpoint.display());
            break;
        }
        if session.guard.is_finished() {
            tracing::info!("{} was unmounted", mountpoint.display());
            break;
        }
    }
    server.shutdown();
    drop(session);
    Ok(())
}

fn blocked_signals() -> libc::sigset_t {
    // SAFETY: the set is initialized by sigemptyset before use; pthread_sigmask only
    // reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_signal(set: &libc::sigset_t, timeout: Duration) -> Option<i32> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: set and ts are valid for the call; a null siginfo pointer is allowed.
    let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (sig > 0).then_some(sig)
}

/// Raise the kernel read-ahead of this mount to 1 MiB through its bdi (root only; the
/// FUSE init handshake caps it at 128 KiB). Failure only costs speed.
fn raise_readahead(mountpoint: &Path) {
    let Some(dev) = mount_device(mountpoint) else {
        tracing::debug!("no mountinfo entry for {}", mountpoint.display());
        return;
    };
    let p = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    if let Err(e) = std::fs::write(&p, "1024") {
        tracing::debug!("could not raise read-ahead via {p}: {e}");
    }
}

/// `major:minor` of the filesystem mounted at `mountpoint`, from /proc/self/mountinfo.
pub fn mount_device(mountpoint: &Path) -> Option<String> {
    let canon = crate::control::canonical_mountpoint(mountpoint);
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 4 && Path::new(&unescape_mountinfo(f[4])) == canon).then(|| f[2].to_string())
    })
}

/// Whether a FUSE filesystem of ours is mounted at `mountpoint` (its mountinfo source
/// is `cawsfs:ARCHIVE`; the fstype is plain `fuse` when mounted without libfuse).
///
/// The mount point itself is never stat'ed: after a daemon crash it answers ENOTCONN,
/// and `cawsfs umount` must still recognise it to clean it up.
pub fn is_mounted(mountpoint: &Path) -> bool {
    let canon = crate::control::canonical_mountpoint(mountpoint);
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    info.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let Some((_, tail)) = l.split_once(" - ") else {
            return false;
        };
        let mut t = tail.split(' ');
        let (fstype, source) = (t.next().unwrap_or(""), t.next().unwrap_or(""));
        f.len() > 4
            && Path::new(&unescape_mountinfo(f[4])) == canon
            && fstype.starts_with("fuse")
            && source.starts_with("cawsfs:")
    })
}

fn unescape_mountinfo(s: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo.
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Answers control requests from the mount's state.
struct ControlHandler {
    fs: Arc<MountFs>,
    mountpoint: PathBuf,
    /// The archive's router; `Ok(None)` when it has no ROUTING, `Err` when it is unusable.
    router: Result<Option<crate::router::Router>, String>,
}

/// The file routes and `--pin-infra` name chunks of unless told otherwise.
const ROUTE_FILE: &str = "model.gguf";
/// Keyed shards a route returns when the request gives no `top_k`.
const DEFAULT_TOP_K: usize = 8;

impl ControlHandler {
    /// (file id, file size, chunk range) of rows `row0..row1` of `tensor` in `file`.
    fn rows_chunks(
        &self,
        file: &str,
        tensor: usize,
        row0: u64,
        row1: u64,
    ) -> Result<(u32, u64, std::ops::Range<u64>), String> {
        let e = self
            .fs
            .entry_by_name(file)
            .filter(|e| e.cached)
            .ok_or_else(|| format!("no tensor file named {file} in this mount"))?;
        let t = &self.fs.archive().model().tensors[tensor];
        let (_, a, b) = e
            .file
            .tensor_ranges()
            .into_iter()
            .find(|r| r.0 == tensor)
            .ok_or_else(|| format!("{file} does not hold {}", t.name))?;
        // Row spans are contiguous bytes for every tensor the router splits (embeddings,
        // experts); a permuted Q/K projection is only ever routed whole.
        let rows = t.rows().max(1);
        let rb = (b - a) / rows;
        let (lo, hi) = if row0 == 0 && row1 >= rows {
            (a, b)
        } else {
            (a + row0 * rb, a + row1.min(rows) * rb)
        };
        let cs = self.fs.cache().chunk_size();
        Ok((file_id(e.ino), e.file.size, (lo / cs)..hi.div_ceil(cs)))
    }

    /// Pin infrastructure in model.gguf: 1-D tensors, the first `layers` layers and,
    /// given a prompt, the embedding blocks that hold its tokens (every block the router
    /// scores above 0). All or nothing; returns the bytes reserved.
    fn pin_infra(&self, layers: u32, prompt: Option<&str>) -> Result<u64, String> {
        let cache = self.fs.cache();
        let model = self.fs.archive().model();
        let mut spans = Vec::new();
        if let Some(p) = prompt {
            let router = match &self.router {
                Ok(Some(r)) => r,
                Ok(None) => return Err("the archive has no ROUTING section".into()),
                Err(e) => return Err(format!("router unavailable: {e}")),
            };
            let (_, key) = router.prompt_key(model, p)?;
            for r in router.rank(&key, usize::MAX) {
                let s = &router.routing.shards[r.shard];
                spans.push(self.rows_chunks(ROUTE_FILE, s.tensor as usize, s.row0, s.row1)?);
            }
        }
        for (i, t) in model.tensors.iter().enumerate() {
            let early = crate::model::names::layer_of(&t.name).is_some_and(|l| l < layers);
            if t.shape.len() <= 1 || early {
                spans.push(self.rows_chunks(ROUTE_FILE, i, 0, t.rows())?);
            }
        }
        let mut done: Vec<ChunkKey> = Vec::new();
        for (f, size, r) in &spans {
            for index in r.clone() {
                let key = ChunkKey { file: *f, index };
                if cache.is_pinned(key) {
                    continue;
                }
                if let Err(e) = cache.pin(key, *size) {
                    for k in &done {
                        let _ = cache.unpin(*k);
                    }
                    return Err(format!(
                        "infrastructure does not fit the cache budget ({} chunks pinned before: {e})",
                        done.len()
                    ));
                }
                done.push(key);
            }
        }
        for (f, size, r) in spans {
            cache.prefetch_registered(f, size, r);
        }
        Ok(cache.stats().pinned_bytes)
    }

    fn route(
        &self,
        prompt: &str,
        top_k: Option<u32>,
        budget: Option<u64>,
        prefetch: bool,
        file: Option<&str>,
    ) -> Result<Value, String> {
        let router = match &self.router {
            Ok(Some(r)) => r,
            Ok(None) => {
                return Err(
                    "this archive has no ROUTING section (convert it again to get routes)".into(),
                )
            }
            Err(e) => return Err(format!("router unavailable: {e}")),
        };
        let file = file.unwrap_or(ROUTE_FILE);
        let cache = self.fs.cache();
        let cs = cache.chunk_size();
        let model = self.fs.archive().model();
        let (tokens, key) = router.prompt_key(model, prompt)?;
        let k = top_k.map_or(DEFAULT_TOP_K, |k| k as usize);
        let ranked = router.rank(&key, k);
        // Keyed shards by score, then (with a budget) the others in forward-pass order,
        // while the distinct chunks they need fit the budget.
        let mut picks: Vec<(usize, Option<f32>)> =
            ranked.iter().map(|r| (r.shard, Some(r.score))).collect();
        if budget.is_some() {
            picks.extend(router.ordered().into_iter().map(|i| (i, None)));
        }
        let limit = budget.unwrap_or(u64::MAX);
        let mut seen = std::collections::HashSet::new();
        let (mut total, mut out, mut spans) = (0u64, Vec::new(), Vec::new());
        for (i, score) in picks {
            let s = &router.routing.shards[i];
            let (f, size, r) = self.rows_chunks(file, s.tensor as usize, s.row0, s.row1)?;
            let new_bytes: u64 = r
                .clone()
                .filter(|c| !seen.contains(&(f, *c)))
                .map(|c| (size - c * cs).min(cs))
                .sum();
            if total + new_bytes > limit {
                if score.is_some() {
                    continue; // a smaller keyed shard further down may still fit
                }
                break; // ordered shards stop at the first that does not fit
            }
            total += new_bytes;
            seen.extend(r.clone().map(|c| (f, c)));
            out.push(json!({
                "rank": out.len() + 1,
                "kind": s.kind.name(),
                "tensor": model.tensors[s.tensor as usize].name,
                "rows": [s.row0, s.row1],
                "order": s.order,
                "score": score,
                "cost": s.cost,
                "chunks": [r.start, r.end],
            }));
            spans.push((f, size, r));
        }
        let mut reply = json!({
            "file": file,
            "tokens": tokens,
            "shards": out,
            "chunk_bytes": total,
        });
        if prefetch {
            // Each chunk once, in rank order (neighbouring shards share chunks).
            let mut once = std::collections::HashSet::new();
            let chunks: Vec<(u32, u64, u64)> = spans
                .iter()
                .flat_map(|(f, size, r)| r.clone().map(move |c| (*f, *size, c)))
                .filter(|&(f, _, c)| once.insert((f, c)))
                .collect();
            let hinted = cache.set_hints(
                chunks
                    .iter()
                    .map(|&(file, _, index)| ChunkKey { file, index }),
            );
            let mut queued = 0;
            for (f, size, c) in chunks {
                queued += cache.prefetch_registered(f, size, c..c + 1);
            }
            reply["queued_chunks"] = json!(queued);
            reply["hinted_chunks"] = json!(hinted);
        }
        Ok(reply)
    }

    /// (file id, file size, chunk range) for every chunk a target covers.
    fn chunks(&self, target: &Target) -> Result<Vec<(u32, u64, std::ops::Range<u64>)>, String> {
        let cs = self.fs.cache().chunk_size();
        let span = |size: u64, a: u64, b: u64| (a / cs)..b.min(size).div_ceil(cs);
        let model = self.fs.archive().model();
        match target {
            Target::File { file, range } => {
                let e = self
                    .fs
                    .entry_by_name(file)
                    .ok_or_else(|| format!("no file named {file} in this mount"))?;
                if !e.cached {
                    return Err(format!(
                        "{file} is served from memory and needs no prefetch"
                    ));
                }
                let (a, b) = range.unwrap_or((0, e.file.size));
                if a >= e.file.size {
                    return Err(format!(
                        "range starts at {a}, past the end of {file} ({} bytes)",
                        e.file.size
                    ));
                }
                Ok(vec![(file_id(e.ino), e.file.size, span(e.file.size, a, b))])
            }
            Target::Tensor(_) | Target::Layer(_) => {
                let want: Vec<usize> = match target {
                    Target::Tensor(name) => {
                        vec![model
                            .tensor_index(name)
                            .ok_or_else(|| format!("no tensor named {name}"))?]
                    }
                    Target::Layer(l) => {
                        let v: Vec<usize> = (0..model.tensors.len())
                            .filter(|&i| {
                                crate::model::names::layer_of(&model.tensors[i].name) == Some(*l)
                            })
                            .collect();
                        if v.is_empty() {
                            return Err(format!(
                                "no layer {l} (the model has {})",
                                model.arch.n_layers
                            ));
                        }
                        v
                    }
                    Target::File { .. } => unreachable!(),
                };
                // The tensor's bytes in every file that holds it.
                let mut out = Vec::new();
                for e in self.fs.entries().iter().filter(|e| e.cached) {
                    for (t, a, b) in e.file.tensor_ranges() {
                        if want.contains(&t) {
                            out.push((file_id(e.ino), e.file.size, span(e.file.size, a, b)));
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

impl Handler for ControlHandler {
    fn handle(&self, req: Request) -> Result<Value, String> {
        let cache = self.fs.cache();
        match req {
            Request::Ping => Ok(json!({"pong": true})),
            Request::Stat => {
                let mut v = self.fs.stats_json();
                v["mountpoint"] = json!(self.mountpoint.display().to_string());
                Ok(v)
            }
            Request::Prefetch(t) => {
                let mut queued = 0;
                for (f, size, r) in self.chunks(&t)? {
                    queued += cache.prefetch_registered(f, size, r);
                }
                Ok(json!({"queued_chunks": queued}))
            }
            Request::Pin(t) => {
                let spans = self.chunks(&t)?;
                let mut done: Vec<ChunkKey> = Vec::new();
                for (f, size, r) in &spans {
                    for index in r.clone() {
                        let key = ChunkKey { file: *f, index };
                        if let Err(e) = cache.pin(key, *size) {
                            // All or nothing: undo what this request pinned.
                            for k in &done {
                                let _ = cache.unpin(*k);
                            }
                            return Err(e.to_string());
                        }
                        done.push(key);
                    }
                }
                // Pinned chunks are reserved; load them now rather than on first read.
                for (f, size, r) in spans {
                    cache.prefetch_registered(f, size, r);
                }
                Ok(json!({"pinned_chunks": done.len()}))
            }
            Request::Unpin(t) => {
                let mut n = 0;
                for (f, _, r) in self.chunks(&t)? {
                    for index in r {
                        if cache.unpin(ChunkKey { file: f, index }).is_ok() {
                            n += 1;
                        }
                    }
                }
                Ok(json!({"unpinned_chunks": n}))
            }
            Request::Evict(None) => Ok(json!({"freed_bytes": cache.evict_all_unpinned()})),
            Request::Evict(Some(t)) => {
                let mut freed = 0;
                for (f, _, r) in self.chunks(&t)? {
                    freed += cache.evict(r.map(|index| ChunkKey { file: f, index }));
                }
                Ok(json!({"freed_bytes": freed}))
            }
            Request::Trace { on: true } => {
                cache.trace_start();
                Ok(json!({"tracing": true}))
            }
            Request::Trace { on: false } => {
                let (events, dropped) = cache.trace_stop();
                let files: serde_json::Map<String, Value> = self
                    .fs
                    .entries()
                    .iter()
                    .filter(|e| e.cached)
                    .map(|e| (file_id(e.ino).to_string(), json!(e.name)))
                    .collect();
                let ev: Vec<Value> = events
                    .iter()
                    .map(|e| json!([e.file, e.index, e.t_us, e.outcome]))
                    .collect();
                Ok(json!({
                    "tracing": false,
                    "chunk_size": cache.chunk_size(),
                    "files": files,
                    "events": ev,
                    "dropped": dropped,
                }))
            }
            Request::Route {
                prompt,
                top_k,
                budget_bytes,
                prefetch,
                file,
            } => self.route(&prompt, top_k, budget_bytes, prefetch, file.as_deref()),
        }
    }
}

/// Parse a human size: `2GiB`, `512MiB`, `1.5G`, `100M`, `4096`, `64KiB`, `1T`.
/// Decimal suffixes (`G`, `GB`) are read as binary too, as `free -h` users expect.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let not_a_size = || format!("{s:?} is not a size (try 2GiB or 512MiB)");
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    num.parse::<f64>().map_err(|_| not_a_size())?;
    // bytesize reads K/M/G/T and KB/MB/GB/TB as powers of 1000, so every spelling is
    // named by its IEC unit first; the unit check here also keeps the accepted set (and
    // its error text) as it was: no P/E or bare Ki/Mi.
    let iec = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => "B",
        "k" | "kb" | "kib" => "KiB",
        "m" | "mb" | "mib" => "MiB",
        "g" | "gb" | "gib" => "GiB",
        "t" | "tb" | "tib" => "TiB",
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use KiB, MiB, GiB or TiB)"
            ))
        }
    };
    // bytesize saturates at u64::MAX and truncates fractions, so too big and below one
    // byte both land outside this range.
    let v = format!("{num} {iec}")
        .parse::<bytesize::ByteSize>()
        .map_err(|_| not_a_size())?
        .as_u64();
    if !(1..=1 << 62).contains(&v) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size(" 64 KiB ").unwrap(), 64 << 10);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("2XB").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("99999999T").is_err());
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/trail\\04"), "/trail\\04");
    }
}

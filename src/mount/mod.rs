//! The mount daemon: opens an archive, serves its virtual files over FUSE, answers the
//! control socket, and unmounts cleanly on SIGINT/SIGTERM (lazily when a file is
//! still open, so the mount point is never left dead) or an external unmount.
//!
//! * [`run`], here: the daemon's life, from opening the archive to unmounting.
//! * `session`: mounting the FUSE session (options, access, read-ahead) and ending it.
//! * `signals`: the signals that end the daemon, waited for with a timeout.
//! * `handler`: what each control request does to the mount's cache.
//! * `stat`: the `stat` reply, from the cache's, archive's and files' figures.
//! * `mountinfo`: [`is_mounted`] and [`mount_device`] from /proc/self/mountinfo.

mod handler;
mod mountinfo;
mod session;
mod signals;
mod stat;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::archive::ArchiveError;
use crate::control::{ControlError, ControlServer};
use crate::fs::{FsOptions, MountFs, SetupError};

use handler::ControlHandler;
pub use mountinfo::{is_mounted, mount_device};

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
    /// Hand whole disk tier files to the kernel (FUSE passthrough) where it can.
    pub passthrough: bool,
    /// Mount over a directory that has files (hiding them while mounted).
    pub nonempty: bool,
}

/// Why `mountpoint` cannot be mounted at, in one line: it does not exist, is not a
/// directory, is a mount already (a live one, or a dead one whose daemon died), or has
/// files the mount would hide (unless `nonempty`).
pub fn check_mountpoint(mountpoint: &Path, nonempty: bool) -> Result<(), String> {
    let meta = std::fs::metadata(mountpoint);
    if is_mounted(mountpoint) {
        // A FUSE mount whose daemon is gone answers ENOTCONN to everything.
        return Err(match meta {
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => format!(
                "a dead mount left by a daemon that exited; run `cawsfs umount {}` first",
                mountpoint.display()
            ),
            _ => "already a cawsfs mount".into(),
        });
    }
    match meta {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err("does not exist (make the directory first)".into())
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            return Err(format!(
                "a dead FUSE mount; unmount it first (`fusermount3 -u {}`)",
                mountpoint.display()
            ))
        }
        Err(e) => return Err(e.to_string()),
        Ok(m) if !m.is_dir() => return Err("not a directory".into()),
        Ok(_) => {}
    }
    let has_files = std::fs::read_dir(mountpoint)
        .map_err(|e| e.to_string())?
        .next()
        .is_some();
    if has_files && !nonempty {
        return Err(
            "not empty: the mount would hide its files (--nonempty mounts over them)".into(),
        );
    }
    Ok(())
}

/// How often the daemon returns freed heap pages to the system.
const TRIM_EVERY: Duration = Duration::from_millis(200);
/// How often learned expert transitions are written out while mounted.
const SAVE_EXPERTS_EVERY: Duration = Duration::from_secs(30);

/// Return the allocator's free pages to the system (glibc keeps them otherwise).
fn trim_heap() {
    // SAFETY: malloc_trim only releases free memory; it takes the allocator's own locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    /// The archive opened but its files cannot be served (e.g. its tokenizer metadata).
    #[error("{archive}: {err}")]
    Setup { archive: String, err: SetupError },
    #[error("control socket: {0}")]
    Control(#[from] ControlError),
    #[error("{mountpoint}: {reason}")]
    Mount { mountpoint: String, reason: String },
}

/// Default cache budget with a disk tier: a quarter of physical memory, at most this.
/// Served bytes then also live in the page cache and in the tier, which serves a later
/// read without reconstructing, so a larger cache is a third copy, and making it
/// costs: a first pass of a 1.17 B model (1.2 GB view) with the quarter of 24 GiB took
/// 319 k page faults and 3.0 s of daemon CPU, with 512 MiB 165 k and 2.5 s, against
/// 2.3 s for `export` (docs/MOUNT.md, "Runs 27–28").
pub const TIERED_CACHE_BYTES: u64 = 512 << 20;

/// Default cache budget: a quarter of physical memory, at least 256 MiB.
pub fn default_cache_bytes() -> u64 {
    use nix::unistd::{sysconf, SysconfVar};
    let get = |v| sysconf(v).ok().flatten().unwrap_or(0).max(0) as u64;
    let total = get(SysconfVar::_PHYS_PAGES).saturating_mul(get(SysconfVar::PAGE_SIZE));
    (total / 4).max(256 << 20)
}

/// Serve `archive_path` at `mountpoint` until a signal or an external unmount;
/// returns when unmounted. `ready` runs once the mount and its control socket
/// answer (`cawsfs mount` waits on it rather than polling the socket).
pub fn run(
    archive_path: &Path,
    mountpoint: &Path,
    opts: &MountOptions,
    ready: impl FnOnce(),
) -> Result<(), MountError> {
    let mount_err = |reason: String| MountError::Mount {
        mountpoint: mountpoint.display().to_string(),
        reason,
    };
    check_mountpoint(mountpoint, opts.nonempty).map_err(mount_err)?;
    // The path fuser mounts at, and so the one to unmount.
    let canon = mountpoint
        .canonicalize()
        .map_err(|e| mount_err(format!("cannot resolve: {e}")))?;
    // Chunks and scratch buffers (decoded rows) come and go on every miss. glibc's
    // adaptive mmap threshold would move even multi-MiB ones into arenas that keep
    // the memory after free, and the daemon's resident size would drift far above its
    // budget. A fixed threshold of 2 MiB keeps larger ones mmap-backed, returned to the
    // system on free, and smaller ones reused from the arenas (the periodic trim
    // returns what they keep). At 128 KiB every 256 KiB chunk and every 1-2 MiB row
    // buffer was a mapping made and unmapped per load: a first pass took 1.07x the
    // daemon CPU on the test model, and a 1 B model read 1.3x slower with a 16 MiB
    // cache, for 5 MiB less peak RSS (docs/MOUNT.md, "Memory", the mmap threshold).
    // Each arena keeps its own freed pages between trims: with 4 arenas a 16 MiB
    // mount peaked 4-6 MiB higher than with 2, and reading cold was no faster
    // (allocations are per block, not per byte, so the lock is not contended).
    // glibc's own variables, where set, win: they are how a user tunes the allocator.
    // libc: mallopt is glibc-only and nix does not wrap it.
    // SAFETY: mallopt only changes allocator tuning parameters.
    unsafe {
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 2 << 20);
        }
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
    // Block the signals before any thread starts so every thread inherits the mask
    // and only the wait below receives them.
    let sigs = signals::StopSignals::block()
        .map_err(|e| mount_err(format!("cannot block stop signals: {e}")))?;
    let t0 = std::time::Instant::now();
    let archive = crate::archive::open(archive_path)?;
    tracing::debug!("setup: archive opened in {:?}", t0.elapsed());
    let fs = Arc::new(
        MountFs::new(archive, &opts.fs).map_err(|err| MountError::Setup {
            archive: archive_path.display().to_string(),
            err,
        })?,
    );
    if let Err(e) = fs.start_seal_watch() {
        tracing::warn!("disk tier: cannot start the seal watcher ({e}); changes are seen at opens");
    }
    if let Err(e) = fs.start_tier_refill() {
        tracing::warn!(
            "disk tier: cannot start the refill thread ({e}); dropped extents stay missing"
        );
    }
    let session = session::mount(fs.clone(), archive_path, mountpoint, opts)
        .map_err(|e| mount_err(format!("mount failed: {e}")))?;
    fs.check_residency(&canon);

    let handler = Arc::new(ControlHandler::new(fs.clone(), mountpoint.to_path_buf()));
    if let Some(n) = opts.pin_infra_layers {
        match handler.pin_infra(n, opts.pin_prompt.as_deref()) {
            Ok(bytes) => tracing::info!("--pin-infra: pinned {bytes} bytes"),
            Err(e) => {
                finish(session, &canon, false);
                return Err(mount_err(format!("--pin-infra: {e}")));
            }
        }
    }
    let mut server = match ControlServer::for_mount(mountpoint, opts.socket.as_deref(), handler) {
        Ok(s) => s,
        Err(e) => {
            finish(session, &canon, false);
            return Err(e.into());
        }
    };
    tracing::info!(
        "serving {} at {} (control socket {}; set up in {:?})",
        archive_path.display(),
        mountpoint.display(),
        server.path().display(),
        t0.elapsed()
    );
    ready();
    // Building the layouts leaves the heap fragmented with what it freed (META's JSON,
    // the tokenizer's intermediate forms): hand those pages back, after `ready` so
    // that a restart does not wait for it.
    trim_heap();
    let mut last_trim = std::time::Instant::now();
    let mut last_save = last_trim;
    let unmounted = loop {
        // Freed chunks and decode buffers come back to the allocator, not the system;
        // trimming now and then keeps resident memory near what the cache holds.
        if last_trim.elapsed() >= TRIM_EVERY {
            trim_heap();
            last_trim = std::time::Instant::now();
        }
        // What the expert predictors learned goes to disk now and then, so that a
        // crash loses at most that much of it.
        if last_save.elapsed() >= SAVE_EXPERTS_EVERY {
            fs.save_experts();
            last_save = std::time::Instant::now();
        }
        if let Some(sig) = sigs.wait(Duration::from_millis(200)) {
            tracing::info!("signal {sig}: unmounting {}", mountpoint.display());
            break false;
        }
        if session.guard.is_finished() {
            // The request loop also ends on an error, leaving the mount in place.
            if is_mounted(&canon) {
                tracing::error!(
                    "{}: the FUSE session ended; unmounting",
                    mountpoint.display()
                );
                break false;
            }
            tracing::info!("{} was unmounted", mountpoint.display());
            break true;
        }
    };
    server.shutdown();
    let detached = finish(session, &canon, unmounted);
    // What the disk tier still has queued is written and published before exit.
    fs.stop_tier();
    // A detached mount's open files read the backing files until the daemon exits.
    if !detached {
        fs.release_seals();
    }
    fs.save_experts();
    Ok(())
}

/// Where the disk tier lives unless `--disk-cache` says: `$CAWSFS_TIER_DIR`, else
/// `tier/` under `$CAWSFS_CACHE`, `$XDG_CACHE_HOME/cawsfs` or `~/.cache/cawsfs` (the
/// first that is set); None when none is.
pub fn default_tier_dir() -> Option<PathBuf> {
    std::env::var_os("CAWSFS_TIER_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| default_cache_root().map(|d| d.join("tier")))
}

/// The user's cawsfs cache: `$CAWSFS_CACHE`, `$XDG_CACHE_HOME/cawsfs` or
/// `~/.cache/cawsfs`.
pub fn default_cache_root() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("CAWSFS_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("cawsfs")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/cawsfs")))
}

/// The disk tier's default bound: a fifth of the free space where `dir` is (or would
/// be), at most 64 GiB; 1 GiB when that cannot be read.
pub fn default_tier_bytes(dir: &Path) -> u64 {
    let probe = dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or_else(|| Path::new("/"));
    match nix::sys::statvfs::statvfs(probe) {
        Ok(v) => (v.blocks_available().saturating_mul(v.fragment_size()) / 5).min(64 << 30),
        Err(_) => 1 << 30,
    }
}

/// Ends the session (see [`session::end`]) and logs what could not be done cleanly;
/// true when the mount may still be in use (detached, or not unmounted).
fn finish(session: fuser::BackgroundSession, mountpoint: &Path, unmounted: bool) -> bool {
    match session::end(session, mountpoint, unmounted) {
        Ok(session::Ended::Already | session::Ended::Unmounted) => false,
        Ok(session::Ended::Detached) => {
            tracing::warn!(
                "{}: busy (a file is still open), detached it lazily",
                mountpoint.display()
            );
            true
        }
        Err(e) => {
            tracing::error!("{}: {e}", mountpoint.display());
            true
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
}

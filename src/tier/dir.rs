//! The tier directory as a whole, outside any one entry: listing it (`cawsfs tier ls`),
//! and removing entries no mount has open (`tier gc|clear`, and the bound a mount keeps).
//! Names are looked at without being followed and only regular files are read, so
//! whatever else lies in the directory blocks nothing (docs/TIER.md).

use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use super::{io, Label, TierError, FLAG_WHOLE, HEADER};
use crate::localfs::{self, Access};

/// Lock entry `key`'s data file exclusively if no mount has it open: `None` when one
/// does (or the file is gone). A name that is not a regular file is `Misplaced`: no
/// mount can have it open, and removing it is safe.
fn lock_unused(dir: &Path, key: &str) -> Result<Unused, TierError> {
    let path = dir.join(format!("{key}.data"));
    let f = match localfs::open_regular(&path, Access::Read) {
        Ok(f) => f,
        Err(e) if e.is_not_found() => return Ok(Unused::Busy),
        Err(e) if e.is_misplaced() => return Ok(Unused::Misplaced),
        Err(e) => return Err(e.into()),
    };
    match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(Unused::Locked(l)),
        Err((_, Errno::EWOULDBLOCK)) => Ok(Unused::Busy),
        Err((_, e)) => Err(io(&path)(std::io::Error::from(e))),
    }
}

enum Unused {
    /// No mount has it; held until the entry's files are gone.
    Locked(Flock<File>),
    /// A mount has it open, or there is no data file.
    Busy,
    /// The data file's name holds something other than a regular file.
    Misplaced,
}

/// One entry found in a tier directory.
#[derive(Clone, Debug)]
pub struct EntryInfo {
    pub key: String,
    /// Bytes the data file occupies on disk (holes excluded).
    pub disk_bytes: u64,
    pub size: u64,
    pub whole: bool,
    /// When its index last changed (or its data, before the first publish).
    pub last_used: std::time::SystemTime,
    /// A mount has it open (it holds the data file's lock).
    pub in_use: bool,
    pub label: Option<Label>,
}

/// The entries of a tier directory, least recently used first: every `KEY.idx` and
/// every `KEY.data` without one (written, never published, or left by a crash). Names
/// are looked at without being followed; only regular files are read, and only their
/// first bytes, so whatever else lies there costs nothing and blocks nothing.
pub fn list(dir: &Path) -> Result<Vec<EntryInfo>, TierError> {
    let mut out = Vec::new();
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(out),
        _ => localfs::check_private_dir(dir).map_err(TierError::Dir)?,
    }
    let rd = std::fs::read_dir(dir).map_err(io(dir))?;
    let mut keys = std::collections::BTreeSet::new();
    for ent in rd {
        let name = ent.map_err(io(dir))?.file_name();
        let name = name.to_string_lossy();
        if let Some(key) = name
            .strip_suffix(".idx")
            .or_else(|| name.strip_suffix(".data"))
        {
            if key.len() == 32 && key.bytes().all(|b| b.is_ascii_hexdigit()) {
                keys.insert(key.to_string());
            }
        }
    }
    for key in keys {
        let data = std::fs::symlink_metadata(dir.join(format!("{key}.data"))).ok();
        let idx_path = dir.join(format!("{key}.idx"));
        let idx = read_head(&idx_path, HEADER);
        let idx_meta = idx
            .as_ref()
            .and_then(|_| std::fs::symlink_metadata(&idx_path).ok());
        let field = |r: std::ops::Range<usize>| {
            idx.as_ref()
                .and_then(|b| b.get(r))
                .map(|f| f.iter().rev().fold(0u64, |a, &x| a << 8 | u64::from(x)))
        };
        let regular = data.as_ref().is_some_and(|m| m.file_type().is_file());
        let in_use = regular && matches!(lock_unused(dir, &key)?, Unused::Busy);
        let label = localfs::read_bounded(&dir.join(format!("{key}.json")), LABEL_MAX)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        out.push(EntryInfo {
            disk_bytes: data
                .as_ref()
                .filter(|_| regular)
                .map_or(0, |m| m.blocks() * 512),
            size: field(32..40)
                .or(data.as_ref().filter(|_| regular).map(|m| m.len()))
                .unwrap_or(0),
            whole: field(12..16).is_some_and(|f| f as u32 & FLAG_WHOLE != 0),
            last_used: idx_meta
                .or(data)
                .and_then(|m| m.modified().ok())
                .unwrap_or(std::time::UNIX_EPOCH),
            in_use,
            label,
            key,
        });
    }
    out.sort_by_key(|e| e.last_used);
    Ok(out)
}

/// A label is a few names; anything larger is not one.
const LABEL_MAX: u64 = 64 << 10;

/// The first `n` bytes of the regular file at `path` (fewer if it is shorter).
fn read_head(path: &Path, n: usize) -> Option<Vec<u8>> {
    let f = localfs::open_regular(path, Access::Read).ok()?;
    let mut buf = vec![0u8; n];
    let mut got = 0;
    while got < n {
        match f.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    buf.truncate(got);
    Some(buf)
}

/// What [`gc`] did.
#[derive(Debug, Default)]
pub struct Collected {
    pub removed: Vec<EntryInfo>,
    /// Entries that would have gone but a mount has open.
    pub busy: Vec<EntryInfo>,
    /// Entries whose names could not all be removed (a non-empty directory where a
    /// file belongs), with why.
    pub failed: Vec<(EntryInfo, String)>,
    /// Data bytes left.
    pub left_bytes: u64,
}

/// Remove least recently used entries (not those in `keep`, nor any a mount has
/// open) until the data files occupy at most `max_bytes`. Names that are not regular
/// files are removed without being followed.
pub fn gc(dir: &Path, max_bytes: u64, keep: &[u128]) -> Result<Collected, TierError> {
    let entries = list(dir)?;
    localfs::sweep_stale_tmp(dir);
    let mut total: u64 = entries.iter().map(|e| e.disk_bytes).sum();
    let keep: Vec<String> = keep.iter().map(|k| format!("{k:032x}")).collect();
    let mut done = Collected::default();
    let not_file = |ext: &str, key: &str| {
        std::fs::symlink_metadata(dir.join(format!("{key}.{ext}")))
            .is_ok_and(|m| !m.file_type().is_file())
    };
    for e in entries {
        if keep.contains(&e.key) {
            continue;
        }
        // Names that hold no entry (a FIFO, a link, a directory) always go; real
        // entries while over the bound (`clear`: all).
        let misplaced = not_file("data", &e.key) || not_file("idx", &e.key);
        if !misplaced && total <= max_bytes && max_bytes > 0 {
            continue;
        }
        // Held while the files go, so that no mount opens the entry half removed.
        let _lock = match lock_unused(dir, &e.key)? {
            Unused::Locked(l) => {
                // A seal left by a mount that died (docs/TIER.md, "Passthrough").
                localfs::set_immutable(&l, false).map_err(io(dir))?;
                Some(l)
            }
            Unused::Misplaced => None,
            Unused::Busy => {
                if std::fs::symlink_metadata(dir.join(format!("{}.data", e.key))).is_ok() {
                    done.busy.push(e);
                    continue;
                }
                // No data file at all: only an index or a label is left.
                None
            }
        };
        match remove_files(dir, &e.key) {
            Ok(()) => {
                total -= e.disk_bytes;
                done.removed.push(e);
            }
            Err(why) => done.failed.push((e, why.to_string())),
        }
    }
    done.left_bytes = total;
    Ok(done)
}

/// Remove every entry no mount has open.
pub fn clear(dir: &Path) -> Result<Collected, TierError> {
    gc(dir, 0, &[])
}

/// Remove every name of entry `key`: the index first (without it the data is never
/// served), then the data, label, stamp and temporary files.
fn remove_files(dir: &Path, key: &str) -> Result<(), TierError> {
    for ext in ["idx", "data", "json", "ok"] {
        localfs::remove_name(&dir.join(format!("{key}.{ext}")))?;
    }
    let prefix = format!("{key}.");
    for ent in std::fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let name = ent.file_name();
        if name
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".tmp"))
        {
            localfs::remove_name(&ent.path())?;
        }
    }
    Ok(())
}

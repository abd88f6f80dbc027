//! The stamp (`KEY.ok`) that spares a whole entry its full verification while its files
//! are exactly as they were when every listed extent was known to match (docs/TIER.md,
//! "Reading").

use std::os::unix::fs::MetadataExt;

use xxhash_rust::xxh3::xxh3_64;

use super::{Entry, TierError};
use crate::localfs;

/// A stamp is a few short lines; anything larger is not one.
const STAMP_MAX: u64 = 4096;

/// The stamp at `path`, if it is a regular file of a stamp's size (a FIFO or a link
/// there is no stamp, and blocks nothing).
fn read_stamp(path: &std::path::Path) -> Option<String> {
    String::from_utf8(localfs::read_bounded(path, STAMP_MAX).ok()?).ok()
}

/// How long ago an entry's files must have last changed for a clean verification to
/// be stamped (several ticks of the kernel's coarse clock).
pub const SETTLED: std::time::Duration = std::time::Duration::from_millis(100);

impl Entry {
    /// [`Entry::verify_all`], unless the entry's stamp (`KEY.ok`) says every listed
    /// extent matched when the data file and the index were exactly as they are now;
    /// a clean verification writes that stamp. A restarted mount then hands a tier
    /// file to the kernel without reading it whole first.
    pub fn verify_all_once(&self) -> Result<Vec<u64>, TierError> {
        let stamp_path = self.idx_path.with_extension("ok");
        let now = self.stamp();
        if now.is_some() && read_stamp(&stamp_path) == now {
            return Ok(Vec::new());
        }
        if now.is_some() && self.sums.lock().unwrap().vouched_stamp == now {
            self.stamp_vouched();
            return Ok(Vec::new());
        }
        let bad = self.verify_all()?;
        if let (true, Some(text)) = (bad.is_empty(), now.filter(|_| self.settled())) {
            self.write_stamp(&text);
        }
        Ok(bad)
    }

    /// Write the stamp of an entry this process made whole from bytes it wrote or
    /// checked, without reading it back, once both files have settled, so that the
    /// next mount's first passthrough open skips the full read too (a model larger than
    /// the page cache would otherwise be read from disk twice). `Some(wait)`: not yet
    /// settled, try again after `wait`; `None`: written, or nothing to vouch for (not
    /// whole, or a file changed since the publish that made it whole).
    pub fn stamp_vouched(&self) -> Option<std::time::Duration> {
        let vouched = self.sums.lock().unwrap().vouched_stamp.clone();
        let (now, vouched) = (self.stamp()?, vouched?);
        if now != vouched {
            return None;
        }
        if !self.settled() {
            return Some(SETTLED);
        }
        if read_stamp(&self.idx_path.with_extension("ok")) != Some(now.clone()) {
            self.write_stamp(&now);
        }
        None
    }

    pub(super) fn write_stamp(&self, text: &str) {
        // Not synced: a stamp lost in a crash only costs the next verification.
        let _ = localfs::replace(&self.idx_path.with_extension("ok"), text.as_bytes(), false);
    }

    /// Whether both files last changed long enough ago that any later change gets
    /// another change time: file systems take it from a clock that ticks every few
    /// milliseconds, so a write in the tick of the last one would leave it as it was.
    pub(super) fn settled(&self) -> bool {
        let old = |m: std::io::Result<std::fs::Metadata>| {
            m.ok().is_some_and(|m| {
                let changed = std::time::UNIX_EPOCH
                    + std::time::Duration::new(m.ctime().max(0) as u64, m.ctime_nsec() as u32);
                changed.elapsed().is_ok_and(|d| d >= SETTLED)
            })
        };
        old(self.data.metadata()) && old(std::fs::symlink_metadata(&self.idx_path))
    }

    /// What a verification vouches for: the data file's and the index's identity, size,
    /// modification and change times (any write, by us or anyone, moves the change
    /// time, which no one but the kernel sets), and the checksums listed in memory.
    /// None when either file cannot be read, or extents are waiting to be published.
    pub(super) fn stamp(&self) -> Option<String> {
        let sums = self.sums.lock().unwrap();
        if !sums.pending.is_empty() || sums.dropped {
            return None;
        }
        let listed = xxh3_64(bytemuck::cast_slice(&sums.listed));
        drop(sums);
        let file = |m: std::fs::Metadata| {
            format!(
                "{}:{} {} {}.{} {}.{}",
                m.dev(),
                m.ino(),
                m.len(),
                m.mtime(),
                m.mtime_nsec(),
                m.ctime(),
                m.ctime_nsec()
            )
        };
        let data = file(self.data.metadata().ok()?);
        let idx = file(std::fs::symlink_metadata(&self.idx_path).ok()?);
        Some(format!(
            "cawsfs-tier-verified 1\ndata {data}\nidx {idx}\nlisted {listed:016x}\n"
        ))
    }
}

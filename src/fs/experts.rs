//! The expert predictor of each mixture-of-experts file (docs/MOE.md, "One step
//! ahead"): its map from the layout, and what it learned kept on disk between mounts,
//! keyed by the archive's identity and the file's layout so that another archive or
//! view never takes it.

use std::ops::Range;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_128;

use super::{file_id, Entry, MountFs};
use crate::archive::Store;
use crate::cache::{ChunkCache, ExpertMap, ExpertMode};
use crate::layout;
use crate::model::ModelDesc;

/// Experts per token assumed when the source does not say (Mixtral's).
const DEFAULT_USED: u32 = 2;
/// The kernel read-ahead of a mount: 1 MiB, as FUSE reads go best in large requests.
const READAHEAD_KB: u32 = 1024;
/// The least a mount of small experts gets (the FUSE default).
const MIN_READAHEAD_KB: u32 = 128;

#[derive(Clone, Debug)]
pub struct ExpertOptions {
    pub mode: ExpertMode,
    /// Where learned transitions are kept between mounts (None: not kept).
    pub dir: Option<PathBuf>,
}

/// One file with a predictor.
pub(super) struct Learned {
    file: u32,
    key: u128,
    path: Option<PathBuf>,
    /// Its name in the mount.
    name: String,
    /// Whether its predictions are queued.
    queues: bool,
}

/// Give every tensor file that holds experts a predictor; load what an earlier mount
/// of the same archive and view learned.
pub(super) fn start(
    archive: &dyn Store,
    entries: &[Entry],
    cache: &ChunkCache,
    opts: &ExpertOptions,
) -> Vec<Learned> {
    let model = archive.model();
    let mut out = Vec::new();
    for e in entries.iter().filter(|e| e.cached) {
        let (extents, used) = layout::expert_extents(model, &e.file);
        let Some(experts) = extents.iter().map(|x| x.1 + 1).max() else {
            continue;
        };
        let map = match ExpertMap::new(experts, used.unwrap_or(DEFAULT_USED), extents) {
            Ok(m) => m,
            Err(why) => {
                tracing::warn!("{}: no expert prefetch ({why})", e.name);
                continue;
            }
        };
        let (layers, n) = (map.layers(), map.experts());
        let file = file_id(e.ino);
        cache.set_experts(file, map, opts.mode);
        let key = xxh3_128(
            format!(
                "cawsfs-experts 1\narchive {:032x}\nfile {}\nlayout {:016x}\n",
                archive.identity(),
                e.name,
                e.file.fingerprint()
            )
            .as_bytes(),
        );
        let path = opts
            .dir
            .as_ref()
            .map(|d| d.join(format!("{key:032x}.xpred")));
        if let Some(p) = &path {
            match std::fs::read(p) {
                Ok(bytes) => match cache.load_experts(file, key, &bytes) {
                    Ok(()) => tracing::info!(
                        "{}: expert transitions learned before loaded from {}",
                        e.name,
                        p.display()
                    ),
                    Err(why) => tracing::warn!(
                        "{}: {} not used ({why}); learning again",
                        e.name,
                        p.display()
                    ),
                },
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => tracing::warn!("{}: cannot read {}: {err}", e.name, p.display()),
            }
        }
        tracing::debug!(
            "{}: expert predictor over {layers} layers of {n} experts",
            e.name
        );
        out.push(Learned {
            file,
            key,
            path,
            name: e.name.clone(),
            queues: opts.mode == ExpertMode::Prefetch,
        });
    }
    out
}

/// The kernel read-ahead for a mount of `entries`, in KiB: [`READAHEAD_KB`], less when
/// they hold small experts ([`readahead_kb`]).
pub(super) fn kernel_readahead_kb(model: &ModelDesc, entries: &[Entry]) -> u32 {
    let smallest = entries
        .iter()
        .filter(|e| e.cached)
        .flat_map(|e| layout::expert_extents(model, &e.file).0)
        .map(|x| x.2.end - x.2.start)
        .min();
    smallest.map_or(READAHEAD_KB, readahead_kb)
}

/// The kernel read-ahead for experts whose smallest piece (one expert's gate, up or
/// down matrix) is `smallest` bytes: a fault reads around its page and read-ahead runs
/// past a piece's end, into experts no token asked for, so the window is kept to a
/// sixteenth of a piece. Measured on a model of 3 MB pieces under memory pressure
/// (docs/MOE.md): 1 MiB windows made the kernel ask for 1.5 x the bytes 128 KiB did.
fn readahead_kb(smallest: u64) -> u32 {
    let kb = (smallest / 16 / 1024).min(u64::from(READAHEAD_KB)) as u32;
    if kb < MIN_READAHEAD_KB {
        return MIN_READAHEAD_KB;
    }
    // A power of two, as the bdi's other sizes are.
    1 << kb.ilog2()
}

/// The page-aligned parts of `ranges` of the mounted file `path` that the page cache
/// does not hold. The daemon opens its own file, maps it without touching a page and
/// asks mincore(2), then closes it at once: a file it kept open would make the mount
/// busy to `cawsfs umount`. None when it cannot tell.
fn not_resident(path: &Path, ranges: &[Range<u64>]) -> Option<Vec<Range<u64>>> {
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: the map is only passed to mincore, never read; the file is ours.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    drop(file);
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |p| p as u64);
    let mut out = Vec::new();
    for range in ranges {
        let start = range.start / page * page;
        let end = range.end.min(map.len() as u64);
        if start >= end {
            continue;
        }
        let mut pages = vec![0u8; (end - start).div_ceil(page) as usize];
        // SAFETY: start < end <= the map's length, and `pages` has a byte per page of
        // it. libc: nix does not wrap mincore.
        let rc = unsafe {
            libc::mincore(
                map.as_ptr().add(start as usize) as *mut libc::c_void,
                (end - start) as usize,
                pages.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return None;
        }
        out.extend(missing_runs(&pages, start, page, end));
    }
    Some(out)
}

/// Runs of pages whose mincore byte says "not resident", as byte ranges from `start`
/// (the last one cut at `end`).
fn missing_runs(pages: &[u8], start: u64, page: u64, end: u64) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::new();
    for (i, _) in pages.iter().enumerate().filter(|(_, b)| *b & 1 == 0) {
        let at = start + i as u64 * page;
        match out.last_mut() {
            Some(last) if last.end == at => last.end = (at + page).min(end),
            _ => out.push(at..(at + page).min(end)),
        }
    }
    out
}

/// Write `bytes` to `path` whole or not at all (a crash leaves the old file).
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

impl MountFs {
    /// The kernel read-ahead this mount should have, in KiB (docs/MOE.md).
    pub fn kernel_readahead_kb(&self) -> u32 {
        self.readahead_kb
    }

    /// Let each file whose predictions are queued queue only the chunks the kernel no
    /// longer holds, looked up in the page cache of its file under `mountpoint`
    /// (docs/MOE.md, "One step ahead"). Call once the mount is live.
    pub fn check_residency(&self, mountpoint: &Path) {
        for l in self.experts.iter().filter(|l| l.queues) {
            let path = mountpoint.join(&l.name);
            self.cache
                .set_residency(l.file, Box::new(move |r| not_resident(&path, r)));
        }
    }

    /// Keep on disk what the expert predictors learned since the last save (cheap when
    /// nothing changed). Failures are logged: learning again costs only prefetches.
    pub fn save_experts(&self) {
        for l in &self.experts {
            let Some(path) = &l.path else { continue };
            let Some(bytes) = self.cache.save_experts(l.file, l.key) else {
                continue;
            };
            if let Err(e) = write_atomic(path, &bytes) {
                tracing::warn!("cannot keep expert transitions in {}: {e}", path.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pages_not_resident_become_byte_runs() {
        use super::missing_runs;
        assert_eq!(missing_runs(&[1, 1, 1], 0, 4096, 12288), vec![]);
        assert_eq!(
            missing_runs(&[0, 0, 1, 0, 1, 0], 8192, 4096, 8192 + 5 * 4096 + 100),
            vec![8192..16384, 20480..24576, 28672..28772]
        );
    }

    #[test]
    fn readahead_is_a_sixteenth_of_the_smallest_piece_within_bounds() {
        use super::readahead_kb;
        assert_eq!(readahead_kb(u64::MAX), 1024);
        assert_eq!(readahead_kb(33 << 20), 1024);
        assert_eq!(readahead_kb(3_000_000), 128);
        assert_eq!(readahead_kb(8 << 20), 512);
        assert_eq!(readahead_kb(6 << 20), 256);
        assert_eq!(readahead_kb(100_000), 128);
    }
}

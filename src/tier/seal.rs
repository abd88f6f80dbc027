//! Sealing a whole entry's data file while it is handed to the kernel as a FUSE
//! passthrough backing file (docs/TIER.md, "Passthrough"): the kernel then reads the
//! file itself and no checksum stands between its bytes and a reader, so nobody may
//! change them. The seal is the immutable flag (`chattr +i`): writes and truncation
//! fail with EPERM, root's included, until it is lifted. What gets through (someone
//! lifting the flag) shows in the file's change time, checked at every open and
//! release ([`Entry::seal_holds`]).

use std::os::fd::AsRawFd;

use super::{io, Entry, FileSig, TierError};
use crate::localfs;

impl Entry {
    /// Seal the data file. `Ok(true)`: sealed (now, or earlier by this process);
    /// `Ok(false)`: this file system or process cannot set the immutable flag, so the
    /// file must not be handed to the kernel.
    pub fn seal(&self) -> Result<bool, TierError> {
        let mut sealed = self.sealed.lock().unwrap();
        if sealed.is_some() {
            return Ok(true);
        }
        if !localfs::set_immutable(&self.data, true).map_err(io(&self.data_path))? {
            return Ok(false);
        }
        *sealed = Some(FileSig::of(&self.data).map_err(io(&self.data_path))?);
        Ok(true)
    }

    /// Whether the data file is still as this process sealed it: immutable, the same
    /// inode, size and times. False when it is not sealed.
    pub fn seal_holds(&self) -> bool {
        let sealed = *self.sealed.lock().unwrap();
        sealed.is_some_and(|s| {
            localfs::is_immutable(&self.data) && FileSig::of(&self.data).ok() == Some(s)
        })
    }

    /// Whether this process holds a seal on the data file.
    pub fn is_sealed(&self) -> bool {
        self.sealed.lock().unwrap().is_some()
    }

    /// Forget a seal found broken; true the first time. The entry must be verified
    /// again before it is handed to the kernel again.
    pub fn seal_broken(&self) -> bool {
        self.sealed.lock().unwrap().take().is_some()
    }

    /// Before a data file whose seal was found broken is checked and written again in
    /// place: lift whatever immutable flag is set, and give it back its size.
    pub fn prepare_repair(&self) -> Result<(), TierError> {
        localfs::set_immutable(&self.data, false).map_err(io(&self.data_path))?;
        let len = self.data.metadata().map_err(io(&self.data_path))?.len();
        if len != self.spec.size {
            self.data
                .set_len(self.spec.size)
                .map_err(io(&self.data_path))?;
        }
        Ok(())
    }

    /// The data file's signature now (None when it cannot be read).
    pub fn data_sig(&self) -> Option<FileSig> {
        FileSig::of(&self.data).ok()
    }

    /// Whether the data file's contents may differ from when `before` was taken: its
    /// inode, size or modification time moved (the change time moves with the seal).
    pub fn changed_since(&self, before: &FileSig) -> bool {
        self.data_sig().is_none_or(|now| {
            (now.dev, now.ino, now.len, now.mtime)
                != (before.dev, before.ino, before.len, before.mtime)
        })
    }

    /// Lift this process's seal, at unmount, unless another mount still hands the file
    /// to the kernel (it holds its shared lock; the last one out lifts the seal).
    /// Returns the file's signature right after, when the seal held until then: the
    /// entry is then as verified, and [`Entry::restamp`] may say so.
    pub fn unseal(&self) -> Option<FileSig> {
        let sig = self.sealed.lock().unwrap().take()?;
        let intact = localfs::is_immutable(&self.data) && self.data_sig() == Some(sig);
        let fd = self.data.as_raw_fd();
        // Our shared lock becomes exclusive only if no other process holds one. Linux
        // drops the shared lock first, so it is taken again either way (without
        // waiting: a `gc` that got in between removes the entry, which is unused).
        // SAFETY: flock only takes the descriptor, which `self.data` keeps open.
        let alone = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0;
        let lifted = alone && localfs::set_immutable(&self.data, false).unwrap_or(false);
        // SAFETY: as above.
        unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) };
        if !lifted {
            if alone {
                tracing::warn!(
                    "tier entry {}: the seal could not be lifted; `cawsfs tier clear` lifts it",
                    self.data_path.display()
                );
            }
            return None;
        }
        intact.then(|| self.data_sig()).flatten()
    }

    /// After [`Entry::unseal`] returned `after`, once the files have settled: stamp the
    /// entry as verified if nothing changed since, so that the next mount hands it to
    /// the kernel without reading it whole (lifting the seal moved its change time).
    pub fn restamp(&self, after: &FileSig) {
        if self.data_sig().as_ref() != Some(after) || !self.settled() {
            return;
        }
        if let Some(text) = self.stamp() {
            self.write_stamp(&text);
        }
    }
}

/// Watches sealed data files (inotify: writes, truncation, attribute changes), so that
/// a write past a lifted seal while the kernel reads the file is seen at once, not only
/// at the next open or release of it: a client that maps a file once and reads it for
/// hours would otherwise read what was written for as long. (Lifting the immutable flag
/// alone raises no event on this kernel; the write that follows does.)
pub struct SealWatch {
    inotify: nix::sys::inotify::Inotify,
    /// Watch descriptor → the caller's token for the file.
    tokens: std::sync::Mutex<std::collections::HashMap<i32, u64>>,
}

impl SealWatch {
    pub fn new() -> std::io::Result<SealWatch> {
        use nix::sys::inotify::{InitFlags, Inotify};
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        Ok(SealWatch {
            inotify,
            tokens: Default::default(),
        })
    }

    /// Watch `entry`'s data file (the open inode, through /proc, not its name),
    /// reporting changes as `token`.
    pub fn watch(&self, entry: &Entry, token: u64) -> std::io::Result<()> {
        use nix::sys::inotify::AddWatchFlags as F;
        let path = format!("/proc/self/fd/{}", entry.data.as_raw_fd());
        let wd = self
            .inotify
            .add_watch(path.as_str(), F::IN_ATTRIB | F::IN_MODIFY)?;
        self.tokens.lock().unwrap().insert(wd.as_raw(), token);
        Ok(())
    }

    /// The tokens of watched files that changed, waiting up to `timeout` for the first.
    /// Every token when events were lost (the queue overflowed).
    pub fn changed(&self, timeout: std::time::Duration) -> Vec<u64> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use nix::sys::inotify::AddWatchFlags as F;
        use std::os::fd::AsFd;
        let mut fds = [PollFd::new(self.inotify.as_fd(), PollFlags::POLLIN)];
        let wait = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        if !matches!(poll(&mut fds, wait), Ok(n) if n > 0) {
            return Vec::new();
        }
        let Ok(events) = self.inotify.read_events() else {
            return Vec::new();
        };
        let tokens = self.tokens.lock().unwrap();
        let mut out: Vec<u64> = if events.iter().any(|e| e.mask.contains(F::IN_Q_OVERFLOW)) {
            tokens.values().copied().collect()
        } else {
            events
                .iter()
                .filter_map(|e| tokens.get(&e.wd.as_raw()).copied())
                .collect()
        };
        out.sort_unstable();
        out.dedup();
        out
    }
}

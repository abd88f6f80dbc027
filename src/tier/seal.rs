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

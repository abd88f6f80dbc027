//! FUSE passthrough of whole disk tier files: which file is handed to the kernel and
//! when, its seal while it is (docs/TIER.md, "Passthrough never serves changed
//! bytes"): checked at every open and release and by a watcher, a changed file put
//! right in place, seals lifted at unmount.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::*;

/// How long the seal watcher waits for an event before it looks whether the tier is
/// stopping: an unmount waits for it at most this long.
const SEAL_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Whether a mount hands whole tier files to the kernel (FUSE passthrough).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Passthrough {
    /// Not decided yet (before the kernel's FUSE init).
    #[default]
    Pending,
    On,
    /// Turned off by the user (`--no-passthrough`).
    Off,
    /// The kernel refused it; the reason, for `stat` and the log.
    Unavailable(String),
}

impl std::fmt::Display for Passthrough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Passthrough::Pending => write!(f, "pending"),
            Passthrough::On => write!(f, "on"),
            Passthrough::Off => write!(f, "off"),
            Passthrough::Unavailable(why) => write!(f, "unavailable ({why})"),
        }
    }
}

impl MountFs {
    /// Watch the sealed backing files on a thread of its own until the tier stops: a
    /// file whose seal was lifted is put right (or withdrawn) at once
    /// ([`MountFs::backing_intact`]), not only at its next open or release.
    pub fn start_seal_watch(self: &Arc<Self>) -> std::io::Result<()> {
        let Some(t) = &self.tier else { return Ok(()) };
        if t.seal_watch.is_none() {
            return Ok(());
        }
        let fs = Arc::downgrade(self);
        let h = std::thread::Builder::new()
            .name("cawsfs-seal-watch".into())
            .spawn(move || loop {
                let Some(fs) = fs.upgrade() else { break };
                let Some(t) = fs
                    .tier
                    .as_ref()
                    .filter(|t| !t.stopping.load(Ordering::Relaxed))
                else {
                    break;
                };
                let Some(w) = t.seal_watch.as_ref() else {
                    break;
                };
                for ino in w.changed(SEAL_POLL) {
                    // Only files still sealed here: a withdrawn one waits for its
                    // next open (each check of a changed file reads it whole).
                    let sealed = fs
                        .entry(ino)
                        .ok()
                        .and_then(|e| e.tier.as_ref())
                        .is_some_and(|te| te.is_sealed());
                    if sealed {
                        fs.backing_intact(ino);
                    }
                }
            })?;
        *t.seal_thread.lock().unwrap() = Some(h);
        Ok(())
    }

    /// Record whether whole tier files go to the kernel (the FUSE adapter decides at
    /// init, or when the kernel refuses a backing file).
    pub fn set_passthrough(&self, state: Passthrough) {
        if let Some(t) = &self.tier {
            *t.passthrough.lock().unwrap() = state;
        }
    }

    /// Count an open of `ino` answered with FUSE passthrough.
    pub fn passthrough_opened(&self, ino: u64) {
        if let (Ok(e), Some(t)) = (self.entry(ino), &self.tier) {
            e.passthrough.store(true, Ordering::Relaxed);
            t.passthrough_opens.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether `ino` was opened with FUSE passthrough in this mount.
    pub fn is_passthrough(&self, ino: u64) -> bool {
        self.entry(ino)
            .is_ok_and(|e| e.passthrough.load(Ordering::Relaxed))
    }

    /// The tier's data file of `ino` for a passthrough open, sealed ([`tier::Entry::seal`]):
    /// only when the entry is whole, every extent matched its checksum (once per
    /// mount, or per seal broken), and the file system lets it be sealed
    /// (docs/TIER.md, "Passthrough").
    pub fn backing_file(&self, ino: u64) -> Option<std::fs::File> {
        let e = self.entry(ino).ok()?;
        let t = e.tier.as_ref()?;
        let ft = self.tier.as_ref()?;
        if !t.is_whole() {
            return None;
        }
        let before = t.data_sig()?;
        if !e.verified.load(Ordering::Acquire) {
            match t.verify_all_once() {
                Ok(bad) if bad.is_empty() => e.verified.store(true, Ordering::Release),
                Ok(bad) => {
                    ft.bad_extents
                        .fetch_add(bad.len() as u64, Ordering::Relaxed);
                    tracing::warn!(
                        "disk tier: {} has {} bad extents; served through the daemon",
                        e.name,
                        bad.len()
                    );
                    return None;
                }
                Err(err) => {
                    tracing::warn!("{err}; {} served through the daemon", e.name);
                    return None;
                }
            }
        }
        match t.seal() {
            Ok(true) => {}
            Ok(false) => {
                if !ft.unsealable.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "disk tier: {} cannot be sealed (no immutable flag on this file system, \
                         or not permitted): tier files are served through the daemon",
                        t.data_path().display()
                    );
                }
                return None;
            }
            Err(err) => {
                tracing::warn!("{err}; {} served through the daemon", e.name);
                return None;
            }
        }
        // Changed between the verification and the seal: verified again next time.
        if t.changed_since(&before) {
            self.seal_lost(e, t);
            let _ = t.unseal();
            return None;
        }
        if let Some(w) = &ft.seal_watch {
            if let Err(err) = w.watch(t, ino) {
                tracing::debug!("disk tier: cannot watch {}: {err}", t.data_path().display());
            }
        }
        // The same inode, read-only, without a second lookup of its name.
        use std::os::fd::AsRawFd;
        let fd = t.data_file().as_raw_fd();
        std::fs::File::open(format!("/proc/self/fd/{fd}")).ok()
    }

    /// Whether the backing file of `ino` holds the right bytes under an intact seal.
    /// When its seal was lifted (and the file perhaps changed), the change is counted
    /// and the file put right in place: every extent checked, those that differ
    /// reconstructed and written back into the same inode the kernel reads, then sealed
    /// again, so that descriptors already open read the right bytes from then on. Only
    /// when that fails is the entry verified again before it is handed over again: the
    /// FUSE adapter stops handing out its backing file (docs/TIER.md).
    pub fn backing_intact(&self, ino: u64) -> bool {
        let Ok(e) = self.entry(ino) else { return true };
        let (Some(t), Some(ft)) = (e.tier.as_ref(), self.tier.as_ref()) else {
            return true;
        };
        let _one = ft.repairing.lock().unwrap();
        if t.seal_holds() {
            return true;
        }
        if t.seal_broken() {
            ft.tampered.fetch_add(1, Ordering::Relaxed);
        }
        match self.repair_backing(e, t) {
            Ok(n) => {
                ft.bad_extents.fetch_add(n as u64, Ordering::Relaxed);
                tracing::warn!(
                    "disk tier: {} changed while handed to the kernel (its seal was lifted); \
                     {n} extents put right in place, sealed again",
                    t.data_path().display()
                );
                true
            }
            Err(why) => {
                self.seal_lost(e, t);
                tracing::warn!(
                    "disk tier: {} changed while handed to the kernel (its seal was lifted) and \
                     cannot be put right ({why}); verified again before its next passthrough open",
                    t.data_path().display()
                );
                false
            }
        }
    }

    /// [`MountFs::backing_intact`]'s repair: returns how many extents were rewritten.
    fn repair_backing(&self, e: &Entry, t: &tier::Entry) -> Result<usize, String> {
        t.prepare_repair().map_err(|err| err.to_string())?;
        let bad = t.verify_all().map_err(|err| err.to_string())?;
        for &x in &bad {
            let len = t.extent_len(x).map_err(|err| err.to_string())?;
            let buf = self.reconstruct_extent(e, x, len)?;
            t.write(x, &buf).map_err(|err| err.to_string())?;
        }
        t.publish().map_err(|err| err.to_string())?;
        if !t.is_whole() {
            return Err("not whole after the repair".into());
        }
        match t.seal() {
            Ok(true) => Ok(bad.len()),
            Ok(false) => Err("it cannot be sealed again".into()),
            Err(err) => Err(err.to_string()),
        }
    }

    fn seal_lost(&self, e: &Entry, t: &tier::Entry) {
        e.verified.store(false, Ordering::Release);
        t.seal_broken();
    }

    /// At unmount (once the kernel no longer reads them): lift the seals of this
    /// mount's backing files that no other mount uses, and stamp those that stayed
    /// sealed throughout as verified, so the next mount skips reading them whole.
    pub fn release_seals(&self) {
        let lifted: Vec<_> = self
            .entries
            .iter()
            .filter_map(|e| e.tier.as_ref())
            .filter_map(|t| t.unseal().map(|sig| (t, sig)))
            .collect();
        if lifted.is_empty() {
            return;
        }
        std::thread::sleep(tier::SETTLED);
        for (t, sig) in lifted {
            t.restamp(&sig);
        }
    }
}

//! Mounting the FUSE session: the kernel mount options, who may use the mount, request
//! threads, and the read-ahead raise once it is mounted; and ending it: unmounting
//! ourselves (lazily when busy) rather than through fuser's handle.

use std::io;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use nix::errno::Errno;
use nix::mount::{umount2, MntFlags};

use crate::fs::MountFs;
use crate::fuse::FuseAdapter;

use super::mountinfo::mount_device;
use super::MountOptions;

/// Mounts `fs` at `mountpoint`; end the session with [`end`], not by dropping it.
pub(super) fn mount(
    fs: Arc<MountFs>,
    archive_path: &Path,
    mountpoint: &Path,
    opts: &MountOptions,
) -> std::io::Result<fuser::BackgroundSession> {
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
    let kb = fs.kernel_readahead_kb();
    let session = fuser::spawn_mount(FuseAdapter::new(fs, opts.passthrough), mountpoint, &config)?;
    raise_readahead(mountpoint, kb);
    Ok(session)
}

/// Raise the kernel read-ahead of this mount to `kb` KiB (1 MiB, less for small experts:
/// [`MountFs::kernel_readahead_kb`]) through its bdi (root only; the FUSE init handshake
/// caps it at 128 KiB). Failure only costs speed.
fn raise_readahead(mountpoint: &Path, kb: u32) {
    let Some(dev) = mount_device(mountpoint) else {
        tracing::debug!("no mountinfo entry for {}", mountpoint.display());
        return;
    };
    let p = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    if let Err(e) = std::fs::write(&p, kb.to_string()) {
        tracing::debug!("could not raise read-ahead via {p}: {e}");
    }
}

/// How [`end`] left the mount point.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Ended {
    /// Unmounted by someone else (`cawsfs umount`, `fusermount3 -u`) before we ended.
    Already,
    /// Unmounted by us.
    Unmounted,
    /// Busy (a file still open): detached, so the mount point is usable at once; the
    /// open files fail once the daemon exits.
    Detached,
}

/// Ends `session`, mounted at `mountpoint` (canonical): unmounts it unless
/// `unmounted` says the kernel already did, detaching it lazily if it is busy.
///
/// fuser's handle is never dropped, because its drop unmounts blindly: its "is it
/// still mounted" test always answers yes, so after an external unmount it calls
/// umount(2) again and logs "Unmount failed: Invalid argument" (or, on a busy
/// mount, fails with EBUSY and leaves a dead mount behind once we exit). The handle
/// is leaked instead; its /dev/fuse descriptor closes when the process exits, moments
/// later, and request threads still serving a detached mount's open files end then.
pub(super) fn end(
    session: fuser::BackgroundSession,
    mountpoint: &Path,
    unmounted: bool,
) -> Result<Ended, String> {
    std::mem::forget(session);
    if unmounted {
        return Ok(Ended::Already);
    }
    match umount2(mountpoint, MntFlags::empty()) {
        Ok(()) => return Ok(Ended::Unmounted),
        Err(Errno::EBUSY) => {
            return umount2(mountpoint, MntFlags::MNT_DETACH)
                .map(|()| Ended::Detached)
                .map_err(|e| format!("lazy unmount failed: {e}"));
        }
        // Not root: the mount was made by the setuid fusermount3, which must undo it.
        Err(Errno::EPERM) => {}
        Err(e) => return Err(format!("unmount failed: {e}")),
    }
    let busy = match fusermount(&["-u", "-q"], mountpoint) {
        Ok(()) => return Ok(Ended::Unmounted),
        Err(e) => e,
    };
    fusermount(&["-u", "-z", "-q"], mountpoint)
        .map(|()| Ended::Detached)
        .map_err(|e| format!("unmount failed ({busy}), and lazy unmount failed: {e}"))
}

/// Runs `fusermount3 ARGS -- MOUNTPOINT` (`fusermount` where there is no
/// fusermount3); `Err` holds its last line of error output.
fn fusermount(args: &[&str], mountpoint: &Path) -> Result<(), String> {
    let run = |bin: &str| {
        Command::new(bin)
            .args(args)
            .arg("--")
            .arg(mountpoint)
            .stdin(std::process::Stdio::null())
            .output()
    };
    let out = match run("fusermount3") {
        Err(e) if e.kind() == io::ErrorKind::NotFound => run("fusermount"),
        r => r,
    }
    .map_err(|e| format!("cannot run fusermount3: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    Err(err
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map_or_else(
            || format!("fusermount3 {}", out.status),
            |l| l.trim().to_string(),
        ))
}

//! Mounting the FUSE session: the kernel mount options, who may use the mount, request
//! threads, and the read-ahead raise once it is mounted.

use std::path::Path;
use std::sync::Arc;

use crate::fs::MountFs;
use crate::fuse::FuseAdapter;

use super::mountinfo::mount_device;
use super::MountOptions;

/// Mounts `fs` at `mountpoint`; the session unmounts when dropped.
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
    let session = fuser::spawn_mount(FuseAdapter::new(fs), mountpoint, &config)?;
    raise_readahead(mountpoint);
    Ok(session)
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

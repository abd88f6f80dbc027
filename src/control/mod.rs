//! The control socket: a Unix stream socket per mount speaking JSON lines.
//!
//! ```text
//! cawsfs stat / route / prefetch ──► client ──► socket (0600) ──► server ──► Handler
//!                                                                   (the daemon's cache)
//! ```
//! This module knows nothing of FUSE or of the cache: the daemon implements
//! [`Handler`] and the CLI calls [`request`] / [`ControlClient`] and the renderers.
//! The wire protocol, socket placement and permissions are in docs/CONTROL.md.
//!
//! * [`protocol`]: [`Request`] / [`Response`] and their one-line parse errors.
//! * [`reply`]: the typed payload of each verb's reply, built by the daemon and read
//!   by the CLI.
//! * [`server`]: [`ControlServer`] — safe bind (0600 without a window, stale-socket
//!   replacement), peer-uid check, bounded threads, panic isolation.
//! * [`client`]: [`request`], [`ControlClient`].
//! * [`render`]: `cawsfs stat` as a table, Prometheus text, and `--watch`.
//! * socket path derivation and the `--socket` registry, here.

pub mod client;
pub mod protocol;
pub mod render;
pub mod reply;
pub mod server;

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

pub use client::{daemon_pid, decode, request, request_as, trusted_server, ControlClient};
pub use protocol::{Request, Response, Target, MAX_REQUEST_LINE};
pub use render::{render_prometheus, render_rates, render_stat, watch};
pub use reply::{
    ArchiveStat, CacheStat, EvictReply, FileStat, LatencyStat, PinReply, PingReply, PrefetchReply,
    Reply, RouteReply, RoutedShard, StatReply, TierStat, TraceOffReply, TraceOnReply, TracedLookup,
    UnpinReply,
};
pub use server::{allowed_peer, ControlServer, Handler, ServerOptions};

/// Longest socket path `bind`/`connect` accept: `sun_path` is 108 bytes with its NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// Everything that can go wrong on either side of the socket; each message is one line.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("no cawsfs daemon at {} (is it mounted?)", .path.display())]
    NoDaemon { path: PathBuf },
    #[error("permission denied connecting to {} (the daemon belongs to another user)", .path.display())]
    PermissionDenied { path: PathBuf },
    #[error("timed out after {secs}s waiting for the cawsfs daemon at {}", .path.display())]
    Timeout { path: PathBuf, secs: f64 },
    #[error("bad reply from the cawsfs daemon at {}: {msg}", .path.display())]
    BadReply { path: PathBuf, msg: String },
    /// The daemon's own `{"ok":false}` message.
    #[error("{0}")]
    Daemon(String),
    #[error("a cawsfs daemon is already listening on {}", .path.display())]
    AlreadyRunning { path: PathBuf },
    #[error("{} exists and is not a socket; refusing to replace it", .path.display())]
    NotASocket { path: PathBuf },
    #[error("socket path {} is {len} bytes; at most {MAX_SOCKET_PATH} fit in a Unix socket address", .path.display())]
    PathTooLong { path: PathBuf, len: usize },
    #[error("insecure control directory {}: {why}", .path.display())]
    InsecureDir { path: PathBuf, why: String },
    #[error("refusing the control socket {}: its server runs as uid {uid}, not as us (uid {own}) or root", .path.display())]
    UntrustedServer { path: PathBuf, uid: u32, own: u32 },
    #[error("{what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl ControlError {
    pub(crate) fn io(what: &'static str, path: &Path, source: io::Error) -> ControlError {
        ControlError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The current effective uid.
pub fn current_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The directory holding derived sockets and registry files, not yet created:
/// `$XDG_RUNTIME_DIR/cawsfs` when that variable is an absolute path, otherwise
/// `/tmp/cawsfs-<uid>`.
pub fn socket_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(d) if d.is_absolute() => d.join("cawsfs"),
        _ => PathBuf::from(format!("/tmp/cawsfs-{}", current_uid())),
    }
}

/// Creates `dir` (mode 0700) if needed and checks that it is a real directory owned
/// by us and closed to others; a wider mode on our own directory is narrowed.
/// /tmp is shared, so a directory someone else planted there must not be used.
pub fn ensure_private_dir(dir: &Path) -> Result<(), ControlError> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(ControlError::io("cannot create control directory", dir, e)),
    }
    let md = fs::symlink_metadata(dir)
        .map_err(|e| ControlError::io("cannot stat control directory", dir, e))?;
    let insecure = |why: String| ControlError::InsecureDir {
        path: dir.to_path_buf(),
        why,
    };
    if !md.file_type().is_dir() {
        return Err(insecure("not a directory (or a symlink)".into()));
    }
    if md.uid() != current_uid() {
        return Err(insecure(format!(
            "owned by uid {}, not {}",
            md.uid(),
            current_uid()
        )));
    }
    if md.mode() & 0o077 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| ControlError::io("cannot chmod control directory", dir, e))?;
    }
    Ok(())
}

/// The mount point as the key of its socket: `canonicalize(parent) / file_name`, so
/// that relative paths and symlinked parents agree, without stat'ing the mount point
/// itself (which would block on a hung FUSE daemon).
pub fn canonical_mountpoint(mountpoint: &Path) -> PathBuf {
    let abs = std::path::absolute(mountpoint).unwrap_or_else(|_| mountpoint.to_path_buf());
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => match fs::canonicalize(parent) {
            Ok(p) => p.join(name),
            Err(_) => abs,
        },
        // "/", or a path ending in "..": resolve it whole.
        _ => fs::canonicalize(&abs).unwrap_or(abs),
    }
}

/// `<name>-<xxh3 hex>`: the file stem shared by a mount's socket and registry file.
fn mount_key(mountpoint: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let canon = canonical_mountpoint(mountpoint);
    let hash = xxh3_64(canon.as_os_str().as_bytes());
    let name: String = canon
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "root".into())
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(32)
        .collect();
    format!("{name}-{hash:016x}")
}

/// The socket a mount uses when `--socket` is not given (docs/CONTROL.md).
pub fn default_socket_path(mountpoint: &Path) -> PathBuf {
    socket_dir().join(format!("{}.sock", mount_key(mountpoint)))
}

/// Where a mount started with `--socket` records its socket path.
pub fn registry_path(mountpoint: &Path) -> PathBuf {
    socket_dir().join(format!("{}.path", mount_key(mountpoint)))
}

/// Records `socket` as the control socket of `mountpoint` (daemon side, with
/// `--socket`). Written to a temporary file and renamed, mode 0600.
pub fn register_socket(mountpoint: &Path, socket: &Path) -> Result<PathBuf, ControlError> {
    use std::os::unix::ffi::OsStrExt;
    let dir = socket_dir();
    ensure_private_dir(&dir)?;
    let reg = registry_path(mountpoint);
    let tmp = dir.join(format!(
        ".reg-{}-{}",
        std::process::id(),
        mount_key(mountpoint)
    ));
    let socket = std::path::absolute(socket).unwrap_or_else(|_| socket.to_path_buf());
    let write = || -> io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(socket.as_os_str().as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, &reg)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        ControlError::io("cannot write socket registry", &reg, e)
    })?;
    Ok(reg)
}

/// Removes the registry entry of `mountpoint` (daemon side, at unmount).
pub fn unregister_socket(mountpoint: &Path) {
    let _ = fs::remove_file(registry_path(mountpoint));
}

/// The socket to reach `mountpoint`'s daemon (client side): the registered
/// `--socket` path when a registry file we own exists, else [`default_socket_path`].
pub fn find_socket(mountpoint: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    let reg = registry_path(mountpoint);
    if let Ok(md) = fs::symlink_metadata(&reg) {
        // Small cap: a path, not a document.
        if md.file_type().is_file() && md.uid() == current_uid() && md.len() <= 4096 {
            if let Ok(bytes) = fs::read(&reg) {
                if !bytes.is_empty() {
                    return PathBuf::from(std::ffi::OsStr::from_bytes(&bytes));
                }
            }
        }
    }
    default_socket_path(mountpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_path_is_stable_and_sanitized() {
        let t = tempfile::tempdir().unwrap();
        let m = t.path().join("my mount!");
        let a = default_socket_path(&m);
        assert_eq!(a, default_socket_path(&m));
        let name = a.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("my_mount_-"), "{name}");
        assert!(name.ends_with(".sock"));
        assert_eq!(name.len(), "my_mount_-".len() + 16 + 5);
        assert_eq!(a.parent().unwrap(), socket_dir());
        // Relative and dotted spellings of the same place agree.
        let dotted = t.path().join("sub/..").join("my mount!");
        std::fs::create_dir(t.path().join("sub")).unwrap();
        assert_eq!(default_socket_path(&dotted), a);
        // Different mount points differ.
        assert_ne!(default_socket_path(&t.path().join("other")), a);
        assert!(a.as_os_str().len() <= MAX_SOCKET_PATH);
    }

    #[test]
    fn private_dir_checks() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("ctl");
        ensure_private_dir(&d).unwrap();
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        ensure_private_dir(&d).unwrap();
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        let f = t.path().join("file");
        fs::write(&f, b"x").unwrap();
        assert!(matches!(
            ensure_private_dir(&f),
            Err(ControlError::InsecureDir { .. })
        ));
        let l = t.path().join("link");
        std::os::unix::fs::symlink(&d, &l).unwrap();
        assert!(matches!(
            ensure_private_dir(&l),
            Err(ControlError::InsecureDir { .. })
        ));
        if current_uid() == 0 {
            let o = t.path().join("other");
            fs::create_dir(&o).unwrap();
            std::os::unix::fs::chown(&o, Some(65534), None).unwrap();
            let e = ensure_private_dir(&o).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }

    #[test]
    fn registry_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let m = t.path().join("mnt-registry-test");
        let custom = t.path().join("custom.sock");
        assert_eq!(find_socket(&m), default_socket_path(&m));
        let reg = register_socket(&m, &custom).unwrap();
        assert_eq!(fs::metadata(&reg).unwrap().mode() & 0o777, 0o600);
        assert_eq!(find_socket(&m), custom);
        unregister_socket(&m);
        assert_eq!(find_socket(&m), default_socket_path(&m));
    }
}

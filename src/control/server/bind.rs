//! Putting the socket file in place safely: length checks, refusing a live daemon or
//! a non-socket at the path, replacing a stale socket, and binding so that the final
//! name never has a mode wider than 0600.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::control::{ControlError, MAX_SOCKET_PATH};

/// Tells apart the temporary bind directories of binds running at once in one process.
static BIND_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Refuses an empty path or one too long for `sun_path`.
pub(super) fn check_len(path: &Path) -> Result<(), ControlError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH || len == 0 {
        return Err(ControlError::PathTooLong {
            path: path.to_path_buf(),
            len,
        });
    }
    Ok(())
}

/// Refuses a live socket or a non-socket at `path`; a stale socket is left for the
/// rename to replace.
pub(super) fn check_existing(path: &Path) -> Result<(), ControlError> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ControlError::io("cannot stat", path, e)),
        Ok(md) if !md.file_type().is_socket() => Err(ControlError::NotASocket {
            path: path.to_path_buf(),
        }),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => Err(ControlError::AlreadyRunning {
                path: path.to_path_buf(),
            }),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(ControlError::io("cannot probe existing socket", path, e)),
        },
    }
}

/// Binds in a fresh 0700 directory beside `path`, chmods to 0600, renames into place.
pub(super) fn bind_private(path: &Path) -> Result<UnixListener, ControlError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let n = BIND_COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp_dir = parent.join(format!(".cb{}.{n}", std::process::id()));
    let tmp = tmp_dir.join("s");
    check_len(&tmp).map_err(|_| ControlError::PathTooLong {
        // Name the path the user gave; the temporary one is ours.
        path: path.to_path_buf(),
        len: tmp.as_os_str().len(),
    })?;
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&tmp_dir)
        .map_err(|e| ControlError::io("cannot create temporary directory", &tmp_dir, e))?;
    let result = (|| {
        let l = UnixListener::bind(&tmp).map_err(|e| ControlError::io("cannot bind", &tmp, e))?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))
            .map_err(|e| ControlError::io("cannot chmod", &tmp, e))?;
        fs::rename(&tmp, path).map_err(|e| ControlError::io("cannot move socket to", path, e))?;
        Ok(l)
    })();
    let _ = fs::remove_file(&tmp);
    let _ = fs::remove_dir(&tmp_dir);
    result
}

//! Files the daemon keeps on local disk (the disk tier, the fetch cache) are input too:
//! whoever can write their directory can leave a FIFO, a device, a directory or a
//! symbolic link where a file belongs, or a file of any size. Every open here therefore
//! refuses to follow a symbolic link (`O_NOFOLLOW`), never blocks (`O_NONBLOCK`: a
//! FIFO's open returns at once), and accepts a regular file only, checked with `fstat`
//! on the descriptor it opened, never by a second lookup of the name. Reads are bounded
//! before they start. Directories are made private (0700) and refused when others can
//! write them. Errors name the path and what was found there, in one line.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// What went wrong with a local file or directory, naming it.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Something other than a regular file (or directory, for [`private_dir`]) is there.
    #[error("{path}: {what}, not a {want}")]
    Kind {
        path: PathBuf,
        what: String,
        want: &'static str,
    },
    #[error("{path}: {len} bytes, more than the {max} it may have")]
    TooLarge { path: PathBuf, len: u64, max: u64 },
    #[error("{path}: {why}")]
    Unsafe { path: PathBuf, why: String },
}

impl LocalError {
    fn io(path: &Path, source: std::io::Error) -> LocalError {
        LocalError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// The name exists but is not of the kind wanted (or is too large): removing it
    /// and starting again is the remedy, unlike an I/O error.
    pub fn is_misplaced(&self) -> bool {
        matches!(self, LocalError::Kind { .. } | LocalError::TooLarge { .. })
    }

    /// Nothing is at the path.
    pub fn is_not_found(&self) -> bool {
        matches!(self, LocalError::Io { source, .. } if source.kind() == ErrorKind::NotFound)
    }

    /// The file is there but writing it is not permitted (the immutable flag).
    pub fn is_permission(&self) -> bool {
        matches!(self, LocalError::Io { source, .. } if source.raw_os_error() == Some(libc::EPERM))
    }
}

/// What a name is, in words, from its own (not followed) metadata.
pub fn kind_of(m: &Metadata) -> &'static str {
    let t = m.file_type();
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_file() {
        "a regular file"
    } else {
        "something unknown"
    }
}

/// How a regular file is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    /// Read and write, made (mode 0600) when absent.
    ReadWriteCreate,
    /// Appending (and reading), made (mode 0600) when absent.
    AppendCreate,
}

/// Open the regular file at `path` without following a symbolic link or blocking;
/// anything else there is a [`LocalError::Kind`].
pub fn open_regular(path: &Path, access: Access) -> Result<File, LocalError> {
    let mut o = OpenOptions::new();
    o.read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC);
    match access {
        Access::Read => {}
        Access::ReadWriteCreate => {
            o.write(true).create(true).truncate(false).mode(0o600);
        }
        Access::AppendCreate => {
            o.append(true).create(true).mode(0o600);
        }
    }
    let f = o.open(path).map_err(|e| misplaced(path, e))?;
    check_regular(path, &f)?;
    Ok(f)
}

/// Make a new regular file at `path` (mode 0600), failing if any name is there.
pub fn create_new(path: &Path) -> Result<File, LocalError> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| LocalError::io(path, e))?;
    check_regular(path, &f)?;
    Ok(f)
}

/// The regular file at `path`, read whole if it has at most `max` bytes.
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, LocalError> {
    let f = open_regular(path, Access::Read)?;
    read_file_bounded(path, &f, max)
}

/// `f` (the file at `path`) read whole from its start if it has at most `max` bytes.
pub fn read_file_bounded(path: &Path, f: &File, max: u64) -> Result<Vec<u8>, LocalError> {
    let len = f.metadata().map_err(|e| LocalError::io(path, e))?.len();
    if len > max {
        return Err(LocalError::TooLarge {
            path: path.to_path_buf(),
            len,
            max,
        });
    }
    let mut out = Vec::with_capacity(len as usize);
    // `take`: the file may grow between the fstat and the read.
    let r: &File = f;
    r.take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| LocalError::io(path, e))?;
    if out.len() as u64 > max {
        return Err(LocalError::TooLarge {
            path: path.to_path_buf(),
            len: out.len() as u64,
            max,
        });
    }
    Ok(out)
}

/// Write `bytes` to a new file beside `path` and rename it over `path`, so that readers
/// see the old file or the new one; `sync` makes it durable first. The temporary name
/// carries the process id, so writers in two processes never share one, and
/// [`sweep_stale_tmp`] can tell a dead process's leftovers.
pub fn replace(path: &Path, bytes: &[u8], sync: bool) -> Result<(), LocalError> {
    use std::io::Write;
    let tmp = tmp_name(path);
    // A leftover of this process (a failed earlier attempt) is ours to remove.
    let _ = std::fs::remove_file(&tmp);
    let written = create_new(&tmp).and_then(|mut f| {
        f.write_all(bytes).map_err(|e| LocalError::io(&tmp, e))?;
        if sync {
            f.sync_all().map_err(|e| LocalError::io(&tmp, e))?;
        }
        std::fs::rename(&tmp, path).map_err(|e| LocalError::io(path, e))
    });
    if written.is_err() {
        // A failed write (a full disk) leaves nothing behind.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// `NAME.PID.tmp` beside `path` (`NAME` its file name).
fn tmp_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.tmp", std::process::id()));
    path.with_file_name(name)
}

/// Remove the temporary files [`replace`] leaves when its process dies mid-write
/// (`*.PID.tmp` whose process is gone), and unnumbered `*.tmp` of older versions, in
/// `dir`; returns how many went.
pub fn sweep_stale_tmp(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for ent in rd.flatten() {
        let name = ent.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".tmp")) else {
            continue;
        };
        let pid = stem.rsplit('.').next().and_then(|p| p.parse::<i32>().ok());
        // Signal 0 only asks whether the process exists (EPERM: it does, not ours).
        let alive = pid.is_some_and(|p| {
            p > 0
                && nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), None)
                    != Err(nix::errno::Errno::ESRCH)
        });
        if !alive && remove_name(&ent.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Remove whatever is at `path` without following it: a file, link, FIFO or device
/// node is unlinked, an empty directory removed; a non-empty directory is left (an
/// error naming it).
pub fn remove_name(path: &Path) -> Result<(), LocalError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EISDIR) || e.kind() == ErrorKind::IsADirectory => {
            std::fs::remove_dir(path).map_err(|e| LocalError::Unsafe {
                path: path.to_path_buf(),
                why: format!("a directory where a file belongs, and it cannot be removed ({e})"),
            })
        }
        Err(e) => Err(LocalError::io(path, e)),
    }
}

/// Make `dir` (and its parents) if absent, mode 0700, and check that it is a usable
/// private directory: a directory (a symbolic link to one is followed: the user chose
/// the path), owned by this user, writable by no one else.
pub fn private_dir(dir: &Path) -> Result<(), LocalError> {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            if std::fs::symlink_metadata(dir).is_ok() {
                return Err(LocalError::Unsafe {
                    path: dir.to_path_buf(),
                    why: "a dangling symbolic link, not a directory".into(),
                });
            }
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| LocalError::io(dir, e))?;
        }
        Err(e) => return Err(describe_dir_error(dir, e)),
        Ok(_) => {}
    }
    check_private_dir(dir)
}

/// [`private_dir`]'s checks of an existing directory, making nothing.
pub fn check_private_dir(dir: &Path) -> Result<(), LocalError> {
    let m = std::fs::metadata(dir).map_err(|e| describe_dir_error(dir, e))?;
    if !m.is_dir() {
        return Err(LocalError::Kind {
            path: dir.to_path_buf(),
            what: kind_of(&m).into(),
            want: "directory",
        });
    }
    let me = nix::unistd::geteuid().as_raw();
    if m.uid() != me {
        return Err(LocalError::Unsafe {
            path: dir.to_path_buf(),
            why: format!(
                "owned by uid {}, not by this user (uid {me}); use a directory of your own",
                m.uid()
            ),
        });
    }
    if m.permissions().mode() & 0o022 != 0 {
        return Err(LocalError::Unsafe {
            path: dir.to_path_buf(),
            why: format!(
                "writable by others (mode {:o}); `chmod go-w` it or use another directory",
                m.permissions().mode() & 0o7777
            ),
        });
    }
    Ok(())
}

fn describe_dir_error(dir: &Path, e: std::io::Error) -> LocalError {
    match e.raw_os_error() {
        Some(libc::ELOOP) => LocalError::Unsafe {
            path: dir.to_path_buf(),
            why: "a loop of symbolic links, not a directory".into(),
        },
        Some(libc::ENOTDIR) => LocalError::Unsafe {
            path: dir.to_path_buf(),
            why: "a path through something that is not a directory".into(),
        },
        _ => LocalError::io(dir, e),
    }
}

/// The error of an open that failed because of what is at `path` (a link, a directory,
/// a socket) as a [`LocalError::Kind`]; other errors as they are.
fn misplaced(path: &Path, e: std::io::Error) -> LocalError {
    let kind_err = matches!(
        e.raw_os_error(),
        Some(libc::ELOOP | libc::EISDIR | libc::ENXIO | libc::ENODEV | libc::EOPNOTSUPP)
    );
    match std::fs::symlink_metadata(path) {
        Ok(m) if kind_err && !m.file_type().is_file() => LocalError::Kind {
            path: path.to_path_buf(),
            what: kind_of(&m).into(),
            want: "regular file",
        },
        _ => LocalError::io(path, e),
    }
}

fn check_regular(path: &Path, f: &File) -> Result<(), LocalError> {
    let m = f.metadata().map_err(|e| LocalError::io(path, e))?;
    if !m.file_type().is_file() {
        return Err(LocalError::Kind {
            path: path.to_path_buf(),
            what: kind_of(&m).into(),
            want: "regular file",
        });
    }
    Ok(())
}

/// `FS_IMMUTABLE_FL` of linux/fs.h (the libc crate does not export it).
const FS_IMMUTABLE_FL: libc::c_int = 0x10;

/// The immutable flag (`chattr +i`): while set, nobody, root included, can write,
/// truncate, rename or remove the file until it is cleared. `Ok(false)` where the file
/// system or the caller's privileges do not allow it.
pub fn set_immutable(f: &File, on: bool) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int into `flags`, which lives across the call.
    if unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) } != 0 {
        return not_supported(std::io::Error::last_os_error());
    }
    let want = if on {
        flags | FS_IMMUTABLE_FL
    } else {
        flags & !FS_IMMUTABLE_FL
    };
    if want != flags {
        // SAFETY: FS_IOC_SETFLAGS reads one int from `want`, which lives across the call.
        if unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_SETFLAGS, &want) } != 0 {
            return not_supported(std::io::Error::last_os_error());
        }
    }
    Ok(true)
}

/// Whether the immutable flag is set on `f` (false where flags cannot be read).
pub fn is_immutable(f: &File) -> bool {
    use std::os::fd::AsRawFd;
    let mut flags: libc::c_int = 0;
    // SAFETY: as in `set_immutable`.
    let got = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) } == 0;
    got && flags & FS_IMMUTABLE_FL != 0
}

fn not_supported(e: std::io::Error) -> std::io::Result<bool> {
    match e.raw_os_error() {
        Some(libc::ENOTTY | libc::EOPNOTSUPP | libc::EPERM | libc::EACCES | libc::EINVAL) => {
            Ok(false)
        }
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_open_and_nothing_blocks_or_follows() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let fifo = d.join("f");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        for a in [Access::Read, Access::ReadWriteCreate, Access::AppendCreate] {
            let e = open_regular(&fifo, a).unwrap_err();
            assert!(e.is_misplaced() && e.to_string().contains("a FIFO"), "{e}");
        }
        let victim = d.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = d.join("l");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = open_regular(&link, Access::ReadWriteCreate).unwrap_err();
        assert!(e.to_string().contains("a symbolic link"), "{e}");
        let e = read_bounded(&link, 100).unwrap_err();
        assert!(e.is_misplaced(), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        std::fs::create_dir(d.join("dir")).unwrap();
        let e = open_regular(&d.join("dir"), Access::ReadWriteCreate).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        // /dev/zero through a link is refused, and a size bound holds on a real file.
        std::os::unix::fs::symlink("/dev/zero", d.join("z")).unwrap();
        assert!(read_bounded(&d.join("z"), 1 << 20)
            .unwrap_err()
            .is_misplaced());
        std::fs::write(d.join("big"), vec![1u8; 1000]).unwrap();
        let e = read_bounded(&d.join("big"), 999).unwrap_err();
        assert!(matches!(e, LocalError::TooLarge { len: 1000, .. }), "{e}");
        assert_eq!(read_bounded(&d.join("big"), 1000).unwrap().len(), 1000);
        // remove_name takes the names away, never their targets.
        for n in ["f", "l", "z", "dir"] {
            remove_name(&d.join(n)).unwrap();
            assert!(std::fs::symlink_metadata(d.join(n)).is_err(), "{n}");
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    }

    #[test]
    fn directories_must_be_private() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("a/b");
        private_dir(&d).unwrap();
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&d).unwrap_err().to_string();
        assert!(e.contains("writable by others"), "{e}");
        let file = tmp.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = private_dir(&file).unwrap_err().to_string();
        assert!(e.contains("a regular file, not a directory"), "{e}");
        let dangling = tmp.path().join("dangling");
        std::os::unix::fs::symlink(tmp.path().join("nowhere"), &dangling).unwrap();
        let e = private_dir(&dangling).unwrap_err().to_string();
        assert!(e.contains("dangling"), "{e}");
        let (l1, l2) = (tmp.path().join("l1"), tmp.path().join("l2"));
        std::os::unix::fs::symlink(&l2, &l1).unwrap();
        std::os::unix::fs::symlink(&l1, &l2).unwrap();
        let e = private_dir(&l1).unwrap_err().to_string();
        assert!(e.contains("loop"), "{e}");
        let e = private_dir(Path::new("/dev/null")).unwrap_err().to_string();
        assert!(e.contains("a character device, not a directory"), "{e}");
    }

    #[test]
    fn replace_leaves_no_temporary_and_stale_ones_are_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("x.idx");
        replace(&p, b"one", true).unwrap();
        replace(&p, b"two", false).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names = |d: &Path| {
            let mut v: Vec<String> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(tmp.path()), ["x.idx"]);
        // A dead process's leftover and an old unnumbered one go; a live one stays.
        std::fs::write(tmp.path().join("x.idx.999999999.tmp"), b"").unwrap();
        std::fs::write(tmp.path().join("x.idx.tmp"), b"").unwrap();
        let live = format!("x.idx.{}.tmp", std::process::id());
        std::fs::write(tmp.path().join(&live), b"").unwrap();
        assert_eq!(sweep_stale_tmp(tmp.path()), 2);
        assert_eq!(names(tmp.path()), ["x.idx", live.as_str()]);
    }
}

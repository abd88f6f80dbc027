//! Reading /proc/self/mountinfo: which device backs a mount point, and whether a
//! cawsfs filesystem is mounted there.

use std::path::{Path, PathBuf};

use procfs::process::MountInfo;

/// Every mount of this process's namespace, in mountinfo order (later mounts last);
/// empty when /proc cannot be read.
fn mounts() -> Vec<MountInfo> {
    match procfs::process::Process::myself().and_then(|p| p.mountinfo()) {
        Ok(m) => m.0,
        Err(e) => {
            tracing::debug!("cannot read /proc/self/mountinfo: {e}");
            Vec::new()
        }
    }
}

/// The entry's mount point with mountinfo's octal escapes decoded: procfs hands the
/// field over as written (`/mnt/a\040b`).
fn mount_point(m: &MountInfo) -> PathBuf {
    PathBuf::from(unescape_mountinfo(&m.mount_point.to_string_lossy()))
}

/// `major:minor` of the filesystem mounted at `mountpoint`, from /proc/self/mountinfo.
/// With several mounts stacked there, the last one listed: the one on top.
pub fn mount_device(mountpoint: &Path) -> Option<String> {
    let canon = crate::control::canonical_mountpoint(mountpoint);
    mounts()
        .into_iter()
        .rev()
        .find(|m| mount_point(m) == canon)
        .map(|m| m.majmin)
}

/// Whether a FUSE filesystem of ours is mounted at `mountpoint` (its mountinfo source
/// is `cawsfs:ARCHIVE`; the fstype is plain `fuse` when mounted without libfuse).
///
/// The mount point itself is never stat'ed: after a daemon crash it answers ENOTCONN,
/// and `cawsfs umount` must still recognise it to clean it up.
pub fn is_mounted(mountpoint: &Path) -> bool {
    let canon = crate::control::canonical_mountpoint(mountpoint);
    mounts().iter().any(|m| {
        mount_point(m) == canon
            && m.fs_type.starts_with("fuse")
            && m.mount_source
                .as_deref()
                .is_some_and(|s| s.starts_with("cawsfs:"))
    })
}

fn unescape_mountinfo(s: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo.
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/trail\\04"), "/trail\\04");
    }

    #[test]
    fn procfs_entries_are_unescaped() {
        let line = "36 35 0:52 / /mnt/a\\040b rw,nosuid master:1 - fuse cawsfs:/x\\040y.cawsf ro";
        let m = MountInfo::from_line(line).unwrap();
        assert_eq!(mount_point(&m), Path::new("/mnt/a b"));
        assert_eq!(m.majmin, "0:52");
        assert_eq!(m.fs_type, "fuse");
        assert_eq!(m.mount_source.as_deref(), Some("cawsfs:/x\\040y.cawsf"));
    }

    #[test]
    fn root_has_a_device() {
        assert!(mount_device(Path::new("/")).is_some());
        assert!(!is_mounted(Path::new("/")));
    }
}

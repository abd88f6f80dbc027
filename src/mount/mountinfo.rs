//! Reading /proc/self/mountinfo: which device backs a mount point, and whether a
//! cawsfs filesystem is mounted there.

use std::path::Path;

/// `major:minor` of the filesystem mounted at `mountpoint`, from /proc/self/mountinfo.
pub fn mount_device(mountpoint: &Path) -> Option<String> {
    let canon = crate::control::canonical_mountpoint(mountpoint);
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 4 && Path::new(&unescape_mountinfo(f[4])) == canon).then(|| f[2].to_string())
    })
}

/// Whether a FUSE filesystem of ours is mounted at `mountpoint` (its mountinfo source
/// is `cawsfs:ARCHIVE`; the fstype is plain `fuse` when mounted without libfuse).
///
/// The mount point itself is never stat'ed: after a daemon crash it answers ENOTCONN,
/// and `cawsfs umount` must still recognise it to clean it up.
pub fn is_mounted(mountpoint: &Path) -> bool {
    let canon = crate::control::canonical_mountpoint(mountpoint);
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    info.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let Some((_, tail)) = l.split_once(" - ") else {
            return false;
        };
        let mut t = tail.split(' ');
        let (fstype, source) = (t.next().unwrap_or(""), t.next().unwrap_or(""));
        f.len() > 4
            && Path::new(&unescape_mountinfo(f[4])) == canon
            && fstype.starts_with("fuse")
            && source.starts_with("cawsfs:")
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
}

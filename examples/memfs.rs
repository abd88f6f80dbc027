//! The "FUSE ceiling" baseline for `scripts/bench-mount.py`: a read-only filesystem
//! serving one file whose bytes are read into RAM at start, set up the way the cawsfs
//! daemon is (fuser 0.18, 4 threads, `clone_fd`, `FOPEN_KEEP_CACHE`). Whatever a read
//! through it costs is the price of FUSE itself.
//!
//! `cargo run --release --example memfs -- FILE MOUNTPOINT`; runs until SIGINT/SIGTERM
//! or an external unmount.

use std::ffi::OsStr;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request,
};

const TTL: Duration = Duration::from_secs(3600);
const FILE_INO: u64 = 2;

struct MemFs {
    name: String,
    data: Vec<u8>,
    mtime: SystemTime,
}

impl MemFs {
    fn attr(&self, ino: u64) -> FileAttr {
        let dir = ino == 1;
        let size = if dir { 0 } else { self.data.len() as u64 };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.mtime,
            mtime: self.mtime,
            ctime: self.mtime,
            crtime: self.mtime,
            kind: if dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            },
            perm: if dir { 0o555 } else { 0o444 },
            nlink: if dir { 2 } else { 1 },
            // SAFETY: getuid/getgid cannot fail and touch no memory.
            uid: unsafe { libc::getuid() },
            gid: unsafe { libc::getgid() },
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

impl Filesystem for MemFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent.0 == 1 && name == OsStr::new(&self.name) {
            reply.entry(&TTL, &self.attr(FILE_INO), Generation(0))
        } else {
            reply.error(Errno::ENOENT)
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino.0 {
            1 | FILE_INO => reply.attr(&TTL, &self.attr(ino.0)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE)
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let start = (offset as usize).min(self.data.len());
        let end = start.saturating_add(size as usize).min(self.data.len());
        reply.data(&self.data[start..end])
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = [
            (1, FileType::Directory, "."),
            (1, FileType::Directory, ".."),
        ];
        let file = [(FILE_INO, FileType::RegularFile, self.name.as_str())];
        for (i, (ino, kind, name)) in entries
            .iter()
            .chain(&file)
            .enumerate()
            .skip(offset as usize)
        {
            if reply.add(INodeNo(*ino), i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok()
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, file, mountpoint] = args.as_slice() else {
        eprintln!("usage: memfs FILE MOUNTPOINT");
        std::process::exit(2);
    };
    let path = std::path::Path::new(file);
    let name = path
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let fs = MemFs {
        name,
        data: std::fs::read(path)?,
        mtime: SystemTime::now(),
    };

    // Block the signals before the FUSE threads start so only sigtimedwait gets them.
    // SAFETY: the set is initialized by sigemptyset; the calls only read it.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("memfs".into()),
        fuser::MountOption::RO,
    ];
    config.n_threads = Some(4);
    config.clone_fd = true;
    let session = fuser::spawn_mount(fs, mountpoint, &config)?;
    // Same 1 MiB bdi read-ahead the cawsfs daemon sets, so the ceiling is comparable.
    if let Some(dev) = cawsfs::mount::mount_device(std::path::Path::new(mountpoint)) {
        let _ = std::fs::write(format!("/sys/class/bdi/{dev}/read_ahead_kb"), "1024");
    }
    println!("serving {file} at {mountpoint}");
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 200_000_000,
    };
    loop {
        // SAFETY: set and ts are valid for the call; a null siginfo pointer is allowed.
        if unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) } > 0 {
            break;
        }
        if session.guard.is_finished() {
            break;
        }
    }
    drop(session);
    Ok(())
}

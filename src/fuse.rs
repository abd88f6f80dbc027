//! The FUSE adapter: translates `fuser` requests into [`MountFs`] calls and typed
//! errors into errno, in one place ([`errno`]). No format, codec or cache logic here.

use std::ffi::OsStr;
use std::time::Duration;

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, IoctlFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};

use crate::fs::{Attr, FsError, MountFs, Passthrough};
use crate::model::ReadError;

/// The files never change while mounted, so the kernel may cache names and attributes
/// for long.
const TTL: Duration = Duration::from_secs(3600);

/// The errno for every filesystem error, and how loudly to log it.
pub fn errno(e: &FsError) -> Errno {
    match e {
        FsError::NotFound(_) | FsError::NoInode(_) => Errno::ENOENT,
        FsError::NotADirectory => Errno::ENOTDIR,
        FsError::IsADirectory => Errno::EISDIR,
        FsError::ReadOnly => Errno::EROFS,
        FsError::Read(ReadError::OutOfRange { .. }) => Errno::EINVAL,
        // A block that fails its checksum or does not decode is never served.
        FsError::Read(
            ReadError::Checksum { .. }
            | ReadError::Corrupt { .. }
            | ReadError::Io(_)
            | ReadError::NotRaw(_)
            | ReadError::Changed(_),
        ) => Errno::EIO,
    }
}

fn log(op: &str, e: &FsError) {
    match e {
        // The archive logged its change once; a line per read would bury it.
        FsError::Read(ReadError::Changed(_)) => tracing::debug!("{op}: {e}"),
        FsError::Read(_) => tracing::error!("{op}: {e}"),
        _ => tracing::debug!("{op}: {e}"),
    }
}

pub struct FuseAdapter {
    fs: std::sync::Arc<MountFs>,
    uid: u32,
    gid: u32,
    /// The kernel accepted FUSE passthrough and no backing open has failed.
    passthrough: std::sync::atomic::AtomicBool,
    opens: std::sync::Mutex<Opens>,
}

/// File handles: how an open was answered.
const FH_DAEMON: FileHandle = FileHandle(1);
const FH_PASSTHROUGH: FileHandle = FileHandle(2);

/// Open files per inode. The kernel fails (EIO) a passthrough open of an inode that is
/// open through the daemon, and any other open of one open for passthrough.
#[derive(Default)]
struct Opens {
    /// One backing file per inode once used, kept while its seal holds (the kernel
    /// requires the same one for every passthrough open of an inode).
    backing: std::collections::HashMap<u64, std::sync::Arc<fuser::BackingId>>,
    /// Opens served through the daemon and not yet released.
    daemon: std::collections::HashMap<u64, u32>,
    /// Passthrough opens not yet released.
    passthrough: std::collections::HashMap<u64, u32>,
}

fn live(counts: &std::collections::HashMap<u64, u32>, ino: u64) -> bool {
    counts.get(&ino).is_some_and(|&n| n > 0)
}

impl FuseAdapter {
    /// `passthrough`: offer whole disk tier files to the kernel as backing files.
    pub fn new(fs: std::sync::Arc<MountFs>, passthrough: bool) -> FuseAdapter {
        let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
        let (uid, gid) = (uid.as_raw(), gid.as_raw());
        FuseAdapter {
            fs,
            uid,
            gid,
            passthrough: std::sync::atomic::AtomicBool::new(passthrough),
            opens: Default::default(),
        }
    }

    fn attr(&self, a: Attr) -> FileAttr {
        FileAttr {
            ino: INodeNo(a.ino),
            size: a.size,
            blocks: a.size.div_ceil(512),
            atime: a.mtime,
            mtime: a.mtime,
            ctime: a.mtime,
            crtime: a.mtime,
            kind: if a.is_dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            },
            perm: if a.is_dir { 0o555 } else { 0o444 },
            nlink: if a.is_dir { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The kernel caps this at 128 KiB here; the daemon raises the bdi read-ahead
        // through sysfs after mounting (`mount::session`).
        let _ = config.set_max_readahead(1 << 20);
        // Whole files of the disk tier are handed to the kernel (docs/TIER.md).
        use std::sync::atomic::Ordering::Relaxed;
        let wanted = self.passthrough.load(Relaxed) && self.fs.tier().is_some();
        let granted = wanted
            && config
                .add_capabilities(fuser::InitFlags::FUSE_PASSTHROUGH)
                .is_ok()
            && config.set_max_stack_depth(1).is_ok();
        self.passthrough.store(granted, Relaxed);
        self.fs.set_passthrough(match (wanted, granted) {
            (_, true) => Passthrough::On,
            (false, _) => Passthrough::Off,
            (true, false) => {
                tracing::info!(
                    "FUSE passthrough is not available here: tier files are served through the daemon"
                );
                Passthrough::Unavailable("the kernel does not offer it".into())
            }
        });
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.fs.lookup(parent.0, name) {
            Ok(a) => reply.entry(&TTL, &self.attr(a), Generation(0)),
            Err(e) => {
                log("lookup", &e);
                reply.error(errno(&e))
            }
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&TTL, &self.attr(a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let write = !matches!(flags.acc_mode(), OpenAccMode::O_RDONLY);
        use std::sync::atomic::Ordering::Relaxed;
        if let Err(e) = self.fs.open(ino.0, write) {
            return reply.error(errno(&e));
        }
        let mut opens = self.opens.lock().unwrap();
        // A backing file found changed is not handed out again (docs/TIER.md).
        if opens.backing.contains_key(&ino.0) && !self.fs.backing_intact(ino.0) {
            opens.backing.remove(&ino.0);
        }
        let daemon_open = live(&opens.daemon, ino.0);
        let passthrough_open = live(&opens.passthrough, ino.0);
        let id = match opens.backing.get(&ino.0) {
            // Passthrough opens of this inode may be alive: a daemon open now would
            // fail in the kernel, so it is served the same way even if passthrough was
            // turned off since.
            Some(id) if !daemon_open => Some(id.clone()),
            Some(_) => None,
            // A new backing file only when no passthrough open of the inode is left.
            None if self.passthrough.load(Relaxed) && !daemon_open && !passthrough_open => {
                match self.fs.backing_file(ino.0).map(|f| reply.open_backing(&f)) {
                    Some(Ok(id)) => {
                        let id = std::sync::Arc::new(id);
                        opens.backing.insert(ino.0, id.clone());
                        Some(id)
                    }
                    Some(Err(e)) => {
                        tracing::info!("FUSE passthrough refused ({e}): tier files are served through the daemon");
                        self.passthrough.store(false, Relaxed);
                        self.fs
                            .set_passthrough(Passthrough::Unavailable(e.to_string()));
                        None
                    }
                    None => None,
                }
            }
            None => None,
        };
        if let Some(id) = id {
            // The kernel refuses KEEP_CACHE with passthrough (the page cache is the
            // backing file's).
            self.fs.passthrough_opened(ino.0);
            *opens.passthrough.entry(ino.0).or_default() += 1;
            return reply.opened_passthrough(FH_PASSTHROUGH, FopenFlags::empty(), &id);
        }
        if passthrough_open {
            // Its backing file was found changed and could not be put right while
            // passthrough opens of it are alive: the kernel allows no other kind of
            // open beside them, and handing out the changed file again is what must
            // not happen. EIO until they close; the next open verifies the file again
            // (docs/TIER.md).
            return reply.error(Errno::EIO);
        }
        *opens.daemon.entry(ino.0).or_default() += 1;
        // Contents never change: keep the page cache across opens.
        reply.opened(FH_DAEMON, FopenFlags::FOPEN_KEEP_CACHE)
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut opens = self.opens.lock().unwrap();
        let counts = match fh {
            FH_DAEMON => &mut opens.daemon,
            FH_PASSTHROUGH => &mut opens.passthrough,
            _ => return reply.ok(),
        };
        if let Some(n) = counts.get_mut(&ino.0) {
            *n = n.saturating_sub(1);
        }
        // Checked on release too: a change seen now is one more open spared it.
        if fh == FH_PASSTHROUGH
            && opens.backing.contains_key(&ino.0)
            && !self.fs.backing_intact(ino.0)
        {
            opens.backing.remove(&ino.0);
        }
        reply.ok();
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        // The reply is sent from inside `read_with` (from its buffer) or, on error, here.
        let mut reply = Some(reply);
        let sent = self.fs.read_with(ino.0, offset, size, |data| {
            if let Some(r) = reply.take() {
                r.data(data)
            }
        });
        if let (Err(e), Some(r)) = (sent, reply.take()) {
            log("read", &e);
            r.error(errno(&e))
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match self.fs.readdir(ino.0) {
            Ok(entries) => {
                for (i, (ino, is_dir, name)) in entries.iter().enumerate().skip(offset as usize) {
                    let kind = if *is_dir {
                        FileType::Directory
                    } else {
                        FileType::RegularFile
                    };
                    if reply.add(INodeNo(*ino), i as u64 + 1, kind, name) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    // The answers below are what a read-only filesystem without extended attributes
    // gives; fuser's defaults would answer ENOSYS and log a multi-line
    // "[Not Implemented]" warning each time (an ioctl on every Python `open()`).

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing is ever written, so a close has nothing to flush. ENOSYS (without
        // fuser's warning) makes the kernel stop sending FLUSH for the mount's life, and
        // close() then returns 0 at once instead of waiting for a round trip here (0.2 ms
        // of every open and close of a warm passthrough file on the 2-core VM).
        reply.error(Errno::ENOSYS);
    }

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        reply.error(Errno::NO_XATTR);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let total: u64 = self.fs.entries().map(|e| e.file.size).sum();
        let n = self.fs.entries().count() as u64 + 1;
        reply.statfs(total.div_ceil(4096), 0, 0, n, 0, 4096, 255, 4096);
    }
}

//! `cawsfs mount` and `cawsfs umount`. Without `--foreground`, mount checks the mount
//! point, then re-runs itself with `--foreground` as a detached daemon and waits until
//! the daemon says on a pipe that the mount and its control socket answer.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use procfs::process::Process;

use super::args::{float_of, Eviction, ExpertPrefetch, MountArgs};

pub fn cmd_mount(a: MountArgs) -> Result<()> {
    if a.foreground {
        // Taken first: nothing has started a thread yet (a CUDA driver would).
        let ready = ready_pipe_from_env();
        // In the daemon itself: a CUDA context does not survive the detaching fork.
        super::init_device(&a.device, true)?;
        return cawsfs::mount::run(&a.archive, &a.mountpoint, &mount_options(&a), || {
            if let Some(mut w) = ready {
                // The byte is the whole message; closing the pipe follows.
                let _ = std::io::Write::write_all(&mut w, b"1");
            }
        })
        .map_err(Into::into);
    }
    // Check what is cheap to check before detaching. The archive is opened once, by the
    // daemon (opening it here too cost a restart 45 ms); its error comes back as ours.
    if let Err(why) = cawsfs::mount::check_mountpoint(&a.mountpoint, a.nonempty) {
        bail!("{}: {why}", a.mountpoint.display());
    }
    spawn_daemon(&a)
}

fn mount_options(a: &MountArgs) -> cawsfs::mount::MountOptions {
    let tier = a
        .disk_cache
        .clone()
        .or_else(cawsfs::mount::default_tier_dir)
        .filter(|_| !a.no_disk_cache)
        .map(|dir| cawsfs::fs::TierOptions {
            max_bytes: a
                .disk_cache_size
                .unwrap_or_else(|| cawsfs::mount::default_tier_bytes(&dir)),
            required: a.disk_cache.is_some(),
            dir,
        });
    // Pinned bytes are charged to the budget: a mount that pins keeps the larger one.
    let pins = a.pin_infra || a.pin_prompt.is_some();
    let cache_bytes = a.cache_size.unwrap_or_else(|| {
        let quarter = cawsfs::mount::default_cache_bytes();
        if tier.is_some() && !pins {
            quarter.min(cawsfs::mount::TIERED_CACHE_BYTES)
        } else {
            quarter
        }
    });
    cawsfs::mount::MountOptions {
        fs: cawsfs::fs::FsOptions {
            cache_bytes,
            gguf_type: a.gguf_type,
            safetensors_dtype: a.dtype.map(float_of),
            safetensors_shard_bytes: a.safetensors_shard_size,
            prefetch_threads: a.prefetch_threads,
            readahead_chunks: a.readahead_chunks,
            router_eviction: a.eviction == Eviction::Router,
            tier,
            experts: expert_options(a),
            ..Default::default()
        },
        threads: a.threads,
        allow_other: a.allow_other,
        socket: a.socket.clone(),
        pin_infra_layers: a.pin_infra.then_some(a.pin_infra_layers),
        pin_prompt: a.pin_prompt.clone(),
        passthrough: !a.no_passthrough,
        nonempty: a.nonempty,
    }
}

/// The expert predictor's mode, and where it keeps what it learned: `experts/` in the
/// disk tier's directory when one is given, else in the user's cawsfs cache.
fn expert_options(a: &MountArgs) -> Option<cawsfs::fs::ExpertOptions> {
    let mode = match a.expert_prefetch {
        ExpertPrefetch::On => cawsfs::cache::ExpertMode::Prefetch,
        ExpertPrefetch::Learn => cawsfs::cache::ExpertMode::Learn,
        ExpertPrefetch::Off => return None,
    };
    let dir = match &a.disk_cache {
        Some(d) => Some(d.join("experts")),
        None => cawsfs::mount::default_cache_root().map(|d| d.join("experts")),
    };
    Some(cawsfs::fs::ExpertOptions { mode, dir })
}

/// The variable naming the write end of the pipe on which the daemon says it is
/// serving (one byte); its closing without that byte means the daemon is gone.
const READY_FD_VAR: &str = "CAWSFS_READY_FD";

/// The daemon's end of the ready pipe, when `cawsfs mount` handed one over: the
/// descriptor named by [`READY_FD_VAR`], taken only if it is a pipe, and kept from
/// anything the daemon runs.
fn ready_pipe_from_env() -> Option<std::fs::File> {
    use std::os::fd::{BorrowedFd, FromRawFd};
    let fd: i32 = std::env::var(READY_FD_VAR).ok()?.parse().ok()?;
    // SAFETY: called before any thread starts (see the caller); the variable belongs
    // to the process that set it.
    unsafe { std::env::remove_var(READY_FD_VAR) };
    if fd < 3 {
        return None;
    }
    // SAFETY: only borrowed for the checks below; fstat fails on a closed descriptor.
    let b = unsafe { BorrowedFd::borrow_raw(fd) };
    let st = nix::sys::stat::fstat(b).ok()?;
    if nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT
        != nix::sys::stat::SFlag::S_IFIFO
    {
        return None;
    }
    nix::fcntl::fcntl(
        b,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .ok()?;
    // SAFETY: an open pipe handed to this process for it alone; owned from here on.
    Some(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Re-run this command line with `--foreground` as a session leader logging to a file
/// next to the socket, and wait until the mount answers (or the daemon dies, whose last
/// log line becomes the error). The daemon says it is serving on a pipe, so a restart
/// waits for nothing but the daemon itself.
fn spawn_daemon(a: &MountArgs) -> Result<()> {
    let dir = cawsfs::control::socket_dir();
    cawsfs::control::ensure_private_dir(&dir)?;
    let log = cawsfs::control::default_socket_path(&a.mountpoint).with_extension("log");
    let log_file = std::fs::File::create(&log).with_context(|| format!("{}", log.display()))?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1)).arg("--foreground");
    if std::env::var_os("CAWSFS_LOG").is_none() {
        cmd.env("CAWSFS_LOG", "info");
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    let (ready_r, ready_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("creating the ready pipe")?;
    let ready_fd = std::os::fd::AsRawFd::as_raw_fd(&ready_w);
    cmd.env(READY_FD_VAR, ready_fd.to_string());
    // SAFETY: setsid and fcntl are async-signal-safe. setsid detaches the daemon from
    // our terminal (failure only means it keeps our session: nothing to report from
    // here); the ready pipe's write end is the one descriptor of ours it inherits.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            let _ = nix::unistd::setsid();
            if libc::fcntl(ready_fd, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the mount daemon")?;
    // Ours closed, the pipe reads end-of-file once the daemon is gone.
    drop(ready_w);
    let mut ready_r = std::fs::File::from(ready_r);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let _ = child.kill();
            let _ = std::process::Command::new("fusermount3")
                .arg("-u")
                .arg(&a.mountpoint)
                .status();
            bail!(
                "{}: the mount did not come up within 60 s (log {})",
                a.mountpoint.display(),
                log.display()
            );
        }
        let mut fds = [nix::poll::PollFd::new(
            std::os::fd::AsFd::as_fd(&ready_r),
            nix::poll::PollFlags::POLLIN,
        )];
        let ms = left.as_millis().min(u16::MAX as u128) as u16;
        match nix::poll::poll(&mut fds, ms) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e).context("waiting for the mount daemon"),
        }
        let mut byte = [0u8; 1];
        match std::io::Read::read(&mut ready_r, &mut byte) {
            Ok(1) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).context("waiting for the mount daemon"),
        }
        // End of file: the daemon exited before serving.
        let status = child.wait()?;
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let last = text
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message");
        // The daemon's own one-line error is the whole story; anything else (a crash)
        // says how it ended.
        match last.strip_prefix("cawsfs: error: ") {
            Some(err) => bail!("{err}"),
            None => bail!("mount daemon exited ({status}): {last}"),
        }
    }
    let sock = a
        .socket
        .clone()
        .unwrap_or_else(|| cawsfs::control::find_socket(&a.mountpoint));
    println!(
        "mounted {} at {} (pid {}, socket {}, log {})",
        a.archive.display(),
        a.mountpoint.display(),
        child.id(),
        sock.display(),
        log.display()
    );
    Ok(())
}

pub fn cmd_umount(mp: &Path) -> Result<()> {
    if !cawsfs::mount::is_mounted(mp) {
        bail!("{}: not a cawsfs mount", mp.display());
    }
    // The daemon to wait for, asked before the unmount takes its socket away. None
    // after a crash (nothing answers), which leaves only the dead mount to clean up.
    let sock = cawsfs::control::find_socket(mp);
    let daemon = match cawsfs::control::daemon_pid(&sock, Duration::from_secs(2)) {
        Ok(pid) => Process::new(pid as i32)
            .and_then(|p| p.stat())
            .ok()
            .map(|st| (pid, st.starttime)),
        Err(cawsfs::control::ControlError::NoDaemon { .. }) => None,
        Err(e) => {
            tracing::warn!(
                "{e}; not waiting for the daemon of {} to exit",
                mp.display()
            );
            None
        }
    };
    let unmount = |quiet: bool| {
        let mut c = std::process::Command::new("fusermount3");
        c.arg("-u");
        if quiet {
            c.arg("-q");
        }
        c.arg(mp)
            .status()
            .or_else(|_| std::process::Command::new("umount").arg(mp).status())
            .context("running fusermount3")
    };
    // With expert prefetch the daemon opens its own file for an instant to look at its
    // page cache: an unmount that meets that instant finds the mount busy, so a busy
    // unmount is tried once more, and only the second failure is reported.
    let mut status = unmount(true)?;
    if !status.success() {
        std::thread::sleep(Duration::from_millis(200));
        status = unmount(false)?;
    }
    if !status.success() {
        bail!(
            "{}: unmount failed ({status}); is a program still using it?",
            mp.display()
        );
    }
    if let Some((pid, start)) = daemon {
        let deadline = Instant::now() + UMOUNT_WAIT;
        while running(pid, start) {
            if Instant::now() > deadline {
                bail!(
                    "{}: unmounted, but its daemon (pid {pid}) is still running after {} s",
                    mp.display(),
                    UMOUNT_WAIT.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    println!("unmounted {}", mp.display());
    Ok(())
}

/// How long `cawsfs umount` waits for the daemon to exit after the unmount.
const UMOUNT_WAIT: Duration = Duration::from_secs(30);

/// Whether process `pid`, started at `start` (clock ticks after boot, so a reused
/// pid is not mistaken for it), is still running. A zombie whose threads have all
/// exited has exited: only its parent has not collected it yet. Its main thread is a
/// zombie as soon as it returns, while other threads may still hold its files.
fn running(pid: u32, start: u64) -> bool {
    Process::new(pid as i32)
        .and_then(|p| p.stat())
        .is_ok_and(|st| st.starttime == start && (st.state != 'Z' || st.num_threads > 1))
}

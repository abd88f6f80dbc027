//! The signals that unmount the daemon (SIGINT, SIGTERM, SIGHUP): blocked in every
//! thread and received only by the run loop's timed wait.

use std::os::fd::AsFd;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

/// The stop signals, blocked in the calling thread (and so in every thread it starts
/// afterwards) and readable from a signalfd instead. Blocking rather than handling
/// them means no FUSE or cache thread is ever interrupted by one.
pub(super) struct StopSignals {
    fd: SignalFd,
}

impl StopSignals {
    /// Blocks the signals; call before any thread starts so every thread inherits
    /// the mask.
    pub(super) fn block() -> nix::Result<StopSignals> {
        let mut set = SigSet::empty();
        set.add(Signal::SIGINT);
        set.add(Signal::SIGTERM);
        set.add(Signal::SIGHUP);
        set.thread_block()?;
        // Non-blocking: `wait` polls with a timeout, then reads what is pending.
        let fd = SignalFd::with_flags(&set, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)?;
        Ok(StopSignals { fd })
    }

    /// The number of a stop signal received within `timeout`, else `None`.
    pub(super) fn wait(&self, timeout: Duration) -> Option<i32> {
        let t = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, t) {
            Ok(n) if n > 0 => {}
            _ => return None,
        }
        match self.fd.read_signal() {
            Ok(Some(info)) => i32::try_from(info.ssi_signo).ok(),
            _ => None,
        }
    }
}

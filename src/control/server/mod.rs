//! The daemon's end of the control socket.
//!
//! One accept thread, one thread per connection (at most
//! [`ServerOptions::max_connections`]), each reading bounded request lines and
//! answering every line with exactly one reply line. Safety properties, each tested:
//! * the socket file never exists under its final name with a mode wider than 0600
//!   (bound in a private 0700 directory, chmod'ed, then renamed into place — changing
//!   the umask instead would race with every other thread of the daemon);
//! * peers are checked with `SO_PEERCRED`: only the daemon's uid and root are served;
//! * a request line is never buffered beyond the cap, whatever the client sends;
//! * a panicking [`Handler`] costs one error reply, not the server;
//! * idle clients cannot lock others out: a connection idle for
//!   [`ServerOptions::idle_timeout`] is closed, and at the connection cap the longest
//!   idle one is closed to admit a new client.
//!
//! Here: [`ControlServer`]'s life (bind, accept loop, connection limit, shutdown).
//! `bind`: placing the socket file safely. `conn`: one connection (peer check,
//! framing, replies). `tests`: all of the above through real sockets.

mod bind;
mod conn;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::Shutdown;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::socket;

use super::protocol::{Request, MAX_REQUEST_LINE};
use super::reply::Reply;
use super::{current_uid, ControlError};
use bind::{bind_private, check_existing, check_len};
pub use conn::{allowed_peer, peer_uid};
use conn::{refuse, serve};

/// The daemon's side of the protocol, implemented over its cache. `Ok(reply)`
/// becomes `{"ok":true, ...reply's fields}`, `Err(msg)` an error reply. Called from many
/// connection threads at once; a panic is caught and answered with an error reply.
pub trait Handler: Send + Sync {
    fn handle(&self, req: Request) -> Result<Reply, String>;
}

/// Limits of a [`ControlServer`]; the defaults are the documented protocol limits.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Connections served at once. A client beyond that is admitted by closing the
    /// connection idle the longest; when every one is handling a request it is
    /// answered with an error and closed.
    pub max_connections: usize,
    /// Longest request line in bytes, without its newline.
    pub max_line: usize,
    /// How long a reply may wait for a client that does not read before the
    /// connection is dropped (so a stuck client cannot hold a thread forever).
    pub write_timeout: Duration,
    /// How long a connection may take to send its next complete request line before
    /// it is closed (however slowly its bytes trickle in).
    pub idle_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_connections: 64,
            max_line: MAX_REQUEST_LINE,
            write_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
        }
    }
}

struct Shared {
    handler: Arc<dyn Handler>,
    opts: ServerOptions,
    stopping: AtomicBool,
    next_id: AtomicU64,
    /// Every connection being served, so that shutdown and the cap can close them;
    /// its length is the number served (a connection closed to make room may take a
    /// moment more to end its thread).
    conns: Mutex<HashMap<u64, Conn>>,
    daemon_uid: u32,
}

/// One served connection, as the accept thread sees it.
struct Conn {
    /// A clone of the connection's stream, to close it from outside.
    stream: UnixStream,
    /// Since when it has been waiting for a request; `None` while one is handled.
    idle_since: Option<Instant>,
}

impl Shared {
    /// Marks connection `id` as waiting for a request (`idle`) or handling one.
    fn set_idle(&self, id: u64, idle: bool) {
        if let Some(c) = lock(&self.conns).get_mut(&id) {
            c.idle_since = idle.then(Instant::now);
        }
    }
}

/// A listening control socket. Dropping it (or [`ControlServer::shutdown`]) stops
/// accepting, closes open connections and removes the socket file.
pub struct ControlServer {
    path: PathBuf,
    /// (device, inode) of the socket we created: only that file is removed at shutdown.
    id: (u64, u64),
    listener: Arc<UnixListener>,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
    /// The mount point whose `--socket` registry entry we wrote, removed at shutdown.
    registered: Option<PathBuf>,
}

impl ControlServer {
    /// Listens at `path` with the default [`ServerOptions`].
    pub fn bind(path: &Path, handler: Arc<dyn Handler>) -> Result<ControlServer, ControlError> {
        Self::bind_with(path, handler, ServerOptions::default())
    }

    /// Listens at `path`. A stale socket there (nothing answers) is replaced; a live
    /// one or a non-socket file is an error.
    pub fn bind_with(
        path: &Path,
        handler: Arc<dyn Handler>,
        opts: ServerOptions,
    ) -> Result<ControlServer, ControlError> {
        check_len(path)?;
        check_existing(path)?;
        let listener = bind_private(path)?;
        let md = fs::symlink_metadata(path)
            .map_err(|e| ControlError::io("cannot stat new socket", path, e))?;
        let shared = Arc::new(Shared {
            handler,
            opts,
            stopping: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            daemon_uid: current_uid(),
        });
        let listener = Arc::new(listener);
        let accept = {
            let (l, s) = (listener.clone(), shared.clone());
            std::thread::Builder::new()
                .name("cawsfs-ctl-accept".into())
                .spawn(move || accept_loop(&l, &s))
                .map_err(|e| {
                    let _ = fs::remove_file(path);
                    ControlError::io("cannot start control thread for", path, e)
                })?
        };
        Ok(ControlServer {
            path: path.to_path_buf(),
            id: (md.dev(), md.ino()),
            listener,
            shared,
            accept: Some(accept),
            registered: None,
        })
    }

    /// The daemon's one call: listens at `socket` if given (and registers it so
    /// `cawsfs stat MOUNTPOINT` finds it), else at [`default_socket_path`] in a
    /// private directory created for it. Both undone at shutdown.
    ///
    /// [`default_socket_path`]: super::default_socket_path
    pub fn for_mount(
        mountpoint: &Path,
        socket: Option<&Path>,
        handler: Arc<dyn Handler>,
    ) -> Result<ControlServer, ControlError> {
        match socket {
            Some(sock) => {
                let mut srv = Self::bind(sock, handler)?;
                super::register_socket(mountpoint, sock)?;
                srv.registered = Some(mountpoint.to_path_buf());
                Ok(srv)
            }
            None => {
                super::ensure_private_dir(&super::socket_dir())?;
                Self::bind(&super::default_socket_path(mountpoint), handler)
            }
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Connections being served now.
    pub fn active_connections(&self) -> usize {
        lock(&self.shared.conns).len()
    }

    /// Stops accepting, closes open connections (a request being handled finishes
    /// but its reply may be lost) and removes the socket file if it is still ours.
    /// Idempotent.
    pub fn shutdown(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        // On Linux, shutting down a listening Unix socket makes a blocked accept()
        // return EINVAL ("receive shutdown"), which wakes the accept thread.
        let _ = socket::shutdown(self.listener.as_raw_fd(), socket::Shutdown::Both);
        let _ = accept.join();
        if let Some(m) = self.registered.take() {
            // Only our own entry: a later mount may have registered another socket.
            let ours = std::path::absolute(&self.path).unwrap_or_else(|_| self.path.clone());
            if super::find_socket(&m) == ours {
                super::unregister_socket(&m);
            }
        }
        let conns = std::mem::take(&mut *lock(&self.shared.conns));
        for c in conns.values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        if let Ok(md) = fs::symlink_metadata(&self.path) {
            if (md.dev(), md.ino()) == self.id {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned map of streams is still a valid map.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    loop {
        let res = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match res {
            Ok((stream, _)) => start_connection(stream, shared),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // EMFILE and friends: back off instead of spinning.
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn start_connection(stream: UnixStream, shared: &Arc<Shared>) {
    let _ = stream.set_write_timeout(Some(shared.opts.write_timeout));
    let clone = match stream.try_clone() {
        Ok(c) => c,
        Err(e) => return refuse(&stream, &format!("cannot serve the connection: {e}")),
    };
    let max = shared.opts.max_connections;
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    {
        let mut conns = lock(&shared.conns);
        if conns.len() >= max {
            // Room for the newcomer: the connection idle the longest goes (its client
            // sees the connection closed, as after an idle timeout).
            let oldest = conns
                .iter()
                .filter_map(|(k, c)| c.idle_since.map(|t| (t, *k)))
                .min()
                .map(|(_, k)| k);
            match oldest.and_then(|k| conns.remove(&k)) {
                Some(c) => {
                    let _ = c.stream.shutdown(Shutdown::Both);
                }
                None => {
                    drop(conns);
                    return refuse(
                        &stream,
                        &format!("too many control connections ({max} open, none idle)"),
                    );
                }
            }
        }
        conns.insert(
            id,
            Conn {
                stream: clone,
                idle_since: Some(Instant::now()),
            },
        );
    }
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("cawsfs-ctl-conn".into())
        .spawn(move || {
            let _guard = ConnGuard { shared: &s, id };
            // Shutdown has begun (and closed, or will close, this stream).
            if s.stopping.load(Ordering::SeqCst) {
                return;
            }
            serve(&stream, &s, id);
        });
    if spawned.is_err() {
        lock(&shared.conns).remove(&id);
    }
}

/// Takes a connection out of the map when its thread ends (unless the cap or shutdown
/// already did).
struct ConnGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for ConnGuard<'_> {
    fn drop(&mut self) {
        lock(&self.shared.conns).remove(&self.id);
    }
}

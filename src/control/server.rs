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
//! * a panicking [`Handler`] costs one error reply, not the server.

use std::collections::HashMap;
use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::socket::{self, getsockopt, sockopt::PeerCredentials};
use serde_json::Value;

use super::protocol::{Request, Response, MAX_REQUEST_LINE};
use super::{current_uid, ControlError, MAX_SOCKET_PATH};

/// The daemon's side of the protocol, implemented over its cache. `Ok(payload)`
/// becomes `{"ok":true, ...payload}`, `Err(msg)` an error reply. Called from many
/// connection threads at once; a panic is caught and answered with an error reply.
pub trait Handler: Send + Sync {
    fn handle(&self, req: Request) -> Result<Value, String>;
}

/// Limits of a [`ControlServer`]; the defaults are the documented protocol limits.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Connections served at once; more are answered with an error and closed.
    pub max_connections: usize,
    /// Longest request line in bytes, without its newline.
    pub max_line: usize,
    /// How long a reply may wait for a client that does not read before the
    /// connection is dropped (so a stuck client cannot hold a thread forever).
    pub write_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_connections: 64,
            max_line: MAX_REQUEST_LINE,
            write_timeout: Duration::from_secs(10),
        }
    }
}

/// Whether a peer with `peer_uid` may use a daemon running as `daemon_uid`.
pub fn allowed_peer(peer_uid: u32, daemon_uid: u32) -> bool {
    peer_uid == daemon_uid || peer_uid == 0
}

/// The uid of the process at the other end of `s` (`SO_PEERCRED`: the credentials
/// at connect time, which the peer cannot forge).
pub fn peer_uid(s: &UnixStream) -> io::Result<u32> {
    let cred = getsockopt(s, PeerCredentials)?;
    Ok(cred.uid())
}

struct Shared {
    handler: Arc<dyn Handler>,
    opts: ServerOptions,
    stopping: AtomicBool,
    active: AtomicUsize,
    next_id: AtomicU64,
    /// A clone of every open connection, so shutdown can close them.
    conns: Mutex<HashMap<u64, UnixStream>>,
    daemon_uid: u32,
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

static BIND_COUNTER: AtomicU64 = AtomicU64::new(0);

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
            active: AtomicUsize::new(0),
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
        self.shared.active.load(Ordering::SeqCst)
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
        for s in conns.values() {
            let _ = s.shutdown(Shutdown::Both);
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

fn check_len(path: &Path) -> Result<(), ControlError> {
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
fn check_existing(path: &Path) -> Result<(), ControlError> {
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
fn bind_private(path: &Path) -> Result<UnixListener, ControlError> {
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
    let max = shared.opts.max_connections;
    if shared.active.fetch_add(1, Ordering::SeqCst) >= max {
        shared.active.fetch_sub(1, Ordering::SeqCst);
        refuse(
            &stream,
            &format!("too many control connections ({max} open)"),
        );
        return;
    }
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let clone = stream.try_clone();
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("cawsfs-ctl-conn".into())
        .spawn(move || {
            let _guard = ConnGuard { shared: &s, id };
            if let Ok(c) = clone {
                lock(&s.conns).insert(id, c);
            }
            // Shutdown may have swept the map just before we registered.
            if s.stopping.load(Ordering::SeqCst) {
                return;
            }
            serve(&stream, &s);
        });
    if spawned.is_err() {
        shared.active.fetch_sub(1, Ordering::SeqCst);
    }
}

struct ConnGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for ConnGuard<'_> {
    fn drop(&mut self) {
        lock(&self.shared.conns).remove(&self.id);
        self.shared.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One error reply, then the connection is dropped.
fn refuse(mut stream: &UnixStream, msg: &str) {
    let _ = stream.write_all(Response::error(msg).to_line().as_bytes());
    let _ = stream.shutdown(Shutdown::Both);
}

fn serve(stream: &UnixStream, shared: &Shared) {
    match peer_uid(stream) {
        Ok(uid) if allowed_peer(uid, shared.daemon_uid) => {}
        Ok(uid) => {
            return refuse(
                stream,
                &format!(
                    "permission denied: uid {uid} may not use this daemon (owner uid {})",
                    shared.daemon_uid
                ),
            )
        }
        Err(e) => return refuse(stream, &format!("cannot read peer credentials: {e}")),
    }
    let max = shared.opts.max_line;
    let mut reader = BufReader::new(stream);
    let mut writer = stream;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        // `take` bounds what one line may cost: max bytes plus its newline.
        match (&mut reader)
            .take(max as u64 + 1)
            .read_until(b'\n', &mut buf)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let line = match buf.strip_suffix(b"\n") {
            Some(l) => l,
            None if buf.len() > max => {
                return refuse(stream, &format!("request line longer than {max} bytes"));
            }
            // The last line before EOF, without a newline: still a request.
            None => &buf[..],
        };
        let resp = answer(line, shared.handler.as_ref());
        if writer.write_all(resp.to_line().as_bytes()).is_err() {
            return;
        }
    }
}

fn answer(line: &[u8], handler: &dyn Handler) -> Response {
    let req = match Request::parse_line(line) {
        Ok(r) => r,
        Err(e) => return Response::error(e),
    };
    match catch_unwind(AssertUnwindSafe(|| handler.handle(req))) {
        Ok(Ok(v)) => Response::ok(v),
        Ok(Err(e)) => Response::error(e),
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            Response::error(format!(
                "internal error: the request handler panicked: {msg}"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::client::{request, ControlClient};
    use serde_json::json;
    use std::io::BufRead;
    use std::time::Instant;

    const T: Duration = Duration::from_secs(10);

    /// Echoes the request back; `layer 666` panics; `tensor "slow"` sleeps.
    struct Mock;
    impl Handler for Mock {
        fn handle(&self, req: Request) -> Result<Value, String> {
            match &req {
                Request::Pin(crate::control::Target::Layer(666)) => panic!("boom"),
                Request::Pin(crate::control::Target::Tensor(t)) if t == "missing" => {
                    Err(format!("no tensor named {t:?}"))
                }
                Request::Stat => Ok(json!({"cache": {"hits": 3, "misses": 1}})),
                _ => Ok(json!({"echo": req.to_json()})),
            }
        }
    }

    fn server(dir: &Path) -> (ControlServer, PathBuf) {
        let p = dir.join("c.sock");
        (ControlServer::bind(&p, Arc::new(Mock)).unwrap(), p)
    }

    /// A raw line-level connection.
    struct Raw {
        r: std::io::BufReader<UnixStream>,
        w: UnixStream,
    }
    impl Raw {
        fn new(p: &Path) -> Raw {
            let w = UnixStream::connect(p).unwrap();
            w.set_read_timeout(Some(T)).unwrap();
            Raw {
                r: std::io::BufReader::new(w.try_clone().unwrap()),
                w,
            }
        }
        fn send(&mut self, bytes: &[u8]) -> Value {
            self.w.write_all(bytes).unwrap();
            self.recv()
        }
        fn recv(&mut self) -> Value {
            let mut l = String::new();
            self.r.read_line(&mut l).unwrap();
            assert!(l.ends_with('\n'), "reply {l:?}");
            serde_json::from_str(&l).unwrap()
        }
    }

    fn err_of(v: &Value) -> &str {
        assert_eq!(v["ok"], false, "{v}");
        v["error"].as_str().unwrap()
    }

    #[test]
    fn allowed_peer_rule() {
        assert!(allowed_peer(1000, 1000));
        assert!(allowed_peer(0, 1000));
        assert!(allowed_peer(0, 0));
        assert!(!allowed_peer(1001, 1000));
        assert!(!allowed_peer(65534, 0));
    }

    #[test]
    fn round_trip_and_mode() {
        let t = tempfile::tempdir().unwrap();
        let (srv, p) = server(t.path());
        let md = fs::symlink_metadata(&p).unwrap();
        assert!(md.file_type().is_socket());
        assert_eq!(md.mode() & 0o777, 0o600);
        // Nothing left behind from the private bind directory.
        assert_eq!(fs::read_dir(t.path()).unwrap().count(), 1);
        let v = request(&p, &Request::Stat, T).unwrap();
        assert_eq!(v, json!({"cache": {"hits": 3, "misses": 1}}));
        let v = request(&p, &Request::Trace { on: true }, T).unwrap();
        assert_eq!(v["echo"], json!({"verb": "trace", "on": true}));
        let e = request(
            &p,
            &Request::Pin(crate::control::Target::Tensor("missing".into())),
            T,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, "no tensor named \"missing\"");
        drop(srv);
        assert!(!p.exists(), "socket removed at shutdown");
    }

    #[test]
    fn malformed_requests_get_errors_and_the_connection_lives() {
        let t = tempfile::tempdir().unwrap();
        let (_srv, p) = server(t.path());
        let mut c = Raw::new(&p);
        assert!(err_of(&c.send(b"{not json\n")).starts_with("invalid JSON"));
        assert!(
            err_of(&c.send(b"{\"verb\":\"frobnicate\"}\n")).contains("unknown verb \"frobnicate\"")
        );
        assert!(err_of(&c.send(b"{\"verb\":\"pin\",\"layer\":\"x\"}\n"))
            .contains("\"layer\" must be a non-negative integer"));
        assert!(err_of(&c.send(b"{\"verb\":\"trace\",\"on\":\"yes\"}\n")).contains("true or false"));
        assert!(err_of(&c.send(b"\n")).contains("empty"));
        assert!(err_of(&c.send(b"\xff\n")).contains("UTF-8"));
        // Two requests in one write: two replies, in order.
        c.w.write_all(b"{\"verb\":\"ping\"}\n{\"verb\":\"nope\"}\n")
            .unwrap();
        assert_eq!(c.recv()["ok"], true);
        assert_eq!(c.recv()["ok"], false);
        assert_eq!(c.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
    }

    #[test]
    fn oversize_line_is_refused_without_reading_it_all() {
        let t = tempfile::tempdir().unwrap();
        let (_srv, p) = server(t.path());
        let mut c = Raw::new(&p);
        // A line far beyond the cap, written from another thread since the server
        // stops reading it.
        let w = c.w.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let mut w = w;
            let chunk = vec![b'a'; 64 * 1024];
            for _ in 0..64 {
                if w.write_all(&chunk).is_err() {
                    return true; // the server closed: it did not read 4 MiB
                }
            }
            false
        });
        let v = c.recv();
        assert_eq!(err_of(&v), "request line longer than 65536 bytes");
        assert!(
            writer.join().unwrap(),
            "server kept reading the oversize line"
        );
        // Exactly the cap is fine.
        let mut c = Raw::new(&p);
        let mut line = br#"{"verb":"route","prompt":""#.to_vec();
        line.resize(MAX_REQUEST_LINE - 2, b'x');
        line.extend_from_slice(b"\"}\n");
        let v = c.send(&line);
        assert_eq!(v["echo"]["verb"], "route", "{v}");
        // One byte more is not.
        line.insert(30, b'x');
        assert!(err_of(&c.send(&line)).contains("longer than"));
        assert_eq!(
            request(&p, &Request::Ping, T).unwrap(),
            json!({"echo": {"verb": "ping"}})
        );
    }

    #[test]
    fn handler_panic_is_an_error_reply() {
        let t = tempfile::tempdir().unwrap();
        let (_srv, p) = server(t.path());
        let mut c = Raw::new(&p);
        let v = c.send(b"{\"verb\":\"pin\",\"layer\":666}\n");
        assert_eq!(
            err_of(&v),
            "internal error: the request handler panicked: boom"
        );
        assert_eq!(c.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
        assert!(request(&p, &Request::Stat, T).is_ok());
    }

    #[test]
    fn stale_socket_replaced_live_one_and_files_refused() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("c.sock");
        drop(UnixListener::bind(&p).unwrap()); // leaves a dead socket file
        assert!(p.exists());
        let srv = ControlServer::bind(&p, Arc::new(Mock)).unwrap();
        assert!(request(&p, &Request::Ping, T).is_ok());
        // A second daemon on the same path is refused and the first keeps working.
        let e = ControlServer::bind(&p, Arc::new(Mock)).err().unwrap();
        assert!(matches!(e, ControlError::AlreadyRunning { .. }), "{e}");
        assert!(request(&p, &Request::Ping, T).is_ok());
        drop(srv);
        // Regular files and directories are never replaced.
        fs::write(&p, b"precious").unwrap();
        let e = ControlServer::bind(&p, Arc::new(Mock)).err().unwrap();
        assert!(e.to_string().contains("is not a socket"), "{e}");
        assert_eq!(fs::read(&p).unwrap(), b"precious");
        let d = t.path().join("d");
        fs::create_dir(&d).unwrap();
        assert!(matches!(
            ControlServer::bind(&d, Arc::new(Mock)),
            Err(ControlError::NotASocket { .. })
        ));
        let long = t.path().join("x".repeat(120));
        assert!(matches!(
            ControlServer::bind(&long, Arc::new(Mock)),
            Err(ControlError::PathTooLong { .. })
        ));
    }

    #[test]
    fn for_mount_default_and_custom_sockets() {
        let t = tempfile::tempdir().unwrap();
        let m = t.path().join("mnt-for-mount-test");
        let srv = ControlServer::for_mount(&m, None, Arc::new(Mock)).unwrap();
        assert_eq!(srv.path(), crate::control::default_socket_path(&m));
        assert_eq!(crate::control::find_socket(&m), srv.path());
        assert!(request(&crate::control::find_socket(&m), &Request::Ping, T).is_ok());
        drop(srv);
        assert!(!crate::control::default_socket_path(&m).exists());

        let custom = t.path().join("custom.sock");
        let srv = ControlServer::for_mount(&m, Some(&custom), Arc::new(Mock)).unwrap();
        assert_eq!(crate::control::find_socket(&m), custom);
        assert!(request(&crate::control::find_socket(&m), &Request::Stat, T).is_ok());
        drop(srv);
        assert!(!custom.exists());
        assert!(
            !crate::control::registry_path(&m).exists(),
            "registry entry removed"
        );
    }

    #[test]
    fn shutdown_leaves_a_foreign_file_alone() {
        let t = tempfile::tempdir().unwrap();
        let (mut srv, p) = server(t.path());
        fs::remove_file(&p).unwrap();
        fs::write(&p, b"someone else's").unwrap();
        srv.shutdown();
        assert_eq!(fs::read(&p).unwrap(), b"someone else's");
    }

    #[test]
    fn shutdown_is_prompt_and_closes_connections() {
        let t = tempfile::tempdir().unwrap();
        let (mut srv, p) = server(t.path());
        let mut c = Raw::new(&p);
        assert_eq!(c.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
        let t0 = Instant::now();
        srv.shutdown();
        assert!(t0.elapsed() < Duration::from_secs(2));
        let mut l = String::new();
        assert_eq!(c.r.read_line(&mut l).unwrap_or(0), 0, "connection closed");
        let e = request(&p, &Request::Ping, T).unwrap_err().to_string();
        assert!(e.contains("(is it mounted?)"), "{e}");
    }

    #[test]
    fn concurrent_clients() {
        let t = tempfile::tempdir().unwrap();
        let (srv, p) = server(t.path());
        let threads: Vec<_> = (0..16u32)
            .map(|i| {
                let p = p.clone();
                std::thread::spawn(move || {
                    let mut c = ControlClient::connect(&p, T).unwrap();
                    for j in 0..25u32 {
                        let r = Request::Prefetch(crate::control::Target::Layer(i * 100 + j));
                        let v = c.call(&r).unwrap();
                        assert_eq!(v["echo"]["layer"], i * 100 + j);
                    }
                    // And a fresh connection per request.
                    for _ in 0..5 {
                        request(&p, &Request::Ping, T).unwrap();
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        let t0 = Instant::now();
        while srv.active_connections() > 0 && t0.elapsed() < T {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(srv.active_connections(), 0);
    }

    #[test]
    fn connection_limit() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("c.sock");
        let opts = ServerOptions {
            max_connections: 2,
            ..Default::default()
        };
        let srv = ControlServer::bind_with(&p, Arc::new(Mock), opts).unwrap();
        let mut a = Raw::new(&p);
        let mut b = Raw::new(&p);
        assert_eq!(a.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
        assert_eq!(b.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
        let mut c = Raw::new(&p);
        assert_eq!(err_of(&c.recv()), "too many control connections (2 open)");
        drop((a, b));
        let t0 = Instant::now();
        while srv.active_connections() > 0 && t0.elapsed() < T {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(request(&p, &Request::Ping, T).is_ok());
    }

    /// Connects to `sock` as uid 65534 (nobody) from a forked child and returns
    /// `Err(errno)` if connect failed, else the bytes the daemon replied.
    fn connect_as_nobody(sock: &Path) -> Result<Vec<u8>, i32> {
        use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
        use nix::sys::wait::{waitpid, WaitStatus};
        use nix::unistd::{fork, pipe, read, write, ForkResult};
        // Everything the child needs is prepared before fork: after fork in a
        // threaded process only async-signal-safe calls are allowed (no allocation,
        // no panics).
        let addr = UnixAddr::new(sock).unwrap();
        let req = b"{\"verb\":\"ping\"}\n";
        let (rx, tx) = pipe().unwrap();
        // SAFETY: the child makes only plain syscalls (nix's wrappers of them
        // allocate nothing) and leaves through `_exit`.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                drop(rx);
                // libc: raw syscalls, because glibc's setuid wrappers (and nix's,
                // which call them) coordinate threads a forked child no longer has;
                // and `_exit`, which nix does not wrap.
                // SAFETY: plain syscalls with valid (null, empty) arguments.
                unsafe {
                    if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) != 0
                        || libc::syscall(libc::SYS_setgid, 65534) != 0
                        || libc::syscall(libc::SYS_setuid, 65534) != 0
                    {
                        libc::_exit(100);
                    }
                }
                let fd = socket(
                    AddressFamily::Unix,
                    SockType::Stream,
                    SockFlag::empty(),
                    None,
                );
                let connected = fd.and_then(|fd| connect(fd.as_raw_fd(), &addr).map(|()| fd));
                let fd = match connected {
                    Ok(fd) => fd,
                    // SAFETY: `_exit` ends the child without running destructors.
                    Err(errno) => unsafe { libc::_exit((errno as i32).min(99)) },
                };
                let _ = write(&fd, req);
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = read(&fd, &mut buf) {
                    let _ = write(&tx, &buf[..n]);
                }
                // SAFETY: as above.
                unsafe { libc::_exit(0) }
            }
            ForkResult::Parent { child } => {
                drop(tx);
                let mut out = Vec::new();
                std::fs::File::from(rx).read_to_end(&mut out).unwrap();
                match waitpid(child, None).unwrap() {
                    WaitStatus::Exited(_, 0) => Ok(out),
                    WaitStatus::Exited(_, 100) => panic!("child could not drop privileges"),
                    WaitStatus::Exited(_, errno) => Err(errno),
                    other => panic!("child ended with {other:?}"),
                }
            }
        }
    }

    #[test]
    fn other_users_are_refused() {
        if current_uid() != 0 {
            eprintln!("skipped: needs root to become another user");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        // Let nobody reach the socket's directory, so only the socket guards it.
        fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let (_srv, p) = server(t.path());
        // With the socket at 0600 the kernel refuses connect().
        assert_eq!(connect_as_nobody(&p), Err(nix::errno::Errno::EACCES as i32));
        // Widened by hand, the connection gets through and SO_PEERCRED refuses it.
        fs::set_permissions(&p, fs::Permissions::from_mode(0o666)).unwrap();
        let reply = connect_as_nobody(&p).expect("connect");
        let v: Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(
            err_of(&v),
            "permission denied: uid 65534 may not use this daemon (owner uid 0)"
        );
        // Exactly one line, then the daemon closed the connection.
        assert_eq!(reply.iter().filter(|&&b| b == b'\n').count(), 1);
        assert!(
            request(&p, &Request::Ping, T).is_ok(),
            "server still serving"
        );
    }
}

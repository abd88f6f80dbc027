//! The control server's tests: a mock handler behind a real socket, raw clients
//! that send what the real client never would, and a forked client of another uid.

use std::io::{BufRead, Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Instant;

use serde_json::{json, Value};

use super::*;
use crate::control::client::{request, ControlClient};
use crate::control::protocol::MAX_REQUEST_LINE;

const T: Duration = Duration::from_secs(10);

/// Answers each verb with a reply that shows what it was asked (a prefetch of layer
/// `n` queues `n` chunks, a route's only token is its prompt); `layer 666` panics;
/// `tensor "missing"` is an error.
struct Mock;
impl Handler for Mock {
    fn handle(&self, req: Request) -> Result<Reply, String> {
        use crate::control::{reply::*, Target};
        match req {
            Request::Pin(Target::Layer(666)) => panic!("boom"),
            Request::Pin(Target::Tensor(t)) if t == "missing" => {
                Err(format!("no tensor named {t:?}"))
            }
            Request::Stat => Ok(StatReply {
                cache: CacheStat {
                    hits: Some(3),
                    misses: Some(1),
                    ..CacheStat::default()
                },
                ..StatReply::default()
            }
            .into()),
            Request::Prefetch(Target::Layer(n)) => Ok(PrefetchReply {
                queued_chunks: n.into(),
            }
            .into()),
            Request::Trace { on } => Ok(TraceOnReply { tracing: on }.into()),
            Request::Route { prompt, .. } => Ok(RouteReply {
                file: "model.gguf".into(),
                tokens: vec![prompt],
                shards: vec![],
                chunk_bytes: 0,
                queued_chunks: None,
                hinted_chunks: None,
            }
            .into()),
            _ => Ok(PingReply { pong: true }.into()),
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
    assert_eq!(
        v["cache"],
        json!({"hits": 3, "misses": 1, "latency_us": {}})
    );
    let v = request(&p, &Request::Trace { on: true }, T).unwrap();
    assert_eq!(v, json!({"tracing": true}));
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
    assert!(err_of(&c.send(b"{\"verb\":\"frobnicate\"}\n")).contains("unknown verb \"frobnicate\""));
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
    assert_eq!(
        v["tokens"][0].as_str().unwrap().len(),
        line.len() - 29,
        "{v}"
    );
    // One byte more is not.
    line.insert(30, b'x');
    assert!(err_of(&c.send(&line)).contains("longer than"));
    assert_eq!(
        request(&p, &Request::Ping, T).unwrap(),
        json!({"pong": true})
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
                    assert_eq!(v["queued_chunks"], i * 100 + j);
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
fn at_the_cap_the_longest_idle_connection_makes_room() {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join("c.sock");
    let opts = ServerOptions {
        max_connections: 2,
        ..Default::default()
    };
    let srv = ControlServer::bind_with(&p, Arc::new(Mock), opts).unwrap();
    let mut a = Raw::new(&p);
    let mut b = Raw::new(&p);
    // A connection counts as idle again only after its reply is written: give each
    // server thread time to get there (on a loaded machine `a`'s thread, still about
    // to, could otherwise mark `a` idle after `b`).
    assert_eq!(a.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(b.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
    std::thread::sleep(Duration::from_millis(100));
    // `a` has been idle longest: it is closed and `c` served.
    let mut c = Raw::new(&p);
    assert_eq!(c.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
    let mut l = String::new();
    assert_eq!(a.r.read_line(&mut l).unwrap_or(0), 0, "a closed");
    assert_eq!(b.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
    assert_eq!(srv.active_connections(), 2);
}

#[test]
fn cap_many_idle_connections_do_not_lock_out_a_new_client() {
    let t = tempfile::tempdir().unwrap();
    let (srv, p) = server(t.path());
    let max = ServerOptions::default().max_connections;
    // Connected and silent: not even a first request.
    let idle: Vec<Raw> = (0..max).map(|_| Raw::new(&p)).collect();
    let t0 = Instant::now();
    while srv.active_connections() < max && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(srv.active_connections(), max);
    for _ in 0..3 {
        assert_eq!(request(&p, &Request::Ping, T).unwrap()["pong"], true);
    }
    drop(idle);
}

/// Answers `prefetch` of layer 1 after a pause (a request in progress), else pongs.
struct Slow;
impl Handler for Slow {
    fn handle(&self, req: Request) -> Result<Reply, String> {
        if let Request::Prefetch(crate::control::Target::Layer(1)) = req {
            std::thread::sleep(Duration::from_millis(1500));
        }
        Ok(crate::control::reply::PingReply { pong: true }.into())
    }
}

#[test]
fn at_the_cap_with_every_connection_busy_a_new_one_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join("c.sock");
    let opts = ServerOptions {
        max_connections: 2,
        ..Default::default()
    };
    let srv = ControlServer::bind_with(&p, Arc::new(Slow), opts).unwrap();
    let mut busy: Vec<Raw> = (0..2).map(|_| Raw::new(&p)).collect();
    for c in &mut busy {
        c.w.write_all(b"{\"verb\":\"prefetch\",\"layer\":1}\n")
            .unwrap();
    }
    // Both requests are being handled before the third client arrives.
    std::thread::sleep(Duration::from_millis(300));
    let mut c = Raw::new(&p);
    assert_eq!(
        err_of(&c.recv()),
        "too many control connections (2 open, none idle)"
    );
    for c in &mut busy {
        assert_eq!(c.recv()["ok"], true);
    }
    drop(busy);
    let t0 = Instant::now();
    while srv.active_connections() > 0 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(request(&p, &Request::Ping, T).is_ok());
}

#[test]
fn idle_connections_are_closed_after_the_timeout() {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join("c.sock");
    let opts = ServerOptions {
        idle_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let srv = ControlServer::bind_with(&p, Arc::new(Mock), opts).unwrap();
    let mut quiet = Raw::new(&p);
    assert_eq!(quiet.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
    // A client trickling one byte at a time is timed on its whole line.
    let mut slow = Raw::new(&p);
    let t0 = Instant::now();
    let mut closed = false;
    for b in b"{\"verb\":\"ping\"" {
        if slow.w.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        closed,
        "a trickling client was served for {:?}",
        t0.elapsed()
    );
    let mut l = String::new();
    assert_eq!(quiet.r.read_line(&mut l).unwrap_or(0), 0, "quiet closed");
    let t0 = Instant::now();
    while srv.active_connections() > 0 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(srv.active_connections(), 0);
    // A client that keeps talking is not cut off.
    let mut c = Raw::new(&p);
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(c.send(b"{\"verb\":\"ping\"}\n")["ok"], true);
    }
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

//! The client end of the control socket: what `cawsfs stat`, `route`, `prefetch` use.
//!
//! Every failure becomes a [`ControlError`] whose message tells the user what to do
//! ("no cawsfs daemon at … (is it mounted?)"); a reply is read up to a generous cap
//! so a broken daemon cannot make the client allocate without bound.
//!
//! The server is checked as the server checks its clients: with `--socket` in a
//! directory others can write, another user could put their own server at the path,
//! so only a server running as our uid or as root is talked to (`SO_PEERCRED`).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::protocol::{Request, Response};
use super::{current_uid, ControlError};

/// Longest reply line the client accepts (a stat reply with thousands of files fits).
pub const MAX_REPLY_LINE: usize = 64 * 1024 * 1024;

/// One request on a fresh connection: the reply's payload (the object without
/// `"ok"`), or the daemon's error message as [`ControlError::Daemon`].
pub fn request(socket: &Path, req: &Request, timeout: Duration) -> Result<Value, ControlError> {
    ControlClient::connect(socket, timeout)?.call(req)
}

/// [`request`], the payload read as the verb's reply type (`control::reply`); a
/// payload that does not fit it is [`ControlError::BadReply`].
pub fn request_as<T: DeserializeOwned>(
    socket: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<T, ControlError> {
    ControlClient::connect(socket, timeout)?.call_as(req)
}

/// `payload`, the reply to `req` from the daemon at `socket`, read as `T` (the reply
/// type of `req`'s verb); a payload that does not fit is [`ControlError::BadReply`].
pub fn decode<T: DeserializeOwned>(
    socket: &Path,
    req: &Request,
    payload: &Value,
) -> Result<T, ControlError> {
    T::deserialize(payload).map_err(|e| ControlError::BadReply {
        path: socket.to_path_buf(),
        msg: format!("{} reply: {e}", req.verb()),
    })
}

/// Whether a client running as `own_uid` may trust a server running as `server_uid`:
/// the same rule the server applies to its peers.
pub fn trusted_server(server_uid: u32, own_uid: u32) -> bool {
    server_uid == own_uid || server_uid == 0
}

/// The pid of the daemon answering at `socket` (its `SO_PEERCRED`), once it has
/// answered a ping: what `cawsfs umount` waits for.
pub fn daemon_pid(socket: &Path, timeout: Duration) -> Result<u32, ControlError> {
    let mut c = ControlClient::connect(socket, timeout)?;
    c.call(&Request::Ping)?;
    Ok(c.server_pid())
}

/// A connection that can carry many requests (`cawsfs stat --watch` keeps one).
pub struct ControlClient {
    path: PathBuf,
    /// The server's pid, from `SO_PEERCRED` (the process that listens).
    server_pid: u32,
    timeout: Duration,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl ControlClient {
    /// Connects to a server of our uid or root; `timeout` bounds each later send and
    /// reply.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<ControlClient, ControlError> {
        let path = socket.to_path_buf();
        let stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
                ControlError::NoDaemon { path: path.clone() }
            }
            io::ErrorKind::PermissionDenied => {
                ControlError::PermissionDenied { path: path.clone() }
            }
            _ => ControlError::io("cannot connect to", socket, e),
        })?;
        let cred = getsockopt(&stream, PeerCredentials).map_err(|e| {
            ControlError::io("cannot read the server's credentials on", socket, e.into())
        })?;
        let own = current_uid();
        if !trusted_server(cred.uid(), own) {
            return Err(ControlError::UntrustedServer {
                path,
                uid: cred.uid(),
                own,
            });
        }
        // A zero timeout means "none" to us but is an error to std.
        let t = (!timeout.is_zero()).then_some(timeout);
        let setup = |s: &UnixStream| -> io::Result<UnixStream> {
            s.set_read_timeout(t)?;
            s.set_write_timeout(t)?;
            s.try_clone()
        };
        let writer = setup(&stream).map_err(|e| ControlError::io("cannot set up", socket, e))?;
        Ok(ControlClient {
            path,
            server_pid: u32::try_from(cred.pid()).unwrap_or(0),
            timeout,
            reader: BufReader::new(stream),
            writer,
        })
    }

    /// The pid of the server process (`SO_PEERCRED`).
    pub fn server_pid(&self) -> u32 {
        self.server_pid
    }

    fn map_io(&self, e: io::Error) -> ControlError {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ControlError::Timeout {
                path: self.path.clone(),
                secs: self.timeout.as_secs_f64(),
            },
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                self.bad_reply("the connection was closed".into())
            }
            _ => ControlError::io("cannot talk to", &self.path, e),
        }
    }

    fn bad_reply(&self, msg: String) -> ControlError {
        ControlError::BadReply {
            path: self.path.clone(),
            msg,
        }
    }

    /// Sends one request and waits for its reply line.
    pub fn call(&mut self, req: &Request) -> Result<Value, ControlError> {
        let mut line = req.to_json().to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .map_err(|e| self.map_io(e))?;
        let mut buf = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_REPLY_LINE as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| self.map_io(e))?;
        if n == 0 {
            return Err(self.bad_reply("the connection was closed before a reply".into()));
        }
        if buf.last() != Some(&b'\n') {
            return Err(self.bad_reply(if buf.len() > MAX_REPLY_LINE {
                format!("reply longer than {MAX_REPLY_LINE} bytes")
            } else {
                "the connection was closed in the middle of a reply".into()
            }));
        }
        let text = std::str::from_utf8(&buf).map_err(|_| self.bad_reply("not UTF-8".into()))?;
        match Response::parse_line(text).map_err(|m| self.bad_reply(m))? {
            Response::Ok(m) => Ok(Value::Object(m)),
            Response::Err(e) => Err(ControlError::Daemon(e)),
        }
    }

    /// [`ControlClient::call`], the payload read as `T` (the reply type of `req`'s verb).
    pub fn call_as<T: DeserializeOwned>(&mut self, req: &Request) -> Result<T, ControlError> {
        let v = self.call(req)?;
        decode(&self.path, req, &v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn trusted_server_rule() {
        assert!(trusted_server(1000, 1000));
        assert!(trusted_server(0, 1000));
        assert!(trusted_server(0, 0));
        assert!(!trusted_server(1001, 1000));
        assert!(!trusted_server(65534, 0));
    }

    #[test]
    fn a_server_of_our_own_uid_is_trusted_and_its_pid_known() {
        let (_t, p, h) = fake(b"{\"ok\":true,\"pong\":true}\n");
        assert_eq!(daemon_pid(&p, T).unwrap(), std::process::id());
        h.join().unwrap();
    }

    #[test]
    fn missing_socket_is_a_clear_error() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("nothing.sock");
        let e = request(&p, &Request::Stat, T).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("no cawsfs daemon at {} (is it mounted?)", p.display())
        );
        // A dead socket file reads the same.
        drop(UnixListener::bind(&p).unwrap());
        let e = request(&p, &Request::Stat, T).unwrap_err();
        assert!(matches!(e, ControlError::NoDaemon { .. }), "{e}");
    }

    /// A fake daemon that answers the first line with `reply` (or not at all).
    fn fake(reply: &'static [u8]) -> (tempfile::TempDir, PathBuf, std::thread::JoinHandle<()>) {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("f.sock");
        let l = UnixListener::bind(&p).unwrap();
        let h = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(&s);
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            (&s).write_all(reply).unwrap();
            std::thread::sleep(Duration::from_millis(700));
        });
        (t, p, h)
    }

    #[test]
    fn bad_and_missing_replies() {
        let (_t, p, h) = fake(b"garbage\n");
        let e = request(&p, &Request::Ping, T).unwrap_err().to_string();
        assert!(e.starts_with("bad reply from the cawsfs daemon at"), "{e}");
        h.join().unwrap();

        let (_t, p, h) = fake(b"{\"ok\":false,\"error\":\"nope\"}\n");
        let e = request(&p, &Request::Ping, T).unwrap_err();
        assert!(matches!(&e, ControlError::Daemon(m) if m == "nope"), "{e}");
        h.join().unwrap();

        let (_t, p, h) = fake(b"{\"ok\":true,\"queued_chunks\":\"3\"}\n");
        let e = request_as::<crate::control::PrefetchReply>(&p, &Request::Ping, T)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad reply") && e.contains("ping reply: invalid type"),
            "{e}"
        );
        h.join().unwrap();

        let (_t, p, h) = fake(b"");
        let e = request(&p, &Request::Ping, Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("timed out after 0.2s"), "{e}");
        h.join().unwrap();
    }
}

//! One connection: the peer-uid check, bounded request lines read within the idle
//! timeout, and one reply line per request with handler panics turned into error
//! replies.

use std::io::{self, BufRead, BufReader, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::{Handler, Shared};
use crate::control::protocol::{Request, Response};

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

/// One error reply, then the connection is dropped.
pub(super) fn refuse(mut stream: &UnixStream, msg: &str) {
    let _ = stream.write_all(Response::error(msg).to_line().as_bytes());
    let _ = stream.shutdown(Shutdown::Both);
}

/// Serves one accepted connection (`id` in `shared.conns`) until the peer closes it,
/// a write fails, a line is over the cap, or no complete line comes within the idle
/// timeout.
pub(super) fn serve(stream: &UnixStream, shared: &Shared, id: u64) {
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
        let deadline = Instant::now() + shared.opts.idle_timeout;
        match read_line_before(&mut reader, max, deadline, &mut buf) {
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
        shared.set_idle(id, false);
        let resp = answer(line, shared.handler.as_ref());
        if writer.write_all(resp.to_line().as_bytes()).is_err() {
            return;
        }
        shared.set_idle(id, true);
    }
}

/// Reads one line (through its `\n`, at most `max + 1` bytes: a longer line is cut
/// there) into `buf`, failing with `TimedOut` at `deadline` however the bytes trickle
/// in: a socket read timeout alone would restart with every byte. Returns the bytes
/// read, 0 at end of file.
fn read_line_before(
    reader: &mut BufReader<&UnixStream>,
    max: usize,
    deadline: Instant,
    buf: &mut Vec<u8>,
) -> io::Result<usize> {
    let cap = max + 1;
    loop {
        if reader.buffer().is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            reader.get_ref().set_read_timeout(Some(left))?;
        }
        let avail = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(buf.len());
        }
        let room = &avail[..avail.len().min(cap - buf.len())];
        let (used, done) = match room.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (room.len(), buf.len() + room.len() >= cap),
        };
        buf.extend_from_slice(&room[..used]);
        reader.consume(used);
        if done {
            return Ok(buf.len());
        }
    }
}

/// The reply to one request line; a handler panic becomes an error reply.
fn answer(line: &[u8], handler: &dyn Handler) -> Response {
    let req = match Request::parse_line(line) {
        Ok(r) => r,
        Err(e) => return Response::error(e),
    };
    match catch_unwind(AssertUnwindSafe(|| handler.handle(req))) {
        // Through a `Value`, as before the replies were typed: the same bytes on the wire.
        Ok(Ok(reply)) => match serde_json::to_value(&reply) {
            Ok(v) => Response::ok(v),
            Err(e) => Response::error(format!("internal error: cannot encode the reply: {e}")),
        },
        Ok(Err(e)) => Response::error(e),
        Err(p) => {
            let msg = crate::error::panic_text(&*p);
            Response::error(format!(
                "internal error: the request handler panicked: {msg}"
            ))
        }
    }
}

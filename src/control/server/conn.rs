//! One connection: the peer-uid check, bounded request lines, and one reply line per
//! request with handler panics turned into error replies.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};

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

/// Serves one accepted connection until the peer closes it, a write fails, or a
/// line is over the cap.
pub(super) fn serve(stream: &UnixStream, shared: &Shared) {
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

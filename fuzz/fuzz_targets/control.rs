//! The control protocol (docs/CONTROL.md), both ends: the daemon's request line parser
//! (`Request::parse_line`; a parsed request must survive its own wire form unchanged)
//! and the client's reply side (`Response::parse_line`, then the payload read as each
//! typed reply the CLI decodes, and `stat`'s renderers run on a decoded `StatReply`).
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::control(data));
}

//! The ROUTING section (docs/FORMAT.md §7, `cawsfs::archive::parse_routing`), stored by
//! every archive kind. A parsed section must encode to bytes that parse back to the same
//! encoding.
use cawsfs::archive::{encode_routing, parse_routing};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        if let Ok(r) = parse_routing(data) {
            let once = encode_routing(&r);
            let back = parse_routing(&once).expect("encoded routing parses");
            assert_eq!(encode_routing(&back), once);
        }
    });
}

//! The ROUTING section (docs/FORMAT.md §7, `cawsfs::archive::parse_routing`), stored by
//! every archive kind. A parsed section must encode to bytes that parse back to the same
//! encoding.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::routing(data));
}

//! The `.npy` header parser alone (`cawsfs::archive::npydir::npy`): `header_len` of the
//! first 12 bytes, `parse`, and for a parsed header: `write_header` of the same dtype
//! and shape parses back to the same header.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::npy_header(data));
}

//! llama.cpp importance matrices (`cawsfs::import::imatrix`), both formats: a parsed
//! file has entries of finite non-negative values, and looking them up never panics.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::imatrix(data));
}

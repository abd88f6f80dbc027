//! `.cawsf` archive: header, TOC, sections, INDEX, META, block records, ROUTING — the
//! input is the archive file, opened by `cawsfs::archive::open`; when it opens, every
//! tensor's first block and last row are read, verify runs, and every virtual file's
//! header and first tensor bytes are read. Seeds: archives the converter wrote.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::cawsf(data));
}

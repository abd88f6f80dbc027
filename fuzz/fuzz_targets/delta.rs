//! Delta archive (docs/FORMAT-DELTA.md): the input is the file, opened by
//! `cawsfs::archive::open` (by its magic); when it opens, rows, verify and virtual files
//! are read as for `.cawsf`. Seeds: delta archives the converter wrote.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::delta(data));
}

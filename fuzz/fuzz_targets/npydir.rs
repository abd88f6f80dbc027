//! npy-dir archive (docs/NPYDIR.md): `manifest.json`, `cawsfs.json`, `routing.bin`, the
//! `.npy` files and framed `.npy.zst` files under `tensors/`. The input is a list of
//! files (`cawsfs_fuzz::decode_files`: pieces split on `\n\0%%FILE%%`, each
//! `NAME\nCONTENT`), written into a fresh directory that `cawsfs::archive::open` opens;
//! when it opens, rows, verify and virtual files are read. Seeds: npy-dirs the converter
//! wrote (int8, int4, zstd), with and without `cawsfs.json`.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::npydir(data));
}

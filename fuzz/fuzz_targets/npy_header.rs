//! The `.npy` header parser alone (`cawsfs::archive::npydir::npy`): `header_len` of the
//! first 12 bytes, `parse`, and for a parsed header: `write_header` of the same dtype
//! and shape parses back to the same header.
use cawsfs::archive::npydir::npy;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let _ = npy::header_len(&data[..data.len().min(12)]);
        if let Ok(h) = npy::parse(data) {
            assert!(h.data_offset <= data.len() as u64);
            let again = npy::parse(&npy::write_header(h.dtype, &h.shape)).expect("own header");
            assert_eq!((again.dtype, &again.shape), (h.dtype, &h.shape));
        }
    });
}

//! Walking a `.npy.zst` stream without decompressing it (frame and block headers
//! only), and reading the npy header from its first bytes (docs/NPYDIR.md §4).

use super::{npy, MAX_FILES};

/// One zstd frame of a stream.
pub(super) struct Frame {
    pub offset: usize,
    /// Compressed length.
    pub len: usize,
    /// Decompressed size, when the frame records it.
    pub content: Option<u64>,
}

/// The frames of `data`, in order; a truncated or corrupt stream is an error.
pub(super) fn walk_frames(data: &[u8]) -> Result<Vec<Frame>, String> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < data.len() {
        let rest = &data[off..];
        let n = zstd::zstd_safe::find_frame_compressed_size(rest)
            .map_err(|_| format!("truncated or corrupt zstd stream at byte {off}"))?;
        if n == 0 || n > rest.len() {
            return Err(format!("truncated or corrupt zstd stream at byte {off}"));
        }
        let content = zstd::zstd_safe::get_frame_content_size(rest).ok().flatten();
        out.push(Frame {
            offset: off,
            len: n,
            content,
        });
        off += n;
        if out.len() > MAX_FILES {
            return Err("too many zstd frames".into());
        }
    }
    Ok(out)
}

/// The npy header at the start of a zstd stream (decompressing only its first bytes).
pub(super) fn zst_header(data: &[u8]) -> Result<npy::Header, String> {
    use std::io::Read;
    let bad = |e: std::io::Error| format!("zstd: {e}");
    let mut dec = zstd::stream::read::Decoder::with_buffer(data).map_err(bad)?;
    let mut prefix = Vec::new();
    (&mut dec).take(12).read_to_end(&mut prefix).map_err(bad)?;
    let hl = npy::header_len(&prefix)?;
    if (prefix.len() as u64) < hl.min(12) {
        return Err("truncated npy header".into());
    }
    let need = hl.saturating_sub(prefix.len() as u64);
    (&mut dec)
        .take(need)
        .read_to_end(&mut prefix)
        .map_err(bad)?;
    npy::parse(&prefix)
}

//! Walking a `.npy.zst` stream without decompressing it (frame and block headers
//! only), and reading the npy header from its first bytes (docs/NPYDIR.md §4).

use super::{npy, MAX_FILES};
use crate::archive::container::invalid;
use crate::archive::file::ArchiveFile;
use crate::archive::ArchiveError;

/// One zstd frame of a stream.
pub(super) struct Frame {
    pub offset: u64,
    /// Compressed length.
    pub len: usize,
    /// Decompressed size, when the frame records it.
    pub content: Option<u64>,
}

/// What is read of the file at a time while walking.
const WINDOW: usize = 4 << 20;
/// No frame cawsfs writes comes near this; a longer one is refused rather than buffered.
const MAX_FRAME: usize = 512 << 20;

/// The frames of `file`, in order; a truncated or corrupt stream is an error. Reads the
/// file a window at a time (a window grows only to hold one long frame).
pub(super) fn walk_frames(file: &ArchiveFile) -> Result<Vec<Frame>, ArchiveError> {
    let bad = |m: String| invalid(file.path(), m);
    let len = file.len();
    let mut out = Vec::new();
    let (mut buf, mut buf_off) = (Vec::new(), 0u64);
    let mut off = 0u64;
    while off < len {
        let rest = &buf[(off - buf_off) as usize..];
        let n = match zstd::zstd_safe::find_frame_compressed_size(rest) {
            Ok(n) if n > 0 && n <= rest.len() => n,
            // The window ends before the file does: read on from this frame.
            _ if buf_off + (buf.len() as u64) < len => {
                if rest.len() >= MAX_FRAME {
                    return Err(bad(format!(
                        "zstd frame at byte {off} is longer than {} MiB or corrupt",
                        MAX_FRAME >> 20
                    )));
                }
                let want = (WINDOW.max(2 * rest.len()) as u64).min(len - off);
                buf = file.read_head(off, want as usize)?;
                buf_off = off;
                continue;
            }
            _ => {
                return Err(bad(format!(
                    "truncated or corrupt zstd stream at byte {off}"
                )))
            }
        };
        let content = zstd::zstd_safe::get_frame_content_size(rest).ok().flatten();
        out.push(Frame {
            offset: off,
            len: n,
            content,
        });
        off += n as u64;
        if out.len() > MAX_FILES {
            return Err(bad("too many zstd frames".into()));
        }
    }
    Ok(out)
}

/// The npy header at the start of a zstd stream (decompressing only its first bytes).
pub(super) fn zst_header(data: &[u8]) -> Result<npy::Header, String> {
    use std::io::Read;
    let bad = |e: std::io::Error| format!("zstd: {e}");
    crate::archive::container::with_zstd_stream(|ctx| {
        let mut dec = zstd::stream::read::Decoder::with_context(data, ctx);
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
    })
}

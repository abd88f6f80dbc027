//! A chunk's bytes: zeroed, in one heap allocation, starting at a page boundary.
//!
//! Why aligned: the disk tier writes freshly loaded chunks to disk with `O_DIRECT`,
//! which wants an aligned buffer. With the chunk itself aligned the tier's writer takes
//! a reference to it instead of copying every byte into an aligned buffer of its own
//! (that copy, and hashing it again later from memory gone cold, were most of what a
//! fresh tier added to a first pass's CPU; docs/MOUNT.md, "Disk tier").

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// Told of each chunk a loader has just produced (its index and bytes), on the loading
/// thread once the chunk's readers have it: the disk tier keeps a reference to write
/// it out (fs/tiering.rs). It must not block.
pub type Keeper = Box<dyn Fn(u64, &Arc<Chunk>) + Send + Sync>;

impl super::ChunkCache {
    /// Tell `keeper` of every chunk of `file` loaded from now on (demand, read-ahead
    /// and prefetch loads alike). One per file: false when it already has one.
    pub fn set_keeper(&self, file: u32, keeper: Keeper) -> bool {
        self.shared.file_state(file).keeper.set(keeper).is_ok()
    }
}

/// Alignment of a chunk's first byte.
pub const CHUNK_ALIGN: usize = 4096;

/// `len` bytes at a page boundary inside a plain allocation of `len + CHUNK_ALIGN - 1`
/// (up to a page more than needed, 1.6 % of a 256 KiB chunk). Not an aligned allocation:
/// glibc's `memalign` splits off a fragment before and after each block, and a cache
/// that frees and makes 256 KiB chunks all day then grew its heap around the fragments
/// (a 16 MiB cache's daemon peaked at up to 44 MiB of anonymous memory against 27 MiB);
/// blocks of one size are reused whole.
pub struct Chunk {
    buf: Box<[u8]>,
    start: usize,
    len: usize,
}

impl Chunk {
    /// `len` zero bytes, page-aligned.
    pub fn zeroed(len: usize) -> Chunk {
        let buf = vec![0u8; len + CHUNK_ALIGN - 1].into_boxed_slice();
        let start = buf.as_ptr().align_offset(CHUNK_ALIGN);
        Chunk { buf, start, len }
    }
}

impl Deref for Chunk {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Chunk({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_chunks_are_aligned_exact_and_writable() {
        for len in [0, 1, 4095, 4096, 4097, 256 * 1024, 256 * 1024 + 17] {
            let mut c = Chunk::zeroed(len);
            assert_eq!(c.len(), len);
            assert!(c.iter().all(|&b| b == 0));
            if len > 0 {
                assert_eq!(c.as_ptr() as usize % CHUNK_ALIGN, 0, "len {len}");
                c[len - 1] = 7;
                assert_eq!(c.as_ref()[len - 1], 7);
            }
        }
    }
}

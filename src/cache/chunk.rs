//! A chunk's bytes, in one zeroed heap allocation, and the keeper that is told of each
//! freshly loaded chunk. Shared (`Arc<Chunk>`): the disk tier's writer keeps a
//! reference to a chunk until it is written instead of copying its bytes (that copy,
//! and hashing it again later from memory gone cold, were most of what a fresh tier
//! added to a first pass's CPU; docs/MOUNT.md, "Disk tier").

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

/// One chunk's bytes.
pub struct Chunk {
    buf: Box<[u8]>,
}

impl Chunk {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Chunk {
        Chunk {
            buf: vec![0u8; len].into_boxed_slice(),
        }
    }
}

impl Deref for Chunk {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Chunk({} bytes)", self.buf.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_chunks_are_exact_and_writable() {
        for len in [0, 1, 4095, 4096, 4097, 256 * 1024, 256 * 1024 + 17] {
            let mut c = Chunk::zeroed(len);
            assert_eq!(c.len(), len);
            assert!(c.iter().all(|&b| b == 0));
            if len > 0 {
                c[len - 1] = 7;
                assert_eq!(c.as_ref()[len - 1], 7);
            }
        }
    }
}

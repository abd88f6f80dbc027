//! A chunk's bytes: one zeroed heap allocation whose first byte is page-aligned.
//!
//! Why aligned: the disk tier writes freshly loaded chunks to disk with `O_DIRECT`,
//! which wants an aligned buffer. With the chunk itself aligned the tier's writer takes
//! a reference to it instead of copying every byte into an aligned buffer of its own
//! (that copy, and hashing it again later from memory gone cold, were most of what a
//! fresh tier added to a first pass's CPU; docs/MOUNT.md, "Disk tier").

use std::ops::{Deref, DerefMut};

/// Alignment of a chunk's first byte.
pub const CHUNK_ALIGN: usize = 4096;

/// One page, the unit a chunk is allocated in; `bytemuck` allocates a zeroed slice of
/// them with their alignment.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; CHUNK_ALIGN]);

// SAFETY: a plain byte array: no padding (size equals alignment), every bit pattern
// valid, all zeros included.
unsafe impl bytemuck::Zeroable for Page {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for Page {}

/// `len` bytes in whole pages (the last page's tail is never shown).
pub struct Chunk {
    pages: Box<[Page]>,
    len: usize,
}

impl Chunk {
    /// `len` zero bytes, page-aligned. Like `vec![0; len]`, it aborts when memory
    /// cannot be had.
    pub fn zeroed(len: usize) -> Chunk {
        let n = len.div_ceil(CHUNK_ALIGN);
        let pages = bytemuck::try_zeroed_slice_box(n).unwrap_or_else(|()| {
            std::alloc::handle_alloc_error(
                std::alloc::Layout::array::<Page>(n).unwrap_or(std::alloc::Layout::new::<Page>()),
            )
        });
        Chunk { pages, len }
    }
}

impl Deref for Chunk {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.pages)[..self.len]
    }
}

impl DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.pages)[..self.len]
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

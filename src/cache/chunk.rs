//! A chunk's bytes: zeroed, starting at a page boundary, in a slot of a huge-page block
//! (slots.rs) or in one heap allocation.
//!
//! Why aligned: the disk tier writes freshly loaded chunks to disk with `O_DIRECT`,
//! which wants an aligned buffer. With the chunk itself aligned the tier's writer takes
//! a reference to it instead of copying every byte into an aligned buffer of its own
//! (that copy, and hashing it again later from memory gone cold, were most of what a
//! fresh tier added to a first pass's CPU; docs/MOUNT.md, "Disk tier").

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use super::slots;

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

/// A chunk of more than half a slot and at most one ([`slots::SLOT`], the default
/// chunk size) lives in a slot of the pool of huge-page blocks (slots.rs); others, and
/// any the pool cannot map, in the heap.
pub struct Chunk {
    mem: Mem,
    len: usize,
}

enum Mem {
    Slot(slots::SlotAddr),
    /// `len` bytes at a page boundary inside a plain allocation of `len + CHUNK_ALIGN - 1`
    /// (up to a page more than needed). Not an aligned allocation: glibc's `memalign`
    /// splits off a fragment before and after each block, and a cache that frees and
    /// makes chunks all day then grew its heap around the fragments (a 16 MiB cache's
    /// daemon peaked at up to 44 MiB of anonymous memory against 27 MiB); blocks of one
    /// size are reused whole.
    Heap {
        buf: Box<[u8]>,
        start: usize,
    },
}

// SAFETY: a slot's bytes belong to its chunk alone, as a Box's do (the pool never hands
// out a live slot again), and are only reached through the chunk's `&`/`&mut` borrows.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    /// `len` zero bytes, page-aligned.
    pub fn zeroed(len: usize) -> Chunk {
        let slot = (len > slots::SLOT / 2 && len <= slots::SLOT)
            .then(|| slots::alloc(len))
            .flatten();
        let mem = match slot {
            Some(addr) => Mem::Slot(addr),
            None => {
                let buf = vec![0u8; len + CHUNK_ALIGN - 1].into_boxed_slice();
                let start = buf.as_ptr().align_offset(CHUNK_ALIGN);
                Mem::Heap { buf, start }
            }
        };
        Chunk { mem, len }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let Mem::Slot(addr) = self.mem {
            slots::free(addr);
        }
    }
}

impl Deref for Chunk {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.mem {
            // SAFETY: the slot holds `len` <= SLOT initialized bytes, ours until drop.
            Mem::Slot(addr) => unsafe { std::slice::from_raw_parts(addr.as_ptr(), self.len) },
            Mem::Heap { buf, start } => &buf[*start..*start + self.len],
        }
    }
}

impl DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            // SAFETY: as in `deref`, and `&mut self` makes this the only borrow.
            Mem::Slot(addr) => unsafe { std::slice::from_raw_parts_mut(addr.as_ptr(), self.len) },
            Mem::Heap { buf, start } => &mut buf[*start..*start + self.len],
        }
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
        for len in [
            0,
            1,
            4095,
            4096,
            4097,
            200 << 10,
            256 * 1024,
            256 * 1024 + 17,
        ] {
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

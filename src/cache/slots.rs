//! Memory for full-size chunks: anonymous 2 MiB blocks that the kernel is asked to back
//! with a transparent huge page (`MADV_HUGEPAGE`), cut into [`SLOT`]-byte slots.
//!
//! Why: a chunk in heap memory is faulted in 4 KiB at a time. A first pass of the test
//! model's 106 MiB view through a fresh tier took 31.6 k page faults in the daemon; with
//! its chunks in huge pages (glibc's `glibc.malloc.hugetlb=1`, by hand) 5.2 k, and 0.29 s
//! of daemon CPU against 0.33 s (docs/MOUNT.md, "Memory"). That tunable is not what the
//! daemon uses: glibc advises only heap growths of 2 MiB or more, and with the daemon's
//! periodic trims one mount got huge pages and the next, of the same file, none.
//!
//! A freed slot stays resident for the next chunk (zeroed again on reuse) while the pool
//! keeps fewer such slots than its reserve; past that its pages go back to the system
//! (`MADV_DONTNEED`: the next touch reads zeros), its block is no longer asked to be a
//! huge page, and a block with no slot in use nor kept is unmapped. Kept slots are taken
//! first, then free slots of blocks still whole (resident already, in the huge page),
//! then those of blocks that gave pages back, and only then a new block: beyond the
//! chunks in use, what is resident is the reserve and the free slots of whole blocks,
//! which the next allocations fill.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use memmap2::{Advice, MmapMut, UncheckedAdvice};

/// Bytes of a slot: the cache's default chunk size.
pub const SLOT: usize = super::DEFAULT_CHUNK_SIZE as usize;
/// Bytes of a block: one transparent huge page on x86-64 and arm64 (4 KiB base pages).
const BLOCK: usize = 2 << 20;
const SLOTS: usize = BLOCK / SLOT;
const ALL: u8 = u8::MAX >> (8 - SLOTS);
const PAGE: usize = 4096;

/// Slots kept resident after their chunk is freed unless the cache asks for more
/// ([`reserve_at_least`]).
const DEFAULT_RESERVE_SLOTS: usize = 4;

struct Block {
    /// The mapping, over-sized so that a `BLOCK`-aligned `BLOCK` lies inside it (a huge
    /// page must be aligned); the pages outside that are never touched.
    map: MmapMut,
    /// Bit i: slot i is handed out.
    live: u8,
    /// Bit i: slot i is free with its pages resident (holding old bytes).
    kept: u8,
    /// The aligned address the slots start at.
    base: usize,
    /// Some of its pages were given back: no longer asked to be a huge page.
    split: bool,
}

impl Block {
    fn start(&self) -> usize {
        self.map.as_ptr() as usize
    }

    fn clean(&self) -> u8 {
        ALL & !self.live & !self.kept
    }
}

/// The slots of all blocks; the process has one ([`alloc`], [`free`]), tests their own.
pub(crate) struct Pool {
    /// By the block's aligned base address.
    blocks: BTreeMap<usize, Block>,
    /// Blocks with a kept slot; with a clean one (never touched or given back) and
    /// still whole (its clean slots are most likely resident already, in the huge page);
    /// with a clean one and split (a clean slot adds its pages when touched).
    with_kept: BTreeSet<usize>,
    with_clean_whole: BTreeSet<usize>,
    with_clean_split: BTreeSet<usize>,
    kept_slots: usize,
    reserve_slots: usize,
}

/// Where a slot's bytes start.
pub(crate) type SlotAddr = std::ptr::NonNull<u8>;

impl Pool {
    pub(crate) const fn new(reserve_slots: usize) -> Pool {
        Pool {
            blocks: BTreeMap::new(),
            with_kept: BTreeSet::new(),
            with_clean_whole: BTreeSet::new(),
            with_clean_split: BTreeSet::new(),
            kept_slots: 0,
            reserve_slots,
        }
    }

    /// A slot whose first `zeroed` bytes are zero, or None when no block can be mapped.
    pub(crate) fn alloc(&mut self, zeroed: usize) -> Option<SlotAddr> {
        debug_assert!(zeroed <= SLOT);
        let (base, bit, kept) = if let Some(&base) = self.with_kept.first() {
            (base, self.blocks[&base].kept.trailing_zeros(), true)
        } else if let Some(&base) =
            (self.with_clean_whole.first()).or_else(|| self.with_clean_split.first())
        {
            (base, self.blocks[&base].clean().trailing_zeros(), false)
        } else {
            (self.map_block()?, 0, false)
        };
        let b = self.blocks.get_mut(&base).expect("filed blocks exist");
        let mask = 1u8 << bit;
        b.live |= mask;
        b.kept &= !mask;
        let addr = base + bit as usize * SLOT;
        if kept {
            self.kept_slots -= 1;
            // SAFETY: the slot lies inside a live mapping and is now ours alone.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0, zeroed) };
        }
        self.refile(base);
        SlotAddr::new(addr as *mut u8)
    }

    /// Give back the slot at `addr`, which [`Pool::alloc`] handed out.
    pub(crate) fn free(&mut self, addr: SlotAddr) {
        let addr = addr.as_ptr() as usize;
        let base = addr & !(BLOCK - 1);
        let mask = 1u8 << ((addr - base) / SLOT);
        let Some(b) = self.blocks.get_mut(&base) else {
            debug_assert!(false, "slot {addr:#x} of no block");
            return;
        };
        debug_assert!(b.live & mask != 0, "slot {addr:#x} freed twice");
        b.live &= !mask;
        if self.kept_slots < self.reserve_slots {
            b.kept |= mask;
            self.kept_slots += 1;
        } else if b.live != 0 || b.kept != 0 {
            if !b.split {
                // Else khugepaged may make the block whole again, the given-back pages
                // included (it collapses a range with as little as one page present), and
                // a 16 MiB mount peaked 8 MiB higher.
                let _ = b
                    .map
                    .advise_range(Advice::NoHugePage, b.base - b.start(), BLOCK);
                b.split = true;
            }
            // SAFETY: the slot is free, so nothing refers to its bytes any more.
            let r = unsafe {
                b.map
                    .unchecked_advise_range(UncheckedAdvice::DontNeed, addr - b.start(), SLOT)
            };
            if r.is_err() {
                // Its old bytes are still there: keep it, over the reserve.
                b.kept |= mask;
                self.kept_slots += 1;
            }
        }
        self.refile(base);
    }

    /// Map a new block; its base address.
    fn map_block(&mut self) -> Option<usize> {
        let map = MmapMut::map_anon(2 * BLOCK - PAGE).ok()?;
        let start = map.as_ptr() as usize;
        let base = start.next_multiple_of(BLOCK);
        // Without huge pages (the kernel's setting) the block is served in base pages.
        let _ = map.advise_range(Advice::HugePage, base - start, BLOCK);
        self.blocks.insert(
            base,
            Block {
                map,
                live: 0,
                kept: 0,
                base,
                split: false,
            },
        );
        Some(base)
    }

    /// File the block at `base` under the sets its slots put it in; unmap it when it
    /// holds no slot in use and none kept.
    fn refile(&mut self, base: usize) {
        let b = &self.blocks[&base];
        if b.live == 0 && b.kept == 0 {
            self.blocks.remove(&base);
            self.with_kept.remove(&base);
            self.with_clean_whole.remove(&base);
            self.with_clean_split.remove(&base);
            return;
        }
        let (kept, clean) = (b.kept != 0, b.clean() != 0);
        for (set, want) in [
            (&mut self.with_kept, kept),
            (&mut self.with_clean_whole, clean && !b.split),
            (&mut self.with_clean_split, clean && b.split),
        ] {
            if want {
                set.insert(base);
            } else {
                set.remove(&base);
            }
        }
    }

    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        (self.blocks.len(), self.kept_slots)
    }
}

static POOL: Mutex<Pool> = Mutex::new(Pool::new(DEFAULT_RESERVE_SLOTS));

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    // The pool's state is consistent between statements that can panic.
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A slot of the process's pool whose first `zeroed` bytes are zero.
pub(crate) fn alloc(zeroed: usize) -> Option<SlotAddr> {
    pool().alloc(zeroed)
}

/// Give back a slot that [`alloc`] handed out.
pub(crate) fn free(addr: SlotAddr) {
    pool().free(addr)
}

/// Let the pool keep at least `bytes` of freed slots resident for reuse (a cache asks
/// for a share of its budget: a chunk evicted to make room is then the next one's
/// memory, with no page faults).
pub(crate) fn reserve_at_least(bytes: u64) {
    let slots = usize::try_from(bytes / SLOT as u64).unwrap_or(usize::MAX);
    let mut p = pool();
    p.reserve_slots = p.reserve_slots.max(slots);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<'a>(a: SlotAddr) -> &'a mut [u8] {
        // SAFETY: a live slot of a pool the test owns; one reference at a time.
        unsafe { std::slice::from_raw_parts_mut(a.as_ptr(), SLOT) }
    }

    #[test]
    fn slots_are_aligned_distinct_and_zeroed_when_reused() {
        let mut p = Pool::new(2);
        let slots: Vec<_> = (0..SLOTS + 3).map(|_| p.alloc(SLOT).unwrap()).collect();
        let mut addrs: Vec<_> = slots.iter().map(|a| a.as_ptr() as usize).collect();
        assert!(addrs.iter().all(|a| a % SLOT == 0));
        addrs.sort();
        addrs.dedup();
        assert_eq!(addrs.len(), SLOTS + 3);
        assert_eq!(p.counts(), (2, 0));
        for &s in &slots {
            bytes(s).fill(0xAB);
        }
        // Two kept (the reserve), the rest given back: every reuse reads zeros.
        for &s in &slots[..5] {
            p.free(s);
        }
        assert_eq!(p.counts(), (2, 2));
        for _ in 0..5 {
            let s = p.alloc(SLOT).unwrap();
            assert!(bytes(s).iter().all(|&b| b == 0));
            bytes(s).fill(0xCD);
        }
        assert_eq!(p.counts(), (2, 0));
    }

    #[test]
    fn a_reused_slot_is_zeroed_as_far_as_asked() {
        let mut p = Pool::new(1);
        let s = p.alloc(SLOT).unwrap();
        bytes(s).fill(7);
        p.free(s);
        let t = p.alloc(100).unwrap();
        assert_eq!(t, s, "the kept slot comes first");
        assert!(bytes(t)[..100].iter().all(|&b| b == 0));
    }

    #[test]
    fn empty_blocks_are_unmapped_and_the_reserve_bounds_what_is_kept() {
        let mut p = Pool::new(3);
        let slots: Vec<_> = (0..4 * SLOTS).map(|_| p.alloc(SLOT).unwrap()).collect();
        assert_eq!(p.counts(), (4, 0));
        for s in slots {
            p.free(s);
        }
        // Three slots kept, in at most three blocks; the other blocks are gone.
        let (blocks, kept) = p.counts();
        assert_eq!(kept, 3);
        assert!(blocks <= 3, "{blocks} blocks");
        let filed = p.with_clean_whole.iter().chain(&p.with_clean_split);
        assert!(filed.chain(&p.with_kept).all(|b| p.blocks.contains_key(b)));
    }
}

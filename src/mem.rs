//! Heap bytes a computation keeps: the process's allocator counts, per thread, bytes
//! allocated minus bytes freed (as malloc lays them out), so [`retained`] can tell what a call left allocated
//! (the router's tokenizer, loaded on the first route, is charged to the mount's cache
//! budget by that amount). Allocation itself is the system allocator's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator with a per-thread count of live bytes.
pub struct Counting;

thread_local! {
    // Const-initialized and without a destructor: usable inside the allocator, at
    // any point of a thread's life.
    static NET: Cell<i64> = const { Cell::new(0) };
    // The highest NET since the last `peak_above` began (tests only: the allocator's
    // path stays as short as it was in the build).
    #[cfg(test)]
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn add(delta: i64) {
    let _ = NET.try_with(|n| {
        let v = n.get().wrapping_add(delta);
        n.set(v);
        #[cfg(test)]
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

/// What an allocation really occupies: malloc's usable size plus its chunk header,
/// so many small allocations (a vocabulary's strings) are counted at their true cost.
fn footprint(p: *mut u8) -> i64 {
    // SAFETY: `p` is a live allocation of the system allocator.
    let usable = unsafe { libc::malloc_usable_size(p.cast()) };
    (usable + std::mem::size_of::<usize>()) as i64
}

// SAFETY: every call is forwarded to `System` with the caller's arguments unchanged;
// the count is a side effect that allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            add(footprint(p));
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            add(footprint(p));
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add(-footprint(ptr));
        System.dealloc(ptr, layout);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let before = footprint(ptr);
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            add(footprint(p) - before);
        }
        p
    }
}

/// Run `f` and return what it left allocated on this thread: bytes allocated minus
/// bytes freed during the call, malloc's overhead included (0 when it freed more). Allocations made by other
/// threads on `f`'s behalf are not seen.
pub fn retained<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = NET.with(Cell::get);
    let out = f();
    let after = NET.with(Cell::get);
    (out, after.saturating_sub(before).max(0) as u64)
}

/// Run `f` and return, beside its result, the most heap it held at once on this thread
/// above what was allocated when it started (its transient peak; see [`retained`]).
#[cfg(test)]
pub fn peak_above<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = NET.with(Cell::get);
    let outer = PEAK.with(|p| p.replace(before));
    let out = f();
    let peak = PEAK.with(|p| p.replace(outer.max(p.get())));
    (out, peak.saturating_sub(before).max(0) as u64)
}

/// Drop the pages of `range` of a read-only file mapping from this process; they stay in
/// the page cache, and a later access reads them again. A converted tensor's source
/// bytes are not needed any more, and left mapped they counted toward the converter's
/// RSS: 2.2 GiB of a 2.9 GiB peak converting a 2.3 GB model (docs/CODECS.md,
/// "Conversion: memory and speed"). Errors are ignored: the pages then simply stay.
pub fn release_pages(map: &memmap2::Mmap, range: std::ops::Range<usize>) {
    use nix::unistd::{sysconf, SysconfVar};
    let page = match sysconf(SysconfVar::PAGE_SIZE) {
        Ok(Some(p)) if p > 0 => p as usize,
        _ => return,
    };
    // Whole pages, the ones shared with neighbouring tensors included: those are read
    // again from the page cache if a neighbour still needs them.
    let start = range.start / page * page;
    let end = range.end.next_multiple_of(page).min(map.len());
    if start >= end {
        return;
    }
    // SAFETY: `Mmap` is a read-only shared mapping of a file: after MADV_DONTNEED its
    // pages read the file's contents again, so no byte any slice of it shows changes.
    let _ = unsafe {
        map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_a_call_keeps() {
        let (v, kept) = retained(|| {
            let scratch = vec![1u8; 1 << 20];
            drop(scratch);
            let mut keep = Vec::with_capacity(1000);
            keep.extend(0..1000u64);
            keep
        });
        // 8000 bytes asked for, in one malloc chunk (usable size + header).
        assert!((8008..8100).contains(&kept), "{kept}");
        let ((), freed) = retained(move || drop(v));
        assert_eq!(freed, 0);
    }

    /// Resident bytes of the mapping that starts at `addr` (its line in
    /// /proc/self/smaps, then its `Rss:` line).
    fn mapping_rss_kib(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{addr:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
        lines.next().expect("the mapping is listed");
        let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
        rss.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn released_pages_leave_the_process_and_read_the_same() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
        f.write_all(&bytes).unwrap();
        // SAFETY: a private temporary file nobody else writes.
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        assert_eq!(&map[..], &bytes[..]);
        let addr = map.as_ptr() as usize;
        assert!(mapping_rss_kib(addr) >= 8 << 10);
        // An unaligned range: the pages it touches go, the others stay.
        release_pages(&map, 1000..(6 << 20) + 5);
        let rss = mapping_rss_kib(addr);
        assert!(rss <= 2 << 10, "{rss} KiB still resident");
        assert_eq!(&map[..], &bytes[..]);
    }
}

//! Residency: the locked [`State`] holding the byte-budgeted LRUs of unpinned chunks,
//! the pinned chunks and the loads in flight, with lookup, insertion and eviction, and
//! the public operations that change what is resident (pin, unpin, evict, route
//! hints). Everything here runs under the one state mutex; loading happens elsewhere.

use super::flight::Flight;
use super::stats::{add, bump, Counters};
use super::{lock, CacheError, Chunk, ChunkCache, ChunkKey, Outcome};
use ::lru::LruCache;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

pub(super) struct Entry {
    pub(super) data: Arc<Chunk>,
    /// Loaded by prefetch and not yet served to a demand read.
    pub(super) prefetched: bool,
}

/// A pinned chunk: its bytes are reserved whether or not it is resident yet.
pub(super) struct PinSlot {
    count: u32,
    len: u64,
    pub(super) entry: Option<Entry>,
}

pub(super) struct State {
    pub(super) lru: LruCache<ChunkKey, Entry>,
    /// Resident unpinned chunks named by a route hint; evicted after `lru`.
    pub(super) hinted: LruCache<ChunkKey, Entry>,
    hints: HashSet<ChunkKey>,
    pub(super) unpinned_bytes: u64,
    pub(super) pinned: HashMap<ChunkKey, PinSlot>,
    pub(super) pinned_reserved: u64,
    pub(super) pinned_resident: u64,
    pub(super) inflight: HashMap<ChunkKey, Arc<Flight>>,
    /// Bytes the loads in flight count against the budget (each its chunk's length
    /// times `CacheConfig::load_work_factor`).
    pub(super) working: u64,
    /// Demand loads waiting for room for their working memory (prefetches wait behind them).
    pub(super) room_waiters: u64,
    /// Bytes held outside the cache on its budget's account ([`ChunkCache::charge`]).
    pub(super) charged: u64,
}

impl State {
    pub(super) fn new() -> Self {
        State {
            lru: LruCache::unbounded(),
            hinted: LruCache::unbounded(),
            hints: HashSet::new(),
            unpinned_bytes: 0,
            pinned: HashMap::new(),
            pinned_reserved: 0,
            pinned_resident: 0,
            inflight: HashMap::new(),
            working: 0,
            room_waiters: 0,
            charged: 0,
        }
    }

    /// Resident chunk for `key`; a demand lookup promotes it and consumes its
    /// prefetch mark.
    pub(super) fn lookup(&mut self, key: &ChunkKey, demand: bool) -> Option<(Arc<Chunk>, Outcome)> {
        if demand && self.hints.remove(key) {
            // The route's prediction came true: an ordinary chunk from now on.
            if let Some(e) = self.hinted.pop(key) {
                self.lru.push(*key, e);
            }
        }
        let entry = match self.pinned.get_mut(key) {
            Some(slot) => slot.entry.as_mut(),
            None => match self.lru.get_mut(key) {
                Some(e) => Some(e),
                None => self.hinted.get_mut(key),
            },
        }?;
        let outcome = if demand && entry.prefetched {
            entry.prefetched = false;
            Outcome::PrefetchHit
        } else {
            Outcome::Hit
        };
        Some((entry.data.clone(), outcome))
    }

    pub(super) fn is_present(&self, key: &ChunkKey) -> bool {
        self.inflight.contains_key(key)
            || self.lru.contains(key)
            || self.hinted.contains(key)
            || self.pinned.get(key).is_some_and(|s| s.entry.is_some())
    }

    /// Evict LRU unpinned chunks until `unpinned_bytes + extra` fits beside the pins
    /// and the loads in flight.
    pub(super) fn make_room(&mut self, budget: u64, extra: u64, counters: &Counters) {
        let room = budget.saturating_sub(self.reserved().saturating_add(self.working));
        while self.unpinned_bytes.saturating_add(extra) > room {
            match self.lru.pop_lru().or_else(|| self.hinted.pop_lru()) {
                Some((_, e)) => {
                    self.unpinned_bytes -= e.data.len() as u64;
                    bump(&counters.evictions);
                }
                None => break,
            }
        }
    }

    pub(super) fn insert(&mut self, key: ChunkKey, entry: Entry, budget: u64, counters: &Counters) {
        let len = entry.data.len() as u64;
        if let Some(slot) = self.pinned.get_mut(&key) {
            // Its bytes are already reserved by the pin.
            if slot.entry.is_none() {
                self.pinned_resident += len;
                slot.entry = Some(entry);
            }
            return;
        }
        if let Some(old) = self.pop_unpinned(&key) {
            self.unpinned_bytes -= old.data.len() as u64;
        }
        if len > budget.saturating_sub(self.reserved()) {
            bump(&counters.not_retained);
            return;
        }
        self.make_room(budget, len, counters);
        self.push_unpinned(key, entry);
        self.unpinned_bytes += len;
    }

    /// Bytes no unpinned chunk may use: pins' and charges'.
    pub(super) fn reserved(&self) -> u64 {
        self.pinned_reserved.saturating_add(self.charged)
    }

    /// Remove an unpinned resident chunk from whichever LRU holds it.
    fn pop_unpinned(&mut self, key: &ChunkKey) -> Option<Entry> {
        self.lru.pop(key).or_else(|| self.hinted.pop(key))
    }

    /// Put an unpinned chunk in the LRU its hint says, as most recent.
    fn push_unpinned(&mut self, key: ChunkKey, entry: Entry) {
        if self.hints.contains(&key) {
            self.hinted.push(key, entry);
        } else {
            self.lru.push(key, entry);
        }
    }
}

impl ChunkCache {
    /// Count `bytes` the caller holds for the life of the cache (`what`, for the error)
    /// against the budget, as a pin would: resident chunks make room for them. Fails,
    /// charging nothing, when pins and earlier charges leave less than that.
    pub fn charge(&self, what: &str, bytes: u64) -> Result<(), CacheError> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state);
        let budget = sh.cfg.budget_bytes;
        if st.reserved().saturating_add(bytes) > budget {
            return Err(CacheError::ChargeOverBudget {
                what: what.to_string(),
                needed: bytes,
                reserved: st.reserved(),
                budget,
            });
        }
        st.charged += bytes;
        st.make_room(budget, 0, &sh.counters);
        Ok(())
    }

    /// Set aside up to `bytes` of the budget, as [`ChunkCache::charge`] does, for memory
    /// the caller is about to hold for a moment (a load whose working memory is known
    /// only roughly): resident chunks make room first, so the load does not come on top
    /// of a full cache. Never fails: sets aside what pins and charges leave when that is
    /// less, and returns the amount, which [`ChunkCache::uncharge`] gives back.
    pub fn reserve(&self, bytes: u64) -> u64 {
        let sh = &*self.shared;
        let mut st = lock(&sh.state);
        let budget = sh.cfg.budget_bytes;
        let n = bytes.min(budget.saturating_sub(st.reserved()));
        st.charged += n;
        st.make_room(budget, 0, &sh.counters);
        n
    }

    /// Give back `bytes` charged by [`ChunkCache::charge`] or [`ChunkCache::reserve`].
    pub fn uncharge(&self, bytes: u64) {
        let sh = &*self.shared;
        {
            let mut st = lock(&sh.state);
            st.charged = st.charged.saturating_sub(bytes);
        }
        // Loads waiting for room may fit now.
        sh.room_cv.notify_all();
    }

    /// Pin chunk `key` of a file of `file_size` bytes: it is never evicted, and its
    /// bytes count against the budget from now on, resident or not (a later read or
    /// prefetch makes it resident). Pins nest. Fails if pinned bytes would exceed the
    /// budget; unpinned chunks are evicted to make room.
    pub fn pin(&self, key: ChunkKey, file_size: u64) -> Result<(), CacheError> {
        let sh = &*self.shared;
        let len = sh
            .chunk_len(file_size, key.index)
            .ok_or(CacheError::OutOfRange {
                file: key.file,
                index: key.index,
                size: file_size,
            })?;
        let mut st = lock(&sh.state);
        if let Some(slot) = st.pinned.get_mut(&key) {
            slot.count += 1;
            return Ok(());
        }
        let budget = sh.cfg.budget_bytes;
        if st.reserved().saturating_add(len) > budget {
            return Err(CacheError::PinOverBudget {
                file: key.file,
                index: key.index,
                needed: len,
                pinned: st.reserved(),
                budget,
            });
        }
        let entry = st.pop_unpinned(&key);
        if let Some(e) = &entry {
            st.unpinned_bytes -= e.data.len() as u64;
        }
        if entry.is_some() {
            st.pinned_resident += len;
        }
        st.pinned_reserved += len;
        st.pinned.insert(
            key,
            PinSlot {
                count: 1,
                len,
                entry,
            },
        );
        st.make_room(budget, 0, &sh.counters);
        Ok(())
    }

    /// Drop one pin of `key`; the last one returns a resident chunk to the LRU as most
    /// recently used.
    pub fn unpin(&self, key: ChunkKey) -> Result<(), CacheError> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state);
        let Some(slot) = st.pinned.get_mut(&key) else {
            return Err(CacheError::NotPinned {
                file: key.file,
                index: key.index,
            });
        };
        slot.count -= 1;
        if slot.count > 0 {
            return Ok(());
        }
        let slot = st.pinned.remove(&key).expect("present");
        st.pinned_reserved -= slot.len;
        if let Some(e) = slot.entry {
            st.pinned_resident -= slot.len;
            st.unpinned_bytes += e.data.len() as u64;
            st.push_unpinned(key, e);
        }
        Ok(())
    }

    /// Whether `key` is pinned.
    pub fn is_pinned(&self, key: ChunkKey) -> bool {
        lock(&self.shared.state).pinned.contains_key(&key)
    }

    /// Drop every unpinned chunk; returns the bytes freed.
    pub fn evict_all_unpinned(&self) -> u64 {
        let mut st = lock(&self.shared.state);
        let freed = st.unpinned_bytes;
        add(
            &self.shared.counters.evictions,
            (st.lru.len() + st.hinted.len()) as u64,
        );
        st.lru.clear();
        st.hinted.clear();
        st.unpinned_bytes = 0;
        freed
    }

    /// Drop these chunks if they are resident and unpinned; returns the bytes freed.
    pub fn evict(&self, keys: impl IntoIterator<Item = ChunkKey>) -> u64 {
        let mut st = lock(&self.shared.state);
        let mut freed = 0;
        for k in keys {
            if let Some(e) = st.pop_unpinned(&k) {
                let len = e.data.len() as u64;
                st.unpinned_bytes -= len;
                freed += len;
                bump(&self.shared.counters.evictions);
            }
        }
        freed
    }

    /// Replace the route hints: `keys` are the chunks a pending route will need, to be
    /// evicted after every other unpinned chunk. Ignored (returns 0) when the cache was
    /// configured for plain LRU. Returns the number of hints set.
    pub fn set_hints(&self, keys: impl IntoIterator<Item = ChunkKey>) -> usize {
        if !self.shared.cfg.router_eviction {
            return 0;
        }
        let mut st = lock(&self.shared.state);
        let new: HashSet<ChunkKey> = keys.into_iter().collect();
        // Chunks that lose their hint go back to the ordinary LRU, ...
        let old: Vec<ChunkKey> = st
            .hints
            .iter()
            .filter(|k| !new.contains(k))
            .copied()
            .collect();
        st.hints = new;
        for k in old {
            if let Some(e) = st.hinted.pop(&k) {
                st.lru.push(k, e);
            }
        }
        // ... and resident chunks that gain one move to the hinted LRU.
        let gained: Vec<ChunkKey> = st
            .hints
            .iter()
            .filter(|k| st.lru.contains(k))
            .copied()
            .collect();
        for k in gained {
            if let Some(e) = st.lru.pop(&k) {
                st.hinted.push(k, e);
            }
        }
        st.hints.len()
    }

    /// Number of chunks hinted now (resident or not).
    pub fn hint_count(&self) -> usize {
        lock(&self.shared.state).hints.len()
    }
}

#[cfg(test)]
impl State {
    /// Panics unless the byte accounting matches the entries and the budget holds: true
    /// whenever the state lock is free, so a test may check it at any moment.
    pub(super) fn assert_consistent(&self, budget: u64) {
        let unpinned: u64 = self
            .lru
            .iter()
            .chain(self.hinted.iter())
            .map(|(_, e)| e.data.len() as u64)
            .sum();
        assert_eq!(unpinned, self.unpinned_bytes, "unpinned bytes");
        let reserved: u64 = self.pinned.values().map(|s| s.len).sum();
        assert_eq!(reserved, self.pinned_reserved, "pinned reserved bytes");
        let resident: u64 = self
            .pinned
            .values()
            .filter(|s| s.entry.is_some())
            .map(|s| s.len)
            .sum();
        assert_eq!(resident, self.pinned_resident, "pinned resident bytes");
        for (k, s) in &self.pinned {
            assert!(s.count > 0, "pin slot {k:?} with no pins");
            if let Some(e) = &s.entry {
                assert_eq!(e.data.len() as u64, s.len, "pinned chunk {k:?} length");
            }
            assert!(
                !self.lru.contains(k) && !self.hinted.contains(k),
                "pinned chunk {k:?} also in an LRU"
            );
        }
        for (k, _) in self.lru.iter() {
            assert!(!self.hinted.contains(k), "chunk {k:?} in both LRUs");
            assert!(
                !self.hints.contains(k),
                "hinted chunk {k:?} in the ordinary LRU"
            );
        }
        for (k, _) in self.hinted.iter() {
            assert!(
                self.hints.contains(k),
                "unhinted chunk {k:?} in the hinted LRU"
            );
        }
        assert!(
            self.unpinned_bytes + self.reserved() <= budget,
            "{} unpinned + {} pinned + {} charged bytes over the budget of {budget}",
            self.unpinned_bytes,
            self.pinned_reserved,
            self.charged
        );
    }
}

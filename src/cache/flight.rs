//! Single-flight loading: a missing chunk is loaded once, outside the state lock, and
//! concurrent readers of the same chunk wait on its [`Flight`] instead of loading it
//! again. Separate from the LRU because this is the only code that runs loaders, and
//! the only place where panics and errors from them are contained.

use super::lru::{Entry, State};
use super::stats::{add, bump};
use super::sync::{AtomicBool, Condvar, Mutex};
use super::{io_err, lock, Chunk, ChunkKey, LoadFn, Outcome, Shared};
use crate::model::ReadError;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, PoisonError};

type FlightResult = Result<Arc<Chunk>, ReadError>;

/// One in-progress load that others may wait on.
pub(super) struct Flight {
    slot: Mutex<Option<FlightResult>>,
    cv: Condvar,
    prefetch: bool,
    /// A demand read joined this (prefetch) load; set and read under the state lock.
    demand_joined: AtomicBool,
}

impl Flight {
    fn wait(&self) -> FlightResult {
        let mut slot = lock(&self.slot);
        loop {
            if let Some(r) = slot.as_ref() {
                return match r {
                    Ok(d) => Ok(d.clone()),
                    Err(e) => Err(clone_read_error(e)),
                };
            }
            slot = self.cv.wait(slot).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn publish(&self, r: FlightResult) {
        *lock(&self.slot) = Some(r);
        self.cv.notify_all();
    }
}

/// `ReadError` is not `Clone` (it holds an `io::Error`); waiters of a failed flight get
/// an equivalent copy.
fn clone_read_error(e: &ReadError) -> ReadError {
    match e {
        ReadError::Checksum {
            tensor,
            block,
            stored,
            computed,
        } => ReadError::Checksum {
            tensor: tensor.clone(),
            block: *block,
            stored: *stored,
            computed: *computed,
        },
        ReadError::Corrupt {
            tensor,
            block,
            reason,
        } => ReadError::Corrupt {
            tensor: tensor.clone(),
            block: *block,
            reason: reason.clone(),
        },
        ReadError::OutOfRange { tensor, r0, r1 } => ReadError::OutOfRange {
            tensor: tensor.clone(),
            r0: *r0,
            r1: *r1,
        },
        ReadError::Changed(m) => ReadError::Changed(m.clone()),
        ReadError::NotRaw(m) => ReadError::NotRaw(m.clone()),
        ReadError::Io(io) => ReadError::Io(std::io::Error::new(io.kind(), io.to_string())),
    }
}

/// Counts a demand load (or a demand wait on one) for the prefetchers' back-off.
struct DemandGuard<'a>(&'a Shared);

impl<'a> DemandGuard<'a> {
    fn new(sh: &'a Shared) -> Self {
        *lock(&sh.demand_waiting) += 1;
        DemandGuard(sh)
    }
}

impl Drop for DemandGuard<'_> {
    fn drop(&mut self) {
        let mut n = lock(&self.0.demand_waiting);
        *n -= 1;
        if *n == 0 {
            self.0.demand_cv.notify_all();
        }
    }
}

/// Completes a flight with an error if the loader unwinds, so waiters never hang.
struct FlightGuard<'a> {
    shared: &'a Shared,
    key: ChunkKey,
    flight: Arc<Flight>,
    armed: bool,
    /// Bytes this load counts against the budget while it runs (`State::working`).
    work: u64,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut st = lock(&self.shared.state);
            st.inflight.remove(&self.key);
            st.working -= self.work;
            drop(st);
            self.shared.room_cv.notify_all();
            bump(&self.shared.counters.load_errors);
            self.flight.publish(Err(io_err(
                std::io::ErrorKind::Other,
                format!(
                    "loader for chunk {} of file {} panicked",
                    self.key.index, self.key.file
                ),
            )));
        }
    }
}

impl Shared {
    /// A demand read that waited for room stops waiting: prefetches held back for it
    /// may go (they wait on the same condition variable).
    fn leave_room_queue(&self, st: &mut State, was_waiting: bool) {
        if was_waiting {
            st.room_waiters -= 1;
            self.room_cv.notify_all();
        }
    }

    /// Produce chunk `key` (`len` bytes) into a fresh allocation.
    fn run_loader(&self, key: ChunkKey, len: u64, load: &LoadFn<'_>) -> FlightResult {
        let len_usize = usize::try_from(len).map_err(|_| {
            io_err(
                std::io::ErrorKind::InvalidInput,
                format!("chunk {} of file {}: {len} bytes", key.index, key.file),
            )
        })?;
        let t0 = std::time::Instant::now();
        let mut data = Chunk::zeroed(len_usize);
        let buf = &mut data[..];
        // A loader bug (a panic) fails this read with EIO instead of taking down the
        // mount's thread.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(key.index, buf)));
        // Every load, failed ones too: `count` equals the `loads` counter.
        self.load_latency
            .record(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX));
        let n = r.map_err(|_| {
            io_err(
                std::io::ErrorKind::Other,
                format!(
                    "loader for chunk {} of file {} panicked",
                    key.index, key.file
                ),
            )
        })??;
        if n != len_usize {
            return Err(io_err(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "chunk {} of file {}: loader produced {n} of {len} bytes",
                    key.index, key.file
                ),
            ));
        }
        Ok(Arc::new(data))
    }

    /// Resident chunk, or join the in-flight load, or load it (single-flight).
    pub(super) fn fetch(
        &self,
        key: ChunkKey,
        len: u64,
        load: &LoadFn<'_>,
        demand: bool,
    ) -> Result<(Arc<Chunk>, Outcome), ReadError> {
        let work = len.saturating_mul(self.cfg.load_work_factor);
        let flight = {
            let mut st = lock(&self.state);
            let mut waited = false;
            loop {
                if let Some(found) = st.lookup(&key, demand) {
                    self.leave_room_queue(&mut st, waited && demand);
                    return Ok(found);
                }
                if let Some(f) = st.inflight.get(&key) {
                    if demand {
                        f.demand_joined.store(true, Relaxed);
                    }
                    let f = f.clone();
                    self.leave_room_queue(&mut st, waited && demand);
                    drop(st);
                    let _g = demand.then(|| DemandGuard::new(self));
                    return f.wait().map(|d| (d, Outcome::Coalesced));
                }
                // Admission: a load starts only when its working memory fits beside
                // the pins, charges and loads already running; otherwise it waits for
                // one of them to finish. One load always runs, so this never waits for
                // ever, and a prefetch also yields to demand loads waiting for room.
                let fits = st.working == 0
                    || st
                        .reserved()
                        .saturating_add(st.working)
                        .saturating_add(work)
                        <= self.cfg.budget_bytes;
                if fits && (demand || st.room_waiters == 0) {
                    self.leave_room_queue(&mut st, waited && demand);
                    break;
                }
                if !waited {
                    waited = true;
                    st.room_waiters += u64::from(demand);
                    bump(&self.counters.room_waits);
                }
                st = self
                    .room_cv
                    .wait(st)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            let f = Arc::new(Flight {
                slot: Mutex::new(None),
                cv: Condvar::new(),
                prefetch: !demand,
                demand_joined: AtomicBool::new(false),
            });
            st.inflight.insert(key, f.clone());
            // The load's buffers count against the budget while it runs: resident
            // chunks make room for them now, so memory stays within the budget however
            // many loads run at once (as long as pins leave room).
            st.working += work;
            st.make_room(self.cfg.budget_bytes, 0, &self.counters);
            f
        };
        let _g = demand.then(|| DemandGuard::new(self));
        let mut guard = FlightGuard {
            shared: self,
            key,
            flight: flight.clone(),
            armed: true,
            work,
        };
        bump(&self.counters.loads);
        let result = self.run_loader(key, len, load);
        guard.armed = false;
        {
            let mut st = lock(&self.state);
            st.inflight.remove(&key);
            st.working -= work;
            match &result {
                Ok(data) => {
                    add(&self.counters.bytes_loaded, data.len() as u64);
                    let prefetched = flight.prefetch && !flight.demand_joined.load(Relaxed);
                    let entry = Entry {
                        data: data.clone(),
                        prefetched,
                    };
                    st.insert(key, entry, self.cfg.budget_bytes, &self.counters);
                }
                Err(_) => bump(&self.counters.load_errors),
            }
        }
        self.room_cv.notify_all();
        let fstate = result.is_ok().then(|| self.file_state(key.file));
        if let (Ok(data), Some(f)) = (&result, &fstate) {
            if let Some(p) = f.experts.get() {
                let start = key.index * self.cfg.chunk_size;
                p.loaded(start..start + data.len() as u64);
            }
        }
        let shared_result = match &result {
            Ok(d) => Ok(d.clone()),
            Err(e) => Err(clone_read_error(e)),
        };
        flight.publish(shared_result);
        // After the waiters have it, while its bytes are still in this core's caches.
        if let (Ok(data), Some(keep)) = (&result, fstate.as_ref().and_then(|f| f.keeper.get())) {
            keep(key.index, data);
        }
        result.map(|d| (d, Outcome::Loaded))
    }
}

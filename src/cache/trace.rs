//! Read trace: an opt-in, bounded, in-order record of demand chunk lookups, for
//! replaying and comparing access patterns. Separate because it is a side channel:
//! nothing on the read path depends on it beyond one relaxed flag check.

use super::sync::{AtomicBool, Mutex};
use super::{lock, ChunkCache, Outcome, TRACE_CAP};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// How a traced demand chunk lookup was satisfied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceOutcome {
    Hit,
    PrefetchHit,
    /// Loaded (or joined a load in flight) for this read.
    Miss,
}

impl TraceOutcome {
    /// The outcome's name in a trace reply (docs/CONTROL.md).
    pub fn name(self) -> &'static str {
        match self {
            TraceOutcome::Hit => "hit",
            TraceOutcome::PrefetchHit => "prefetch_hit",
            TraceOutcome::Miss => "miss",
        }
    }
}

/// One traced chunk lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    pub file: u32,
    pub index: u64,
    /// Microseconds since the trace started.
    pub t_us: u64,
    pub outcome: TraceOutcome,
}

/// The trace of one cache: `on` is checked without the lock on every lookup.
#[derive(Default)]
pub(super) struct Trace {
    on: AtomicBool,
    inner: Mutex<TraceBuf>,
}

#[derive(Default)]
struct TraceBuf {
    start: Option<Instant>,
    events: Vec<TraceEvent>,
    dropped: u64,
}

impl ChunkCache {
    /// Start (or restart, clearing) the read trace.
    pub fn trace_start(&self) {
        let t = &self.shared.trace;
        let mut b = lock(&t.inner);
        *b = TraceBuf {
            start: Some(Instant::now()),
            ..TraceBuf::default()
        };
        t.on.store(true, Relaxed);
    }

    /// Stop the trace; returns its events in order and how many did not fit.
    pub fn trace_stop(&self) -> (Vec<TraceEvent>, u64) {
        let t = &self.shared.trace;
        let mut b = lock(&t.inner);
        t.on.store(false, Relaxed);
        let b = std::mem::take(&mut *b);
        (b.events, b.dropped)
    }

    /// Whether a trace is running.
    pub fn tracing(&self) -> bool {
        self.shared.trace.on.load(Relaxed)
    }

    /// Record one demand lookup if a trace is running.
    pub(super) fn trace(&self, file: u32, index: u64, outcome: Outcome) {
        let t = &self.shared.trace;
        if !t.on.load(Relaxed) {
            return;
        }
        let mut b = lock(&t.inner);
        let Some(start) = b.start else { return };
        if b.events.len() >= TRACE_CAP {
            b.dropped += 1;
            return;
        }
        let outcome = match outcome {
            Outcome::Hit => TraceOutcome::Hit,
            Outcome::PrefetchHit => TraceOutcome::PrefetchHit,
            Outcome::Loaded | Outcome::Coalesced => TraceOutcome::Miss,
        };
        let t_us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        b.events.push(TraceEvent {
            file,
            index,
            t_us,
            outcome,
        });
    }
}

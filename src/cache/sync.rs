//! The cache's synchronization primitives and threads, in one place so that the
//! `shuttle` feature can swap them: std's normally, shuttle's under the feature, where
//! the schedule-exploring tests (`shuttle_tests.rs`) then control every lock, wait,
//! atomic and thread of the cache. Statistics counters (`stats.rs`) stay std atomics:
//! they never decide anything, and as scheduling points they would only slow the search.
//!
//! With the feature on, the cache works only inside a shuttle test (`shuttle::check_*`):
//! the feature is for `cargo test --features shuttle --lib cache::`, never for a build.

#[cfg(not(feature = "shuttle"))]
pub(super) use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64},
        Condvar, Mutex, MutexGuard, RwLock,
    },
    thread,
};

#[cfg(feature = "shuttle")]
pub(super) use shuttle::{
    sync::{
        atomic::{AtomicBool, AtomicU64},
        Condvar, Mutex, MutexGuard, RwLock,
    },
    thread,
};

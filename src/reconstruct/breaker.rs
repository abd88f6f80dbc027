//! A circuit breaker for a GPU that keeps failing: after [`STREAK`] failed batches in a
//! row the GPU rests (every batch goes straight to the CPU) for a while, then one batch
//! tries it again. A failed try rests it twice as long (up to [`MAX_REST`]); a batch
//! that succeeds closes the breaker. Without it a dead GPU (lost device, a context
//! spoiled by an earlier fault) costs every read a failed copy-in or launch first.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Failed batches in a row that make the GPU rest.
pub const STREAK: u32 = 8;
/// The first rest; each failed try after a rest doubles it.
pub const FIRST_REST: Duration = Duration::from_secs(1);
pub const MAX_REST: Duration = Duration::from_secs(60);

/// Times are nanoseconds on the caller's clock (a process-wide `Instant` in use, a
/// plain counter in tests).
#[derive(Debug)]
pub struct Breaker {
    streak: AtomicU32,
    /// Rests in a row without a successful batch between them.
    trips: AtomicU32,
    /// The GPU is not tried before this time.
    rest_until: AtomicU64,
    /// Rests begun, ever (`cawsfs stat`).
    rests: AtomicU64,
}

impl Breaker {
    pub const fn new() -> Breaker {
        Breaker {
            streak: AtomicU32::new(0),
            trips: AtomicU32::new(0),
            rest_until: AtomicU64::new(0),
            rests: AtomicU64::new(0),
        }
    }

    /// Whether a batch at `now` may try the GPU.
    pub fn allows(&self, now: u64) -> bool {
        now >= self.rest_until.load(Ordering::Acquire)
    }

    pub fn success(&self) {
        // Loads first: the common path writes nothing shared.
        if self.streak.load(Ordering::Relaxed) != 0 {
            self.streak.store(0, Ordering::Relaxed);
        }
        if self.trips.load(Ordering::Relaxed) != 0 {
            self.trips.store(0, Ordering::Relaxed);
        }
    }

    /// Records a failed batch at `now`; returns the rest it begins, if it begins one.
    pub fn failure(&self, now: u64) -> Option<Duration> {
        let streak = self.streak.fetch_add(1, Ordering::Relaxed) + 1;
        // A try after a rest that fails rests again at once.
        let retry = self.trips.load(Ordering::Relaxed) > 0;
        if streak < STREAK && !retry {
            return None;
        }
        self.streak.store(0, Ordering::Relaxed);
        let trips = self.trips.fetch_add(1, Ordering::Relaxed);
        let rest = FIRST_REST
            .saturating_mul(1u32 << trips.min(16))
            .min(MAX_REST);
        self.rest_until.store(
            now.saturating_add(rest.as_nanos() as u64),
            Ordering::Release,
        );
        self.rests.fetch_add(1, Ordering::Relaxed);
        Some(rest)
    }

    pub fn rests(&self) -> u64 {
        self.rests.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn rests_after_a_streak_and_doubles_while_tries_fail() {
        let b = Breaker::new();
        for _ in 0..STREAK - 1 {
            assert!(b.allows(0));
            assert_eq!(b.failure(0), None);
        }
        assert_eq!(b.failure(0), Some(Duration::from_secs(1)));
        assert!(!b.allows(S - 1));
        assert!(b.allows(S));
        // The try after the rest fails: a rest twice as long, at once.
        assert_eq!(b.failure(S), Some(Duration::from_secs(2)));
        assert!(!b.allows(3 * S - 1) && b.allows(3 * S));
        let mut now = 3 * S;
        let mut last = Duration::ZERO;
        for _ in 0..10 {
            last = b.failure(now).expect("every failed try rests");
            now += last.as_nanos() as u64;
        }
        assert_eq!(last, MAX_REST);
        assert_eq!(b.rests(), 12);
    }

    #[test]
    fn a_success_closes_it_and_resets_the_streak() {
        let b = Breaker::new();
        for _ in 0..STREAK - 1 {
            b.failure(0);
        }
        b.success();
        for _ in 0..STREAK - 1 {
            assert_eq!(b.failure(0), None, "the streak started again");
        }
        assert!(b.failure(0).is_some());
        assert!(b.allows(S));
        b.success();
        // Back to a full streak before the next rest, and a first rest again.
        for _ in 0..STREAK - 1 {
            assert_eq!(b.failure(S), None);
        }
        assert_eq!(b.failure(S), Some(FIRST_REST));
        assert_eq!(b.rests(), 2);
    }
}

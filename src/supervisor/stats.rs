//! The synchronous `Stats` snapshot and the metrics the actor publishes.

use std::sync::atomic::{AtomicU64, Ordering};

use super::core::Figures;
use crate::metric_names;
/// A cheap snapshot of a supervisor's counters.
///
/// Every count is in slots (a k-slot lease counts k), but `waiting` (callers) and `leases`. Each
/// broker release is counted once per slot, as its own answer comes. So, whenever no grant and
/// no release is in flight (nobody gathering slots, no broker call unanswered):
///
/// ```text
/// acquired_total == released_total + release_failed_total + active + quarantined
/// held_slots     == active + quarantined
/// ```
///
/// Fields are read independently (each is exact, the set is one picture only between the
/// supervisor's turns); once an awaited call on the supervisor has answered, they include its
/// effect.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Slots held and not quarantined: running, draining, or whose release is in flight.
    pub active: usize,
    /// Callers waiting for a slot (a multi-slot request gathering its slots among them).
    pub waiting: usize,
    /// Slots the broker granted to this supervisor, ever (a k-slot lease counts k). A grant
    /// whose caller had left before it was handed over counts too: its slot went straight
    /// back, and counts in `released_total` (or `release_failed_total`) once the broker
    /// answers. A slot handed back and granted again within one turn of the supervisor counts
    /// once. `render_slot.acquire.count` counts exactly this.
    pub acquired_total: u64,
    /// Slots whose broker release succeeded, ever.
    pub released_total: u64,
    /// Slots whose broker release failed or timed out, ever.
    pub release_failed_total: u64,
    /// Leases a distributed broker saw expire while orphaned, ever.
    pub orphan_expired_total: u64,
    /// Slots held in quarantine now.
    pub quarantined: usize,
    /// Of `active`, the slots of jobs whose body has ended and whose physical end (tracked
    /// tasks, processes, GPU work) or temp dir removal is still being proven.
    pub draining: usize,
    /// Slots held from the broker now: `active + quarantined`, and those a multi-slot waiter
    /// has gathered so far.
    pub held_slots: usize,
    /// How many slots the supervisor grants up to (the broker's capacity capped by the GPU
    /// sub-slots, as changed by [`Supervisor::resize`](crate::Supervisor::resize)); `None` when
    /// the broker does not say. After a resize lowered it, `held_slots` may exceed it until
    /// leases return; no slot is granted while it does.
    pub capacity: Option<usize>,
    /// Leases held now, in any phase (a k-slot lease counts once).
    pub leases: usize,
}

/// Atomics the actor publishes into after each message; `Supervisor::stats` reads them.
#[derive(Debug, Default)]
pub(crate) struct SharedStats {
    active: AtomicU64,
    waiting: AtomicU64,
    acquired_total: AtomicU64,
    released_total: AtomicU64,
    release_failed_total: AtomicU64,
    orphan_expired_total: AtomicU64,
    quarantined: AtomicU64,
    draining: AtomicU64,
    held_slots: AtomicU64,
    /// The capacity as [`encode_capacity`] stores it (an atomic holds no `Option`).
    capacity: AtomicU64,
    leases: AtomicU64,
    /// Supervision events the actor received (tests: a worker sends none).
    #[cfg(test)]
    pub(crate) supervision_events: AtomicU64,
    /// What the shell keeps per caller and per lease (waiters, explicit leases, running jobs,
    /// renewals), as of the last publication (tests: nothing is left once all have ended).
    #[cfg(test)]
    pub(crate) shell_entries: AtomicU64,
}

/// What the actor last stored into [`SharedStats`] (owned by the actor, their only writer), so
/// that unchanged figures are not written again after every message and before every reply.
#[derive(Debug, Default)]
pub(crate) struct Published {
    stored: Option<Figures>,
}

impl SharedStats {
    /// Stores the table's figures. Called before every reply, so that a caller who has just
    /// been answered reads figures that already include what it was answered about. Nothing is
    /// written when they equal what was last stored (the atomics still hold exactly that: the
    /// actor is their only writer).
    // Relaxed: each field is a standalone figure; the reply's channel orders it for the caller.
    pub(crate) fn publish(&self, now: Figures, last: &mut Published) {
        if last.stored == Some(now) {
            return;
        }
        let c = now.counters;
        let set = |cell: &AtomicU64, v: u64| cell.store(v, Ordering::Relaxed);
        set(&self.active, now.active as u64);
        set(&self.waiting, now.waiting as u64);
        set(&self.acquired_total, c.acquired_total);
        set(&self.released_total, c.released_total);
        set(&self.release_failed_total, c.release_failed_total);
        set(&self.orphan_expired_total, c.orphan_expired_total);
        set(&self.quarantined, now.quarantined as u64);
        set(&self.draining, now.draining as u64);
        set(&self.held_slots, now.held_slots as u64);
        set(
            &self.capacity,
            encode_capacity(now.capacity.map(|c| c as u64)),
        );
        set(&self.leases, now.leases as u64);
        last.stored = Some(now);
    }

    /// The capacity at start, before the actor's first publication.
    pub(crate) fn set_capacity(&self, capacity: Option<u32>) {
        self.capacity
            .store(encode_capacity(capacity.map(u64::from)), Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let get = |cell: &AtomicU64| cell.load(Ordering::Relaxed);
        Stats {
            active: get(&self.active) as usize,
            waiting: get(&self.waiting) as usize,
            acquired_total: get(&self.acquired_total),
            released_total: get(&self.released_total),
            release_failed_total: get(&self.release_failed_total),
            orphan_expired_total: get(&self.orphan_expired_total),
            quarantined: get(&self.quarantined) as usize,
            draining: get(&self.draining) as usize,
            held_slots: get(&self.held_slots) as usize,
            capacity: decode_capacity(get(&self.capacity)),
            leases: get(&self.leases) as usize,
        }
    }
}

/// The supervisor's metrics, registered once when it starts (so install a recorder before
/// `start()`): a handle costs one call per update, where the macros would build and hash a key
/// every time.
pub(crate) struct Metrics {
    acquire_count: metrics::Counter,
    /// `Stats::acquired_total` as last added to `acquire_count` (the highest published: a grant
    /// handed back in the same turn and granted again counts once).
    acquired_counted: u64,
    pub(crate) acquire_ms: metrics::Histogram,
    release_count: metrics::Counter,
    pub(crate) release_ms: metrics::Histogram,
    release_failed: metrics::Counter,
    /// `Stats::released_total` and `release_failed_total` as last added to the release
    /// counters, which so count exactly what `Stats` does.
    released_counted: (u64, u64),
    /// The supervisor's own pool, released in the core's step with no time passing: each of
    /// its releases is recorded here, as 0 ms (another broker's, where the shell timed it).
    pool: bool,
    pub(crate) orphan_expired: metrics::Counter,
    pub(crate) held_too_long: metrics::Counter,
    active: metrics::Gauge,
    waiting: metrics::Gauge,
    quarantined: metrics::Gauge,
}

impl Metrics {
    pub(crate) fn register(pool: bool) -> Self {
        Self {
            acquire_count: metrics::counter!(metric_names::ACQUIRE_COUNT),
            acquired_counted: 0,
            acquire_ms: metrics::histogram!(metric_names::ACQUIRE_DURATION_MS),
            release_count: metrics::counter!(metric_names::RELEASE_COUNT),
            release_ms: metrics::histogram!(metric_names::RELEASE_DURATION_MS),
            release_failed: metrics::counter!(metric_names::RELEASE_FAILED_COUNT),
            released_counted: (0, 0),
            pool,
            orphan_expired: metrics::counter!(metric_names::ORPHAN_EXPIRED_COUNT),
            held_too_long: metrics::counter!(metric_names::HELD_TOO_LONG_COUNT),
            active: metrics::gauge!(metric_names::ACTIVE_COUNT),
            waiting: metrics::gauge!(metric_names::WAITING_COUNT),
            quarantined: metrics::gauge!(metric_names::QUARANTINED_COUNT),
        }
    }

    /// Sets the gauges of DESIGN.md section 5 and adds the slots granted since the last call to
    /// `render_slot.acquire.count`, which so counts exactly what `Stats::acquired_total` does
    /// (once per batch of messages, and before an answer that leaves within one). The gauges
    /// are set every time, even unchanged: a recorder may drain gauges when it reads them
    /// (metrics-util's `DebuggingRecorder` does), and must then see them again.
    pub(crate) fn publish(&mut self, figures: &Figures) {
        let acquired = figures.counters.acquired_total;
        if acquired > self.acquired_counted {
            self.acquire_count
                .increment(acquired - self.acquired_counted);
            self.acquired_counted = acquired;
        }
        let c = &figures.counters;
        let (ok, failed) = self.released_counted;
        if (c.released_total, c.release_failed_total) != (ok, failed) {
            let new_failed = c.release_failed_total - failed;
            let released = c.released_total - ok + new_failed;
            self.release_count.increment(released);
            self.release_failed.increment(new_failed);
            if self.pool {
                self.release_ms.record_many(0.0, released as usize);
            }
            self.released_counted = (c.released_total, c.release_failed_total);
        }
        self.active.set(figures.active as f64);
        self.waiting.set(figures.waiting as f64);
        self.quarantined.set(figures.quarantined as f64);
    }
}

/// An optional capacity in one atomic word: a capacity counts slots (a `u32` at most), so the
/// word one above the largest capacity stands for "unknown" and no capacity can be read as it.
fn encode_capacity(capacity: Option<u64>) -> u64 {
    capacity.map_or(UNKNOWN_CAPACITY, |c| c.min(u64::from(u32::MAX)))
}

fn decode_capacity(word: u64) -> Option<usize> {
    (word != UNKNOWN_CAPACITY).then_some(word as usize)
}

/// The word that stands for an unknown capacity (see [`encode_capacity`]).
const UNKNOWN_CAPACITY: u64 = u32::MAX as u64 + 1;

#[cfg(test)]
mod tests {
    use super::{decode_capacity, encode_capacity};

    #[test]
    fn a_capacity_goes_through_its_atomic_word_unchanged_and_unknown_stays_unknown() {
        for capacity in [None, Some(0), Some(1), Some(8), Some(u64::from(u32::MAX))] {
            assert_eq!(
                decode_capacity(encode_capacity(capacity)),
                capacity.map(|c| c as usize)
            );
        }
        // Past the largest capacity a broker can state (a u32): the largest, never "unknown".
        assert_eq!(
            decode_capacity(encode_capacity(Some(u64::MAX))),
            Some(u32::MAX as usize)
        );
    }
}

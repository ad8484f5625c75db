//! The pure lease state machine: no tokio, no ractor, no I/O.
//!
//! The supervisor actor is a thin shell around [`LeaseTable`]: it turns messages into calls
//! here and performs the effects (broker calls, temp dir removal, replies) the table asks for.
//! The model-based test drives this module directly.
//!
//! A slot's life: `Free → Granted → Draining → Releasing → Free`, or `Draining → Quarantined`
//! when physical completion cannot be proven in its bound, and `Quarantined → Releasing` when it
//! is proven later. `Free` is the absence of a record. Every edge is in [`step`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

use crate::broker::SlotToken;

/// Supervisor-internal key of one lease (not the broker's lease id).
pub(crate) type LeaseKey = u64;
/// Supervisor-internal id of one waiting acquire.
pub(crate) type WaiterId = u64;

/// Where a held slot is in the release pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Held by a body or an explicit lease.
    Granted,
    /// The body ended; waiting for proof of physical exit, then the temp dir's removal.
    Draining,
    /// Physically done; the broker release is in flight.
    Releasing,
    /// Physical completion not proven: held, not reusable, reported.
    Quarantined,
}

/// How a broker release ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReleaseOutcome {
    Ok,
    Failed,
    TimedOut,
}

/// The events that move a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Edge {
    /// A token was handed out.
    Grant,
    /// The worker ended (its supervision event, or its join handle, whichever came first).
    BodyEnded,
    /// An explicit lease (or a token nobody waits for) is given back; nothing to drain.
    ReleaseRequested,
    /// Physical exit proven and the temp dir removed.
    Drained,
    /// Physical exit or scratch removal could not be proven in its bound.
    Unconfirmed,
    /// The broker release ended (whatever its outcome, the lease is over).
    Released(ReleaseOutcome),
}

/// An edge that does not exist from the current phase. Always a bug; the shell logs it and
/// changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IllegalTransition {
    pub(crate) from: Option<Phase>,
    pub(crate) edge: Edge,
}

impl fmt::Display for IllegalTransition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "illegal lease transition {:?} from {:?}",
            self.edge, self.from
        )
    }
}

/// The one place where lease phases change. `None` is `Free`.
pub(crate) fn step(from: Option<Phase>, edge: Edge) -> Result<Option<Phase>, IllegalTransition> {
    use Phase::*;
    match (from, edge) {
        (None, Edge::Grant) => Ok(Some(Granted)),
        (Some(Granted), Edge::BodyEnded) => Ok(Some(Draining)),
        (Some(Granted), Edge::ReleaseRequested) => Ok(Some(Releasing)),
        (Some(Draining), Edge::Drained) => Ok(Some(Releasing)),
        (Some(Draining), Edge::Unconfirmed) => Ok(Some(Quarantined)),
        (Some(Quarantined), Edge::Drained) => Ok(Some(Releasing)),
        (Some(Releasing), Edge::Released(_)) => Ok(None),
        (from, edge) => Err(IllegalTransition { from, edge }),
    }
}

/// Who holds a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseKind {
    /// A `run` job: a worker actor, tracked tasks, a temp dir.
    Job,
    /// An explicit `Lease` held by user code.
    Explicit,
    /// A token that arrived when nobody was waiting any more: released at once.
    Surplus,
}

#[derive(Debug, Clone)]
pub(crate) struct LeaseRecord {
    pub(crate) token: SlotToken,
    pub(crate) phase: Phase,
    pub(crate) kind: LeaseKind,
    /// The worker's task has ended and every tracked task has returned.
    pub(crate) exited: bool,
    /// The worker's supervision event was handled (any state in it dropped).
    pub(crate) event_seen: bool,
    /// Temp dir removal has been started (it is started once).
    pub(crate) scratch_started: bool,
}

/// Why a broker's token was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TokenRefused {
    SlotHeld { token: SlotToken, holder: SlotToken },
    LeaseIdLive { token: SlotToken, holder: SlotToken },
}

impl fmt::Display for TokenRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SlotHeld { token, holder } => {
                write!(
                    f,
                    "broker granted {token} but that slot is held by live {holder}"
                )
            }
            Self::LeaseIdLive { token, holder } => {
                write!(
                    f,
                    "broker granted {token} but that lease id is live as {holder}"
                )
            }
        }
    }
}

/// Monotonic counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) acquired_total: u64,
    pub(crate) released_total: u64,
    pub(crate) release_failed_total: u64,
    pub(crate) orphan_expired_total: u64,
}

/// The slot table, the FIFO waiter queue and the counters.
#[derive(Debug)]
pub(crate) struct LeaseTable {
    capacity: Option<usize>,
    leases: HashMap<LeaseKey, LeaseRecord>,
    /// Slot id (widened) → the newest lease on it.
    by_slot: HashMap<u64, LeaseKey>,
    by_lease_id: HashMap<u64, LeaseKey>,
    /// FIFO of waiter ids; ids no longer in `waiting` are skipped when popped (lazy deletion
    /// keeps cancel O(1)).
    queue: VecDeque<WaiterId>,
    waiting: HashSet<WaiterId>,
    /// Broker acquires in flight.
    pending: usize,
    quarantined: usize,
    next_key: LeaseKey,
    stopping: bool,
    counters: Counters,
}

impl LeaseTable {
    pub(crate) fn new(capacity: Option<u32>) -> Self {
        Self {
            capacity: capacity.map(|c| c as usize),
            leases: HashMap::new(),
            by_slot: HashMap::new(),
            by_lease_id: HashMap::new(),
            queue: VecDeque::new(),
            waiting: HashSet::new(),
            pending: 0,
            quarantined: 0,
            next_key: 1,
            stopping: false,
            counters: Counters::default(),
        }
    }

    /// Adds a waiter at the back of the queue. Refused once stopping.
    pub(crate) fn enqueue(&mut self, waiter: WaiterId) -> bool {
        if self.stopping {
            return false;
        }
        if self.waiting.insert(waiter) {
            self.queue.push_back(waiter);
        }
        true
    }

    /// Removes a waiter; `true` when it was still waiting.
    pub(crate) fn cancel_waiter(&mut self, waiter: WaiterId) -> bool {
        let removed = self.waiting.remove(&waiter);
        // Cancelled ids stay in the queue until popped; compact when they dominate, so that a
        // long-lived head waiter with many cancelled waiters behind it cannot grow the queue
        // without bound (amortised O(1) per cancel).
        if self.queue.len() > 2 * self.waiting.len() + 16 {
            let waiting = &self.waiting;
            self.queue.retain(|w| waiting.contains(w));
        }
        removed
    }

    /// The longest-waiting live waiter, without removing it.
    pub(crate) fn head(&mut self) -> Option<WaiterId> {
        while let Some(&w) = self.queue.front() {
            if self.waiting.contains(&w) {
                return Some(w);
            }
            self.queue.pop_front();
        }
        None
    }

    /// Pops the longest-waiting live waiter.
    pub(crate) fn pop_waiter(&mut self) -> Option<WaiterId> {
        while let Some(w) = self.queue.pop_front() {
            if self.waiting.remove(&w) {
                return Some(w);
            }
        }
        None
    }

    /// How many new broker acquires to start now (already counted as pending): one per waiter
    /// not yet covered by a request, never more than the known capacity allows.
    pub(crate) fn requests_to_issue(&mut self) -> usize {
        let uncovered = self.waiting.len().saturating_sub(self.pending);
        let room = match self.capacity {
            Some(cap) => cap.saturating_sub(self.leases.len() + self.pending),
            None => usize::MAX,
        };
        let n = uncovered.min(room);
        self.pending += n;
        n
    }

    /// A broker acquire ended with a token: checks it against every live lease.
    ///
    /// A lease whose broker release is in flight does not conflict: the broker may apply the
    /// release and grant the slot again before the release's answer reaches the supervisor (a
    /// remote broker, or one shared by several supervisors). Refusing such a token would leak
    /// it, since a refused token is never released.
    pub(crate) fn token_arrived(&mut self, token: SlotToken) -> Result<(), TokenRefused> {
        self.pending -= 1;
        let conflict = |index: &HashMap<_, LeaseKey>, id| {
            index
                .get(&id)
                .map(|k| &self.leases[k])
                .filter(|r| r.phase != Phase::Releasing)
                .map(|r| r.token)
        };
        if let Some(holder) = conflict(&self.by_slot, u64::from(token.slot_id())) {
            return Err(TokenRefused::SlotHeld { token, holder });
        }
        if let Some(holder) = conflict(&self.by_lease_id, token.lease_id()) {
            return Err(TokenRefused::LeaseIdLive { token, holder });
        }
        Ok(())
    }

    /// A broker acquire ended with an error.
    pub(crate) fn request_failed(&mut self) {
        self.pending -= 1;
    }

    /// Records a grant of a token that passed [`token_arrived`](Self::token_arrived).
    pub(crate) fn grant(&mut self, token: SlotToken, kind: LeaseKind) -> LeaseKey {
        let key = self.next_key;
        self.next_key += 1;
        let phase = step(None, Edge::Grant).expect("Free -> Granted exists");
        let record = LeaseRecord {
            token,
            phase: phase.expect("granted"),
            kind,
            exited: false,
            event_seen: false,
            scratch_started: false,
        };
        self.by_slot.insert(u64::from(token.slot_id()), key);
        self.by_lease_id.insert(token.lease_id(), key);
        self.leases.insert(key, record);
        self.counters.acquired_total += 1;
        key
    }

    /// Moves a lease along `edge`, keeping the indexes and counters in step.
    pub(crate) fn apply(
        &mut self,
        key: LeaseKey,
        edge: Edge,
    ) -> Result<Option<Phase>, IllegalTransition> {
        let record = self.leases.get_mut(&key);
        let from = record.as_ref().map(|r| r.phase);
        let to = step(from, edge)?;
        if from == Some(Phase::Quarantined) {
            self.quarantined -= 1;
        }
        match to {
            Some(phase) => {
                if phase == Phase::Quarantined {
                    self.quarantined += 1;
                }
                record.expect("checked by step").phase = phase;
            }
            None => {
                let record = self.leases.remove(&key).expect("checked by step");
                // A newer lease may already hold the slot (see `token_arrived`).
                let slot = u64::from(record.token.slot_id());
                if self.by_slot.get(&slot) == Some(&key) {
                    self.by_slot.remove(&slot);
                }
                if self.by_lease_id.get(&record.token.lease_id()) == Some(&key) {
                    self.by_lease_id.remove(&record.token.lease_id());
                }
                match edge {
                    Edge::Released(ReleaseOutcome::Ok) => self.counters.released_total += 1,
                    _ => self.counters.release_failed_total += 1,
                }
            }
        }
        Ok(to)
    }

    /// Records one proof of a worker's physical end (`exited`: its task and tracked tasks are
    /// done; otherwise: its supervision event was handled). Returns `true` exactly once, when both
    /// proofs are in: the shell may then remove the temp dir.
    pub(crate) fn note_worker_end(&mut self, key: LeaseKey, exited: bool) -> bool {
        let Some(record) = self.leases.get_mut(&key) else {
            return false;
        };
        if exited {
            record.exited = true;
        } else {
            record.event_seen = true;
        }
        if record.phase == Phase::Granted {
            // Either proof means the body has ended.
            let _ = self.apply(key, Edge::BodyEnded);
        }
        let record = self.leases.get_mut(&key).expect("present");
        if record.exited && record.event_seen && !record.scratch_started {
            record.scratch_started = true;
            true
        } else {
            false
        }
    }

    /// Gives back the capacity of the queue and the indexes once they are mostly empty (after a
    /// flood drains). Amortised O(1): a structure is rebuilt only when at most a quarter full.
    pub(crate) fn shrink_idle(&mut self) {
        const FLOOR: usize = 64;
        let cap = self.queue.capacity();
        if cap > FLOOR && self.queue.len() <= cap / 4 {
            self.queue.shrink_to((self.queue.len() * 2).max(FLOOR));
        }
        let cap = self.waiting.capacity();
        if cap > FLOOR && self.waiting.len() <= cap / 4 {
            self.waiting.shrink_to((self.waiting.len() * 2).max(FLOOR));
        }
        shrink_map(&mut self.leases, FLOOR);
        shrink_map(&mut self.by_slot, FLOOR);
        shrink_map(&mut self.by_lease_id, FLOOR);
    }

    /// Starts stopping: no new waiter; returns every waiter still queued, in FIFO order.
    pub(crate) fn begin_stop(&mut self) -> Vec<WaiterId> {
        self.stopping = true;
        let mut out = Vec::with_capacity(self.waiting.len());
        while let Some(w) = self.pop_waiter() {
            out.push(w);
        }
        out
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping
    }

    pub(crate) fn get(&self, key: LeaseKey) -> Option<&LeaseRecord> {
        self.leases.get(&key)
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = (LeaseKey, &LeaseRecord)> {
        self.leases.iter().map(|(k, r)| (*k, r))
    }

    /// Leases held and not quarantined (granted, draining or releasing).
    pub(crate) fn active(&self) -> usize {
        self.leases.len() - self.quarantined
    }

    pub(crate) fn quarantined(&self) -> usize {
        self.quarantined
    }

    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub(crate) fn pending(&self) -> usize {
        self.pending
    }

    /// A distributed broker saw an orphaned lease expire.
    pub(crate) fn note_orphan_expired(&mut self) {
        self.counters.orphan_expired_total += 1;
    }

    pub(crate) fn counters(&self) -> Counters {
        self.counters
    }
}

/// Gives back most of a map's capacity once it is at most a quarter full (see
/// [`LeaseTable::shrink_idle`]).
pub(crate) fn shrink_map<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(
    map: &mut HashMap<K, V, S>,
    floor: usize,
) {
    let cap = map.capacity();
    if cap > floor && map.len() <= cap / 4 {
        map.shrink_to((map.len() * 2).max(floor));
    }
}

#[cfg(test)]
#[path = "state_model_tests.rs"]
mod model_tests;

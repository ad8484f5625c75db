//! Model-based tests of the pure lease state machine.
//!
//! A [`Harness`] drives a [`LeaseTable`] exactly the way the supervisor actor shell does
//! (`pump`, `on_acquired`, `on_release_request`, `start_release`, `finish_release`,
//! `on_scratch_removed`, `on_drain_timeout`, `begin_shutdown`, `maybe_finish_shutdown` in
//! `actor.rs`), against a model broker, and checks the invariants of DESIGN.md section 3 after
//! every operation. Random sequences come from proptest; a few hand-written sequences pin the
//! scenarios that matter most.
//!
//! Modelling choices:
//! - The model broker frees a slot when the shell hears the release's answer, whatever its
//!   outcome (a failed or timed-out release is the broker's problem from then on).
//! - The shell only applies edges it believes legal, so every `apply` the harness makes must
//!   succeed; an `Err` is an invariant failure (section 3 does not allow one on a used edge).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

use super::*;

type TestResult<T = ()> = Result<T, TestCaseError>;

/// Every legal edge, as documented: `(from, edge, to)`. `None` is `Free`.
const DOCUMENTED_EDGES: &[(Option<Phase>, Edge, Option<Phase>)] = &[
    (None, Edge::Grant, Some(Phase::Granted)),
    (Some(Phase::Granted), Edge::BodyEnded, Some(Phase::Draining)),
    (
        Some(Phase::Granted),
        Edge::ReleaseRequested,
        Some(Phase::Releasing),
    ),
    (Some(Phase::Draining), Edge::Drained, Some(Phase::Releasing)),
    (
        Some(Phase::Draining),
        Edge::Unconfirmed,
        Some(Phase::Quarantined),
    ),
    (
        Some(Phase::Quarantined),
        Edge::Drained,
        Some(Phase::Releasing),
    ),
    (
        Some(Phase::Releasing),
        Edge::Released(ReleaseOutcome::Ok),
        None,
    ),
    (
        Some(Phase::Releasing),
        Edge::Released(ReleaseOutcome::Failed),
        None,
    ),
    (
        Some(Phase::Releasing),
        Edge::Released(ReleaseOutcome::TimedOut),
        None,
    ),
];

const ALL_FROM: [Option<Phase>; 5] = [
    None,
    Some(Phase::Granted),
    Some(Phase::Draining),
    Some(Phase::Releasing),
    Some(Phase::Quarantined),
];

const ALL_EDGES: [Edge; 8] = [
    Edge::Grant,
    Edge::BodyEnded,
    Edge::ReleaseRequested,
    Edge::Drained,
    Edge::Unconfirmed,
    Edge::Released(ReleaseOutcome::Ok),
    Edge::Released(ReleaseOutcome::Failed),
    Edge::Released(ReleaseOutcome::TimedOut),
];

/// Where `edge` leads from `from` according to the documentation; `None` when it is illegal.
fn documented(from: Option<Phase>, edge: Edge) -> Option<Option<Phase>> {
    DOCUMENTED_EDGES
        .iter()
        .find(|(f, e, _)| *f == from && *e == edge)
        .map(|(_, _, to)| *to)
}

macro_rules! coverage {
    ($($field:ident),* $(,)?) => {
        /// How often each notable event happened in a run (to show the generator reaches them).
        #[derive(Debug, Default, Clone, Copy)]
        struct Coverage {
            $($field: u64,)*
        }

        impl Coverage {
            fn merge(&mut self, other: &Self) {
                $(self.$field += other.$field;)*
            }

            fn missing(&self) -> Vec<&'static str> {
                let mut missing = Vec::new();
                $(if self.$field == 0 {
                    missing.push(stringify!($field));
                })*
                missing
            }
        }
    };
}

coverage!(
    enqueued_explicit,
    enqueued_job,
    refused_at_enqueue,
    cancelled_waiting,
    cancelled_after_served,
    granted_explicit,
    granted_job,
    skipped_gone_caller,
    delivery_failed,
    surplus_token,
    broker_error,
    refused_slot_held,
    refused_lease_id_live,
    exit_proof_first,
    event_proof_first,
    scratch_removed_ok,
    scratch_removal_failed,
    drain_timed_out,
    quarantined_then_drained,
    release_ok,
    release_failed,
    release_timed_out,
    explicit_release_requested,
    repeated_release_request,
    shutdown_began,
    shutdown_finished,
);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WaiterKindModel {
    Lease,
    Job,
}

/// What the shell finds when a token reaches a waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Caller {
    /// Still there: the lease is delivered, or the job starts.
    Present,
    /// Gone before the grant (reply closed, or the job's cancel token fired): skipped.
    Gone,
    /// Granted, then released at once: an explicit lease whose caller left between the check
    /// and the send, or a job whose temp dir or worker could not be made.
    FailsAtDelivery,
}

#[derive(Debug, Clone, Copy)]
struct ModelWaiter {
    kind: WaiterKindModel,
    caller: Caller,
}

/// How every acquire ended (invariant 6: none is left hanging).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    RefusedAtEnqueue,
    Cancelled,
    Skipped,
    Failed,
    Granted,
    DeliveryFailed,
    Stopped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scratch {
    NotStarted,
    InFlight,
    Removed,
    Failed,
}

#[derive(Debug, Clone)]
struct ModelLease {
    token: SlotToken,
    kind: LeaseKind,
    /// The model's phase; `None` once freed.
    phase: Option<Phase>,
    /// A worker was spawned for it (a job lease that started).
    worker: bool,
    exited: bool,
    event_seen: bool,
    drain_timed_out: bool,
    scratch: Scratch,
    released: Option<ReleaseOutcome>,
}

/// The broker as the test sees it.
#[derive(Debug)]
struct ModelBroker {
    slots: u32,
    free: BTreeSet<u32>,
    last_lease_id: u64,
    /// Acquire requests the broker still owes an answer to.
    outstanding: usize,
    /// Fresh tokens handed out, in order.
    granted: Vec<SlotToken>,
    /// Duplicate tokens sent on purpose (the table must refuse them).
    refused: Vec<SlotToken>,
    /// Broker releases the shell issued, per token.
    releases: HashMap<SlotToken, u32>,
}

impl ModelBroker {
    fn next_lease_id(&mut self) -> u64 {
        self.last_lease_id += 1;
        self.last_lease_id
    }
}

#[derive(Debug, Clone, Copy)]
struct Setup {
    /// What the table is told (`None`: the broker does not say).
    known_capacity: Option<u32>,
    /// What the broker really has.
    broker_slots: u32,
    /// The broker answers an acquire on the first poll when it has a free slot.
    inline_broker: bool,
    /// The broker answers a release (with Ok) on the first poll.
    inline_release: bool,
    /// Where a shutdown is inserted in the operation sequence.
    shutdown_at: Option<usize>,
}

impl Setup {
    fn known(slots: u32) -> Self {
        Self {
            known_capacity: Some(slots),
            broker_slots: slots,
            inline_broker: false,
            inline_release: false,
            shutdown_at: None,
        }
    }
}

/// One operation. `usize` fields pick among the current candidates (modulo their number); an
/// operation without a candidate does nothing.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// A caller acquires (a `run` job, or an explicit lease).
    Acquire { job: bool },
    /// A cancel message for some waiter id ever issued (it may have been served already).
    Cancel(usize),
    /// A waiting caller goes away without a cancel message having arrived (yet).
    CallerGone(usize),
    /// A waiting caller will not take its grant (left at the send, or its job cannot start).
    DeliveryWillFail(usize),
    /// The broker answers a request with a fresh token for a free slot.
    BrokerToken(usize),
    /// The broker answers a request with an error.
    BrokerError,
    /// The broker answers a request with a token for a slot a live lease holds.
    BrokerTokenForHeldSlot(usize),
    /// The broker answers a request with a token reusing a live lease id.
    BrokerTokenWithLiveLeaseId(usize),
    /// One proof of a worker's end: its join (`exited`) or its supervision event.
    WorkerEnd { lease: usize, exited: bool },
    /// The drain bound passed with tracked tasks still running.
    DrainTimeout(usize),
    /// The temp dir removal ended.
    ScratchRemoved { lease: usize, ok: bool },
    /// A broker release in flight ended.
    BrokerReleased {
        release: usize,
        outcome: ReleaseOutcome,
    },
    /// An explicit lease is released or dropped (any explicit lease ever granted: a second
    /// request on one already releasing or freed is a double release).
    LeaseDropped(usize),
    /// `shutdown` (`begin_stop`).
    Shutdown,
}

fn pick<T: Copy>(items: impl IntoIterator<Item = T>, p: usize) -> Option<T> {
    let items: Vec<T> = items.into_iter().collect();
    if items.is_empty() {
        None
    } else {
        Some(items[p % items.len()])
    }
}

/// The shell around the table, plus the model it is checked against.
struct Harness {
    table: LeaseTable,
    known_capacity: Option<usize>,
    broker: ModelBroker,
    inline_broker: bool,
    inline_release: bool,
    next_waiter: WaiterId,
    /// Waiters the shell holds (its `waiters` map); ids grow with enqueue order, so the map's
    /// order is the FIFO order.
    waiters: BTreeMap<WaiterId, ModelWaiter>,
    ended: BTreeMap<WaiterId, Ended>,
    /// Waiters granted with their caller present, in grant order.
    grant_order: Vec<WaiterId>,
    /// Every lease ever granted.
    leases: BTreeMap<LeaseKey, ModelLease>,
    by_token: HashMap<SlotToken, LeaseKey>,
    releases_in_flight: Vec<LeaseKey>,
    scratch_in_flight: Vec<LeaseKey>,
    stopping: bool,
    /// The actor has stopped (shutdown finished): no message is handled any more.
    stopped: bool,
    coverage: Coverage,
}

impl Harness {
    fn new(setup: Setup) -> Self {
        Self {
            table: LeaseTable::new(setup.known_capacity),
            known_capacity: setup.known_capacity.map(|c| c as usize),
            broker: ModelBroker {
                slots: setup.broker_slots,
                free: (0..setup.broker_slots).collect(),
                last_lease_id: 0,
                outstanding: 0,
                granted: Vec::new(),
                refused: Vec::new(),
                releases: HashMap::new(),
            },
            inline_broker: setup.inline_broker,
            inline_release: setup.inline_release,
            next_waiter: 1,
            waiters: BTreeMap::new(),
            ended: BTreeMap::new(),
            grant_order: Vec::new(),
            leases: BTreeMap::new(),
            by_token: HashMap::new(),
            releases_in_flight: Vec::new(),
            scratch_in_flight: Vec::new(),
            stopping: false,
            stopped: false,
            coverage: Coverage::default(),
        }
    }

    fn lease(&self, key: LeaseKey) -> &ModelLease {
        &self.leases[&key]
    }

    fn lease_mut(&mut self, key: LeaseKey) -> &mut ModelLease {
        self.leases
            .get_mut(&key)
            .expect("a lease the model granted")
    }

    fn live_count(&self) -> usize {
        self.leases.values().filter(|l| l.phase.is_some()).count()
    }

    /// Live leases a duplicate token must be refused against: all but those whose broker
    /// release is in flight (a broker may re-grant a slot once it has applied the release, before
    /// its answer reaches the supervisor; see `LeaseTable::token_arrived`).
    fn conflicting_keys(&self) -> Vec<LeaseKey> {
        self.leases
            .iter()
            .filter(|(_, l)| l.phase.is_some_and(|p| p != Phase::Releasing))
            .map(|(k, _)| *k)
            .collect()
    }

    /// Live job leases that ran a worker and pass `filter`.
    fn running_jobs(&self, filter: impl Fn(&ModelLease) -> bool) -> Vec<LeaseKey> {
        self.leases
            .iter()
            .filter(|(_, l)| l.kind == LeaseKind::Job && l.worker && l.phase.is_some() && filter(l))
            .map(|(k, _)| *k)
            .collect()
    }

    // ----- operations -------------------------------------------------------------------

    /// One message to the shell, then its `settle`, then every invariant.
    fn apply_op(&mut self, op: Op) -> TestResult {
        if self.stopped {
            return Ok(());
        }
        match op {
            Op::Acquire { job } => self.on_acquire(job)?,
            Op::Cancel(p) => {
                if let Some(id) = pick(1..self.next_waiter, p) {
                    self.on_cancel(id)?;
                }
            }
            Op::CallerGone(p) => {
                if let Some(id) = pick(self.waiters.keys().copied(), p) {
                    self.waiters.get_mut(&id).expect("listed").caller = Caller::Gone;
                }
            }
            Op::DeliveryWillFail(p) => {
                if let Some(id) = pick(self.waiters.keys().copied(), p) {
                    self.waiters.get_mut(&id).expect("listed").caller = Caller::FailsAtDelivery;
                }
            }
            Op::BrokerToken(p) => {
                if self.broker.outstanding > 0
                    && let Some(slot) = pick(self.broker.free.iter().copied(), p)
                {
                    let token = self.fresh_token(slot);
                    self.on_acquired(Ok(token), None)?;
                }
            }
            Op::BrokerError => {
                if self.broker.outstanding > 0 {
                    self.broker.outstanding -= 1;
                    self.coverage.broker_error += 1;
                    self.on_acquired(Err(()), None)?;
                }
            }
            Op::BrokerTokenForHeldSlot(p) => {
                if self.broker.outstanding > 0
                    && let Some(key) = pick(self.conflicting_keys(), p)
                {
                    self.broker.outstanding -= 1;
                    let holder = self.lease(key).token;
                    let lease_id = self.broker.next_lease_id();
                    let token = SlotToken::new(holder.slot_id(), lease_id);
                    self.broker.refused.push(token);
                    self.coverage.refused_slot_held += 1;
                    self.on_acquired(Ok(token), Some(TokenRefused::SlotHeld { token, holder }))?;
                }
            }
            Op::BrokerTokenWithLiveLeaseId(p) => {
                if self.broker.outstanding > 0
                    && let Some(key) = pick(self.conflicting_keys(), p)
                {
                    self.broker.outstanding -= 1;
                    let holder = self.lease(key).token;
                    // A slot no live lease holds: a free one, or one the broker does not have.
                    let slot =
                        pick(self.broker.free.iter().copied(), p).unwrap_or(self.broker.slots + 7);
                    let token = SlotToken::new(slot, holder.lease_id());
                    self.broker.refused.push(token);
                    self.coverage.refused_lease_id_live += 1;
                    self.on_acquired(Ok(token), Some(TokenRefused::LeaseIdLive { token, holder }))?;
                }
            }
            Op::WorkerEnd { lease, exited } => {
                let candidates =
                    self.running_jobs(|l| if exited { !l.exited } else { !l.event_seen });
                if let Some(key) = pick(candidates, lease) {
                    self.on_worker_end(key, exited)?;
                }
            }
            Op::DrainTimeout(p) => {
                let candidates = self.running_jobs(|l| !l.exited && !l.drain_timed_out);
                if let Some(key) = pick(candidates, p) {
                    self.on_drain_timeout(key)?;
                }
            }
            Op::ScratchRemoved { lease, ok } => {
                if !self.scratch_in_flight.is_empty() {
                    let i = lease % self.scratch_in_flight.len();
                    let key = self.scratch_in_flight.swap_remove(i);
                    self.on_scratch_removed(key, ok)?;
                }
            }
            Op::BrokerReleased { release, outcome } => {
                if !self.releases_in_flight.is_empty() {
                    let i = release % self.releases_in_flight.len();
                    let key = self.releases_in_flight.swap_remove(i);
                    self.finish_release(key, outcome)?;
                }
            }
            Op::LeaseDropped(p) => {
                let explicit = self
                    .leases
                    .iter()
                    .filter(|(_, l)| l.kind == LeaseKind::Explicit)
                    .map(|(k, _)| *k);
                if let Some(key) = pick(explicit.collect::<Vec<_>>(), p) {
                    self.on_release_request(key)?;
                }
            }
            Op::Shutdown => self.begin_shutdown()?,
        }
        self.settle()?;
        self.check()
    }

    fn fresh_token(&mut self, slot: u32) -> SlotToken {
        self.broker.outstanding -= 1;
        self.broker.free.remove(&slot);
        let token = SlotToken::new(slot, self.broker.next_lease_id());
        self.broker.granted.push(token);
        token
    }

    fn on_acquire(&mut self, job: bool) -> TestResult {
        let id = self.next_waiter;
        self.next_waiter += 1;
        let accepted = self.table.enqueue(id);
        prop_assert_eq!(
            accepted,
            !self.stopping,
            "enqueue is refused exactly once stopping"
        );
        if accepted {
            let kind = if job {
                self.coverage.enqueued_job += 1;
                WaiterKindModel::Job
            } else {
                self.coverage.enqueued_explicit += 1;
                WaiterKindModel::Lease
            };
            self.waiters.insert(
                id,
                ModelWaiter {
                    kind,
                    caller: Caller::Present,
                },
            );
        } else {
            self.coverage.refused_at_enqueue += 1;
            self.ended.insert(id, Ended::RefusedAtEnqueue);
        }
        Ok(())
    }

    fn on_cancel(&mut self, id: WaiterId) -> TestResult {
        let was_waiting = self.waiters.contains_key(&id);
        let removed = self.table.cancel_waiter(id);
        prop_assert_eq!(
            removed,
            was_waiting,
            "cancel_waiter({}) must say whether it still waited",
            id
        );
        if removed {
            self.waiters.remove(&id);
            self.ended.insert(id, Ended::Cancelled);
            self.coverage.cancelled_waiting += 1;
        } else {
            self.coverage.cancelled_after_served += 1;
        }
        Ok(())
    }

    /// The shell's `pop_live_waiter`, checked against the FIFO order.
    fn pop_live_waiter(&mut self) -> TestResult<Option<(WaiterId, ModelWaiter)>> {
        let expected = self.waiters.keys().next().copied();
        let popped = self.table.pop_waiter();
        prop_assert_eq!(
            popped,
            expected,
            "FIFO: the longest-waiting live waiter is served first"
        );
        Ok(popped.map(|id| (id, self.waiters.remove(&id).expect("checked"))))
    }

    /// The shell's `on_acquired`. `refusal` is what the table must answer to a duplicate token.
    fn on_acquired(
        &mut self,
        result: Result<SlotToken, ()>,
        refusal: Option<TokenRefused>,
    ) -> TestResult {
        let token = match result {
            Ok(token) => token,
            Err(()) => {
                self.table.request_failed();
                if let Some((id, _)) = self.pop_live_waiter()? {
                    self.ended.insert(id, Ended::Failed);
                }
                return Ok(());
            }
        };
        let before = (
            self.table.counters(),
            self.table.active(),
            self.table.quarantined(),
        );
        match (self.table.token_arrived(token), refusal) {
            (Ok(()), None) => {}
            (Err(got), Some(want)) => {
                prop_assert_eq!(got, want);
                let after = (
                    self.table.counters(),
                    self.table.active(),
                    self.table.quarantined(),
                );
                prop_assert_eq!(before, after, "a refused token grants nothing");
                if let Some((id, _)) = self.pop_live_waiter()? {
                    self.ended.insert(id, Ended::Failed);
                }
                return Ok(());
            }
            (got, want) => {
                return Err(TestCaseError::fail(format!(
                    "token {token}: the table answered {got:?}, expected refusal {want:?}"
                )));
            }
        }
        loop {
            let Some((id, waiter)) = self.pop_live_waiter()? else {
                // Nobody waits any more: the token goes straight back, exactly once.
                self.coverage.surplus_token += 1;
                let key = self.grant(token, LeaseKind::Surplus)?;
                self.apply_edge(key, Edge::ReleaseRequested)?;
                return self.start_release(key);
            };
            let kind = match waiter.kind {
                WaiterKindModel::Lease => LeaseKind::Explicit,
                WaiterKindModel::Job => LeaseKind::Job,
            };
            match waiter.caller {
                Caller::Gone => {
                    self.coverage.skipped_gone_caller += 1;
                    self.ended.insert(id, Ended::Skipped);
                    continue;
                }
                Caller::Present => {
                    let key = self.grant(token, kind)?;
                    self.ended.insert(id, Ended::Granted);
                    self.grant_order.push(id);
                    if kind == LeaseKind::Job {
                        self.coverage.granted_job += 1;
                        self.lease_mut(key).worker = true;
                    } else {
                        self.coverage.granted_explicit += 1;
                    }
                    return Ok(());
                }
                Caller::FailsAtDelivery => {
                    self.coverage.delivery_failed += 1;
                    let key = self.grant(token, kind)?;
                    self.ended.insert(id, Ended::DeliveryFailed);
                    self.apply_edge(key, Edge::ReleaseRequested)?;
                    return self.start_release(key);
                }
            }
        }
    }

    fn grant(&mut self, token: SlotToken, kind: LeaseKind) -> TestResult<LeaseKey> {
        prop_assert!(
            self.broker.granted.contains(&token),
            "only a fresh broker token is granted"
        );
        let key = self.table.grant(token, kind);
        prop_assert!(!self.leases.contains_key(&key), "lease key {} reused", key);
        prop_assert!(
            self.by_token.insert(token, key).is_none(),
            "token {} granted twice",
            token
        );
        self.leases.insert(
            key,
            ModelLease {
                token,
                kind,
                phase: Some(Phase::Granted),
                worker: false,
                exited: false,
                event_seen: false,
                drain_timed_out: false,
                scratch: Scratch::NotStarted,
                released: None,
            },
        );
        Ok(key)
    }

    /// The shell's `apply`: the shell only applies edges it believes legal, so an error is a
    /// failure here (invariant f).
    fn apply_edge(&mut self, key: LeaseKey, edge: Edge) -> TestResult {
        let from = self.lease(key).phase;
        let Some(to) = documented(from, edge) else {
            return Err(TestCaseError::fail(format!(
                "the harness applied the undocumented edge {edge:?} from {from:?}"
            )));
        };
        let got = self.table.apply(key, edge);
        prop_assert_eq!(got, Ok(to), "apply({}, {:?}) from {:?}", key, edge, from);
        if from == Some(Phase::Quarantined) && to == Some(Phase::Releasing) {
            self.coverage.quarantined_then_drained += 1;
        }
        let lease = self.lease_mut(key);
        lease.phase = to;
        if let Edge::Released(outcome) = edge {
            lease.released = Some(outcome);
            let slot = lease.token.slot_id();
            prop_assert!(
                self.broker.free.insert(slot),
                "slot {} freed twice at the broker",
                slot
            );
        }
        Ok(())
    }

    /// The shell's `start_release`: one broker release, checked against invariants (c) and (d).
    fn start_release(&mut self, key: LeaseKey) -> TestResult {
        prop_assert_eq!(self.table.get(key).map(|r| r.phase), Some(Phase::Releasing));
        let lease = self.lease(key).clone();
        if lease.kind == LeaseKind::Job && lease.worker {
            prop_assert!(
                lease.exited && lease.event_seen && lease.scratch == Scratch::Removed,
                "release after drain: job lease {} released before both exit proofs and the temp dir's removal: {:?}",
                key,
                lease
            );
        }
        prop_assert!(
            self.broker.granted.contains(&lease.token),
            "a broker release for a token that was never granted: {}",
            lease.token
        );
        let n = self.broker.releases.entry(lease.token).or_insert(0);
        *n += 1;
        prop_assert_eq!(*n, 1, "a second broker release for {}", lease.token);
        if self.inline_release {
            self.finish_release(key, ReleaseOutcome::Ok)
        } else {
            self.releases_in_flight.push(key);
            Ok(())
        }
    }

    /// The shell's `finish_release`.
    fn finish_release(&mut self, key: LeaseKey, outcome: ReleaseOutcome) -> TestResult {
        prop_assert!(
            self.table.get(key).is_some(),
            "a release answer for a lease the table lost"
        );
        match outcome {
            ReleaseOutcome::Ok => self.coverage.release_ok += 1,
            ReleaseOutcome::Failed => self.coverage.release_failed += 1,
            ReleaseOutcome::TimedOut => self.coverage.release_timed_out += 1,
        }
        self.apply_edge(key, Edge::Released(outcome))
    }

    /// The shell's `on_release_request` (an explicit lease's `release` or drop).
    fn on_release_request(&mut self, key: LeaseKey) -> TestResult {
        let Some(record) = self.table.get(key) else {
            prop_assert_eq!(self.lease(key).phase, None, "the table lost a live lease");
            self.coverage.repeated_release_request += 1;
            return Ok(());
        };
        match (record.phase, record.kind) {
            (Phase::Granted, LeaseKind::Explicit) => {
                self.coverage.explicit_release_requested += 1;
                self.apply_edge(key, Edge::ReleaseRequested)?;
                self.start_release(key)
            }
            (Phase::Releasing, LeaseKind::Explicit) => {
                // The reply waits for the release already in flight.
                self.coverage.repeated_release_request += 1;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// `WorkerExited` (`exited`) or the worker's supervision event, then `remove_scratch`.
    fn on_worker_end(&mut self, key: LeaseKey, exited: bool) -> TestResult {
        let lease = self.lease(key).clone();
        if !lease.exited && !lease.event_seen {
            if exited {
                self.coverage.exit_proof_first += 1;
            } else {
                self.coverage.event_proof_first += 1;
            }
        }
        let now_exited = lease.exited || exited;
        let now_event = lease.event_seen || !exited;
        let want = now_exited && now_event && lease.scratch == Scratch::NotStarted;
        let got = self.table.note_worker_end(key, exited);
        prop_assert_eq!(
            got,
            want,
            "note_worker_end({}, exited={}) on {:?}",
            key,
            exited,
            lease
        );
        let to = if lease.phase == Some(Phase::Granted) {
            documented(lease.phase, Edge::BodyEnded).expect("Granted -> Draining")
        } else {
            lease.phase
        };
        let lease = self.lease_mut(key);
        lease.exited = now_exited;
        lease.event_seen = now_event;
        lease.phase = to;
        if got {
            // `remove_scratch`: the job has a temp dir.
            prop_assert!(lease.worker);
            lease.scratch = Scratch::InFlight;
            self.scratch_in_flight.push(key);
        }
        Ok(())
    }

    /// The shell's `on_drain_timeout`.
    fn on_drain_timeout(&mut self, key: LeaseKey) -> TestResult {
        self.lease_mut(key).drain_timed_out = true;
        let Some(record) = self.table.get(key) else {
            return Ok(());
        };
        self.coverage.drain_timed_out += 1;
        if record.phase == Phase::Granted {
            self.apply_edge(key, Edge::BodyEnded)?;
        }
        if self.table.get(key).map(|r| r.phase) == Some(Phase::Draining) {
            self.apply_edge(key, Edge::Unconfirmed)?;
        }
        Ok(())
    }

    /// The shell's `on_scratch_removed`.
    fn on_scratch_removed(&mut self, key: LeaseKey, ok: bool) -> TestResult {
        let Some(record) = self.table.get(key) else {
            return Err(TestCaseError::fail(
                "scratch removal ended for a lease the table lost",
            ));
        };
        let phase = record.phase;
        if ok {
            self.coverage.scratch_removed_ok += 1;
            self.lease_mut(key).scratch = Scratch::Removed;
            self.apply_edge(key, Edge::Drained)?;
            self.start_release(key)
        } else {
            self.coverage.scratch_removal_failed += 1;
            self.lease_mut(key).scratch = Scratch::Failed;
            if phase == Phase::Draining {
                self.apply_edge(key, Edge::Unconfirmed)?;
            }
            Ok(())
        }
    }

    /// The shell's `begin_shutdown`.
    fn begin_shutdown(&mut self) -> TestResult {
        if self.table.is_stopping() {
            return Ok(());
        }
        self.coverage.shutdown_began += 1;
        self.stopping = true;
        let expected: Vec<WaiterId> = self.waiters.keys().copied().collect();
        let refused = self.table.begin_stop();
        prop_assert_eq!(
            &refused,
            &expected,
            "begin_stop returns every waiter, in FIFO order"
        );
        for id in refused {
            self.waiters.remove(&id);
            self.ended.insert(id, Ended::Stopped);
        }
        let mut held: Vec<_> = self
            .table
            .keys()
            .map(|(k, r)| (k, r.phase, r.kind))
            .collect();
        held.sort_by_key(|(k, _, _)| *k);
        for (key, phase, kind) in held {
            // Granted jobs are cancelled: their worker ends later (a `WorkerEnd` operation).
            if (phase, kind) == (Phase::Granted, LeaseKind::Explicit) {
                self.apply_edge(key, Edge::ReleaseRequested)?;
                self.start_release(key)?;
            }
        }
        Ok(())
    }

    /// The shell's `settle`: `pump`, then `maybe_finish_shutdown`.
    fn settle(&mut self) -> TestResult {
        self.pump()?;
        if self.table.is_stopping() && self.table.pending() == 0 && self.table.active() == 0 {
            self.stopped = true;
            self.coverage.shutdown_finished += 1;
        }
        Ok(())
    }

    /// The shell's `pump`, with the request count checked against the model.
    fn pump(&mut self) -> TestResult {
        loop {
            let uncovered = self.waiters.len().saturating_sub(self.broker.outstanding);
            let room = match self.known_capacity {
                Some(cap) => cap.saturating_sub(self.live_count() + self.broker.outstanding),
                None => usize::MAX,
            };
            let n = self.table.requests_to_issue();
            prop_assert_eq!(n, uncovered.min(room), "requests_to_issue");
            if n == 0 {
                return Ok(());
            }
            self.broker.outstanding += n;
            for _ in 0..n {
                // The shell reads the head to name the job in the request.
                let head = self.table.head();
                prop_assert_eq!(head, self.waiters.keys().next().copied(), "head");
            }
            if !self.inline_broker {
                return Ok(());
            }
            let mut ready = Vec::new();
            for _ in 0..n {
                if let Some(&slot) = self.broker.free.first() {
                    ready.push(self.fresh_token(slot));
                }
            }
            if ready.is_empty() {
                return Ok(());
            }
            for token in ready {
                self.on_acquired(Ok(token), None)?;
            }
        }
    }

    // ----- invariants -------------------------------------------------------------------

    /// Every invariant that holds after every message.
    fn check(&mut self) -> TestResult {
        // The table's leases are the model's live leases, phase by phase.
        let mut table_view: Vec<(LeaseKey, SlotToken, Phase, LeaseKind)> = self
            .table
            .keys()
            .map(|(k, r)| (k, r.token, r.phase, r.kind))
            .collect();
        table_view.sort_by_key(|v| v.0);
        let model_view: Vec<(LeaseKey, SlotToken, Phase, LeaseKind)> = self
            .leases
            .iter()
            .filter_map(|(k, l)| l.phase.map(|p| (*k, l.token, p, l.kind)))
            .collect();
        prop_assert_eq!(&table_view, &model_view, "the table's leases");
        let held = model_view.len();

        // (a) Capacity.
        prop_assert_eq!(
            self.table.active() + self.table.quarantined(),
            held,
            "active + quarantined"
        );
        if let Some(cap) = self.known_capacity {
            prop_assert!(
                held <= cap,
                "capacity: {} leases held, capacity {}",
                held,
                cap
            );
        }
        prop_assert!(
            held <= self.broker.slots as usize,
            "more leases than the broker has slots"
        );
        prop_assert_eq!(
            self.broker.free.len() + held,
            self.broker.slots as usize,
            "every broker slot is free or held by exactly one live lease"
        );
        let quarantined = model_view
            .iter()
            .filter(|v| v.2 == Phase::Quarantined)
            .count();
        prop_assert_eq!(self.table.quarantined(), quarantined, "quarantined");

        // (b) No double grant.
        let slots: BTreeSet<u32> = model_view.iter().map(|v| v.1.slot_id()).collect();
        let lease_ids: BTreeSet<u64> = model_view.iter().map(|v| v.1.lease_id()).collect();
        prop_assert_eq!(
            slots.len(),
            held,
            "two live leases share a slot: {:?}",
            model_view
        );
        prop_assert_eq!(
            lease_ids.len(),
            held,
            "two live leases share a lease id: {:?}",
            model_view
        );

        // (c) Release only after drain, for every job lease that ran a worker.
        for (key, lease) in &self.leases {
            if lease.kind == LeaseKind::Job
                && lease.worker
                && matches!(lease.phase, None | Some(Phase::Releasing))
            {
                prop_assert!(
                    lease.exited && lease.event_seen && lease.scratch == Scratch::Removed,
                    "job lease {} releasing before it drained: {:?}",
                    key,
                    lease
                );
            }
        }

        // (d) Exactly one broker release per granted token, none for anything else.
        for token in &self.broker.granted {
            let released = self.broker.releases.get(token).copied().unwrap_or(0);
            let expected = match self.by_token.get(token).map(|k| self.leases[k].phase) {
                // Granted by the broker, not yet answered to the table.
                None => 0,
                Some(None | Some(Phase::Releasing)) => 1,
                Some(Some(_)) => 0,
            };
            prop_assert_eq!(released, expected, "broker releases of {}", token);
        }
        for token in self.broker.releases.keys() {
            prop_assert!(
                self.by_token.contains_key(token),
                "released a token never granted: {}",
                token
            );
        }
        for token in &self.broker.refused {
            prop_assert!(
                !self.broker.releases.contains_key(token),
                "released a refused token {}",
                token
            );
            prop_assert!(
                !self.by_token.contains_key(token),
                "granted a refused token {}",
                token
            );
        }

        // Counters and conservation (e), at every step and not only at quiescence.
        let c = self.table.counters();
        let ok = self
            .leases
            .values()
            .filter(|l| l.released == Some(ReleaseOutcome::Ok))
            .count() as u64;
        let failed = self
            .leases
            .values()
            .filter(|l| {
                matches!(
                    l.released,
                    Some(ReleaseOutcome::Failed | ReleaseOutcome::TimedOut)
                )
            })
            .count() as u64;
        prop_assert_eq!(c.acquired_total, self.leases.len() as u64, "acquired_total");
        prop_assert_eq!(c.released_total, ok, "released_total");
        prop_assert_eq!(c.release_failed_total, failed, "release_failed_total");
        prop_assert_eq!(
            c.acquired_total,
            c.released_total + c.release_failed_total + held as u64,
            "conservation: acquired == released + failed + held"
        );
        if self.table.pending() == 0 && held == 0 {
            prop_assert_eq!(c.acquired_total, c.released_total + c.release_failed_total);
        }

        // Queue and requests.
        prop_assert_eq!(self.table.waiting(), self.waiters.len(), "waiting");
        prop_assert_eq!(self.table.pending(), self.broker.outstanding, "pending");
        prop_assert_eq!(self.table.is_stopping(), self.stopping, "stopping");
        if self.stopping {
            prop_assert_eq!(self.table.waiting(), 0, "nothing waits once stopping");
        }
        // No hang: every waiter is covered by a request, unless the known capacity is all used.
        if self.table.waiting() > self.table.pending() {
            let cap = self.known_capacity;
            prop_assert!(
                cap.is_some_and(|cap| held + self.table.pending() >= cap),
                "{} waiters, {} requests pending, {} held, capacity {:?}",
                self.table.waiting(),
                self.table.pending(),
                held,
                cap
            );
        }

        // FIFO among waiters that stayed.
        prop_assert!(
            self.grant_order.windows(2).all(|w| w[0] < w[1]),
            "grants out of enqueue order: {:?}",
            self.grant_order
        );
        Ok(())
    }

    /// Delivers everything still owed (proofs, removals, answers), releases the explicit
    /// leases, cancels waiters that cannot be served and shuts down; then checks the end state.
    fn quiesce(&mut self) -> TestResult {
        for _ in 0..10_000 {
            if self.stopped {
                break;
            }
            if let Some(key) = self.releases_in_flight.pop() {
                self.finish_release(key, ReleaseOutcome::Ok)?;
            } else if let Some(key) = self.scratch_in_flight.pop() {
                self.on_scratch_removed(key, true)?;
            } else if let Some(&key) = self.running_jobs(|l| !l.event_seen || !l.exited).first() {
                // The supervision event first, then the join (or only the one still missing).
                let exited = self.lease(key).event_seen;
                self.on_worker_end(key, exited)?;
            } else if let Some(key) = self
                .leases
                .iter()
                .find(|(_, l)| l.kind == LeaseKind::Explicit && l.phase == Some(Phase::Granted))
                .map(|(k, _)| *k)
            {
                self.on_release_request(key)?;
            } else if self.broker.outstanding > 0 {
                if let Some(&slot) = self.broker.free.first() {
                    let token = self.fresh_token(slot);
                    self.on_acquired(Ok(token), None)?;
                } else {
                    self.broker.outstanding -= 1;
                    self.on_acquired(Err(()), None)?;
                }
            } else if let Some(&id) = self.waiters.keys().next() {
                // Only quarantined slots are left: nothing can serve it.
                self.on_cancel(id)?;
            } else if !self.stopping {
                self.begin_shutdown()?;
                // A second shutdown changes nothing.
                self.begin_shutdown()?;
            } else {
                break;
            }
            self.settle()?;
            self.check()?;
        }

        // No hang: the shutdown finished, every acquire ended.
        prop_assert!(self.stopped, "shutdown did not finish: {:?}", self.table);
        prop_assert_eq!(self.table.pending(), 0);
        prop_assert_eq!(self.table.waiting(), 0);
        for id in 1..self.next_waiter {
            prop_assert!(self.ended.contains_key(&id), "waiter {} never answered", id);
        }
        // Only quarantined leases are left: a temp dir that could not be removed, or (when the
        // shutdown finished first: quarantined slots are reported, not waited for) tracked tasks
        // that outlived the drain bound.
        for (key, lease) in &self.leases {
            if let Some(phase) = lease.phase {
                prop_assert_eq!(phase, Phase::Quarantined, "lease {} left behind", key);
                prop_assert!(
                    lease.scratch == Scratch::Failed || lease.drain_timed_out,
                    "lease {} quarantined without cause: {:?}",
                    key,
                    lease
                );
            }
        }
        // Conservation (invariant 4): available + quarantined == capacity.
        let quarantined = self.table.quarantined();
        prop_assert_eq!(
            self.broker.free.len() + quarantined,
            self.broker.slots as usize
        );
        let c = self.table.counters();
        prop_assert_eq!(
            c.acquired_total,
            c.released_total + c.release_failed_total + quarantined as u64
        );
        if quarantined == 0 {
            prop_assert_eq!(c.acquired_total, c.released_total + c.release_failed_total);
        }
        // Every granted token but the quarantined ones was released exactly once.
        for token in &self.broker.granted {
            let key = self.by_token[token];
            let want = u32::from(self.leases[&key].phase.is_none());
            prop_assert_eq!(self.broker.releases.get(token).copied().unwrap_or(0), want);
        }
        Ok(())
    }
}

/// Runs `ops` (with a shutdown inserted where `setup` says), then quiesces.
fn run(setup: Setup, mut ops: Vec<Op>) -> TestResult<Coverage> {
    if let Some(at) = setup.shutdown_at {
        let at = at % (ops.len() + 1);
        ops.insert(at, Op::Shutdown);
    }
    let mut h = Harness::new(setup);
    h.check()?;
    for op in ops {
        h.apply_op(op)?;
    }
    h.quiesce()?;
    Ok(h.coverage)
}

fn setup_strategy(known: bool) -> impl Strategy<Value = Setup> {
    (
        1u32..=4,
        any::<bool>(),
        prop::bool::weighted(0.2),
        prop::option::weighted(0.5, any::<usize>()),
    )
        .prop_map(
            move |(slots, inline_broker, inline_release, shutdown_at)| Setup {
                known_capacity: known.then_some(slots),
                broker_slots: slots,
                inline_broker,
                inline_release,
                shutdown_at,
            },
        )
}

fn outcome_strategy() -> impl Strategy<Value = ReleaseOutcome> {
    prop_oneof![
        4 => Just(ReleaseOutcome::Ok),
        1 => Just(ReleaseOutcome::Failed),
        1 => Just(ReleaseOutcome::TimedOut),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => any::<bool>().prop_map(|job| Op::Acquire { job }),
        2 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::CallerGone),
        1 => any::<usize>().prop_map(Op::DeliveryWillFail),
        8 => any::<usize>().prop_map(Op::BrokerToken),
        1 => Just(Op::BrokerError),
        1 => any::<usize>().prop_map(Op::BrokerTokenForHeldSlot),
        1 => any::<usize>().prop_map(Op::BrokerTokenWithLiveLeaseId),
        6 => (any::<usize>(), any::<bool>()).prop_map(|(lease, exited)| Op::WorkerEnd { lease, exited }),
        1 => any::<usize>().prop_map(Op::DrainTimeout),
        4 => (any::<usize>(), prop::bool::weighted(0.85))
            .prop_map(|(lease, ok)| Op::ScratchRemoved { lease, ok }),
        6 => (any::<usize>(), outcome_strategy())
            .prop_map(|(release, outcome)| Op::BrokerReleased { release, outcome }),
        4 => any::<usize>().prop_map(Op::LeaseDropped),
    ]
}

fn ops_strategy() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op_strategy(), 0..=200)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_operation_sequences_keep_every_invariant_with_a_known_capacity(
        setup in setup_strategy(true),
        ops in ops_strategy(),
    ) {
        run(setup, ops)?;
    }

    #[test]
    fn random_operation_sequences_keep_every_invariant_with_an_unknown_capacity(
        setup in setup_strategy(false),
        ops in ops_strategy(),
    ) {
        run(setup, ops)?;
    }

    #[test]
    fn waiters_that_stay_are_granted_in_enqueue_order(
        slots in 1u32..=4,
        ops in prop::collection::vec(
            prop_oneof![
                4 => any::<bool>().prop_map(|job| Op::Acquire { job }),
                2 => any::<usize>().prop_map(Op::Cancel),
                1 => any::<usize>().prop_map(Op::CallerGone),
                1 => Just(Op::BrokerError),
                4 => any::<usize>().prop_map(Op::BrokerToken),
                3 => (any::<usize>(), any::<bool>()).prop_map(|(lease, exited)| Op::WorkerEnd { lease, exited }),
                3 => any::<usize>().prop_map(|lease| Op::ScratchRemoved { lease, ok: true }),
                3 => any::<usize>().prop_map(|release| Op::BrokerReleased { release, outcome: ReleaseOutcome::Ok }),
                3 => any::<usize>().prop_map(Op::LeaseDropped),
            ],
            0..=200,
        ),
    ) {
        let setup = Setup::known(slots);
        let mut h = Harness::new(setup);
        let mut enqueued = Vec::new();
        for op in ops {
            if matches!(op, Op::Acquire { .. }) {
                enqueued.push(h.next_waiter);
            }
            h.apply_op(op)?;
        }
        // Among the waiters that stayed (granted with their caller present), grant order is
        // enqueue order; and every stayer still waiting was enqueued after every granted one.
        let granted: Vec<WaiterId> = h.grant_order.clone();
        let in_enqueue_order: Vec<WaiterId> =
            enqueued.iter().copied().filter(|id| granted.contains(id)).collect();
        prop_assert_eq!(&granted, &in_enqueue_order);
        if let (Some(last), Some(first_waiting)) = (granted.last(), h.waiters.keys().next()) {
            prop_assert!(last < first_waiting, "waiter {} still waits behind {}", first_waiting, last);
        }
        h.quiesce()?;
    }
}

#[test]
fn every_phase_and_edge_pair_is_legal_exactly_when_documented() {
    let mut legal = 0;
    for from in ALL_FROM {
        for edge in ALL_EDGES {
            let got = step(from, edge);
            match documented(from, edge) {
                Some(to) => {
                    legal += 1;
                    assert_eq!(
                        got,
                        Ok(to),
                        "{edge:?} from {from:?} is documented to lead to {to:?}"
                    );
                }
                None => assert_eq!(
                    got,
                    Err(IllegalTransition { from, edge }),
                    "{edge:?} from {from:?} is not a documented edge"
                ),
            }
        }
    }
    assert_eq!(
        legal,
        DOCUMENTED_EDGES.len(),
        "every documented edge was enumerated"
    );
}

#[test]
fn an_illegal_edge_changes_nothing_in_the_table() {
    let mut table = LeaseTable::new(Some(1));
    table.enqueue(1);
    assert_eq!(table.requests_to_issue(), 1);
    let token = SlotToken::new(0, 1);
    table.token_arrived(token).unwrap();
    assert_eq!(table.pop_waiter(), Some(1));
    let key = table.grant(token, LeaseKind::Job);
    table.apply(key, Edge::BodyEnded).unwrap();
    table.apply(key, Edge::Unconfirmed).unwrap();
    let before = (table.counters(), table.active(), table.quarantined());
    for edge in ALL_EDGES {
        if documented(Some(Phase::Quarantined), edge).is_none() {
            assert_eq!(
                table.apply(key, edge),
                Err(IllegalTransition {
                    from: Some(Phase::Quarantined),
                    edge
                })
            );
            assert_eq!(
                (table.counters(), table.active(), table.quarantined()),
                before
            );
            assert_eq!(table.get(key).map(|r| r.phase), Some(Phase::Quarantined));
        }
    }
    // A key the table never granted: only Grant is legal from Free, and apply never grants.
    assert!(
        table
            .apply(key + 1, Edge::Released(ReleaseOutcome::Ok))
            .is_err()
    );
    assert_eq!(
        (table.counters(), table.active(), table.quarantined()),
        before
    );
}

#[test]
fn a_duplicate_token_is_refused_and_grants_nothing() {
    let mut h = Harness::new(Setup::known(2));
    let ops = [
        Op::Acquire { job: false },
        Op::BrokerToken(0),
        Op::Acquire { job: false },
        Op::BrokerTokenForHeldSlot(0),
        Op::Acquire { job: true },
        Op::BrokerTokenWithLiveLeaseId(0),
    ];
    for op in ops {
        h.apply_op(op).unwrap();
    }
    assert_eq!(h.coverage.refused_slot_held, 1);
    assert_eq!(h.coverage.refused_lease_id_live, 1);
    assert_eq!(h.table.active(), 1);
    assert_eq!(h.table.counters().acquired_total, 1);
    assert_eq!(h.ended.get(&2), Some(&Ended::Failed));
    assert_eq!(h.ended.get(&3), Some(&Ended::Failed));
    h.quiesce().unwrap();
    assert!(h.broker.releases.values().all(|n| *n == 1));
    assert_eq!(h.broker.releases.len(), 1);
}

#[test]
fn a_token_for_a_slot_whose_release_is_in_flight_is_accepted_and_indexes_stay_right() {
    let mut table = LeaseTable::new(None);
    assert!(table.enqueue(1));
    assert_eq!(table.requests_to_issue(), 1);
    let old = SlotToken::new(0, 1);
    table.token_arrived(old).unwrap();
    assert_eq!(table.pop_waiter(), Some(1));
    let old_key = table.grant(old, LeaseKind::Explicit);
    table.apply(old_key, Edge::ReleaseRequested).unwrap();
    // The broker applied the release and granted the slot again before its answer arrived.
    assert!(table.enqueue(2));
    assert_eq!(table.requests_to_issue(), 1);
    let new = SlotToken::new(0, 2);
    table.token_arrived(new).unwrap();
    assert_eq!(table.pop_waiter(), Some(2));
    let new_key = table.grant(new, LeaseKind::Explicit);
    // The old release's answer arrives: the slot stays indexed under the new lease.
    table
        .apply(old_key, Edge::Released(ReleaseOutcome::Ok))
        .unwrap();
    assert!(table.enqueue(3));
    assert_eq!(table.requests_to_issue(), 1);
    assert_eq!(
        table.token_arrived(SlotToken::new(0, 3)),
        Err(TokenRefused::SlotHeld {
            token: SlotToken::new(0, 3),
            holder: new
        })
    );
    table.apply(new_key, Edge::ReleaseRequested).unwrap();
    table
        .apply(new_key, Edge::Released(ReleaseOutcome::Ok))
        .unwrap();
    assert_eq!(table.active(), 0);
}

#[test]
fn a_second_release_request_issues_no_second_broker_release() {
    let mut h = Harness::new(Setup::known(1));
    let ops = [
        Op::Acquire { job: false },
        Op::BrokerToken(0),
        Op::LeaseDropped(0),
        // Releasing: the second request waits for the same broker release.
        Op::LeaseDropped(0),
        Op::BrokerReleased {
            release: 0,
            outcome: ReleaseOutcome::Failed,
        },
        // Freed: a third request is a no-op.
        Op::LeaseDropped(0),
    ];
    for op in ops {
        h.apply_op(op).unwrap();
    }
    assert_eq!(h.coverage.repeated_release_request, 2);
    assert_eq!(h.broker.releases.values().copied().collect::<Vec<_>>(), [1]);
    assert_eq!(h.table.counters().release_failed_total, 1);
    h.quiesce().unwrap();
}

#[test]
fn a_failed_grant_delivery_releases_the_token_exactly_once() {
    for job in [false, true] {
        let mut h = Harness::new(Setup::known(1));
        for op in [
            Op::Acquire { job },
            Op::DeliveryWillFail(0),
            Op::BrokerToken(0),
        ] {
            h.apply_op(op).unwrap();
        }
        assert_eq!(h.coverage.delivery_failed, 1);
        assert_eq!(h.releases_in_flight.len(), 1);
        h.quiesce().unwrap();
        assert_eq!(h.table.counters().released_total, 1);
    }
}

#[test]
fn worker_end_proofs_in_either_order_start_scratch_removal_exactly_once() {
    for exit_first in [true, false] {
        let mut h = Harness::new(Setup::known(1));
        let ops = [
            Op::Acquire { job: true },
            Op::BrokerToken(0),
            Op::WorkerEnd {
                lease: 0,
                exited: exit_first,
            },
            Op::WorkerEnd {
                lease: 0,
                exited: !exit_first,
            },
        ];
        for op in ops {
            h.apply_op(op).unwrap();
        }
        assert_eq!(h.scratch_in_flight.len(), 1);
        assert!(
            h.releases_in_flight.is_empty(),
            "no release before the temp dir is gone"
        );
        h.apply_op(Op::ScratchRemoved { lease: 0, ok: true })
            .unwrap();
        assert_eq!(h.releases_in_flight.len(), 1);
        h.quiesce().unwrap();
    }
}

#[test]
fn a_drain_timeout_quarantines_and_a_late_drain_releases() {
    let mut h = Harness::new(Setup::known(1));
    let ops = [
        Op::Acquire { job: true },
        Op::BrokerToken(0),
        Op::DrainTimeout(0),
        // A waiter behind a quarantined slot gets no request: the slot is still held.
        Op::Acquire { job: false },
        Op::WorkerEnd {
            lease: 0,
            exited: false,
        },
        Op::WorkerEnd {
            lease: 0,
            exited: true,
        },
    ];
    for op in ops {
        h.apply_op(op).unwrap();
    }
    assert_eq!(h.table.quarantined(), 1);
    assert_eq!(h.table.active(), 0);
    assert_eq!(h.table.pending(), 0);
    assert_eq!(h.table.waiting(), 1);
    h.apply_op(Op::ScratchRemoved { lease: 0, ok: true })
        .unwrap();
    assert_eq!(h.coverage.quarantined_then_drained, 1);
    assert_eq!(h.table.quarantined(), 0);
    h.apply_op(Op::BrokerReleased {
        release: 0,
        outcome: ReleaseOutcome::Ok,
    })
    .unwrap();
    // The freed slot is asked for at once for the waiter.
    assert_eq!(h.table.pending(), 1);
    h.quiesce().unwrap();
}

#[test]
fn a_failed_scratch_removal_keeps_the_slot_quarantined_through_shutdown() {
    let mut h = Harness::new(Setup::known(2));
    let ops = [
        Op::Acquire { job: true },
        Op::BrokerToken(0),
        Op::WorkerEnd {
            lease: 0,
            exited: true,
        },
        Op::WorkerEnd {
            lease: 0,
            exited: false,
        },
        Op::ScratchRemoved {
            lease: 0,
            ok: false,
        },
    ];
    for op in ops {
        h.apply_op(op).unwrap();
    }
    assert_eq!(h.table.quarantined(), 1);
    h.quiesce().unwrap();
    assert!(h.stopped);
    assert_eq!(h.table.quarantined(), 1);
    assert!(
        h.broker.releases.is_empty(),
        "a quarantined token is never released"
    );
}

#[test]
fn shutdown_refuses_waiters_releases_explicit_leases_and_waits_for_jobs() {
    let mut h = Harness::new(Setup::known(2));
    let ops = [
        Op::Acquire { job: false },
        Op::Acquire { job: true },
        Op::Acquire { job: false },
        Op::BrokerToken(0),
        Op::BrokerToken(0),
        Op::Shutdown,
    ];
    for op in ops {
        h.apply_op(op).unwrap();
    }
    assert_eq!(h.ended.get(&3), Some(&Ended::Stopped));
    assert_eq!(
        h.releases_in_flight.len(),
        1,
        "the explicit lease is released"
    );
    assert!(!h.stopped, "a running job holds the shutdown");
    h.apply_op(Op::Acquire { job: true }).unwrap();
    assert_eq!(h.ended.get(&4), Some(&Ended::RefusedAtEnqueue));
    // The holder's later release is a no-op.
    h.apply_op(Op::LeaseDropped(0)).unwrap();
    assert_eq!(h.broker.releases.len(), 1);
    h.quiesce().unwrap();
}

#[test]
fn a_token_nobody_waits_for_is_released_at_once() {
    let mut h = Harness::new(Setup {
        known_capacity: None,
        ..Setup::known(2)
    });
    for op in [
        Op::Acquire { job: false },
        Op::Cancel(0),
        Op::BrokerToken(0),
    ] {
        h.apply_op(op).unwrap();
    }
    assert_eq!(h.coverage.surplus_token, 1);
    assert_eq!(h.releases_in_flight.len(), 1);
    h.quiesce().unwrap();
}

/// The random mix reaches every notable event (so the properties above are not vacuous).
#[test]
fn the_random_operation_mix_reaches_every_kind_of_event() {
    let mut runner = TestRunner::deterministic();
    let mut total = Coverage::default();
    for i in 0..256 {
        let setup = setup_strategy(i % 2 == 0)
            .new_tree(&mut runner)
            .expect("setup")
            .current();
        let ops = ops_strategy().new_tree(&mut runner).expect("ops").current();
        let coverage = run(setup, ops).unwrap_or_else(|e| panic!("case {i}: {e}"));
        total.merge(&coverage);
    }
    assert!(
        total.missing().is_empty(),
        "never reached: {:?} ({total:?})",
        total.missing()
    );
}

//! The live lease table: what [`Supervisor::leases`](super::Supervisor::leases) reads every frame
//! without a message to the actor.
//!
//! The actor is the table's only writer: after each batch of messages it updates the rows of
//! the leases the core touched (granted, a proof in or missing, releasing, gone). Readers take a
//! snapshot through the concurrent map's shard locks, which the actor holds only for one row's
//! update at a time.

use std::hash::BuildHasherDefault;
use std::sync::Arc;
use std::time::Duration;

// The tokio clock: tests pause it, and the held-too-long check runs on a tokio timer.
use tokio::time::Instant;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use rustc_hash::FxHasher;

use super::core::{self, Holder, LeaseKey, Proof};
use crate::broker::SlotToken;
use crate::job::Priority;

/// One lease, as [`Supervisor::leases`](super::Supervisor::leases) shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseInfo {
    /// The job's id (`None` for an explicit [`Lease`](crate::Lease)).
    pub job_id: Option<Arc<str>>,
    /// A job's, or an explicit lease.
    pub kind: LeaseKind,
    /// The slot held (the first one, for a multi-slot lease).
    pub slot_id: u32,
    /// Every token held, the first one first.
    pub tokens: Vec<SlotToken>,
    /// Where the lease is in its release pipeline.
    pub phase: LeasePhase,
    /// How long since the slot was granted.
    pub held_for: Duration,
    /// What its release still waits for, in pipeline order (empty while a body runs and owes
    /// nothing yet beyond its own end, which shows as [`WaitingFor::Worker`]).
    pub waiting_for: Vec<WaitingFor>,
    /// The GPU device its job runs on (feature `gpu`).
    pub gpu_device: Option<usize>,
    /// The leaders of the process groups its job started that are not yet proven empty.
    pub child_pids: Vec<u32>,
    /// The priority class it was granted under.
    pub priority: Priority,
    /// The actor a lease desk lease is tied to
    /// ([`Supervisor::lease_desk`](super::Supervisor::lease_desk)); `None` otherwise.
    pub holder: Option<ractor::ActorId>,
}

/// Who holds a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LeaseKind {
    /// A job run through [`Supervisor::run`](super::Supervisor::run) or `submit`.
    Job,
    /// An explicit [`Lease`](crate::Lease).
    Explicit,
}

/// Where a lease is in its release pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LeasePhase {
    /// Held by a running body, or by an explicit lease not yet given back.
    Running,
    /// The body has ended; its physical end (tasks, process groups, GPU work) or its temp dir's
    /// removal is still being proven.
    Draining,
    /// Physically done; the broker release is in flight.
    Releasing,
    /// A proof did not come in its bound: held, not reusable (see
    /// [`Supervisor::quarantined`](super::Supervisor::quarantined)).
    Quarantined,
}

/// One thing a lease's release still waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WaitingFor {
    /// The job's worker: its body, then its actor's task.
    Worker,
    /// The worker's supervision event (its state dropped). No longer reported: the worker
    /// unlinks from the supervisor before it ends, and its join handle proves its end
    /// ([`Worker`](Self::Worker)). Kept so that code matching on it still builds.
    SupervisionEvent,
    /// Tasks and blocking closures spawned through the job's context.
    Tasks,
    /// A process group the job started, by its leader's pid (0 when not known).
    ProcessGroup(u32),
    /// GPU work submitted under the lease.
    GpuFence,
    /// The removal of the job's temp dir.
    TempDir,
    /// The broker's answer to the release.
    BrokerRelease,
}

impl std::fmt::Display for WaitingFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Worker => f.write_str("the worker"),
            Self::SupervisionEvent => f.write_str("the worker's supervision event"),
            Self::Tasks => f.write_str("tracked tasks"),
            Self::ProcessGroup(pid) => write!(f, "process group {pid}"),
            Self::GpuFence => f.write_str("gpu work"),
            Self::TempDir => f.write_str("the temp dir"),
            Self::BrokerRelease => f.write_str("the broker release"),
        }
    }
}

/// A row: what the lease table keeps of one lease (the actor writes one at each grant and
/// phase change, on its hot path); [`LeaseInfo`] is built from it when read.
#[derive(Debug)]
pub(crate) struct Row {
    job_id: Option<Arc<str>>,
    priority: Priority,
    kind: LeaseKind,
    phase: LeasePhase,
    token: SlotToken,
    more: Box<[SlotToken]>,
    /// Rewritten in place at each refresh (its capacity is kept: no allocation for a lease
    /// that owes nothing, an explicit one).
    waiting_for: Vec<WaitingFor>,
    device: Option<usize>,
    holder: Option<ractor::ActorId>,
    granted_at: Instant,
    warned: bool,
}

impl Row {
    fn info(&self, now: Instant) -> LeaseInfo {
        LeaseInfo {
            job_id: self.job_id.clone(),
            kind: self.kind,
            slot_id: self.token.slot_id(),
            tokens: std::iter::once(self.token)
                .chain(self.more.iter().copied())
                .collect(),
            phase: self.phase,
            held_for: now.saturating_duration_since(self.granted_at),
            waiting_for: self.waiting_for.clone(),
            gpu_device: self.device,
            child_pids: self
                .waiting_for
                .iter()
                .filter_map(|w| match w {
                    WaitingFor::ProcessGroup(pid) => Some(*pid),
                    _ => None,
                })
                .collect(),
            priority: self.priority,
            holder: self.holder,
        }
    }

    /// Copies what may have changed since the row was made.
    fn refresh(
        &mut self,
        lease: &core::LeaseRecord,
        pid: &dyn Fn(core::ProcessKey) -> Option<u32>,
    ) {
        self.phase = phase(lease);
        self.device = lease.device;
        self.waiting_for.clear();
        // The hot path (an explicit lease, a release) owes nothing: no iterator to run.
        if !lease.owed.is_empty() {
            self.waiting_for
                .extend(lease.owing().map(|proof| match proof {
                    Proof::WorkerJoined => WaitingFor::Worker,
                    Proof::TasksJoined => WaitingFor::Tasks,
                    Proof::Process(p) => WaitingFor::ProcessGroup(pid(p).unwrap_or(0)),
                    Proof::GpuFence => WaitingFor::GpuFence,
                    Proof::TempDir => WaitingFor::TempDir,
                }));
        }
        if lease.is_releasing() {
            self.waiting_for.push(WaitingFor::BrokerRelease);
        }
    }
}

fn phase(lease: &core::LeaseRecord) -> LeasePhase {
    match lease.phase() {
        core::Phase::Running => LeasePhase::Running,
        core::Phase::Draining => LeasePhase::Draining,
        core::Phase::Releasing => LeasePhase::Releasing,
        core::Phase::Quarantined => LeasePhase::Quarantined,
    }
}

pub(crate) type Rows = DashMap<LeaseKey, Row, BuildHasherDefault<FxHasher>>;

/// The table, shared by the actor (its writer) and every `Supervisor` handle.
#[derive(Debug, Default)]
pub(crate) struct LeaseTable {
    rows: Rows,
}

/// What the shell knows of a lease beyond the core.
pub(crate) struct Extra<'a> {
    pub(crate) job_id: &'a dyn Fn() -> Option<Arc<str>>,
    /// The actor a lease desk lease is tied to.
    pub(crate) holder: &'a dyn Fn() -> Option<ractor::ActorId>,
    /// A process key's leader pid.
    pub(crate) pid: &'a dyn Fn(core::ProcessKey) -> Option<u32>,
}

impl LeaseTable {
    /// Writes the row of one lease as the core has it now (`None`: gone). `now` is read only for
    /// a new row.
    pub(crate) fn update(
        &self,
        key: LeaseKey,
        lease: Option<&core::LeaseRecord>,
        extra: Extra<'_>,
        now: impl FnOnce() -> Instant,
    ) {
        let Some(lease) = lease.filter(|l| l.holder != Holder::Surplus) else {
            self.rows.remove(&key);
            return;
        };
        match self.rows.entry(key) {
            Entry::Occupied(mut row) => row.get_mut().refresh(lease, extra.pid),
            Entry::Vacant(slot) => {
                let kind = match lease.holder {
                    Holder::Job => LeaseKind::Job,
                    _ => LeaseKind::Explicit,
                };
                // Each look-up only where it can find something: a job's id, an explicit
                // lease's holder.
                let mut row = Row {
                    job_id: match kind {
                        LeaseKind::Job => (extra.job_id)(),
                        LeaseKind::Explicit => None,
                    },
                    priority: lease.priority,
                    kind,
                    phase: LeasePhase::Running,
                    token: lease.token,
                    more: lease.more.clone(),
                    waiting_for: Vec::new(),
                    device: None,
                    holder: match kind {
                        LeaseKind::Job => None,
                        LeaseKind::Explicit => (extra.holder)(),
                    },
                    granted_at: now(),
                    warned: false,
                };
                row.refresh(lease, extra.pid);
                slot.insert(row);
            }
        }
    }

    /// Every lease now, by slot.
    pub(crate) fn snapshot(&self) -> Vec<LeaseInfo> {
        let now = Instant::now();
        let mut out: Vec<LeaseInfo> = self.rows.iter().map(|row| row.info(now)).collect();
        out.sort_by_key(|i| (i.slot_id, i.tokens.first().map(|t| t.lease_id())));
        out
    }

    /// The leases held at least `threshold` and not reported yet: marked reported, and returned.
    pub(crate) fn newly_held_too_long(&self, threshold: Duration, now: Instant) -> Vec<LeaseInfo> {
        let mut out = Vec::new();
        for mut row in self.rows.iter_mut() {
            if !row.warned && now.saturating_duration_since(row.granted_at) >= threshold {
                row.warned = true;
                out.push(row.info(now));
            }
        }
        out.sort_by_key(|i| i.slot_id);
        out
    }

    /// Drops every row but the quarantined ones: after the supervisor has stopped, those slots
    /// are still held, and the table keeps showing them.
    pub(crate) fn retain_quarantined(&self) {
        self.rows
            .retain(|_, row| row.phase == LeasePhase::Quarantined);
    }

    pub(crate) fn shrink(&self) {
        self.rows.shrink_to_fit();
    }
}

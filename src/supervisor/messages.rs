//! Messages to the supervisor actor (through its [`Inbox`](super::inbox::Inbox)). Every
//! message that starts work carries the caller's span.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;
use tracing::Span;

use super::core::{Ask, Input, LeaseKey, ProcessKey, RequestId, WaiterId, Withdrawal};
use super::reports::{QuarantinedSlot, ReclaimReport, ShutdownReport, WaiterInfo};
use crate::broker::{BrokerError, BrokerEvent, SlotToken};
use crate::error::{AcquireError, CleanupError, PrepareError, ResizeError};
use crate::lease::{Lease, ReleaseReply};
use crate::process::Evidence;
use crate::worker::{BoxedBody, JobShared};

pub(crate) enum SupMsg {
    // --- from handles ---
    /// Join the queue (or, `ask.now_only`, be served in this turn or refused).
    Acquire {
        waiter: WaiterId,
        kind: WaiterKind,
        ask: Ask,
    },
    /// The caller stopped waiting. Ignored once the waiter has been served.
    Withdraw { waiter: WaiterId, why: Withdrawal },
    /// An explicit lease is given back (`reply` is `None` when it was dropped).
    Release {
        key: LeaseKey,
        reply: Option<ReleaseReply>,
    },
    /// A control call, answered once its effect is visible.
    Control(Control),
    /// Stop: refuse new work, cancel jobs, wait (bounded), release everything (`None`: the last
    /// handle was dropped).
    Shutdown {
        reply: Option<oneshot::Sender<ShutdownReport>>,
    },

    // --- from broker tasks ---
    /// A broker acquire that did not finish on its first poll has ended.
    Acquired {
        request: RequestId,
        result: Result<SlotToken, BrokerError>,
    },
    /// A broker release that did not finish on its first poll has ended (or timed out).
    Released {
        key: LeaseKey,
        result: Result<(), CleanupError>,
        started: Instant,
    },
    /// Something the broker reported on its own (see `SlotBroker::attach`).
    Broker(BrokerEvent),

    // --- from the job machinery (worker, driver, keepers, temp dir removal, GPU, timers) ---
    /// A report the core takes as it is: proofs, late proofs, a job that could not be
    /// prepared, a lost lease or device, a device replaced, the shutdown timers.
    Input(Input),
    /// A job started a process group (its leader's pid, which is also the group id).
    ProcessStarted {
        key: LeaseKey,
        process: ProcessKey,
        pid: u32,
    },
    /// A process group's keeper ended: proven empty (`None`), or not (what it knows).
    ProcessEnded {
        key: LeaseKey,
        process: ProcessKey,
        unproven: Option<Box<dyn Evidence>>,
    },
    /// A job's worker task has ended, or may have: its join handle's waker rang (see
    /// `actor::jobs`). The supervisor polls the handle itself to know.
    Joined { key: LeaseKey },
    /// A job's temp dir removal may have an answer: its waker rang (see `actor::jobs`).
    RemovalRang { key: LeaseKey },
    /// A worker whose spawn could not finish within the supervisor's turn was spawned (or
    /// failed to be) in a task of its own.
    WorkerSpawned {
        key: LeaseKey,
        result: Result<tokio::task::JoinHandle<()>, String>,
    },
    /// Time to look for leases held past the held-too-long threshold.
    HeldTick,
    /// The GPU devices were closed at shutdown (`unclosed`: those not proven idle), or the
    /// close as a whole did not report (why: it panicked, or ran past its bound).
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    GpuClosed {
        unclosed: Result<Vec<(usize, String)>, String>,
    },
    /// The broker's close at shutdown ended: `Some` when it failed, timed out or panicked.
    BrokerClosed { failed: Option<BrokerError> },
}

/// A control call and where its answer goes.
pub(crate) enum Control {
    /// Cancel every job with this id that waits or holds a lease not yet releasing; the
    /// answer says whether there was one.
    Cancel {
        job_id: Box<str>,
        reply: oneshot::Sender<bool>,
    },
    /// Set the in-process pool's size; the answer is the capacity now in force.
    Resize {
        slots: u32,
        reply: oneshot::Sender<Result<u32, ResizeError>>,
    },
    /// List the quarantined slots.
    Quarantined {
        reply: oneshot::Sender<Vec<QuarantinedSlot>>,
    },
    /// List the callers waiting, in the order they are served.
    Waiters {
        reply: oneshot::Sender<Vec<WaiterInfo>>,
    },
    /// Re-check the quarantined slots and release those now proven clean.
    Reclaim {
        reply: oneshot::Sender<ReclaimReport>,
    },
}

pub(crate) enum WaiterKind {
    Lease {
        reply: oneshot::Sender<Result<Lease, AcquireError>>,
        span: KeptSpan,
        /// The actor a lease desk lease is tied to (shown in the lease table); boxed: the rare
        /// case, and every waiting caller's message holds room for it.
        holder: Option<Box<ractor::ActorId>>,
    },
    Job(Box<PendingJob>),
}

/// A caller's or a job's span, held while it waits: a disabled span (no subscriber wants it,
/// the common case) is not held at all, so that each of a flood's waiting callers costs 8 bytes
/// for it instead of a `Span`'s 40.
pub(crate) struct KeptSpan(Option<Box<Span>>);

static NO_SPAN: Span = Span::none();

impl KeptSpan {
    pub(crate) fn new(span: Span) -> Self {
        Self((!span.is_disabled()).then(|| Box::new(span)))
    }

    /// The span (a disabled one when it was not kept).
    pub(crate) fn get(&self) -> &Span {
        self.0.as_deref().unwrap_or(&NO_SPAN)
    }

    pub(crate) fn into_span(self) -> Span {
        self.0.map_or_else(Span::none, |span| *span)
    }
}

pub(crate) struct PendingJob {
    pub(crate) job_id: Arc<str>,
    pub(crate) shared: Arc<JobShared>,
    pub(crate) body: BoxedBody,
    pub(crate) reply: oneshot::Sender<RunOutcome>,
    pub(crate) span: KeptSpan,
    /// When the job stops waiting for a slot (the acquire timeout): a job whose caller does not
    /// watch the clock (a detached or unpolled handle, `spawn_job`) is refused at its grant
    /// once this has passed.
    pub(crate) deadline: Option<tokio::time::Instant>,
}

/// What `run` hears back.
pub(crate) enum RunOutcome {
    /// No slot was granted; nothing is held. Boxed: the rare case, and every waiting job's
    /// reply channel holds room for a `RunOutcome`.
    NotGranted(Box<AcquireError>),
    /// The release pipeline has finished (or quarantined the slots). `unprepared`: no body ran,
    /// because the job could not be prepared.
    Finished {
        unprepared: Option<Box<PrepareError>>,
        cleanup: Result<(), CleanupError>,
    },
}

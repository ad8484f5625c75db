//! Messages to the supervisor actor. Every message that starts work carries the caller's span.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tracing::Span;

use super::state::{LeaseKey, WaiterId};
use crate::broker::{BrokerError, BrokerEvent, SlotToken};
use crate::error::{AcquireError, CleanupError};
use crate::lease::Lease;
use crate::supervisor::{QuarantinedSlot, ReclaimReport, ShutdownReport};
use crate::worker::{BoxedBody, JobShared};

pub(crate) enum SupMsg {
    /// Join the FIFO queue. The caller's span travels in `kind` (one per waiter, not two).
    Acquire { waiter: WaiterId, kind: WaiterKind },
    /// The caller stopped waiting. Ignored once the waiter has been served.
    Cancel {
        waiter: WaiterId,
        reason: CancelReason,
    },
    /// A broker acquire that did not finish on its first poll has ended.
    BrokerAcquired {
        result: Result<SlotToken, BrokerError>,
    },
    /// The worker's task has ended and every tracked task has returned.
    WorkerExited { key: LeaseKey },
    /// Tracked tasks outlived the drain bound: quarantine, tell the caller.
    DrainTimedOut { key: LeaseKey, after: Duration },
    /// The temp dir removal ended.
    ScratchRemoved {
        key: LeaseKey,
        result: io::Result<()>,
    },
    /// An explicit lease is given back (`reply` is `None` when it was dropped).
    Release {
        key: LeaseKey,
        reply: Option<ReleaseReply>,
    },
    /// A broker release that did not finish on its first poll has ended (or timed out).
    BrokerReleased {
        key: LeaseKey,
        result: Result<(), CleanupError>,
        /// When the release was started (for the release duration histogram).
        started: Instant,
    },
    /// Stop: refuse new work, cancel jobs, wait, release everything (`None`: last handle dropped).
    Shutdown {
        reply: Option<oneshot::Sender<ShutdownReport>>,
    },
    /// The cleanup timeout has passed since shutdown began: stop waiting for broker acquires
    /// still in flight (their tasks release whatever they still get).
    ShutdownDeadline,
    /// A lost GPU device was replaced (or given up for good).
    #[cfg(feature = "gpu")]
    GpuReplaced { device: usize },
    /// The GPU devices have been closed (at shutdown).
    #[cfg(feature = "gpu")]
    GpuClosed,
    /// The worker's physical end is late (GPU work past the fence bound): quarantine now.
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    Unconfirmed { key: LeaseKey, detail: String },
    /// A lease's keep-alive resolved: the broker could not keep it alive.
    LeaseLost { key: LeaseKey, reason: String },
    /// Something the broker reported on its own (see `SlotBroker::attach`).
    Broker(BrokerEvent),
    /// List the quarantined slots.
    Quarantined {
        reply: oneshot::Sender<Vec<QuarantinedSlot>>,
    },
    /// Re-check the quarantined slots and release those now proven clean.
    Reclaim {
        reply: oneshot::Sender<ReclaimReport>,
    },
}

pub(crate) type ReleaseReply = oneshot::Sender<Result<(), CleanupError>>;

pub(crate) enum WaiterKind {
    Lease {
        reply: oneshot::Sender<Result<Lease, AcquireError>>,
        span: Span,
    },
    Job(Box<PendingJob>),
}

impl WaiterKind {
    /// The caller's span (a job's own span for a job).
    pub(crate) fn span(&self) -> &Span {
        match self {
            Self::Lease { span, .. } => span,
            Self::Job(job) => &job.span,
        }
    }
}

pub(crate) struct PendingJob {
    pub(crate) job_id: Arc<str>,
    pub(crate) shared: Arc<JobShared>,
    pub(crate) body: BoxedBody,
    pub(crate) reply: oneshot::Sender<RunOutcome>,
    pub(crate) span: Span,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum CancelReason {
    Cancelled,
    TimedOut(Duration),
}

impl CancelReason {
    pub(crate) fn into_error(self) -> AcquireError {
        match self {
            Self::Cancelled => AcquireError::Cancelled,
            Self::TimedOut(after) => AcquireError::TimedOut { after },
        }
    }
}

/// What `run` hears back.
pub(crate) enum RunOutcome {
    /// No body ran and nothing is held.
    NotStarted(AcquireError),
    /// The release pipeline has finished (or quarantined the slot).
    Finished { cleanup: Result<(), CleanupError> },
}

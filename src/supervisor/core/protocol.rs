//! The core's protocol: what it is told ([`Input`]) and what it asks the shell to do
//! ([`Effect`]), in the ids of `ids.rs`. Plain data, no behaviour.

use std::io;

use super::record::{Holder, Proof, Proofs};
use crate::broker::{BrokerError, SlotToken};
use crate::error::{AcquireError, CleanupError, PrepareError, ResizeError};
use crate::job::Priority;
use crate::paths::TempDir;

pub(crate) use super::ids::{ControlId, LeaseKey, ProcessKey, RequestId, WaiterId};

/// What a waiter asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    /// An explicit lease.
    Lease,
    /// A slot for a job.
    Job,
}

/// A waiter's request: what for, how many slots, its class, and whether it may wait at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) want: Want,
    pub(crate) slots: u32,
    pub(crate) priority: Priority,
    /// `try_acquire`: served in the turn it arrives or refused, never queued.
    pub(crate) now_only: bool,
}

impl Ask {
    /// One slot, normal priority, may wait.
    pub(crate) fn one(want: Want) -> Self {
        Self {
            want,
            slots: 1,
            priority: Priority::Normal,
            now_only: false,
        }
    }
}

/// How a waiter left the queue without a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Withdrawal {
    Cancelled,
    TimedOut(std::time::Duration),
}

impl Withdrawal {
    pub(crate) fn into_error(self) -> AcquireError {
        match self {
            Self::Cancelled => AcquireError::Cancelled,
            Self::TimedOut(after) => AcquireError::TimedOut { after },
        }
    }
}

/// What a re-check of quarantined slots is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecheckFor {
    /// `reclaim_quarantined`: answer the control once the checks are in.
    Reclaim(ControlId),
    /// Shutdown re-checks what it finds quarantined, so that what is clean now is released.
    Shutdown,
}

/// One re-check's outcome, as the shell reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rechecked {
    pub(crate) key: LeaseKey,
    pub(crate) proof: Proof,
    /// `Ok`: proven now; else what still stands in the way.
    pub(crate) outcome: Result<(), String>,
}

/// Everything that can happen to the supervisor, as the core sees it.
#[derive(Debug)]
pub(crate) enum Input {
    /// A caller joins the queue (or, asking `now_only`, is served in this turn or refused).
    Enqueue { waiter: WaiterId, ask: Ask },
    /// A caller stops waiting (cancelled, timed out). Ignored once it has been served.
    Withdraw { waiter: WaiterId, why: Withdrawal },
    /// `resize`: the in-process pool's new size, to validate and apply.
    Resize { control: ControlId, slots: u32 },
    /// `Supervisor::cancel`: the waiters and leases of jobs with that id (the shell's look-up);
    /// the core decides which of them to cancel and answers whether there was one.
    CancelById {
        control: ControlId,
        waiters: Box<[WaiterId]>,
        leases: Box<[LeaseKey]>,
    },
    /// `Supervisor::quarantined`: list the quarantined slots.
    ListQuarantine { control: ControlId },
    /// `Supervisor::waiters`: list the callers waiting for slots, in the order they are served.
    ListWaiters { control: ControlId },
    /// `reclaim_quarantined`: re-check the quarantined slots and release those proven clean.
    Reclaim { control: ControlId },
    /// The re-checks asked for by [`Effect::Recheck`], all of them.
    Rechecked {
        results: Box<[Rechecked]>,
        leases: Box<[LeaseKey]>,
        purpose: RecheckFor,
    },
    /// A broker acquire ended (also one the core aborted, whose answer came anyway).
    Acquired {
        request: RequestId,
        result: Result<SlotToken, BrokerError>,
    },
    /// The lease granted by [`Effect::Deliver`] found nobody: its caller left before it could be
    /// handed over. Nobody used it: its slots go to the next waiter.
    Undelivered { key: LeaseKey },
    /// The job granted by [`Effect::Deliver`] could not start (no worker, no GPU sub-slot); no
    /// body ran. Its caller is answered when its slots are back.
    NotStarted { key: LeaseKey, why: PrepareError },
    /// The job's worker ran but could not prepare it (GPU checkout): no body ran. The
    /// worker still owes its physical end.
    #[cfg_attr(not(any(feature = "gpu", test)), allow(dead_code))]
    Unprepared { key: LeaseKey, why: PrepareError },
    /// The job's worker is running; `device` is its GPU placement.
    Started {
        key: LeaseKey,
        device: Option<usize>,
    },
    /// Proofs arrived (a job's driver, before its end, when what remains may take long).
    Proven { key: LeaseKey, proofs: Proofs },
    /// A job's driver ended: its last `proofs`, and the temp dir the job asked for, read once
    /// the job is closed (nothing more is made after that; `None`: it never asked, and nothing
    /// is owed for it). The core alone decides when the dir is removed: once the worker's
    /// physical end is proven. The one report of a job's end in the common case.
    Ended {
        key: LeaseKey,
        proofs: Proofs,
        dir: Option<TempDir>,
    },
    /// One proof arrived (events, processes, the temp dir).
    ProvenOne { key: LeaseKey, proof: Proof },
    /// A job started a process group; its slot now also waits for it.
    ProcessStarted { key: LeaseKey, process: ProcessKey },
    /// A proof missed its bound; it is still expected on its own.
    Late {
        key: LeaseKey,
        proof: Proof,
        detail: String,
    },
    /// A proof could not be made; only a re-check can make it.
    Unproven {
        key: LeaseKey,
        proof: Proof,
        detail: String,
    },
    /// The temp dir could not be removed (`detail` names it; `error` says why).
    TempDirFailed {
        key: LeaseKey,
        detail: String,
        error: io::Error,
    },
    /// The lease's GPU device was lost (seen by its fence) on that generation of the device.
    #[cfg_attr(not(any(feature = "gpu", test)), allow(dead_code))]
    DeviceLost {
        key: LeaseKey,
        device: usize,
        generation: u64,
        reason: String,
    },
    /// The lease's GPU device was lost (seen by its fence) on that generation of the device,
    /// and it is one the engine handed over: leasehold never re-creates it, so only the
    /// engine's replacement ([`Input::DeviceReplaced`]) proves the work gone, and a shutdown
    /// does not wait for that.
    #[cfg_attr(not(any(feature = "gpu", test)), allow(dead_code))]
    EngineDeviceLost {
        key: LeaseKey,
        device: usize,
        generation: u64,
        reason: String,
    },
    /// A lost device was replaced (or given up for good); `generation` is the device's now.
    /// Work on every earlier generation is gone.
    #[cfg_attr(not(any(feature = "gpu", test)), allow(dead_code))]
    DeviceReplaced { device: usize, generation: u64 },
    /// An explicit lease is given back (`release`, or its drop).
    ReleaseRequested { key: LeaseKey },
    /// One broker release ended (any outcome ends that token's hold).
    Released {
        key: LeaseKey,
        result: Result<(), CleanupError>,
    },
    /// The broker could not keep a lease alive.
    LeaseLost { key: LeaseKey, reason: String },
    /// A distributed broker saw an orphaned lease expire.
    OrphanExpired,
    /// `shutdown` (or the last handle dropped).
    Shutdown,
    /// The cancel grace has passed since shutdown began: tracked tasks still running are
    /// aborted.
    ShutdownGraceOver,
    /// The shutdown bound has passed: tasks still running are aborted, and whatever is still
    /// owed is quarantined.
    ShutdownDeadline,
    /// The GPU devices were closed at shutdown (or their close ran past its bound).
    GpuClosed,
    /// The broker's close at shutdown ended (or ran past its bound).
    BrokerClosed,
}

/// The answer a lease's caller gets once its pipeline has ended (or been quarantined).
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(crate) enum Answer {
    /// A job's `run`: no body ran when `unprepared` says why; `cleanup` is the release's result
    /// (or the quarantine's early answer).
    Job {
        unprepared: Option<Box<PrepareError>>,
        cleanup: Result<(), CleanupError>,
    },
    /// Every `release` call waiting on an explicit lease.
    Released(Result<(), CleanupError>),
}

/// One quarantined slot, as the core knows it (the shell adds the job's id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QuarantineEntry {
    pub(crate) key: LeaseKey,
    pub(crate) token: SlotToken,
    pub(crate) reason: String,
}

/// One caller waiting for slots, as the core knows it (the shell adds its job id and wait).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WaitingEntry {
    pub(crate) waiter: WaiterId,
    pub(crate) priority: Priority,
    pub(crate) slots: u32,
    /// Slots it has gathered so far (a multi-slot request at the head of the queue).
    pub(crate) gathered: u32,
}

/// A control call's answer.
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(crate) enum Reply {
    /// `cancel`: whether a job with that id waited or held a lease not yet releasing.
    Cancelled(bool),
    /// `resize`: the capacity now in force, or why nothing changed.
    Resized(Result<u32, ResizeError>),
    /// `quarantined`: one entry per quarantined slot.
    Quarantine(Vec<QuarantineEntry>),
    /// `waiters`: the callers waiting, in the order they are served.
    Waiters(Box<[WaitingEntry]>),
    /// `reclaim_quarantined`: every slot now proven clean, and one entry per slot still
    /// quarantined.
    Reclaimed {
        reclaimed: Box<[SlotToken]>,
        still: Box<[QuarantineEntry]>,
    },
}

/// What shutdown did, counted by the core.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StopTally {
    pub(crate) refused_waiters: usize,
    pub(crate) cancelled_jobs: usize,
    pub(crate) released_leases: usize,
}

/// What the shell must do, in order.
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(crate) enum Effect {
    /// Start a broker acquire (poll it once; otherwise run it in a task that reports
    /// [`Input::Acquired`]). `for_waiter` is a hint (tokens are fungible). Never for the
    /// supervisor's own pool, whose slots the core takes itself.
    Acquire {
        request: RequestId,
        for_waiter: Option<WaiterId>,
    },
    /// Drop a broker acquire still in flight: nobody needs what it would bring. A broker must
    /// not keep a queue place or a slot for a dropped acquire; an answer that was already on
    /// its way arrives as [`Input::Acquired`] all the same.
    AbortAcquire {
        request: RequestId,
    },
    /// Hand the lease's tokens to `waiter`: an explicit lease, or start the job.
    Deliver {
        waiter: WaiterId,
        key: LeaseKey,
        token: SlotToken,
        more: Box<[SlotToken]>,
    },
    /// Answer a waiter that gets no slot.
    Refuse {
        waiter: WaiterId,
        error: AcquireError,
    },
    StartRenewal {
        key: LeaseKey,
        token: SlotToken,
    },
    StopRenewal {
        key: LeaseKey,
    },
    /// Cancel a job (its body, tasks and process groups see it), or revoke an explicit lease
    /// (its `slot_id()` refuses, its `lost()` resolves). `lost` says the broker lost the lease.
    Cancel {
        key: LeaseKey,
        holder: Holder,
        lost: Option<String>,
    },
    /// A loss reported after the worker ended: logged only (the slot is still held here).
    LostAfterExit {
        key: LeaseKey,
        reason: String,
    },
    /// Replace a lost GPU device (or report [`Input::DeviceReplaced`] at once if it already
    /// was).
    RecreateDevice {
        device: usize,
    },
    /// Abort the job's tracked async tasks (shutdown, after the cancel grace).
    AbortTasks {
        key: LeaseKey,
    },
    /// Remove the job's temp dir, off the mailbox; report [`Input::ProvenOne`] with
    /// [`Proof::TempDir`] or [`Input::TempDirFailed`].
    RemoveTempDir {
        key: LeaseKey,
        dir: TempDir,
    },
    /// Release one token to the broker under the cleanup timeout; report [`Input::Released`].
    /// Never for the supervisor's own pool, to which the core gives its slots back itself.
    Release {
        key: LeaseKey,
        token: SlotToken,
    },
    /// The caller's answer. A failure nobody hears goes to the error sink.
    Answer {
        key: LeaseKey,
        answer: Answer,
    },
    /// A failure with no caller left (answered early, or a surplus token): the error sink.
    Sink {
        key: LeaseKey,
        error: CleanupError,
    },
    /// The lease is over: the shell forgets what it keeps for it and frees its GPU sub-slot.
    Forget {
        key: LeaseKey,
    },
    /// Re-check these unproven proofs and report them all in one [`Input::Rechecked`],
    /// returning `leases` and `purpose` as they are.
    Recheck {
        checks: Box<[(LeaseKey, Proof)]>,
        leases: Box<[LeaseKey]>,
        purpose: RecheckFor,
    },
    /// A control call's answer (sent once the turn's effects are visible).
    Reply {
        control: ControlId,
        reply: Reply,
    },
    /// Start the shutdown timers ([`Input::ShutdownGraceOver`], [`Input::ShutdownDeadline`]).
    ArmShutdownTimers,
    /// Close the GPU devices under a bound; report [`Input::GpuClosed`].
    CloseGpu,
    /// Close the broker (withdraw what it has in flight, give up its session) under the cleanup
    /// timeout; report [`Input::BrokerClosed`].
    CloseBroker,
    /// Shutdown is complete: answer every shutdown caller with this, and stop.
    Stopped {
        tally: StopTally,
        quarantine: Vec<QuarantineEntry>,
        /// Quarantined temp dirs are evidence: an owned work root that holds them is kept.
        keep_work_root: bool,
    },
    /// The orphan-expiry counter moved (metric).
    OrphanCounted,
    /// The broker handed out a token that would break invariant 2 (its slot or lease id is
    /// live): refused, not released, logged.
    TokenRefused(String),
    /// An input that does not fit the state: a bug somewhere, logged; nothing changed.
    Illegal(String),
}

/// What the shell does with what it still holds when it is dropped without a completed
/// shutdown (its runtime went away).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Abandon {
    /// Temp dirs may still be in use or quarantined: an owned work root is kept.
    pub(crate) keep_work_root: bool,
}

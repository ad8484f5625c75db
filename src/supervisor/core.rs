//! The pure core of the supervisor: every decision of the release pipeline, as data.
//!
//! No tokio, no ractor, no I/O, no clock. The actor shell turns each message it receives into
//! an [`Input`], applies it here, and performs the [`Effect`]s this returns, in order; it
//! decides nothing itself. The model-based tests drive this type directly, and the simulation
//! test drives the real actor around it.
//!
//! # A lease's life
//!
//! Each lease carries what is still owed before its slot may be reused (DESIGN.md section 2):
//!
//! - the worker's physical end: its task joined ([`Proof::WorkerJoined`]), its supervision
//!   event handled ([`Proof::EventHandled`]), every tracked task and blocking closure joined
//!   ([`Proof::TasksJoined`]), every process group it started proven empty
//!   ([`Proof::Process`]), every GPU submission it made completed ([`Proof::GpuFence`]);
//! - then its temp dir removed ([`Proof::Scratch`]), which is started only once every proof
//!   above is in;
//! - then the broker release, started only once nothing else is owed.
//!
//! A proof that is not in within its bound does not hold the caller: the lease is
//! *quarantined* with a [`Reason`] attached to that proof, the caller hears
//! `LEASE_CLEANUP_UNCONFIRMED` (or `LEASE_GPU_DEVICE_LOST`) at once, and the slot stays held,
//! counted and reported. A reason goes away only with the proof it waits for: a late proof on
//! its own ([`Why::Late`]), a device loss when the device is replaced ([`Why::Lost`]), an
//! unproven process group or an unremovable temp dir only through a re-check
//! ([`Why::Unproven`], see [`Input::ReclaimBegin`]).
//!
//! Nothing here panics on an input that does not fit the state (a proof for a lease that is
//! gone, a second release): such an input changes nothing and is reported as
//! [`Effect::Illegal`] or ignored, in every build.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::mem;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::broker::{BrokerError, SlotToken};
use crate::error::{AcquireError, CleanupError, CleanupErrorKind};
use crate::job::{PRIORITY_AGING_GRANTS, Priority};

/// Supervisor-internal key of one lease (not the broker's lease id).
pub(crate) type LeaseKey = u64;
/// Supervisor-internal id of one waiting acquire.
pub(crate) type WaiterId = u64;
/// Supervisor-internal id of one broker acquire.
pub(crate) type RequestId = u64;
/// Supervisor-internal id of one process group a job started.
pub(crate) type ProcessKey = u64;

/// Who holds a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    /// A `run` job: a worker actor, tracked tasks, maybe processes and GPU work, a temp dir.
    Job,
    /// An explicit `Lease` held by user code.
    Explicit,
    /// A token that arrived when nobody was waiting any more: released at once.
    Surplus,
}

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
    /// `try_acquire`: served at once or refused, never queued.
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

/// One proof the release of a lease waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Proof {
    /// The worker's actor task ended (its join handle resolved).
    WorkerJoined,
    /// The worker's supervision event was handled (any state it carried dropped).
    EventHandled,
    /// Every task and blocking closure spawned through the job's context returned.
    TasksJoined,
    /// One process group the job started was proven empty.
    Process(ProcessKey),
    /// Every GPU submission made under the lease completed.
    GpuFence,
    /// The job's temp dir was removed.
    Scratch,
}

impl Proof {
    fn bit(self) -> u8 {
        match self {
            Self::WorkerJoined => Owed::JOINED,
            Self::EventHandled => Owed::EVENT,
            Self::TasksJoined => Owed::TASKS,
            Self::GpuFence => Owed::GPU,
            Self::Scratch => Owed::SCRATCH,
            Self::Process(_) => 0,
        }
    }

    /// What the proof is about, for reasons and the lease table.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::WorkerJoined => "the worker's task",
            Self::EventHandled => "the worker's supervision event",
            Self::TasksJoined => "tasks spawned through the worker context",
            Self::Process(_) => "a process group",
            Self::GpuFence => "gpu work",
            Self::Scratch => "the temp dir",
        }
    }
}

/// Several proofs at once (the driver reports what it saw together in one message).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Proofs(u8);

impl Proofs {
    pub(crate) const JOINED: Self = Self(Owed::JOINED);
    pub(crate) const TASKS: Self = Self(Owed::TASKS);
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    pub(crate) const GPU: Self = Self(Owed::GPU);

    pub(crate) fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// Bits of the proofs a lease still owes (processes are counted apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Owed(u8);

impl Owed {
    const JOINED: u8 = 1;
    const EVENT: u8 = 2;
    const TASKS: u8 = 4;
    const GPU: u8 = 8;
    const SCRATCH: u8 = 16;
    /// Everything that makes up the worker's physical end (DESIGN.md section 2, steps 2 and 3).
    const PHYSICAL: u8 = Self::JOINED | Self::EVENT | Self::TASKS | Self::GPU;

    fn has(self, bit: u8) -> bool {
        self.0 & bit != 0
    }
}

/// Why a proof is missing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Why {
    /// Past its bound; still expected on its own (tasks past the drain bound, gpu work past
    /// the fence bound, anything at the shutdown deadline).
    Late,
    /// Could not be proven; only a re-check proves it ([`Input::ReclaimBegin`]).
    Unproven,
    /// The lease's GPU device was lost (on that generation of the device): its work died with
    /// it, proven once the device is replaced (or given up).
    Lost { device: usize, generation: u64 },
}

/// Why a lease is quarantined: one missing proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reason {
    pub(crate) proof: Proof,
    pub(crate) why: Why,
    pub(crate) detail: String,
}

/// Where a lease is, as users see it (derived from what it owes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Held by a running body or an explicit lease.
    Running,
    /// The body ended; proofs of its physical end (or the temp dir's removal) are still owed.
    Draining,
    /// A proof was not in within its bound: held, not reusable, reported.
    Quarantined,
    /// Physically done; the broker release is in flight.
    Releasing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    NotStarted,
    InFlight,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scratch {
    /// Not removable yet (or no temp dir: explicit leases, jobs that never started).
    Waiting,
    Removing,
    Failed,
}

/// One lease: what it holds, what it still owes, why it is quarantined.
#[derive(Debug)]
pub(crate) struct Lease {
    token: SlotToken,
    /// The other tokens of a multi-slot lease (empty for one slot).
    more: Vec<SlotToken>,
    holder: Holder,
    /// The class it was granted under.
    priority: Priority,
    owed: Owed,
    /// Process groups not yet proven empty.
    processes: Vec<ProcessKey>,
    device: Option<usize>,
    reasons: Vec<Reason>,
    scratch: Scratch,
    release: Release,
    /// Broker releases still to answer (one per token) once the release is in flight.
    releasing: u32,
    /// The first failure among them.
    release_error: Option<CleanupError>,
    renewing: bool,
    /// The caller has its answer (the final one, or an early one on quarantine).
    answered: bool,
    /// Why the temp dir could not be removed, kept for the early answer.
    io: Option<io::Error>,
    cancelled: bool,
    /// Which of the core's phase counts (`draining`, `quarantined`) includes it.
    counted: Option<Phase>,
}

impl Lease {
    pub(crate) fn token(&self) -> SlotToken {
        self.token
    }

    /// Every token, the first one first.
    #[cfg(test)]
    pub(crate) fn tokens(&self) -> impl Iterator<Item = SlotToken> + '_ {
        std::iter::once(self.token).chain(self.more.iter().copied())
    }

    /// The other tokens of a multi-slot lease.
    pub(crate) fn more_tokens(&self) -> &[SlotToken] {
        &self.more
    }

    pub(crate) fn holder(&self) -> Holder {
        self.holder
    }

    pub(crate) fn priority(&self) -> Priority {
        self.priority
    }

    pub(crate) fn device(&self) -> Option<usize> {
        self.device
    }

    /// The broker release is in flight.
    pub(crate) fn is_releasing(&self) -> bool {
        self.release == Release::InFlight
    }

    pub(crate) fn reasons(&self) -> &[Reason] {
        &self.reasons
    }

    pub(crate) fn phase(&self) -> Phase {
        if self.release == Release::InFlight {
            Phase::Releasing
        } else if !self.reasons.is_empty() {
            Phase::Quarantined
        } else if self.holder == Holder::Job && self.body_ended() {
            Phase::Draining
        } else {
            Phase::Running
        }
    }

    /// Either proof of the worker's end means its body has ended.
    fn body_ended(&self) -> bool {
        !self.owed.has(Owed::JOINED) || !self.owed.has(Owed::EVENT)
    }

    /// What the lease still waits for, in pipeline order (no allocation: the lease table
    /// reads it on the actor's hot path).
    pub(crate) fn owing(&self) -> impl Iterator<Item = Proof> + '_ {
        let physical = [
            Proof::WorkerJoined,
            Proof::EventHandled,
            Proof::TasksJoined,
            Proof::GpuFence,
        ];
        physical
            .into_iter()
            .filter(|p| self.owed.has(p.bit()))
            .chain(self.processes.iter().map(|p| Proof::Process(*p)))
            .chain(self.owed.has(Owed::SCRATCH).then_some(Proof::Scratch))
    }

    /// Nothing is owed (an explicit lease, or one whose release has begun).
    pub(crate) fn owes_nothing(&self) -> bool {
        self.owed.0 == 0 && self.processes.is_empty()
    }

    /// [`owing`](Self::owing), collected.
    pub(crate) fn waiting_for(&self) -> Vec<Proof> {
        self.owing().collect()
    }

    fn physically_done(&self) -> bool {
        self.owed.0 & Owed::PHYSICAL == 0 && self.processes.is_empty()
    }

    fn owes(&self, proof: Proof) -> bool {
        match proof {
            Proof::Process(p) => self.processes.contains(&p),
            other => self.owed.has(other.bit()),
        }
    }

    fn is_quarantined(&self) -> bool {
        !self.reasons.is_empty() && self.release == Release::NotStarted
    }

    /// The early answer a quarantine gives the caller.
    fn unconfirmed(&self) -> CleanupError {
        let detail = self
            .reasons
            .iter()
            .map(|r| r.detail.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        match self
            .reasons
            .iter()
            .find(|r| matches!(r.why, Why::Lost { .. }))
        {
            Some(_) => CleanupError::with_kind(CleanupErrorKind::GpuDeviceLost, self.token, detail),
            None => CleanupError::unconfirmed(self.token, detail, None),
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

/// Everything that can happen to the supervisor, as the core sees it.
#[derive(Debug)]
pub(crate) enum Input {
    /// A caller joins the queue (or, asking `now_only`, is served at once or refused).
    Enqueue { waiter: WaiterId, ask: Ask },
    /// The in-process pool's capacity changed (`resize`): waiters asking for more slots than
    /// it now has are refused; lowering it never revokes a lease.
    Resize { capacity: u32 },
    /// Cancel that job (`Supervisor::cancel`): it goes through the pipeline as any cancel.
    CancelJob { key: LeaseKey },
    /// A caller stops waiting (cancelled, timed out). Ignored once it has been served.
    Withdraw { waiter: WaiterId, why: Withdrawal },
    /// A broker acquire ended.
    Acquired {
        request: RequestId,
        result: Result<SlotToken, BrokerError>,
    },
    /// The lease granted by [`Effect::Deliver`] found nobody: its caller left before it could be
    /// handed over. Nobody used it: it goes to the next waiter.
    Undelivered { key: LeaseKey },
    /// The job granted by [`Effect::Deliver`] could not start (no worker, no GPU sub-slot); no
    /// body ran. Its caller is answered when the token is back.
    NotStarted { key: LeaseKey },
    /// The job's worker is running; `device` is its GPU placement.
    Started {
        key: LeaseKey,
        device: Option<usize>,
    },
    /// Proofs arrived.
    Proven { key: LeaseKey, proofs: Proofs },
    /// One proof arrived (events, processes, the temp dir, re-checks).
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
    ScratchFailed {
        key: LeaseKey,
        detail: String,
        error: io::Error,
    },
    /// The lease's GPU device was lost (seen by its fence) on that generation of the device.
    DeviceLost {
        key: LeaseKey,
        device: usize,
        generation: u64,
        reason: String,
    },
    /// A lost device was replaced (or given up for good); `generation` is the device's now.
    /// Work on every earlier generation is gone.
    DeviceReplaced { device: usize, generation: u64 },
    /// An explicit lease is given back (`release`, or its drop).
    ReleaseRequested { key: LeaseKey },
    /// A broker release ended (any outcome ends the lease).
    Released {
        key: LeaseKey,
        result: Result<(), CleanupError>,
    },
    /// The broker could not keep a lease alive.
    LeaseLost { key: LeaseKey, reason: String },
    /// A distributed broker saw an orphaned lease expire.
    OrphanExpired,
    /// `reclaim_quarantined` begins: [`Effect::Recheck`] for every unproven proof follows.
    ReclaimBegin,
    /// `reclaim_quarantined` ends: every re-check has been reported.
    ReclaimEnd,
    /// `shutdown` (or the last handle dropped).
    Shutdown,
    /// The cancel grace has passed since shutdown began: tracked tasks still running are
    /// aborted.
    ShutdownGraceOver,
    /// The shutdown bound has passed: whatever is still owed is quarantined.
    ShutdownDeadline,
    /// The GPU devices were closed at shutdown (or their close ran past its bound).
    GpuClosed,
}

/// What the shell must do, in order.
#[derive(Debug)]
pub(crate) enum Effect {
    /// Start a broker acquire (poll it once; otherwise run it in a task that reports
    /// [`Input::Acquired`]).
    Acquire {
        request: RequestId,
        for_waiter: Option<WaiterId>,
    },
    /// Drop every broker acquire still in flight (shutdown).
    AbortAcquires,
    /// Hand `token` to `waiter`: an explicit lease, or start the job.
    Deliver {
        waiter: WaiterId,
        key: LeaseKey,
        token: SlotToken,
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
    /// [`Proof::Scratch`] or [`Input::ScratchFailed`].
    RemoveScratch {
        key: LeaseKey,
    },
    /// Release the token to the broker under the cleanup timeout; report [`Input::Released`].
    Release {
        key: LeaseKey,
        token: SlotToken,
    },
    /// The caller's answer: the job's `run`, or every `release` waiting on the explicit lease.
    /// A failure nobody hears goes to the error sink.
    Answer {
        key: LeaseKey,
        result: Result<(), CleanupError>,
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
    /// Re-check an unproven proof; report [`Input::ProvenOne`] or nothing.
    Recheck {
        key: LeaseKey,
        proof: Proof,
    },
    /// The reclaim's answer.
    Reclaimed {
        reclaimed: Vec<SlotToken>,
        still: Vec<LeaseKey>,
    },
    /// Start the shutdown timers ([`Input::ShutdownGraceOver`], [`Input::ShutdownDeadline`]).
    ArmShutdownTimers,
    /// Close the GPU devices under a bound; report [`Input::GpuClosed`].
    CloseGpu,
    /// Shutdown is complete: answer every shutdown caller and stop.
    Stopped,
    /// The orphan-expiry counter moved (metric).
    OrphanCounted,
    /// The broker handed out a token that would break invariant 2 (its slot or lease id is
    /// live): refused, not released, logged.
    TokenRefused(String),
    /// An input that does not fit the state: a bug somewhere, logged; nothing changed.
    Illegal(String),
}

/// Monotonic counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) acquired_total: u64,
    pub(crate) released_total: u64,
    pub(crate) release_failed_total: u64,
    pub(crate) orphan_expired_total: u64,
}

/// What shutdown did (the shell adds what it alone knows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StopTally {
    pub(crate) refused_waiters: usize,
    pub(crate) cancelled_jobs: usize,
    pub(crate) released_leases: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Serving,
    Stopping {
        gpu: GpuClose,
        deadline_passed: bool,
    },
    Stopped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GpuClose {
    NotNeeded,
    Pending,
    Closing,
    Closed,
}

/// A queued waiter in 8 bytes: its id shifted left once, what it wants in the low bit (waiter
/// ids come from a counter and never reach 2^63). The flood keeps 100 000 of these in a
/// `VecDeque`: half the size of a `(WaiterId, Want)` pair, about 10 bytes per waiting job.
#[derive(Debug, Clone, Copy)]
struct Queued(u64);

impl Queued {
    fn new(waiter: WaiterId, want: Want) -> Self {
        debug_assert!(waiter < 1 << 63, "waiter id {waiter} out of range");
        Self(waiter << 1 | u64::from(want == Want::Job))
    }

    fn waiter(self) -> WaiterId {
        self.0 >> 1
    }

    fn want(self) -> Want {
        if self.0 & 1 == 1 {
            Want::Job
        } else {
            Want::Lease
        }
    }
}

/// A queued waiter and its deadline under the aging rule (see [`Priority`]).
#[derive(Debug, Clone, Copy)]
struct Entry {
    queued: Queued,
    deadline: u64,
}

/// The waiters: FIFO within each priority class, the earliest deadline first across classes,
/// with O(1) withdrawal (lazy deletion).
#[derive(Debug, Default)]
struct WaitQueue {
    classes: [VecDeque<Entry>; Priority::COUNT],
    live: FxHashSet<WaiterId>,
    /// The slots of the waiters that want more than one (absent: one).
    multi: FxHashMap<WaiterId, u32>,
    /// Slots wanted by the live waiters, all together.
    wanted: usize,
    /// Waiters served so far: the clock of the aging rule.
    served: u64,
}

impl WaitQueue {
    fn push(&mut self, waiter: WaiterId, ask: Ask) {
        if !self.live.insert(waiter) {
            return;
        }
        if ask.slots > 1 {
            self.multi.insert(waiter, ask.slots);
        }
        self.wanted += ask.slots as usize;
        let rank = ask.priority.rank();
        let deadline = self.served + rank as u64 * PRIORITY_AGING_GRANTS;
        self.classes[rank].push_back(Entry {
            queued: Queued::new(waiter, ask.want),
            deadline,
        });
    }

    /// Takes a waiter out of the queue; its slots, if it was in it.
    fn remove(&mut self, waiter: WaiterId) -> Option<u32> {
        if !self.live.remove(&waiter) {
            return None;
        }
        let slots = self.slots_of(waiter);
        self.wanted -= slots as usize;
        // Withdrawn ids stay queued until popped; compact when they dominate, so that a
        // long-lived head with many withdrawn waiters behind it cannot grow the queue without
        // bound (amortised O(1) per withdrawal).
        let queued: usize = self.classes.iter().map(VecDeque::len).sum();
        if queued > 2 * self.live.len() + 16 {
            let live = &self.live;
            for class in &mut self.classes {
                class.retain(|e| live.contains(&e.queued.waiter()));
            }
        }
        Some(slots)
    }

    /// The class whose live front is served next: the earliest deadline, then the earliest
    /// caller. Drops withdrawn entries from the fronts.
    fn next_class(&mut self) -> Option<usize> {
        let live = &self.live;
        let mut best: Option<(u64, WaiterId, usize)> = None;
        for (rank, class) in self.classes.iter_mut().enumerate() {
            while let Some(e) = class.front() {
                if live.contains(&e.queued.waiter()) {
                    break;
                }
                class.pop_front();
            }
            if let Some(e) = class.front() {
                let key = (e.deadline, e.queued.waiter(), rank);
                if best.is_none_or(|b| key < b) {
                    best = Some(key);
                }
            }
        }
        best.map(|(_, _, rank)| rank)
    }

    /// Serves the next waiter: who, what it wants, its slots, its class.
    fn pop(&mut self) -> Option<Served> {
        loop {
            // One class in use (the common case): its front, withdrawn entries skipped here.
            let rank = match self.classes.iter().filter(|c| !c.is_empty()).count() {
                0 => return None,
                1 => self.classes.iter().position(|c| !c.is_empty())?,
                _ => self.next_class()?,
            };
            let entry = self.classes[rank].pop_front()?;
            let waiter = entry.queued.waiter();
            if !self.live.remove(&waiter) {
                continue;
            }
            let slots = self.slots_of(waiter);
            self.wanted -= slots as usize;
            self.served += 1;
            return Some(Served {
                waiter,
                want: entry.queued.want(),
                slots,
                priority: PRIORITIES[rank],
            });
        }
    }

    /// Takes a leaving waiter's slot count out of `multi` (one when it is not there).
    fn slots_of(&mut self, waiter: WaiterId) -> u32 {
        if self.multi.is_empty() {
            return 1;
        }
        self.multi.remove(&waiter).unwrap_or(1)
    }

    /// The waiter served next, without removing it.
    fn head(&mut self) -> Option<WaiterId> {
        let rank = self.next_class()?;
        self.classes[rank].front().map(|e| e.queued.waiter())
    }

    /// Waiters asking for more slots than `capacity`, in id order.
    fn over(&self, capacity: u32) -> Vec<(WaiterId, u32)> {
        let mut over: Vec<(WaiterId, u32)> = self
            .multi
            .iter()
            .filter(|(_, slots)| **slots > capacity)
            .map(|(w, s)| (*w, *s))
            .collect();
        over.sort_unstable();
        over
    }

    fn len(&self) -> usize {
        self.live.len()
    }

    fn wanted(&self) -> usize {
        self.wanted
    }

    fn shrink(&mut self) {
        for class in &mut self.classes {
            shrink_deque(class);
        }
        shrink_set(&mut self.live);
        shrink_map(&mut self.multi);
    }
}

/// The classes by rank.
const PRIORITIES: [Priority; Priority::COUNT] = [Priority::High, Priority::Normal, Priority::Low];

/// A waiter taken from the queue to be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Served {
    waiter: WaiterId,
    want: Want,
    slots: u32,
    priority: Priority,
}

/// A multi-slot waiter at the head of the queue, gathering its tokens.
#[derive(Debug)]
struct Gather {
    served: Served,
    tokens: Vec<SlotToken>,
}

/// The core: the slot table, the waiter queue, the proofs each lease owes, shutdown.
#[derive(Debug)]
pub(crate) struct Core {
    capacity: Option<usize>,
    /// The broker renews leases (start a renewal per grant).
    renews: bool,
    /// The supervisor owns GPU devices (close them at shutdown).
    gpu: bool,
    /// Check every token against the live leases (invariant 2). Off only for the supervisor's
    /// own in-process broker, which cannot hand out a live slot or lease id.
    check_tokens: bool,
    /// The broker is the supervisor's own in-process pool: its capacity is exact and nobody
    /// else takes from it, so multi-slot leases, `try_acquire` and resizing are possible.
    exact: bool,
    leases: FxHashMap<LeaseKey, Lease>,
    /// Tokens held from the broker: every lease's, and those a multi-slot waiter has gathered.
    held: usize,
    /// Slot id → the newest lease on it; lease id → its lease (to refuse duplicates).
    by_slot: FxHashMap<u32, LeaseKey>,
    by_lease_id: FxHashMap<u64, LeaseKey>,
    queue: WaitQueue,
    /// The multi-slot waiter at the head, gathering its tokens.
    gather: Option<Gather>,
    /// `try_acquire` callers admitted in this batch: served before the queue.
    pinned: VecDeque<Served>,
    /// Leases whose table row may have changed since the shell last looked.
    touched: Vec<LeaseKey>,
    /// Broker acquires in flight.
    acquiring: FxHashSet<RequestId>,
    next_request: RequestId,
    next_key: LeaseKey,
    quarantined: usize,
    /// Jobs whose body has ended, their physical end or temp dir still being proven.
    draining: usize,
    stop: Stop,
    stop_tally: StopTally,
    counters: Counters,
    /// A reclaim in progress: leases re-checked so far.
    reclaiming: Option<Vec<LeaseKey>>,
    effects: VecDeque<Effect>,
}

impl Core {
    pub(crate) fn new(capacity: Option<u32>, renews: bool, gpu: bool) -> Self {
        Self {
            capacity: capacity.map(|c| c as usize),
            renews,
            gpu,
            check_tokens: true,
            exact: false,
            leases: FxHashMap::default(),
            held: 0,
            by_slot: FxHashMap::default(),
            by_lease_id: FxHashMap::default(),
            queue: WaitQueue::default(),
            gather: None,
            pinned: VecDeque::new(),
            touched: Vec::new(),
            acquiring: FxHashSet::default(),
            next_request: 1,
            next_key: 1,
            quarantined: 0,
            draining: 0,
            stop: Stop::Serving,
            stop_tally: StopTally::default(),
            counters: Counters::default(),
            reclaiming: None,
            effects: VecDeque::new(),
        }
    }

    /// The next effect to perform. Performing it may apply more inputs, whose effects queue
    /// behind the ones already here.
    pub(crate) fn pop_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// Trusts the broker's tokens: for the supervisor's own `LocalBroker` only, whose slots
    /// and strictly increasing lease ids make a collision impossible by construction.
    pub(crate) fn trusting_tokens(mut self) -> Self {
        self.check_tokens = false;
        self.exact = true;
        self
    }

    /// Moves the keys of the leases touched since the last call into `into` (sorted, once
    /// each).
    pub(crate) fn take_touched(&mut self, into: &mut Vec<LeaseKey>) {
        into.append(&mut self.touched);
        if into.len() > 1 {
            into.sort_unstable();
            into.dedup();
        }
    }

    fn touch(&mut self, key: LeaseKey) {
        // Consecutive touches of one lease (the common case: a release and its answer) are one.
        if self.touched.last() != Some(&key) {
            self.touched.push(key);
        }
    }

    pub(crate) fn has_effects(&self) -> bool {
        !self.effects.is_empty()
    }

    fn emit(&mut self, effect: Effect) {
        self.effects.push_back(effect);
    }

    fn illegal(&mut self, what: fmt::Arguments<'_>) {
        self.emit(Effect::Illegal(what.to_string()));
    }

    /// Applies one input.
    pub(crate) fn apply(&mut self, input: Input) {
        match input {
            Input::Enqueue { waiter, ask } => self.enqueue(waiter, ask),
            Input::Withdraw { waiter, why } => self.withdraw(waiter, why.into_error()),
            Input::Resize { capacity } => self.resize(capacity),
            Input::CancelJob { key } => self.cancel_job(key),
            Input::Acquired { request, result } => self.acquired(request, result),
            Input::Undelivered { key } => self.undelivered(key),
            Input::NotStarted { key } => self.not_started(key),
            Input::Started { key, device } => self.started(key, device),
            Input::Proven { key, proofs } => self.proven(key, proofs.0, None),
            Input::ProvenOne { key, proof } => match proof {
                Proof::Process(p) => self.proven(key, 0, Some(p)),
                other => self.proven(key, other.bit(), None),
            },
            Input::ProcessStarted { key, process } => match self.leases.get_mut(&key) {
                Some(lease) if lease.holder == Holder::Job && lease.owed.has(Owed::TASKS) => {
                    lease.processes.push(process);
                    self.touch(key);
                }
                _ => self.illegal(format_args!("process {process} started for lease {key}")),
            },
            Input::Late { key, proof, detail } => self.missing(key, proof, Why::Late, detail, None),
            Input::Unproven { key, proof, detail } => {
                self.missing(key, proof, Why::Unproven, detail, None)
            }
            Input::ScratchFailed { key, detail, error } => self.scratch_failed(key, detail, error),
            Input::DeviceLost {
                key,
                device,
                generation,
                reason,
            } => {
                self.missing(
                    key,
                    Proof::GpuFence,
                    Why::Lost { device, generation },
                    format!("gpu device {device} lost: {reason}"),
                    None,
                );
                // The slot is needed back: replace the device (or learn it already was).
                self.emit(Effect::RecreateDevice { device });
            }
            Input::DeviceReplaced { device, generation } => {
                self.device_replaced(device, generation)
            }
            Input::ReleaseRequested { key } => self.release_requested(key),
            Input::Released { key, result } => self.released(key, result),
            Input::LeaseLost { key, reason } => self.lease_lost(key, reason),
            Input::OrphanExpired => {
                self.counters.orphan_expired_total += 1;
                self.emit(Effect::OrphanCounted);
            }
            Input::ReclaimBegin => self.reclaim_begin(),
            Input::ReclaimEnd => self.reclaim_end(),
            Input::Shutdown => self.shutdown(),
            Input::ShutdownGraceOver => self.shutdown_grace_over(),
            Input::ShutdownDeadline => self.shutdown_deadline(),
            Input::GpuClosed => {
                if let Stop::Stopping { gpu, .. } = &mut self.stop {
                    *gpu = GpuClose::Closed;
                }
            }
        }
    }

    /// After a batch of inputs: start the broker acquires the queue needs, and finish a
    /// shutdown that has nothing left to wait for.
    pub(crate) fn settle(&mut self) {
        if self.stop == Stop::Serving {
            let uncovered = self.demand().saturating_sub(self.acquiring.len());
            let n = uncovered.min(self.room());
            // The head's id travels with each request, as a hint (tokens are fungible); the
            // supervisor's own pool has no use for it.
            let for_waiter = match (n, &self.gather) {
                (0, _) => None,
                _ if self.exact => None,
                (_, Some(g)) => Some(g.served.waiter),
                _ => match self.pinned.front() {
                    Some(p) => Some(p.waiter),
                    None => self.queue.head(),
                },
            };
            for _ in 0..n {
                let request = self.next_request;
                self.next_request += 1;
                self.acquiring.insert(request);
                self.emit(Effect::Acquire {
                    request,
                    for_waiter,
                });
            }
        }
        self.maybe_stopped();
    }

    /// Slots the waiters still need: the queue's, the admitted `try_acquire` callers', and what
    /// the gathering head lacks.
    fn demand(&self) -> usize {
        let pinned: usize = self.pinned.iter().map(|p| p.slots as usize).sum();
        let gathering = self
            .gather
            .as_ref()
            .map_or(0, |g| g.served.slots as usize - g.tokens.len());
        self.queue.wanted() + pinned + gathering
    }

    /// Tokens that may still be asked for without passing the capacity.
    fn room(&self) -> usize {
        match self.capacity {
            Some(cap) => cap.saturating_sub(self.held + self.acquiring.len()),
            None => usize::MAX,
        }
    }

    fn enqueue(&mut self, waiter: WaiterId, ask: Ask) {
        let refuse = if self.stop != Stop::Serving {
            Some(AcquireError::Stopped)
        } else if (ask.slots > 1 || ask.now_only) && !self.exact {
            Some(AcquireError::Unsupported(if ask.now_only {
                "try_acquire"
            } else {
                "multi-slot leases"
            }))
        } else if ask.slots == 0 || self.capacity.is_some_and(|c| ask.slots as usize > c) {
            Some(AcquireError::SlotCount {
                wanted: ask.slots,
                capacity: self.capacity.map_or(u32::MAX, |c| c as u32),
            })
        } else if ask.now_only
            && (self.queue.len() > 0
                || self.gather.is_some()
                || self.demand() + ask.slots as usize > self.room() + self.acquiring.len())
        {
            // Nobody may be overtaken, and the slots must be free now.
            Some(AcquireError::NoSlotFree)
        } else {
            None
        };
        match refuse {
            Some(error) => self.emit(Effect::Refuse { waiter, error }),
            None if ask.now_only => self.pinned.push_back(Served {
                waiter,
                want: ask.want,
                slots: ask.slots,
                priority: ask.priority,
            }),
            None => self.queue.push(waiter, ask),
        }
    }

    /// A waiter leaves without a slot (cancelled, timed out): from the queue, from the admitted
    /// `try_acquire` callers, or from the head while gathering (its tokens go on to the next
    /// waiters). Ignored once it has been served.
    fn withdraw(&mut self, waiter: WaiterId, error: AcquireError) {
        if self.queue.remove(waiter).is_some() {
            return self.emit(Effect::Refuse { waiter, error });
        }
        if let Some(i) = self.pinned.iter().position(|p| p.waiter == waiter) {
            self.pinned.remove(i);
            return self.emit(Effect::Refuse { waiter, error });
        }
        if self
            .gather
            .as_ref()
            .is_some_and(|g| g.served.waiter == waiter)
        {
            let gather = self.gather.take().expect("checked");
            self.emit(Effect::Refuse { waiter, error });
            self.held -= gather.tokens.len();
            for token in gather.tokens {
                self.hand_to_next(token);
            }
        }
    }

    fn resize(&mut self, capacity: u32) {
        if !self.exact {
            return self.illegal(format_args!("resize of a broker that is not the pool"));
        }
        self.capacity = Some(capacity as usize);
        // Lowering never revokes a lease: it takes effect as leases return (`room`). Waiters
        // that can no longer ever be served hear it now.
        let error = |wanted| AcquireError::SlotCount { wanted, capacity };
        for (waiter, slots) in self.queue.over(capacity) {
            self.queue.remove(waiter);
            self.emit(Effect::Refuse {
                waiter,
                error: error(slots),
            });
        }
        if let Some(g) = &self.gather
            && g.served.slots > capacity
        {
            let Served { waiter, slots, .. } = g.served;
            self.withdraw(waiter, error(slots));
        }
    }

    fn cancel_job(&mut self, key: LeaseKey) {
        if let Some(lease) = self.leases.get_mut(&key)
            && lease.holder == Holder::Job
            && !lease.cancelled
            && lease.release == Release::NotStarted
        {
            lease.cancelled = true;
            self.emit(Effect::Cancel {
                key,
                holder: Holder::Job,
                lost: None,
            });
        }
    }

    /// The waiter that hears a broker's failure: the longest waiter (the gathering head first,
    /// whose tokens then go on).
    fn refuse_longest(&mut self, error: AcquireError) {
        if let Some(g) = &self.gather {
            let waiter = g.served.waiter;
            return self.withdraw(waiter, error);
        }
        let next = match self.pinned.pop_front() {
            Some(p) => Some(p.waiter),
            None => self.queue.pop().map(|s| s.waiter),
        };
        if let Some(waiter) = next {
            self.emit(Effect::Refuse { waiter, error });
        }
    }

    fn acquired(&mut self, request: RequestId, result: Result<SlotToken, BrokerError>) {
        let expected = self.acquiring.remove(&request);
        let token = match result {
            Ok(token) => token,
            Err(err) => {
                // Tokens are fungible and so are failures: the longest waiter hears it.
                if expected {
                    self.refuse_longest(AcquireError::Failed(err));
                }
                return;
            }
        };
        if let Err(refused) = self.check_token(token) {
            // Not released: releasing a duplicate could free the live holder's slot.
            self.emit(Effect::TokenRefused(refused.clone()));
            if expected {
                let err = BrokerError::invalid_response(refused);
                self.refuse_longest(AcquireError::Failed(err));
            }
            return;
        }
        if !expected && self.stop != Stop::Serving {
            // An acquire aborted at shutdown answered anyway: it goes straight back.
            self.return_surplus(token);
            return;
        }
        self.hand_to_next(token);
    }

    /// Grants `token` to the waiter served next (the gathering head first, then admitted
    /// `try_acquire` callers, then the queue), or releases it when nobody waits.
    fn hand_to_next(&mut self, token: SlotToken) {
        if let Some(g) = &mut self.gather {
            g.tokens.push(token);
            self.held += 1;
            if g.tokens.len() == g.served.slots as usize {
                let g = self.gather.take().expect("checked");
                self.held -= g.tokens.len();
                let mut tokens = g.tokens.into_iter();
                let first = tokens.next().expect("a multi-slot waiter has tokens");
                self.deliver(g.served, first, tokens.collect());
            }
            return;
        }
        let next = self.pinned.pop_front().or_else(|| self.queue.pop());
        match next {
            Some(served) if served.slots == 1 => self.deliver(served, token, Vec::new()),
            Some(served) => {
                self.held += 1;
                self.gather = Some(Gather {
                    served,
                    tokens: vec![token],
                });
            }
            None => {
                self.return_surplus(token);
            }
        }
    }

    fn deliver(&mut self, served: Served, token: SlotToken, more: Vec<SlotToken>) {
        let holder = match served.want {
            Want::Lease => Holder::Explicit,
            Want::Job => Holder::Job,
        };
        let key = self.grant(token, more, holder, served.priority);
        self.emit(Effect::Deliver {
            waiter: served.waiter,
            key,
            token,
        });
    }

    /// Checks a broker's token against every live lease. A lease whose broker release is in
    /// flight does not conflict: the broker may apply the release and grant the slot again
    /// before the release's answer arrives here (a remote broker, or one shared by several
    /// supervisors); refusing such a token would leak it, since a refused token is never
    /// released.
    fn check_token(&self, token: SlotToken) -> Result<(), String> {
        if !self.check_tokens {
            return Ok(());
        }
        let live = |key: Option<&LeaseKey>| {
            key.and_then(|k| self.leases.get(k))
                .filter(|l| l.release == Release::NotStarted)
                .map(|l| l.token)
        };
        if let Some(holder) = live(self.by_slot.get(&token.slot_id())) {
            return Err(format!(
                "broker granted {token} but that slot is held by live {holder}"
            ));
        }
        if let Some(holder) = live(self.by_lease_id.get(&token.lease_id())) {
            return Err(format!(
                "broker granted {token} but that lease id is live as {holder}"
            ));
        }
        Ok(())
    }

    /// A token nobody waits for (any more): held as a surplus lease while it goes straight back
    /// to the broker.
    fn return_surplus(&mut self, token: SlotToken) {
        let key = self.grant(token, Vec::new(), Holder::Surplus, Priority::Normal);
        self.start_release(key);
    }

    fn grant(
        &mut self,
        token: SlotToken,
        more: Vec<SlotToken>,
        holder: Holder,
        priority: Priority,
    ) -> LeaseKey {
        let key = self.next_key;
        self.next_key += 1;
        self.held += 1 + more.len();
        // A job owes its worker's physical end from the start; what it does not start (GPU
        // work, processes) is added or cleared as it is learnt.
        let owed = match holder {
            Holder::Job => Owed(Owed::JOINED | Owed::EVENT | Owed::TASKS | Owed::SCRATCH),
            Holder::Explicit | Holder::Surplus => Owed(0),
        };
        self.leases.insert(
            key,
            Lease {
                token,
                more,
                holder,
                priority,
                owed,
                processes: Vec::new(),
                device: None,
                reasons: Vec::new(),
                scratch: Scratch::Waiting,
                release: Release::NotStarted,
                releasing: 0,
                release_error: None,
                renewing: false,
                answered: false,
                io: None,
                cancelled: false,
                counted: None,
            },
        );
        if self.check_tokens {
            // Multi-slot leases come only from the pool, whose tokens are trusted.
            self.by_slot.insert(token.slot_id(), key);
            self.by_lease_id.insert(token.lease_id(), key);
        }
        self.touch(key);
        self.counters.acquired_total += 1;
        if self.renews && holder != Holder::Surplus {
            self.leases.get_mut(&key).expect("just inserted").renewing = true;
            self.emit(Effect::StartRenewal { key, token });
        }
        key
    }

    fn undelivered(&mut self, key: LeaseKey) {
        let Some(lease) = self.leases.get(&key) else {
            return self.illegal(format_args!("undelivered lease {key} is not live"));
        };
        if lease.holder == Holder::Surplus || lease.release != Release::NotStarted {
            return self.illegal(format_args!(
                "undelivered lease {key} was not being delivered"
            ));
        }
        // Nobody ever saw it: forget the grant (it is not counted twice) and pass the tokens on.
        let lease = self.remove(key);
        self.counters.acquired_total -= 1;
        self.emit(Effect::StopRenewal { key });
        self.emit(Effect::Forget { key });
        for token in std::iter::once(lease.token).chain(lease.more) {
            if self.stop == Stop::Serving {
                self.hand_to_next(token);
            } else {
                self.return_surplus(token);
            }
        }
    }

    fn not_started(&mut self, key: LeaseKey) {
        let Some(lease) = self.leases.get_mut(&key) else {
            return self.illegal(format_args!("lease {key} that did not start is not live"));
        };
        // No worker ran: nothing physical is owed. The caller hears why once the token is back
        // (`run` returns only after the pipeline), through the usual answer.
        lease.owed = Owed(0);
        self.advance(key);
    }

    fn started(&mut self, key: LeaseKey, device: Option<usize>) {
        let Some(lease) = self.leases.get_mut(&key) else {
            return self.illegal(format_args!("started lease {key} is not live"));
        };
        if device.is_some() {
            lease.owed.0 |= Owed::GPU;
            lease.device = device;
        }
        let cancelled = lease.cancelled;
        if device.is_some() {
            self.touch(key);
        }
        if self.stop != Stop::Serving && !cancelled {
            // Granted just as shutdown began: cancel it with the rest.
            self.cancel_job_for_shutdown(key);
        }
    }

    /// Shutdown cancels a job not cancelled yet (counted once in the report).
    fn cancel_job_for_shutdown(&mut self, key: LeaseKey) {
        if let Some(lease) = self.leases.get_mut(&key) {
            lease.cancelled = true;
        }
        self.stop_tally.cancelled_jobs += 1;
        self.emit(Effect::Cancel {
            key,
            holder: Holder::Job,
            lost: None,
        });
    }

    fn proven(&mut self, key: LeaseKey, bits: u8, process: Option<ProcessKey>) {
        let Some(lease) = self.leases.get_mut(&key) else {
            return self.illegal(format_args!("proof for lease {key}, which is not live"));
        };
        let owed_process = process.is_none_or(|p| lease.processes.contains(&p));
        // The temp dir is proven removed only by the removal the core asked for.
        let scratch_ok = bits & Owed::SCRATCH == 0 || lease.scratch == Scratch::Removing;
        if lease.owed.0 & bits != bits || !owed_process || !scratch_ok {
            return self.illegal(format_args!(
                "proof {bits:#x}/{process:?} for lease {key}, which does not owe it"
            ));
        }
        lease.owed.0 &= !bits;
        if bits & Owed::SCRATCH != 0 {
            lease.scratch = Scratch::Waiting;
        }
        if let Some(p) = process {
            lease.processes.retain(|q| *q != p);
        }
        lease
            .reasons
            .retain(|r| lease_owes(&lease.owed, &lease.processes, r.proof));
        if bits & Owed::JOINED != 0 {
            // The body's result exists now: a quarantine found earlier is answered.
            self.answer_early(key, None);
        }
        self.advance(key);
    }

    /// A proof is missing past its bound, or cannot be made: quarantine, and tell the caller.
    fn missing(
        &mut self,
        key: LeaseKey,
        proof: Proof,
        why: Why,
        detail: String,
        error: Option<io::Error>,
    ) {
        let Some(lease) = self.leases.get_mut(&key) else {
            return self.illegal(format_args!(
                "{proof:?} missing for lease {key}, which is not live"
            ));
        };
        if !lease.owes(proof) || lease.release != Release::NotStarted {
            return self.illegal(format_args!(
                "{proof:?} missing for lease {key}, which does not owe it"
            ));
        }
        // One reason per proof: the newest says most (a loss after a late fence, say).
        lease.reasons.retain(|r| r.proof != proof);
        lease.reasons.push(Reason { proof, why, detail });
        self.refresh(key);
        self.answer_early(key, error);
    }

    fn scratch_failed(&mut self, key: LeaseKey, detail: String, error: io::Error) {
        match self.leases.get_mut(&key) {
            Some(lease) if lease.scratch == Scratch::Removing => {
                lease.scratch = Scratch::Failed;
                self.missing(key, Proof::Scratch, Why::Unproven, detail, Some(error));
            }
            _ => self.illegal(format_args!(
                "temp dir removal failed for lease {key}, which was not removing it"
            )),
        }
    }

    /// A quarantined job answers its caller at once, without waiting for what may never be
    /// proven, but not before its worker has joined: the answer carries the body's own result,
    /// which exists only once the body has ended.
    fn answer_early(&mut self, key: LeaseKey, io: Option<io::Error>) {
        let lease = self.leases.get_mut(&key).expect("checked by the caller");
        if io.is_some() {
            lease.io = io;
        }
        if lease.answered
            || lease.holder != Holder::Job
            || lease.reasons.is_empty()
            || lease.owed.has(Owed::JOINED)
        {
            return;
        }
        lease.answered = true;
        let mut err = lease.unconfirmed();
        if let Some(io) = lease.io.take() {
            err = err.with_io(io);
        }
        self.emit(Effect::Answer {
            key,
            result: Err(err),
        });
    }

    fn device_replaced(&mut self, device: usize, now: u64) {
        let keys: Vec<LeaseKey> = self
            .leases
            .iter()
            .filter(|(_, l)| {
                l.reasons.iter().any(|r| {
                    matches!(r.why, Why::Lost { device: d, generation } if d == device && generation <= now)
                })
            })
            .map(|(k, _)| *k)
            .collect();
        for key in sorted(keys) {
            // The old device is gone, and its work with it.
            self.proven(key, Owed::GPU, None);
        }
    }

    fn release_requested(&mut self, key: LeaseKey) {
        let Some(lease) = self.leases.get(&key) else {
            // Already released (by an earlier call, or at shutdown): a no-op.
            return self.emit(Effect::Answer {
                key,
                result: Ok(()),
            });
        };
        match (lease.holder, lease.release) {
            (Holder::Explicit, Release::NotStarted) => self.start_release(key),
            // In flight: the caller joins the answer still to come.
            (Holder::Explicit, Release::InFlight) => {}
            _ => self.illegal(format_args!("release requested for job lease {key}")),
        }
    }

    fn lease_lost(&mut self, key: LeaseKey, reason: String) {
        let Some(lease) = self.leases.get_mut(&key) else {
            return;
        };
        if !lease.renewing {
            // Renewal had stopped: the release has begun, nothing to act on.
            return;
        }
        lease.renewing = false;
        let holder = lease.holder;
        match holder {
            // The job's work may still run (its body, tasks, processes or gpu work): it is
            // cancelled and its result says the lease was lost.
            Holder::Job
                if lease.owed.0 & (Owed::JOINED | Owed::TASKS | Owed::GPU) != 0
                    || !lease.processes.is_empty() =>
            {
                lease.cancelled = true;
                self.emit(Effect::Cancel {
                    key,
                    holder,
                    lost: Some(reason),
                });
            }
            Holder::Explicit => self.emit(Effect::Cancel {
                key,
                holder,
                lost: Some(reason),
            }),
            _ => self.emit(Effect::LostAfterExit { key, reason }),
        }
    }

    /// Moves a lease on as far as its proofs allow: temp dir removal once the worker is
    /// physically done, the broker release once nothing else is owed.
    fn advance(&mut self, key: LeaseKey) {
        let lease = self.leases.get_mut(&key).expect("checked by the caller");
        if lease.release != Release::NotStarted {
            return self.refresh(key);
        }
        if lease.physically_done()
            && lease.owed.has(Owed::SCRATCH)
            && lease.scratch == Scratch::Waiting
        {
            lease.scratch = Scratch::Removing;
            self.emit(Effect::RemoveScratch { key });
            return self.refresh(key);
        }
        if lease.owed.0 == 0 && lease.processes.is_empty() && lease.holder == Holder::Job {
            return self.start_release(key);
        }
        self.refresh(key);
    }

    fn start_release(&mut self, key: LeaseKey) {
        let lease = self.leases.get_mut(&key).expect("checked by the caller");
        lease.release = Release::InFlight;
        lease.releasing = 1 + lease.more.len() as u32;
        lease.reasons.clear();
        let (token, renewing) = (lease.token, lease.renewing);
        lease.renewing = false;
        // Kept on the lease too: its table row shows every token until the last is back.
        let more = lease.more.clone();
        if renewing {
            self.emit(Effect::StopRenewal { key });
        }
        self.refresh(key);
        self.emit(Effect::Release { key, token });
        for token in more {
            self.emit(Effect::Release { key, token });
        }
    }

    fn released(&mut self, key: LeaseKey, result: Result<(), CleanupError>) {
        let lease = match self.leases.get_mut(&key) {
            Some(l) if l.release == Release::InFlight && l.releasing > 0 => l,
            _ => {
                return self.illegal(format_args!(
                    "release of lease {key}, which was not releasing"
                ));
            }
        };
        // A multi-slot lease ends when every token's release has answered; the first failure
        // is its result.
        lease.releasing -= 1;
        if let Err(err) = result
            && lease.release_error.is_none()
        {
            lease.release_error = Some(err);
        }
        // Each token stops counting when its own release has answered.
        self.held -= 1;
        if lease.releasing > 0 {
            return;
        }
        let result = match lease.release_error.take() {
            Some(err) => Err(err),
            None => Ok(()),
        };
        let lease = self.remove(key);
        match &result {
            Ok(()) => self.counters.released_total += 1,
            Err(_) => self.counters.release_failed_total += 1,
        }
        let heard = match lease.holder {
            Holder::Job => !lease.answered,
            Holder::Explicit => true,
            Holder::Surplus => false,
        };
        if heard {
            self.emit(Effect::Answer { key, result });
        } else if let Err(error) = result {
            self.emit(Effect::Sink { key, error });
        }
        self.emit(Effect::Forget { key });
    }

    fn remove(&mut self, key: LeaseKey) -> Lease {
        let lease = self.leases.remove(&key).expect("checked by the caller");
        // A releasing lease's tokens stopped counting as their releases answered (`released`).
        if lease.release == Release::NotStarted {
            self.held -= 1 + lease.more.len();
        }
        self.touch(key);
        match lease.counted {
            Some(Phase::Quarantined) => self.quarantined -= 1,
            Some(Phase::Draining) => self.draining -= 1,
            _ => {}
        }
        // A newer lease may already hold the slot (see `check_token`).
        if self.check_tokens {
            if self.by_slot.get(&lease.token.slot_id()) == Some(&key) {
                self.by_slot.remove(&lease.token.slot_id());
            }
            if self.by_lease_id.get(&lease.token.lease_id()) == Some(&key) {
                self.by_lease_id.remove(&lease.token.lease_id());
            }
        }
        lease
    }

    /// Keeps the phase counts in step with one lease (and marks its table row for update).
    fn refresh(&mut self, key: LeaseKey) {
        self.touch(key);
        let lease = self.leases.get_mut(&key).expect("checked by the caller");
        let now = match lease.phase() {
            phase @ (Phase::Quarantined | Phase::Draining) => Some(phase),
            Phase::Running | Phase::Releasing => None,
        };
        if now == lease.counted {
            return;
        }
        match std::mem::replace(&mut lease.counted, now) {
            Some(Phase::Quarantined) => self.quarantined -= 1,
            Some(Phase::Draining) => self.draining -= 1,
            _ => {}
        }
        match now {
            Some(Phase::Quarantined) => self.quarantined += 1,
            Some(Phase::Draining) => self.draining += 1,
            _ => {}
        }
    }

    fn reclaim_begin(&mut self) {
        let mut checked = Vec::new();
        for key in sorted(self.leases.keys().copied().collect()) {
            let lease = &self.leases[&key];
            if !lease.is_quarantined() {
                continue;
            }
            checked.push(key);
            let unproven: Vec<Proof> = lease
                .reasons
                .iter()
                .filter(|r| r.why == Why::Unproven)
                .map(|r| r.proof)
                .collect();
            for proof in unproven {
                if proof == Proof::Scratch {
                    // Retried below, once the other proofs are known.
                    continue;
                }
                self.emit(Effect::Recheck { key, proof });
            }
        }
        self.reclaiming = Some(checked);
    }

    fn reclaim_end(&mut self) {
        let Some(checked) = self.reclaiming.take() else {
            return self.illegal(format_args!("reclaim ended without beginning"));
        };
        let mut reclaimed = Vec::new();
        let mut still = Vec::new();
        for key in checked {
            let Some(lease) = self.leases.get_mut(&key) else {
                continue;
            };
            if lease.scratch == Scratch::Failed && lease.physically_done() {
                // Retry the removal: the slot is clean but for its temp dir.
                lease.scratch = Scratch::Waiting;
                lease.reasons.retain(|r| r.proof != Proof::Scratch);
                self.advance(key);
            }
            let lease = &self.leases[&key];
            if lease.reasons.is_empty() {
                reclaimed.push(lease.token);
            } else {
                still.push(key);
            }
        }
        self.emit(Effect::Reclaimed { reclaimed, still });
    }

    fn shutdown(&mut self) {
        if self.stop != Stop::Serving {
            return;
        }
        self.stop = Stop::Stopping {
            gpu: if self.gpu {
                GpuClose::Pending
            } else {
                GpuClose::NotNeeded
            },
            deadline_passed: false,
        };
        if let Some(g) = self.gather.take() {
            self.stop_tally.refused_waiters += 1;
            self.emit(Effect::Refuse {
                waiter: g.served.waiter,
                error: AcquireError::Stopped,
            });
            // Nobody will use them: straight back to the broker.
            self.held -= g.tokens.len();
            for token in g.tokens {
                self.return_surplus(token);
            }
        }
        let pinned = mem::take(&mut self.pinned);
        let queued = std::iter::from_fn(|| self.queue.pop().map(|s| s.waiter));
        for waiter in pinned
            .into_iter()
            .map(|p| p.waiter)
            .chain(queued.collect::<Vec<_>>())
        {
            self.stop_tally.refused_waiters += 1;
            self.emit(Effect::Refuse {
                waiter,
                error: AcquireError::Stopped,
            });
        }
        if !self.acquiring.is_empty() {
            // Their futures are dropped: a broker must not keep a queue place or a slot for a
            // dropped acquire. One that answered already is released when its answer arrives.
            self.acquiring.clear();
            self.emit(Effect::AbortAcquires);
        }
        for key in sorted(self.leases.keys().copied().collect()) {
            let lease = self.leases.get_mut(&key).expect("listed");
            match (lease.holder, lease.release) {
                (Holder::Job, _) if !lease.cancelled => self.cancel_job_for_shutdown(key),
                (Holder::Explicit, Release::NotStarted) => {
                    self.stop_tally.released_leases += 1;
                    self.emit(Effect::Cancel {
                        key,
                        holder: Holder::Explicit,
                        lost: None,
                    });
                    self.start_release(key);
                }
                _ => {}
            }
        }
        self.emit(Effect::ArmShutdownTimers);
    }

    fn shutdown_grace_over(&mut self) {
        if !matches!(self.stop, Stop::Stopping { .. }) {
            return;
        }
        let keys: Vec<LeaseKey> = self
            .leases
            .iter()
            .filter(|(_, l)| l.holder == Holder::Job && l.owed.has(Owed::TASKS))
            .map(|(k, _)| *k)
            .collect();
        for key in sorted(keys) {
            self.emit(Effect::AbortTasks { key });
        }
    }

    fn shutdown_deadline(&mut self) {
        let Stop::Stopping {
            deadline_passed, ..
        } = &mut self.stop
        else {
            return;
        };
        *deadline_passed = true;
        for key in sorted(self.leases.keys().copied().collect()) {
            let lease = &self.leases[&key];
            if lease.release != Release::NotStarted {
                // Bounded by the cleanup timeout on its own.
                continue;
            }
            for proof in lease.waiting_for() {
                let lease = &self.leases[&key];
                if lease.reasons.iter().any(|r| r.proof == proof) {
                    continue;
                }
                let detail = format!(
                    "{} not proven done when the shutdown bound passed",
                    proof.describe()
                );
                self.missing(key, proof, Why::Late, detail, None);
            }
        }
    }

    /// Shutdown finishes once every lease is released or quarantined for good, no broker
    /// acquire is in flight, and the GPU devices are closed. Until the shutdown bound passes, a
    /// lease quarantined for something that ends on its own (late tasks or GPU work, a lost
    /// device being replaced) is waited for; one that only a re-check could clear (the shutdown
    /// re-checked it when it began) is not.
    fn maybe_stopped(&mut self) {
        let Stop::Stopping {
            gpu,
            deadline_passed,
        } = self.stop
        else {
            return;
        };
        let busy = self.leases.values().any(|l| {
            !l.is_quarantined()
                || (!deadline_passed && l.reasons.iter().any(|r| r.why != Why::Unproven))
        });
        if busy || !self.acquiring.is_empty() || self.reclaiming.is_some() {
            return;
        }
        match gpu {
            GpuClose::Pending => {
                self.stop = Stop::Stopping {
                    gpu: GpuClose::Closing,
                    deadline_passed,
                };
                self.emit(Effect::CloseGpu);
            }
            GpuClose::Closing => {}
            GpuClose::NotNeeded | GpuClose::Closed => {
                self.stop = Stop::Stopped;
                self.emit(Effect::Stopped);
            }
        }
    }

    /// Gives back the memory a flood left behind (amortised O(1)).
    pub(crate) fn shrink_idle(&mut self) {
        self.queue.shrink();
        shrink_map(&mut self.leases);
        shrink_map(&mut self.by_slot);
        shrink_map(&mut self.by_lease_id);
        shrink_set(&mut self.acquiring);
        // One batch of a flood can ask for tens of thousands of effects at once.
        shrink_deque(&mut self.effects);
    }

    // --- queries (no decisions) ---

    pub(crate) fn lease(&self, key: LeaseKey) -> Option<&Lease> {
        self.leases.get(&key)
    }

    /// Every lease, by key order.
    pub(crate) fn leases(&self) -> impl Iterator<Item = (LeaseKey, &Lease)> {
        self.leases.iter().map(|(k, l)| (*k, l))
    }

    /// Leases held and not quarantined (running, draining or releasing).
    pub(crate) fn active(&self) -> usize {
        self.leases.len() - self.quarantined
    }

    pub(crate) fn quarantined(&self) -> usize {
        self.quarantined
    }

    pub(crate) fn draining(&self) -> usize {
        self.draining
    }

    pub(crate) fn waiting(&self) -> usize {
        self.queue.len() + self.pinned.len() + usize::from(self.gather.is_some())
    }

    /// Tokens held from the broker (every lease's, and a gathering waiter's).
    pub(crate) fn held_slots(&self) -> usize {
        self.held
    }

    /// The capacity the core grants up to (`None`: the broker's is unknown).
    pub(crate) fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// Waiters served from the queue so far: the aging rule's clock.
    #[cfg(test)]
    pub(crate) fn served(&self) -> u64 {
        self.queue.served
    }

    pub(crate) fn counters(&self) -> Counters {
        self.counters
    }

    pub(crate) fn is_serving(&self) -> bool {
        self.stop == Stop::Serving
    }

    pub(crate) fn stop_tally(&self) -> StopTally {
        self.stop_tally
    }
}

fn lease_owes(owed: &Owed, processes: &[ProcessKey], proof: Proof) -> bool {
    match proof {
        Proof::Process(p) => processes.contains(&p),
        other => owed.has(other.bit()),
    }
}

/// Keys in order, so that effects come out in the same order in every run (the simulation
/// replays a seed exactly).
fn sorted(mut keys: Vec<LeaseKey>) -> Vec<LeaseKey> {
    keys.sort_unstable();
    keys
}

/// Map capacity kept however empty a map gets.
const SHRINK_FLOOR: usize = 64;

/// Gives back most of a map's capacity once it is at most a quarter full.
pub(crate) fn shrink_map<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(
    map: &mut std::collections::HashMap<K, V, S>,
) {
    let cap = map.capacity();
    if cap > SHRINK_FLOOR && map.len() <= cap / 4 {
        map.shrink_to((map.len() * 2).max(SHRINK_FLOOR));
    }
}

fn shrink_set<K: Eq + std::hash::Hash, S: std::hash::BuildHasher>(
    set: &mut std::collections::HashSet<K, S>,
) {
    let cap = set.capacity();
    if cap > SHRINK_FLOOR && set.len() <= cap / 4 {
        set.shrink_to((set.len() * 2).max(SHRINK_FLOOR));
    }
}

fn shrink_deque<T>(deque: &mut VecDeque<T>) {
    let cap = deque.capacity();
    if cap > SHRINK_FLOOR && deque.len() <= cap / 4 {
        deque.shrink_to((deque.len() * 2).max(SHRINK_FLOOR));
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;

//! One lease as the core keeps it: what it holds, what it still owes before its slots may be
//! reused, why it is quarantined, and where its release and its caller stand. Its phase is
//! derived from those, never stored.

use std::io;

use crate::broker::SlotToken;
use crate::error::{CleanupError, CleanupErrorKind, PrepareError};
use crate::job::Priority;
use crate::paths::TempDir;

pub(crate) use super::ids::ProcessKey;

/// Who holds a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    /// A `run` job: a worker actor, tracked tasks, maybe processes and GPU work, a temp dir.
    Job,
    /// An explicit `Lease` held by user code.
    Explicit,
    /// Tokens nobody may use (nobody waits for them, or they are above the capacity in
    /// force): released at once.
    Surplus,
}

/// One proof the release of a lease waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Proof {
    /// The worker's actor task ended (its join handle resolved: its state dropped, and no
    /// supervision event carries anything of the job, since the worker unlinks from the
    /// supervisor before it ends).
    WorkerJoined,
    /// Every task and blocking closure spawned through the job's context returned.
    TasksJoined,
    /// One process group the job started was proven empty.
    Process(ProcessKey),
    /// Every GPU submission made under the lease completed.
    GpuFence,
    /// The job's temp dir was removed.
    TempDir,
}

impl Proof {
    /// Its bit in [`Owed`] (process groups are kept apart, by key).
    fn bit(self) -> u8 {
        match self {
            Self::WorkerJoined => Owed::JOINED,
            Self::TasksJoined => Owed::TASKS,
            Self::GpuFence => Owed::GPU,
            Self::TempDir => Owed::TEMP_DIR,
            Self::Process(_) => 0,
        }
    }

    /// What the proof is about, for reasons and the lease table.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::WorkerJoined => "the worker's task",
            Self::TasksJoined => "tasks spawned through the worker context",
            Self::Process(_) => "a process group",
            Self::GpuFence => "gpu work",
            Self::TempDir => "the temp dir",
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

    pub(crate) fn of(proof: Proof) -> Self {
        Self(proof.bit())
    }

    pub(crate) fn contains(self, proof: Proof) -> bool {
        let bit = proof.bit();
        bit != 0 && self.0 & bit == bit
    }
}

/// What a lease still owes before its slots may be reused: one flags type for the worker's
/// proofs and the temp dir, and the process groups by key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Owed {
    bits: u8,
    /// Process groups not yet proven empty.
    processes: Vec<ProcessKey>,
}

impl Owed {
    const JOINED: u8 = 1;
    const TASKS: u8 = 4;
    const GPU: u8 = 8;
    const TEMP_DIR: u8 = 16;
    /// Everything that makes up the worker's physical end (the pipeline's steps 2 and 3).
    const PHYSICAL: u8 = Self::JOINED | Self::TASKS | Self::GPU;

    /// A job owes its worker's physical end and its temp dir from the grant on; GPU work and
    /// process groups are added as they are learnt.
    pub(crate) fn job() -> Self {
        Self {
            bits: Self::JOINED | Self::TASKS | Self::TEMP_DIR,
            processes: Vec::new(),
        }
    }

    pub(crate) fn owes(&self, proof: Proof) -> bool {
        match proof {
            Proof::Process(p) => self.processes.contains(&p),
            other => self.bits & other.bit() != 0,
        }
    }

    /// Owes every proof of `proofs`.
    pub(crate) fn owes_all(&self, proofs: Proofs) -> bool {
        self.bits & proofs.0 == proofs.0
    }

    pub(crate) fn add(&mut self, proof: Proof) {
        match proof {
            Proof::Process(p) => self.processes.push(p),
            other => self.bits |= other.bit(),
        }
    }

    pub(crate) fn clear(&mut self, proofs: Proofs) {
        self.bits &= !proofs.0;
    }

    pub(crate) fn clear_process(&mut self, process: ProcessKey) {
        self.processes.retain(|p| *p != process);
    }

    /// No worker ran: nothing physical is owed, nor a temp dir.
    pub(crate) fn forgive_all(&mut self) {
        self.bits = 0;
        self.processes.clear();
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.bits == 0 && self.processes.is_empty()
    }

    /// Every proof of the worker's physical end is in (the temp dir may still be owed).
    pub(crate) fn physically_done(&self) -> bool {
        self.bits & Self::PHYSICAL == 0 && self.processes.is_empty()
    }

    /// The job's work may still run: its body, its tasks, its process groups or its GPU work.
    pub(crate) fn work_running(&self) -> bool {
        self.bits & (Self::JOINED | Self::TASKS | Self::GPU) != 0 || !self.processes.is_empty()
    }

    /// The worker has joined: its body has ended.
    #[inline]
    pub(crate) fn body_ended(&self) -> bool {
        self.bits & Self::JOINED == 0
    }

    /// What is owed, in pipeline order (no allocation: the lease table reads it on the actor's
    /// hot path).
    pub(crate) fn iter(&self) -> impl Iterator<Item = Proof> + '_ {
        const PHYSICAL: [Proof; 3] = [Proof::WorkerJoined, Proof::TasksJoined, Proof::GpuFence];
        PHYSICAL
            .into_iter()
            .filter(|p| self.bits & p.bit() != 0)
            .chain(self.processes.iter().map(|p| Proof::Process(*p)))
            .chain((self.bits & Self::TEMP_DIR != 0).then_some(Proof::TempDir))
    }
}

/// Why a proof is missing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Why {
    /// Past its bound; still expected on its own (tasks past the drain bound, gpu work past
    /// the fence bound, anything at the shutdown deadline).
    Late,
    /// Could not be proven; only a re-check proves it (a reclaim).
    Unproven,
    /// The lease's GPU device was lost (on that generation of the device): its work died with
    /// it, proven once the device is replaced (or given up).
    Lost {
        device: usize,
        generation: u64,
        replacer: Replacer,
    },
}

/// Who brings a lost GPU device back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replacer {
    /// leasehold re-creates it (a device it opened itself): the new device, or its giving up,
    /// comes on its own.
    Leasehold,
    /// Only the engine can hand a replacement over (a device it adopted): nothing comes on
    /// its own, so a shutdown does not wait for it.
    Engine,
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

/// The temp dir's removal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Removal {
    /// Not started (nothing to remove yet, or not removable yet), or done.
    NotStarted,
    /// The job's driver removes it (from the job's start until its report): once it has
    /// proven the worker's physical end, in the job's own task. Its report says what became
    /// of the dir (removed, never made, failed, or left to the core).
    Driver,
    /// Asked for by the core; its answer is awaited.
    Running,
    /// Failed: only a reclaim retries it.
    Failed,
}

/// The broker release of a lease's tokens.
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(crate) enum Release {
    /// Not started: every token is held.
    Held,
    /// In flight: `left` tokens still held, whose releases have not answered; the first
    /// failure among those that have.
    Releasing {
        left: u32,
        error: Option<Box<CleanupError>>,
    },
}

/// The broker's keep-alive of the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    Off,
    Running,
}

/// Where the lease's caller stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Caller {
    /// Waits for the answer the release brings.
    Waiting,
    /// Has its answer already (an early one, on quarantine): the release's failure goes to the
    /// error sink.
    Answered,
}

/// Whether the job was asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    Running,
    Cancelled,
}

/// One lease: what it holds, what it still owes, why it is quarantined.
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(crate) struct LeaseRecord {
    pub(crate) token: SlotToken,
    /// The other tokens of a multi-slot lease (empty for one slot: no allocation).
    pub(crate) more: Box<[SlotToken]>,
    pub(crate) holder: Holder,
    /// The class it was granted under.
    pub(crate) priority: Priority,
    pub(crate) owed: Owed,
    pub(crate) device: Option<usize>,
    pub(crate) reasons: Vec<Reason>,
    pub(crate) removal: Removal,
    pub(crate) release: Release,
    pub(crate) renewal: Renewal,
    pub(crate) caller: Caller,
    pub(crate) stop: Stop,
    /// Why no body ran (the job could not be prepared), for its caller's answer.
    pub(crate) unprepared: Option<Box<PrepareError>>,
    /// Why the temp dir could not be removed, kept for the early answer.
    pub(crate) io: Option<KeptIo>,
    /// The job's temp dir, once its end report named one: what the removal (and a reclaim's
    /// retry of it) removes.
    pub(crate) dir: Option<TempDir>,
}

/// The file system's error for a temp dir that could not be removed, kept for the caller.
/// (Cloned, for the exhaustive exploration's states, as its kind and message.)
#[derive(Debug)]
pub(crate) struct KeptIo(pub(crate) io::Error);

#[cfg(test)]
impl Clone for KeptIo {
    fn clone(&self) -> Self {
        Self(io::Error::new(self.0.kind(), self.0.to_string()))
    }
}

impl LeaseRecord {
    pub(crate) fn new(
        token: SlotToken,
        more: Box<[SlotToken]>,
        holder: Holder,
        priority: Priority,
    ) -> Self {
        Self {
            token,
            more,
            holder,
            priority,
            owed: match holder {
                Holder::Job => Owed::job(),
                Holder::Explicit | Holder::Surplus => Owed::default(),
            },
            device: None,
            reasons: Vec::new(),
            removal: Removal::NotStarted,
            release: Release::Held,
            renewal: Renewal::Off,
            caller: Caller::Waiting,
            stop: Stop::Running,
            unprepared: None,
            io: None,
            dir: None,
        }
    }

    /// Every token, the first one first.
    pub(crate) fn tokens(&self) -> impl Iterator<Item = SlotToken> + '_ {
        std::iter::once(self.token).chain(self.more.iter().copied())
    }

    /// How many slots it was granted.
    #[inline]
    pub(crate) fn slots(&self) -> usize {
        1 + self.more.len()
    }

    /// Slots it still holds from the broker (a releasing lease lets each go as its release
    /// answers).
    #[inline]
    pub(crate) fn held(&self) -> usize {
        match &self.release {
            Release::Held => self.slots(),
            Release::Releasing { left, .. } => *left as usize,
        }
    }

    #[inline]
    pub(crate) fn is_releasing(&self) -> bool {
        matches!(self.release, Release::Releasing { .. })
    }

    #[inline]
    pub(crate) fn phase(&self) -> Phase {
        if self.is_releasing() {
            Phase::Releasing
        } else if !self.reasons.is_empty() {
            Phase::Quarantined
        } else if self.holder == Holder::Job && self.owed.body_ended() {
            Phase::Draining
        } else {
            Phase::Running
        }
    }

    pub(crate) fn is_quarantined(&self) -> bool {
        self.phase() == Phase::Quarantined
    }

    /// [`owing`](Self::owing), collected.
    #[cfg(test)]
    pub(crate) fn waiting_for(&self) -> Vec<Proof> {
        self.owing().collect()
    }

    /// What the release still waits for, in pipeline order.
    pub(crate) fn owing(&self) -> impl Iterator<Item = Proof> + '_ {
        self.owed.iter()
    }

    /// The reasons that still stand once `proofs` (and `process`) are in: a reason goes only
    /// with its proof.
    pub(crate) fn drop_answered_reasons(&mut self) {
        let owed = &self.owed;
        self.reasons.retain(|r| owed.owes(r.proof));
    }

    /// Whether a shutdown still waits for this lease: its release is in flight (bounded by the
    /// cleanup timeout), or it owes a proof that will come on its own — its body, tasks and
    /// process groups until they are proven or given up (whatever its quarantine reasons),
    /// GPU work, a device leasehold re-creates, a temp dir removal under way. What only a
    /// re-check or the engine's replacement of its device could prove is not waited for, nor
    /// anything late once the shutdown deadline has passed.
    pub(crate) fn holds_shutdown(&self, deadline_passed: bool) -> bool {
        if self.is_releasing() {
            return true;
        }
        self.owing().any(|proof| {
            match self
                .reasons
                .iter()
                .find(|r| r.proof == proof)
                .map(|r| &r.why)
            {
                Some(
                    Why::Unproven
                    | Why::Lost {
                        replacer: Replacer::Engine,
                        ..
                    },
                ) => false,
                Some(
                    Why::Late
                    | Why::Lost {
                        replacer: Replacer::Leasehold,
                        ..
                    },
                ) => !deadline_passed,
                // Not removable yet: behind a proof that is unproven (or it would be running).
                None if proof == Proof::TempDir => {
                    matches!(self.removal, Removal::Running | Removal::Driver)
                }
                None => true,
            }
        })
    }

    /// The early answer a quarantine gives the caller.
    pub(crate) fn unconfirmed(&mut self) -> CleanupError {
        let detail = self.reason_line();
        let lost = self
            .reasons
            .iter()
            .any(|r| matches!(r.why, Why::Lost { .. }));
        let err = if lost {
            CleanupError::with_kind(CleanupErrorKind::GpuDeviceLost, self.token, detail)
        } else {
            CleanupError::unconfirmed(self.token, detail, None)
        };
        match self.io.take() {
            Some(KeptIo(io)) => err.with_io(io),
            None => err,
        }
    }

    /// The reasons as one line.
    pub(crate) fn reason_line(&self) -> String {
        self.reasons
            .iter()
            .map(|r| r.detail.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-slot lease on slot 0 under lease id 1.
    fn lease(holder: Holder) -> LeaseRecord {
        LeaseRecord::new(
            SlotToken::new(0, 1),
            Box::default(),
            holder,
            Priority::Normal,
        )
    }

    #[test]
    fn what_a_job_owes_is_listed_in_pipeline_order_and_cleared_proof_by_proof() {
        // From the grant on: its body, its tasks and its temp dir, and nothing else.
        let mut owed = Owed::job();
        assert_eq!(
            owed.iter().collect::<Vec<_>>(),
            [Proof::WorkerJoined, Proof::TasksJoined, Proof::TempDir]
        );
        owed.add(Proof::Process(ProcessKey(7)));
        owed.add(Proof::GpuFence);
        assert_eq!(
            owed.iter().collect::<Vec<_>>(),
            [
                Proof::WorkerJoined,
                Proof::TasksJoined,
                Proof::GpuFence,
                Proof::Process(ProcessKey(7)),
                Proof::TempDir
            ]
        );
        assert!(!owed.body_ended());
        owed.clear(Proofs::JOINED);
        assert!(owed.body_ended());
        owed.clear(Proofs::TASKS.with(Proofs::GPU));
        assert!(!owed.physically_done(), "the process group is still owed");
        owed.clear_process(ProcessKey(7));
        assert!(owed.physically_done());
        assert!(owed.owes(Proof::TempDir));
        owed.clear(Proofs::of(Proof::TempDir));
        assert!(owed.is_empty());
    }

    #[test]
    fn proofs_gathered_twice_are_still_one_set() {
        assert!(Proofs::default().is_empty());
        let both = Proofs::JOINED.with(Proofs::TASKS);
        assert!(!both.is_empty());
        // The union of what a driver saw: the same proof twice is that proof once.
        assert_eq!(both.with(Proofs::JOINED), both);
        assert!(both.contains(Proof::WorkerJoined) && both.contains(Proof::TasksJoined));
        assert!(!both.contains(Proof::GpuFence));
    }

    #[test]
    fn each_proof_of_the_physical_end_is_needed_and_work_runs_while_any_is_owed() {
        // One owed at a time: the body, the tasks, the GPU work, a process group.
        let owing = |proof: Proof| {
            let mut owed = Owed::default();
            owed.add(proof);
            owed
        };
        for proof in [
            Proof::WorkerJoined,
            Proof::TasksJoined,
            Proof::GpuFence,
            Proof::Process(ProcessKey(2)),
        ] {
            let owed = owing(proof);
            assert!(!owed.physically_done(), "{proof:?} is still owed");
            assert!(owed.work_running(), "{proof:?} may still run");
        }
        // Only the temp dir: physically done, nothing runs.
        let owed = owing(Proof::TempDir);
        assert!(owed.physically_done());
        assert!(!owed.work_running());
    }

    #[test]
    fn an_explicit_lease_runs_until_released_and_a_jobs_lease_drains_once_its_body_ended() {
        // An explicit lease owes nothing, so its "body" has always ended: it is still running.
        let mut explicit = lease(Holder::Explicit);
        assert!(explicit.owed.body_ended());
        assert_eq!(explicit.phase(), Phase::Running);
        explicit.release = Release::Releasing {
            left: 1,
            error: None,
        };
        assert_eq!(explicit.phase(), Phase::Releasing);
        let mut job = lease(Holder::Job);
        assert_eq!(job.phase(), Phase::Running);
        job.owed.clear(Proofs::JOINED);
        assert_eq!(job.phase(), Phase::Draining);
    }

    #[test]
    fn a_quarantined_leases_reasons_read_as_one_line_in_order() {
        let mut lease = lease(Holder::Job);
        assert_eq!(lease.reason_line(), "");
        for (proof, detail) in [(Proof::GpuFence, "slow gpu"), (Proof::TempDir, "EACCES")] {
            lease.reasons.push(Reason {
                proof,
                why: Why::Late,
                detail: detail.into(),
            });
        }
        assert_eq!(lease.reason_line(), "slow gpu; EACCES");
    }

    #[test]
    fn a_shutdown_waits_for_a_quarantined_jobs_work_whatever_its_reasons() {
        let mut lease = lease(Holder::Job);
        lease.owed.clear(Proofs::JOINED);
        lease.owed.add(Proof::Process(ProcessKey(3)));
        lease.reasons.push(Reason {
            proof: Proof::Process(ProcessKey(3)),
            why: Why::Unproven,
            detail: "escaped".into(),
        });
        assert!(lease.is_quarantined());
        // Its tasks are still owed, with no reason of their own: waited for.
        assert!(lease.holds_shutdown(false));
        lease.owed.clear(Proofs::TASKS);
        // Only the unproven group and the temp dir behind it remain: nothing more will come on
        // its own.
        assert!(!lease.holds_shutdown(false));
        // A late proof is waited for until the deadline.
        lease.owed.add(Proof::GpuFence);
        lease.reasons.push(Reason {
            proof: Proof::GpuFence,
            why: Why::Late,
            detail: "slow gpu".into(),
        });
        assert!(lease.holds_shutdown(false));
        assert!(!lease.holds_shutdown(true));
    }

    #[test]
    fn a_shutdown_waits_for_a_device_leasehold_re_creates_but_not_for_the_engines() {
        let lost_on = |replacer| {
            let mut lease = lease(Holder::Job);
            lease.owed.clear(Proofs::JOINED.with(Proofs::TASKS));
            lease.owed.add(Proof::GpuFence);
            lease.reasons.push(Reason {
                proof: Proof::GpuFence,
                why: Why::Lost {
                    device: 0,
                    generation: 1,
                    replacer,
                },
                detail: "gpu device 0 lost".into(),
            });
            assert!(lease.is_quarantined());
            lease
        };
        // leasehold's own device comes back (or is given up) on its own: waited for until the
        // deadline.
        let own = lost_on(Replacer::Leasehold);
        assert!(own.holds_shutdown(false));
        assert!(!own.holds_shutdown(true));
        // Only the engine can replace an adopted device: not waited for at all.
        let adopted = lost_on(Replacer::Engine);
        assert!(!adopted.holds_shutdown(false));
    }
}

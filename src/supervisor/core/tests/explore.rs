//! Exhaustive exploration of the pure core, beside the sampled models.
//!
//! A small world — the supervisor's own pool of two slots on the real [`LocalBroker`] (its free
//! list in either order), three job callers (one may ask for both slots), one GPU device with
//! two sub-slots, one resize — in which every input the world
//! can give in a state is applied, in every order, breadth first up to a depth, with states
//! deduplicated (the core's and the world's whole state, hashed). After every input the
//! invariants of DESIGN.md section 3 that the core owns are checked: capacity (1), no double
//! grant (2), release after exit (3), conservation (4), one release per token (5), and an
//! answer's effect visible (11). Breadth first, the first failure found is the shortest input
//! sequence that breaks an invariant, and it is printed.
//!
//! A batch is an input too (`Settle`): the core settles only when the world says, so inputs
//! share batches as they do in the mailbox. What the shell does in the turn itself (the pool's
//! acquire and release, starting a job, closing the pool and the devices) the world does at
//! once; what comes later from outside (a caller leaving, a driver's proofs, a removal, a
//! device re-created, the shutdown timers) is an input of its own.
//!
//! The depth CI runs (`EXPLORE_DEPTH`, 8: about a million states) takes about a minute on two
//! cores in a debug build; deeper by hand (CONTRIBUTING.md has the figures):
//! `LEASEHOLD_EXPLORE_DEPTH=10 cargo test --release --lib explore -- --nocapture`.
//!
//! Taking the capacity check out of `Core::admit` (`over`) is caught at depth 4: a multi-slot
//! head that gathered slot 0 is refused by a resize down to one slot while slot 1 is held, and
//! its token went to the next caller.

use std::collections::{BTreeSet, HashMap};
use std::fmt::{self, Write as _};
use std::hash::{Hash, Hasher};
use std::time::Instant;

use rustc_hash::FxHasher;

use super::prelude::*;
use crate::supervisor::core::CoreConfig;

/// The world's size.
const SLOTS: u32 = 2;
const GPU_SUB_SLOTS: u32 = 2;
const JOBS: usize = 3;

/// The depth CI explores (every input sequence up to this length).
const EXPLORE_DEPTH: usize = 8;

/// What a caller does when its slots are handed over (decided when it joins the queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Fate {
    /// Takes it: the job starts on the GPU device.
    Stays,
    /// Asks for both slots, and takes them.
    StaysWithTwo,
    /// Has left just before: the lease is undelivered.
    Leaves,
    /// The job cannot start (no worker): no body runs.
    CannotStart,
}

/// One input of the world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Op {
    /// A new caller joins the queue.
    Enqueue(Fate),
    /// A waiting caller gives up.
    Withdraw(usize),
    /// `Supervisor::cancel` of a job that waits or runs.
    Cancel(usize),
    /// The job's worker and its tracked tasks are joined (the driver reports before a long
    /// fence).
    Joined(usize),
    /// The job's tracked tasks run past the drain bound.
    TasksLate(usize),
    /// The job's GPU fence: signalled, past its bound, or the device lost.
    Fence(usize, FenceEnd),
    /// The driver ends: every proof it has not sent, and whether the job made a temp dir.
    Ended(usize, bool),
    /// The temp dir removal the core asked for ends: removed, failed, or past its bound.
    Removal(usize, RemovalEnd),
    /// The lost device is re-created.
    Replaced,
    /// The pool is resized (once).
    Resize(u32),
    Reclaim,
    /// The batch ends: the core settles.
    Settle,
    Shutdown,
    GraceOver,
    Deadline,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum FenceEnd {
    Done,
    Late,
    /// The device is lost; leasehold re-creates it.
    Lost,
    /// The device is lost, and it is the engine's: only the engine's replacement brings it
    /// back, and a shutdown does not wait for that.
    EngineLost,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum RemovalEnd {
    Removed,
    Failed,
    Late,
}

/// One caller and its job, as the world knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Job {
    waiter: WaiterId,
    fate: Fate,
    stage: Stage,
}

impl Fate {
    fn slots(self) -> u32 {
        match self {
            Self::StaysWithTwo => 2,
            _ => 1,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Stage {
    Waiting,
    /// Left without a slot (withdrawn, refused), or its lease was undelivered.
    Gone,
    /// Holds a lease.
    Holding(Held),
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Held {
    key: LeaseKey,
    /// Every token of the lease, and those given back to the pool so far.
    tokens: Vec<SlotToken>,
    given_back: Vec<SlotToken>,
    /// The job started (else it could not: no proofs are owed).
    started: bool,
    joined: bool,
    tasks_late: bool,
    fence: Option<FenceEnd>,
    /// The generation of the device its fence was lost on.
    lost_on: Option<u64>,
    ended: bool,
    asked_dir: bool,
    /// The removal the core asked for: in flight, and whether it was reported late.
    removing: Option<bool>,
    dir_removed: bool,
    answered: bool,
    forgotten: bool,
}

#[derive(Clone)]
struct World {
    core: Core,
    jobs: Vec<Job>,
    size: u32,
    resized: bool,
    generation: u64,
    recreating: bool,
    /// A lease was lost on the engine's device: the engine may hand a replacement.
    engine_lost: bool,
    next_waiter: WaiterId,
    next_control: ControlId,
    stopping: bool,
    timers: bool,
    grace_over: bool,
    deadline: bool,
    stopped: bool,
    /// Tokens the core released, each once.
    released: BTreeSet<(u32, u64)>,
    /// The inputs so far, for the report.
    path: Vec<Op>,
    /// The pool's free list at the start, for the report.
    root: &'static str,
}

type Checked = Result<(), String>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// Feeds what is written to a hasher (a state's `Debug`, without a `String`).
struct HashWriter<'a, H: Hasher>(&'a mut H);

impl<H: Hasher> fmt::Write for HashWriter<'_, H> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.write(s.as_bytes());
        Ok(())
    }
}

impl World {
    /// The empty world; with `reversed`, the pool hands out slot 1 before slot 0 (as it does
    /// once slot 0 has been taken and given back), so that a multi-slot head can gather either.
    fn new(reversed: bool) -> Self {
        let pool = LocalBroker::new(SLOTS);
        if reversed {
            let first = pool.take().expect("a free slot");
            pool.give(first).expect("held");
        }
        Self {
            core: Core::new(CoreConfig {
                broker_capacity: Some(SLOTS),
                pool: Some(pool.into_pool()),
                gpu_slots: Some(GPU_SUB_SLOTS),
                renews: false,
            }),
            jobs: Vec::new(),
            size: SLOTS,
            resized: false,
            generation: 1,
            recreating: false,
            engine_lost: false,
            next_waiter: WaiterId(1),
            next_control: ControlId(1),
            stopping: false,
            timers: false,
            grace_over: false,
            deadline: false,
            stopped: false,
            released: BTreeSet::new(),
            path: Vec::new(),
            root: if reversed {
                "the pool's free slots in the order 1, 0"
            } else {
                "the pool's free slots in the order 0, 1"
            },
        }
    }

    /// The whole state (the core's, the pool's, the world's), hashed; not the path.
    fn fingerprint(&self) -> u64 {
        let mut h = FxHasher::default();
        // The core's `Debug` includes its pool (free order, holders, next id).
        let _ = write!(HashWriter(&mut h), "{:?}", self.core);
        self.jobs.hash(&mut h);
        (
            self.size,
            self.resized,
            self.generation,
            self.recreating,
            self.engine_lost,
            self.stopping,
        )
            .hash(&mut h);
        (self.timers, self.grace_over, self.deadline, self.stopped).hash(&mut h);
        self.released.hash(&mut h);
        h.finish()
    }

    /// The capacity in force: the pool's size, capped by the GPU sub-slots.
    fn capacity(&self) -> usize {
        self.size.min(GPU_SUB_SLOTS) as usize
    }

    fn held(&self, j: usize) -> Option<&Held> {
        match &self.jobs[j].stage {
            Stage::Holding(h) if !h.forgotten => Some(h),
            _ => None,
        }
    }

    fn held_mut(&mut self, key: LeaseKey) -> Option<&mut Held> {
        self.jobs.iter_mut().find_map(|j| match &mut j.stage {
            Stage::Holding(h) if h.key == key => Some(h),
            _ => None,
        })
    }

    /// Every input the world can give now.
    fn enabled(&self) -> Vec<Op> {
        let mut ops = vec![Op::Settle];
        if self.stopped {
            return ops;
        }
        if self.jobs.len() < JOBS && !self.stopping {
            ops.extend(
                [
                    Fate::Stays,
                    Fate::StaysWithTwo,
                    Fate::Leaves,
                    Fate::CannotStart,
                ]
                .map(Op::Enqueue),
            );
        }
        for (j, job) in self.jobs.iter().enumerate() {
            if job.stage == Stage::Waiting {
                ops.push(Op::Withdraw(j));
                ops.push(Op::Cancel(j));
            }
            let Some(h) = self.held(j) else { continue };
            if !h.started {
                continue;
            }
            if !h.ended {
                ops.push(Op::Cancel(j));
                if !h.joined {
                    ops.push(Op::Joined(j));
                    if !h.tasks_late {
                        ops.push(Op::TasksLate(j));
                    }
                } else {
                    match h.fence {
                        None => ops.extend(
                            [
                                FenceEnd::Done,
                                FenceEnd::Late,
                                FenceEnd::Lost,
                                FenceEnd::EngineLost,
                            ]
                            .map(|f| Op::Fence(j, f)),
                        ),
                        Some(FenceEnd::Late) => ops.extend(
                            [FenceEnd::Done, FenceEnd::Lost, FenceEnd::EngineLost]
                                .map(|f| Op::Fence(j, f)),
                        ),
                        Some(_) => {}
                    }
                }
                ops.push(Op::Ended(j, true));
                ops.push(Op::Ended(j, false));
            }
            if let Some(late) = h.removing {
                ops.push(Op::Removal(j, RemovalEnd::Removed));
                ops.push(Op::Removal(j, RemovalEnd::Failed));
                if !late {
                    ops.push(Op::Removal(j, RemovalEnd::Late));
                }
            }
        }
        if self.recreating || self.engine_lost {
            ops.push(Op::Replaced);
        }
        if !self.resized && !self.stopping {
            ops.push(Op::Resize(1));
            ops.push(Op::Resize(3));
        }
        if self.core.figures().quarantined > 0 {
            ops.push(Op::Reclaim);
        }
        if !self.stopping {
            ops.push(Op::Shutdown);
        }
        if self.timers && !self.grace_over {
            ops.push(Op::GraceOver);
        }
        if self.timers && !self.deadline {
            ops.push(Op::Deadline);
        }
        ops
    }

    fn control(&mut self) -> ControlId {
        self.next_control.0 += 1;
        self.next_control
    }

    /// Gives one input (with what the shell does in the same turn), then checks the
    /// invariants.
    fn step(&mut self, op: Op) -> Checked {
        self.path.push(op);
        let mut turn = Turn::default();
        match op {
            Op::Enqueue(fate) => {
                let waiter = self.next_waiter.take();
                self.jobs.push(Job {
                    waiter,
                    fate,
                    stage: Stage::Waiting,
                });
                let ask = Ask {
                    slots: fate.slots(),
                    ..Ask::one(Want::Job)
                };
                self.input(Input::Enqueue { waiter, ask }, &mut turn)?;
            }
            Op::Withdraw(j) => {
                let waiter = self.jobs[j].waiter;
                self.input(
                    Input::Withdraw {
                        waiter,
                        why: Withdrawal::Cancelled,
                    },
                    &mut turn,
                )?;
            }
            Op::Cancel(j) => {
                let control = self.control();
                let input = match &self.jobs[j].stage {
                    Stage::Holding(h) => Input::CancelById {
                        control,
                        waiters: Box::default(),
                        leases: Box::new([h.key]),
                    },
                    _ => Input::CancelById {
                        control,
                        waiters: Box::new([self.jobs[j].waiter]),
                        leases: Box::default(),
                    },
                };
                self.input(input, &mut turn)?;
            }
            Op::Joined(j) => {
                let key = self.held(j).expect("enabled").key;
                self.held_mut(key).expect("held").joined = true;
                self.input(
                    Input::Proven {
                        key,
                        proofs: Proofs::JOINED.with(Proofs::TASKS),
                    },
                    &mut turn,
                )?;
            }
            Op::TasksLate(j) => {
                let key = self.held(j).expect("enabled").key;
                self.held_mut(key).expect("held").tasks_late = true;
                self.input(
                    Input::Late {
                        key,
                        proof: Proof::TasksJoined,
                        detail: "tasks still running".into(),
                    },
                    &mut turn,
                )?;
            }
            Op::Fence(j, end) => {
                let key = self.held(j).expect("enabled").key;
                let generation = self.generation;
                let h = self.held_mut(key).expect("held");
                h.fence = Some(end);
                let input = match end {
                    FenceEnd::Done => Input::Proven {
                        key,
                        proofs: Proofs::GPU,
                    },
                    FenceEnd::Late => Input::Late {
                        key,
                        proof: Proof::GpuFence,
                        detail: "fence past its bound".into(),
                    },
                    FenceEnd::Lost => {
                        h.lost_on = Some(generation);
                        Input::DeviceLost {
                            key,
                            device: 0,
                            generation,
                            reason: "lost".into(),
                        }
                    }
                    FenceEnd::EngineLost => {
                        h.lost_on = Some(generation);
                        self.engine_lost = true;
                        Input::EngineDeviceLost {
                            key,
                            device: 0,
                            generation,
                            reason: "destroyed by the engine".into(),
                        }
                    }
                };
                self.input(input, &mut turn)?;
            }
            Op::Ended(j, asked_dir) => {
                let key = self.held(j).expect("enabled").key;
                let h = self.held_mut(key).expect("held");
                let mut proofs = Proofs::default();
                if !h.joined {
                    proofs = proofs.with(Proofs::JOINED).with(Proofs::TASKS);
                }
                if matches!(h.fence, None | Some(FenceEnd::Late)) {
                    proofs = proofs.with(Proofs::GPU);
                    h.fence = Some(FenceEnd::Done);
                }
                h.joined = true;
                h.ended = true;
                h.asked_dir = asked_dir;
                let dir = if asked_dir { dir_of(key) } else { None };
                self.input(Input::Ended { key, proofs, dir }, &mut turn)?;
            }
            Op::Removal(j, end) => {
                let key = self.held(j).expect("enabled").key;
                let h = self.held_mut(key).expect("held");
                let input = match end {
                    RemovalEnd::Removed => {
                        h.removing = None;
                        h.dir_removed = true;
                        Input::ProvenOne {
                            key,
                            proof: Proof::TempDir,
                        }
                    }
                    RemovalEnd::Failed => {
                        h.removing = None;
                        Input::TempDirFailed {
                            key,
                            detail: "temp dir".into(),
                            error: std::io::Error::other("busy"),
                        }
                    }
                    RemovalEnd::Late => {
                        h.removing = Some(true);
                        Input::Late {
                            key,
                            proof: Proof::TempDir,
                            detail: "slow file system".into(),
                        }
                    }
                };
                self.input(input, &mut turn)?;
            }
            Op::Replaced => {
                self.recreating = false;
                self.engine_lost = false;
                self.generation += 1;
                let generation = self.generation;
                self.input(
                    Input::DeviceReplaced {
                        device: 0,
                        generation,
                    },
                    &mut turn,
                )?;
            }
            Op::Resize(slots) => {
                self.resized = true;
                let control = self.control();
                self.input(Input::Resize { control, slots }, &mut turn)?;
            }
            Op::Reclaim => {
                let control = self.control();
                self.input(Input::Reclaim { control }, &mut turn)?;
            }
            Op::Settle => {
                self.core.settle();
                self.effects(&mut turn)?;
            }
            Op::Shutdown => {
                self.stopping = true;
                self.input(Input::Shutdown, &mut turn)?;
            }
            Op::GraceOver => {
                self.grace_over = true;
                self.input(Input::ShutdownGraceOver, &mut turn)?;
            }
            Op::Deadline => {
                self.deadline = true;
                self.input(Input::ShutdownDeadline, &mut turn)?;
            }
        }
        self.check(&turn)
    }

    fn input(&mut self, input: Input, turn: &mut Turn) -> Checked {
        self.apply(input)?;
        self.effects(turn)
    }

    /// Applies one input to the core, then checks every slot the core gave back to its pool
    /// in that step, as it was given (the core owns the pool: a release is no effect).
    fn apply(&mut self, input: Input) -> Checked {
        let before = self.core.pool_holders();
        let resize = match &input {
            Input::Resize { slots, .. } => Some(*slots),
            _ => None,
        };
        self.core.apply(input);
        let after = self.core.pool_holders();
        // Nothing is taken from the pool once the shutdown has begun.
        let held = |h: &[u64]| h.iter().filter(|l| **l != 0).count();
        ensure!(
            !self.stopping || held(&after) <= held(&before),
            "a slot taken from the pool after shutdown: {before:?} -> {after:?}"
        );
        for (slot, lease) in before.iter().enumerate() {
            if *lease != 0 && after.get(slot) != Some(lease) {
                self.released(SlotToken::new(slot as u32, *lease))?;
            }
        }
        if let Some(slots) = resize
            && self.core.pool_size() == Some(slots)
        {
            self.size = slots;
        }
        Ok(())
    }

    /// A token back in the pool: the checks of a release.
    fn released(&mut self, token: SlotToken) -> Checked {
        // Invariant 5: one release per token.
        ensure!(
            self.released.insert((token.slot_id(), token.lease_id())),
            "{token} released twice"
        );
        let generation = self.generation;
        let Some(h) = self.jobs.iter_mut().find_map(|j| match &mut j.stage {
            Stage::Holding(h) if h.tokens.contains(&token) => Some(h),
            _ => None,
        }) else {
            // A surplus token, or one a leaver's grant gave back: nobody held it.
            return Ok(());
        };
        let key = h.key;
        // Invariant 3: a job's slot goes back only after every step of its pipeline.
        if h.started {
            ensure!(
                h.joined && h.ended,
                "lease {key} released before its worker's end: {h:?}"
            );
            ensure!(
                h.fence == Some(FenceEnd::Done) || h.lost_on.is_some_and(|g| g < generation),
                "lease {key} released before its GPU fence: {h:?}"
            );
            ensure!(
                !h.asked_dir || h.dir_removed,
                "lease {key} released before its temp dir was removed: {h:?}"
            );
        }
        ensure!(
            !h.given_back.contains(&token),
            "{token} given back twice by lease {key}"
        );
        h.given_back.push(token);
        Ok(())
    }

    /// Performs the effects the core asked for, as the shell and the world would.
    fn effects(&mut self, turn: &mut Turn) -> Checked {
        while let Some(effect) = self.core.pop_effect() {
            match effect {
                Effect::Acquire { .. } | Effect::Release { .. } => {
                    return Err(format!(
                        "{effect:?}: the core owns its pool and never asks the shell"
                    ));
                }
                Effect::AbortAcquire { request } => {
                    return Err(format!(
                        "acquire {request} dropped: the pool answers at once"
                    ));
                }
                Effect::Deliver {
                    waiter,
                    key,
                    token,
                    more,
                } => {
                    let tokens: Vec<SlotToken> =
                        std::iter::once(token).chain(more.iter().copied()).collect();
                    self.deliver(waiter, key, tokens)?;
                }
                Effect::Refuse { waiter, error } => {
                    // Only the pool's own refusal fails an acquire here: the core asked it for
                    // a slot it did not have.
                    ensure!(
                        !matches!(error, AcquireError::Failed(_)),
                        "{waiter} refused by the pool: {error}"
                    );
                    let job = self
                        .jobs
                        .iter_mut()
                        .find(|j| j.waiter == waiter)
                        .ok_or("refused an unknown waiter")?;
                    ensure!(
                        job.stage == Stage::Waiting,
                        "refused {waiter}, who does not wait"
                    );
                    job.stage = Stage::Gone;
                }
                Effect::StartRenewal { .. } | Effect::StopRenewal { .. } => {
                    return Err("a renewal on the pool, which renews nothing".into());
                }
                Effect::Cancel { .. }
                | Effect::LostAfterExit { .. }
                | Effect::AbortTasks { .. }
                | Effect::Sink { .. }
                | Effect::OrphanCounted
                | Effect::TokenRefused(_) => {}
                Effect::RecreateDevice { .. } => self.recreating = true,
                Effect::RemoveTempDir { key, dir } => {
                    ensure!(
                        Some(&dir) == dir_of(key).as_ref(),
                        "lease {key}'s removal names another dir: {dir:?}"
                    );
                    let generation = self.generation;
                    let h = self.held_mut(key).ok_or("a removal for an unknown lease")?;
                    // Invariant 3: the temp dir goes only after the worker's physical end.
                    ensure!(
                        h.started && h.joined && h.ended,
                        "temp dir of lease {key} removed before its worker's end: {h:?}"
                    );
                    ensure!(
                        h.fence == Some(FenceEnd::Done)
                            || h.lost_on.is_some_and(|g| g < generation),
                        "temp dir of lease {key} removed before its GPU fence: {h:?}"
                    );
                    ensure!(h.asked_dir, "removal of a temp dir never made");
                    ensure!(h.removing.is_none(), "two removals at once");
                    h.removing = Some(false);
                }
                Effect::Answer { key, answer } => {
                    let ok = matches!(
                        answer,
                        Answer::Job {
                            cleanup: Ok(()),
                            ..
                        }
                    );
                    let h = self.held_mut(key).ok_or("an answer for an unknown lease")?;
                    ensure!(!h.answered, "lease {key} answered twice");
                    h.answered = true;
                    if ok {
                        turn.answered_ok.push(key);
                    }
                }
                Effect::Forget { key } => {
                    if let Some(h) = self.held_mut(key) {
                        h.forgotten = true;
                    }
                }
                Effect::Recheck {
                    checks,
                    leases,
                    purpose,
                } => {
                    // Only process groups are re-checked, and no job here starts one.
                    ensure!(checks.is_empty(), "a re-check of {checks:?}");
                    self.apply(Input::Rechecked {
                        results: Box::default(),
                        leases,
                        purpose,
                    })?;
                }
                Effect::Reply { reply, .. } => {
                    if let Reply::Resized(Ok(capacity)) = reply {
                        turn.resized_to = Some(capacity as usize);
                    }
                }
                Effect::ArmShutdownTimers => self.timers = true,
                Effect::CloseGpu => self.apply(Input::GpuClosed)?,
                Effect::CloseBroker => self.apply(Input::BrokerClosed)?,
                Effect::Stopped { .. } => {
                    ensure!(!self.stopped, "stopped twice");
                    self.stopped = true;
                }
                Effect::Illegal(what) => {
                    return Err(format!(
                        "the core refused an input the world made legally: {what}"
                    ));
                }
            }
        }
        Ok(())
    }

    fn deliver(&mut self, waiter: WaiterId, key: LeaseKey, tokens: Vec<SlotToken>) -> Checked {
        let live: Vec<SlotToken> = (0..self.jobs.len())
            .filter_map(|j| self.held(j))
            .flat_map(|h| h.tokens.iter().filter(|t| !h.given_back.contains(t)))
            .copied()
            .collect();
        // Invariant 1: never more slots committed than the capacity in force, and no retired
        // slot handed on.
        ensure!(
            live.len() + tokens.len() <= self.capacity(),
            "{tokens:?} granted with {} slots held, capacity {}",
            live.len(),
            self.capacity()
        );
        for token in &tokens {
            ensure!(
                token.slot_id() < self.size,
                "{token} handed on above the pool's size {}",
                self.size
            );
            // Invariant 2: no slot or lease id held twice.
            for other in live.iter().chain(tokens.iter().filter(|t| *t != token)) {
                ensure!(
                    other.slot_id() != token.slot_id() && other.lease_id() != token.lease_id(),
                    "{token} granted while {other} is held"
                );
            }
        }
        let job = self
            .jobs
            .iter_mut()
            .find(|j| j.waiter == waiter)
            .ok_or("delivered to an unknown waiter")?;
        ensure!(
            job.stage == Stage::Waiting,
            "delivered to {waiter}, who does not wait"
        );
        let fate = job.fate;
        ensure!(
            tokens.len() == fate.slots() as usize,
            "{waiter} asked for {} slots and got {tokens:?}",
            fate.slots()
        );
        let held = |started| Held {
            key,
            tokens: tokens.clone(),
            given_back: Vec::new(),
            started,
            joined: false,
            tasks_late: false,
            fence: None,
            lost_on: None,
            ended: false,
            asked_dir: false,
            removing: None,
            dir_removed: false,
            answered: false,
            forgotten: false,
        };
        match fate {
            Fate::Stays | Fate::StaysWithTwo => {
                job.stage = Stage::Holding(held(true));
                self.apply(Input::Started {
                    key,
                    device: Some(0),
                })?;
            }
            Fate::Leaves => {
                job.stage = Stage::Gone;
                self.apply(Input::Undelivered { key })?;
            }
            Fate::CannotStart => {
                job.stage = Stage::Holding(held(false));
                self.apply(Input::NotStarted {
                    key,
                    why: PrepareError::NoGpuSlot,
                })?;
            }
        }
        Ok(())
    }

    /// The invariants after a whole input.
    fn check(&self, turn: &Turn) -> Checked {
        let f = self.core.figures();
        // The accounting identity, in slots.
        let c = f.counters;
        ensure!(
            c.acquired_total
                == c.released_total + c.release_failed_total + (f.active + f.quarantined) as u64,
            "the counts disagree: {f:?}"
        );
        // The pool never refuses what the core gives back.
        ensure!(
            c.release_failed_total == 0,
            "the pool refused a release: {f:?}"
        );
        // The pool holds what the core counts (leases, and what a multi-slot head gathered).
        ensure!(
            self.core.pool_held() == f.held_slots,
            "the pool holds {} slots, the core counts {} ({} active, {} quarantined)",
            self.core.pool_held(),
            f.held_slots,
            f.active,
            f.quarantined
        );
        // Everyone the world sees waiting is waiting in the core.
        if !self.stopping {
            let waiting = self
                .jobs
                .iter()
                .filter(|j| j.stage == Stage::Waiting)
                .count();
            ensure!(
                f.waiting == waiting,
                "{waiting} callers wait, the core counts {}",
                f.waiting
            );
        }
        // Invariant 4: once no job waits and every worker, fence and removal has ended, every
        // slot is free or quarantined.
        let busy = self.jobs.iter().any(|j| match &j.stage {
            Stage::Waiting => !self.stopping,
            Stage::Holding(h) => !h.forgotten && ((h.started && !h.ended) || h.removing.is_some()),
            Stage::Gone => false,
        });
        if !busy {
            ensure!(
                f.active == 0 && self.core.pool_held() == f.quarantined,
                "every job has ended, yet {} slots are active and the pool holds {} ({} quarantined)",
                f.active,
                self.core.pool_held(),
                f.quarantined
            );
        }
        // Invariant 11: what an answer says is already visible.
        for key in &turn.answered_ok {
            ensure!(
                self.core.view(*key).is_none(),
                "lease {key} was answered as released, but the core still holds it"
            );
        }
        if let Some(capacity) = turn.resized_to {
            ensure!(
                f.capacity == Some(capacity),
                "a resize answered capacity {capacity}, the core shows {:?}",
                f.capacity
            );
        }
        Ok(())
    }
}

/// What one input's effects said, checked once the input is whole.
#[derive(Default)]
struct Turn {
    answered_ok: Vec<LeaseKey>,
    resized_to: Option<usize>,
}

/// What an exploration found.
struct Explored {
    states: usize,
    transitions: usize,
}

/// A broken invariant and the inputs that led to it.
struct Failure {
    why: String,
    root: &'static str,
    path: Vec<Op>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "after {} inputs, from {}: {}",
            self.path.len(),
            self.root,
            self.why
        )?;
        for op in &self.path {
            writeln!(f, "  {op:?}")?;
        }
        Ok(())
    }
}

/// Every input sequence up to `depth` from the empty world, depth first, each state expanded
/// again only when reached with more inputs left than before. On a failure, the search runs
/// again with growing bounds, so that the failure reported is a shortest one.
fn explore(depth: usize) -> Result<Explored, Failure> {
    let mut found = Explored {
        states: 0,
        transitions: 0,
    };
    let mut seen = HashMap::new();
    let roots = [World::new(false), World::new(true)];
    let first = roots
        .iter()
        .find_map(|root| dfs(root, depth, &mut seen, &mut found).err());
    let Some(first) = first else {
        found.states = seen.len();
        return Ok(found);
    };
    for bound in 1..first.path.len() {
        for root in &roots {
            dfs(root, bound, &mut HashMap::new(), &mut found)?;
        }
    }
    Err(first)
}

fn dfs(
    world: &World,
    left: usize,
    seen: &mut HashMap<u64, usize>,
    found: &mut Explored,
) -> Result<(), Failure> {
    if left == 0 {
        return Ok(());
    }
    for op in world.enabled() {
        let mut child = world.clone();
        found.transitions += 1;
        if let Err(why) = child.step(op) {
            return Err(Failure {
                why,
                root: child.root,
                path: child.path,
            });
        }
        let print = child.fingerprint();
        if seen.get(&print).is_some_and(|had| *had >= left - 1) {
            continue;
        }
        seen.insert(print, left - 1);
        dfs(&child, left - 1, seen, found)?;
    }
    Ok(())
}

#[test]
fn every_input_sequence_of_a_small_world_keeps_the_invariants() {
    let depth = std::env::var("LEASEHOLD_EXPLORE_DEPTH")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(EXPLORE_DEPTH);
    let started = Instant::now();
    match explore(depth) {
        Ok(found) => eprintln!(
            "explore: every input sequence up to depth {depth}: {} states, {} inputs applied, {:.1?}",
            found.states,
            found.transitions,
            started.elapsed()
        ),
        Err(failure) => panic!("an invariant broke {failure}"),
    }
}

//! A model-based test of the whole pipeline, on a broker that is not the supervisor's pool.
//!
//! The harness is not a copy of the actor shell: it plays the *world* around the core (a
//! broker with its own slot records, callers who leave, workers whose proofs arrive in any
//! order or never, a file system that fails, devices that are lost) and answers each effect the
//! way that world would. Every decision stays with the core; the harness only records what it
//! was told to do and checks it against what it knows happened. Inputs share batches as they
//! do in the mailbox: the core settles only now and then, and the invariants are checked after
//! every input and at every grant.

use std::collections::{BTreeMap, BTreeSet};
use std::io;

use proptest::prelude::*;

use super::prelude::*;

/// One step the world takes. Indices pick among what is pending (modulo its length).
#[derive(Debug, Clone)]
enum Op {
    Enqueue(Want),
    Withdraw(usize),
    /// Complete a broker acquire: 0 ok, 1 error, 2 a token colliding with a live lease.
    Acquire(usize, u8),
    /// A driver report for a started job: 0 join+tasks, 1 join only, 2 tasks, 3 the driver's
    /// end (every proof still owed, its temp dir removed, or left when a process group is
    /// unproven or the GPU lost), 4 process start, 5 process end ok, 6 process unproven,
    /// 7 tasks late, 8 gpu done, 9 gpu late, 10 gpu lost, 11 the driver's end with its temp
    /// dir removal failed, 12 the driver's temp dir removal late, 13 the driver's end of a job
    /// that never made a temp dir, 14 gpu lost on the engine's own device.
    Worker(usize, u8),
    /// Complete a temp dir removal the core asked for: 0 ok, 1 fail, 2 late (still running).
    TempDir(usize, u8),
    /// Complete a broker release: 0 ok, 1 fail, 2 timeout.
    Release(usize, u8),
    ReleaseExplicit(usize),
    LeaseLost(usize),
    DeviceReplaced(usize),
    Reclaim,
    /// Cancel by id: a job that waits or holds a lease.
    Cancel(usize),
    Shutdown,
    GraceOver,
    Deadline,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => prop_oneof![Just(Want::Lease), Just(Want::Job)].prop_map(Op::Enqueue),
        1 => any::<usize>().prop_map(Op::Withdraw),
        3 => (any::<usize>(), prop_oneof![8 => Just(0u8), 1 => Just(1), 1 => Just(2), 1 => Just(3)]).prop_map(|(i, k)| Op::Acquire(i, k)),
        6 => (any::<usize>(), 0u8..15).prop_map(|(i, k)| Op::Worker(i, k)),
        2 => (any::<usize>(), prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2)]).prop_map(|(i, k)| Op::TempDir(i, k)),
        3 => (any::<usize>(), prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2), 1 => Just(3)]).prop_map(|(i, k)| Op::Release(i, k)),
        2 => any::<usize>().prop_map(Op::ReleaseExplicit),
        1 => any::<usize>().prop_map(Op::LeaseLost),
        1 => (0usize..2).prop_map(Op::DeviceReplaced),
        1 => Just(Op::Reclaim),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => Just(Op::Shutdown),
        1 => Just(Op::GraceOver),
        1 => Just(Op::Deadline),
    ]
}

/// What the world knows of one lease the core granted.
#[derive(Debug, Default, Clone)]
struct Known {
    token: Option<SlotToken>,
    job: bool,
    surplus: bool,
    started: bool,
    device: Option<usize>,
    /// Proofs fed so far.
    joined: bool,
    tasks: bool,
    /// The driver's end was reported (`Input::Ended`): the temp dir is the core's from then.
    ended: bool,
    gpu_done: bool,
    gpu_lost: Option<u64>,
    processes_open: BTreeSet<ProcessKey>,
    processes_unproven: BTreeSet<ProcessKey>,
    temp_dir_proven: bool,
    released: bool,
    answers: usize,
    sinks: usize,
    release_requested: bool,
    release_effects: usize,
    failed_release: bool,
}

#[derive(Debug)]
struct World {
    core: Core,
    capacity: u32,
    gpu: bool,
    next_control: ControlId,
    /// Broker: slot → lease id held; the next lease id.
    held: BTreeMap<u32, u64>,
    next_lease: u64,
    acquiring: Vec<RequestId>,
    /// Acquires the core dropped (their answers may still come).
    aborted: BTreeSet<RequestId>,
    waiting: Vec<WaiterId>,
    wants: BTreeMap<WaiterId, Want>,
    next_waiter: WaiterId,
    /// Waiters and how they ended (one end each).
    ended: BTreeMap<WaiterId, &'static str>,
    known: BTreeMap<LeaseKey, Known>,
    removing: Vec<LeaseKey>,
    releases: Vec<(LeaseKey, SlotToken)>,
    /// Tokens the core asked to release (each once).
    released_tokens: BTreeSet<(u32, u64)>,
    /// Callers' presence at delivery, from the seed.
    rng: u64,
    next_process: ProcessKey,
    generation: [u64; 2],
    stopping: bool,
    stopped: bool,
    timers_armed: bool,
    log: Vec<String>,
}

impl World {
    fn new(capacity: u32, gpu: bool, seed: u64) -> Self {
        Self {
            core: Core::on_broker(Some(capacity), false, gpu),
            capacity,
            gpu,
            next_control: ControlId(1),
            held: BTreeMap::new(),
            next_lease: 1,
            acquiring: Vec::new(),
            aborted: BTreeSet::new(),
            waiting: Vec::new(),
            wants: BTreeMap::new(),
            next_waiter: WaiterId(1),
            ended: BTreeMap::new(),
            known: BTreeMap::new(),
            removing: Vec::new(),
            releases: Vec::new(),
            released_tokens: BTreeSet::new(),
            rng: seed | 1,
            next_process: ProcessKey(1),
            generation: [1, 1],
            stopping: false,
            stopped: false,
            timers_armed: false,
            log: Vec::new(),
        }
    }

    fn roll(&mut self, n: u64) -> u64 {
        // xorshift: the world's own choices, from the case's seed.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % n
    }

    fn input(&mut self, input: Input) {
        self.log.push(format!("{input:?}"));
        self.core.apply(input);
        self.effects();
    }

    fn settle(&mut self) {
        loop {
            self.core.settle();
            if !self.core.has_effects() {
                break;
            }
            self.effects();
        }
    }

    /// Answers every effect the way the world would, checking what the core asks for.
    fn effects(&mut self) {
        while let Some(effect) = self.core.pop_effect() {
            self.log.push(format!("  -> {effect:?}"));
            match effect {
                Effect::Acquire { request, .. } => {
                    assert!(!self.stopping, "an acquire started after shutdown");
                    self.acquiring.push(request);
                }
                Effect::AbortAcquire { request } => {
                    // The future is dropped. The broker may have answered already: then the
                    // answer still comes (kept in `acquiring`, so the world delivers it late);
                    // else nothing was taken.
                    if self.roll(2) == 0 {
                        self.acquiring.retain(|r| *r != request);
                    }
                    self.aborted.insert(request);
                }
                Effect::Deliver {
                    waiter, key, token, ..
                } => {
                    assert!(
                        self.waiting.contains(&waiter),
                        "delivered to a waiter that left"
                    );
                    // Invariant 1, at the grant: no more leases live than the capacity.
                    let live = self
                        .known
                        .values()
                        .filter(|k| !k.released && k.release_effects == 0 && !k.surplus)
                        .count();
                    assert!(
                        live < self.capacity as usize,
                        "granted past the capacity\n{}",
                        self.log.join("\n")
                    );
                    // Invariant 2: no slot held by two live leases the core delivered.
                    for (k, other) in &self.known {
                        if *k != key && !other.released && other.release_effects == 0 {
                            assert_ne!(
                                other.token.map(|t| t.slot_id()),
                                Some(token.slot_id()),
                                "slot {token} delivered while held by lease {k}"
                            );
                        }
                    }
                    let want = self.waiter_want(waiter);
                    match self.roll(10) {
                        // The caller left just before the hand-over: the token goes on.
                        0 => {
                            self.end_waiter(waiter, "left");
                            self.known.insert(key, Known::default());
                            self.input(Input::Undelivered { key });
                            self.known.remove(&key);
                        }
                        // A job that could not start (no worker, no GPU): its caller hears why.
                        1 if want == Want::Job => {
                            self.end_waiter(waiter, "not started");
                            self.known.insert(
                                key,
                                Known {
                                    token: Some(token),
                                    job: true,
                                    ..Default::default()
                                },
                            );
                            self.input(Input::NotStarted {
                                key,
                                why: PrepareError::NoGpuSlot,
                            });
                        }
                        _ => {
                            self.end_waiter(waiter, "granted");
                            let job = want == Want::Job;
                            let device = (job && self.gpu).then(|| self.roll(2) as usize);
                            self.known.insert(
                                key,
                                Known {
                                    token: Some(token),
                                    job,
                                    started: job,
                                    device,
                                    ..Default::default()
                                },
                            );
                            if job {
                                self.input(Input::Started { key, device });
                            }
                        }
                    }
                }
                Effect::Refuse { waiter, .. } => self.end_waiter(waiter, "refused"),
                Effect::StartRenewal { .. } | Effect::StopRenewal { .. } => {}
                Effect::Cancel { .. }
                | Effect::LostAfterExit { .. }
                | Effect::AbortTasks { .. } => {}
                Effect::RecreateDevice { .. } => {}
                Effect::RemoveTempDir { key, dir } => {
                    assert_eq!(
                        Some(dir),
                        dir_of(key),
                        "lease {key}'s removal names another dir"
                    );
                    let k = &self.known[&key];
                    // Invariant 3: the temp dir goes only after every proof of the physical end,
                    // and the core asks only once the driver has handed it over.
                    assert!(
                        k.joined && k.tasks && k.ended,
                        "temp dir removed before the worker's end: {k:?}"
                    );
                    assert!(
                        k.processes_open.is_empty() && k.processes_unproven.is_empty(),
                        "temp dir removed with processes unproven: {k:?}"
                    );
                    assert!(
                        k.device.is_none()
                            || k.gpu_done
                            || k.gpu_lost
                                .is_some_and(|g| g < self.generation[k.device.unwrap()]),
                        "temp dir removed before the gpu fence: {k:?}"
                    );
                    assert!(!self.removing.contains(&key), "two removals at once");
                    self.removing.push(key);
                }
                Effect::Release { key, token } => {
                    // A token nobody waited for any more (surplus) is released at once.
                    let k = self.known.entry(key).or_insert_with(|| Known {
                        token: Some(token),
                        surplus: true,
                        ..Default::default()
                    });
                    // Invariant 5: one release per token.
                    assert!(
                        self.released_tokens
                            .insert((token.slot_id(), token.lease_id())),
                        "{token} released twice"
                    );
                    k.release_effects += 1;
                    if k.job && k.started {
                        assert!(
                            k.temp_dir_proven,
                            "a job's slot released before its temp dir: {k:?}"
                        );
                    }
                    self.releases.push((key, token));
                }
                Effect::Answer { key, .. } => {
                    if let Some(k) = self.known.get_mut(&key) {
                        k.answers += 1;
                        if k.job {
                            // A job's caller hears exactly one answer.
                            assert_eq!(k.answers, 1, "job {key} answered twice");
                        }
                    }
                }
                Effect::Sink { key, .. } => {
                    self.known
                        .get_mut(&key)
                        .expect("sink for an unknown lease")
                        .sinks += 1;
                }
                Effect::Forget { key } => {
                    if let Some(k) = self.known.get_mut(&key) {
                        k.released = true;
                    }
                }
                Effect::Recheck {
                    checks,
                    leases,
                    purpose,
                } => {
                    let mut results = Vec::new();
                    for (key, proof) in checks {
                        let Proof::Process(p) = proof else {
                            panic!("recheck of {proof:?}")
                        };
                        let gone = self.roll(2) == 0;
                        if gone {
                            self.known
                                .get_mut(&key)
                                .unwrap()
                                .processes_unproven
                                .remove(&p);
                        }
                        results.push(Rechecked {
                            key,
                            proof,
                            outcome: if gone {
                                Ok(())
                            } else {
                                Err(format!("group {p} still has members"))
                            },
                        });
                    }
                    self.input(Input::Rechecked {
                        results: results.into(),
                        leases,
                        purpose,
                    });
                }
                Effect::Reply {
                    reply: Reply::Reclaimed { reclaimed, still },
                    ..
                } => {
                    // A reclaim answers only once its re-checks are in: what it calls reclaimed
                    // is out of quarantine, and what it calls still quarantined is in it.
                    let now: Vec<SlotToken> = self
                        .core
                        .quarantine_entries()
                        .iter()
                        .map(|e| e.token)
                        .collect();
                    for token in reclaimed.iter() {
                        let removing = self.core.book.keys_where(|r| {
                            r.removal == crate::supervisor::core::record::Removal::Running
                                && r.tokens().any(|t| t == *token)
                        });
                        assert!(
                            removing.is_empty(),
                            "{token} reported reclaimed while its temp dir is still being removed\n{}",
                            self.log.join("\n")
                        );
                        assert!(
                            !now.contains(token),
                            "{token} reported reclaimed while still quarantined\n{}",
                            self.log.join("\n")
                        );
                    }
                    for entry in still.iter() {
                        assert!(
                            now.contains(&entry.token),
                            "{} reported still quarantined, but it is not\n{}",
                            entry.token,
                            self.log.join("\n")
                        );
                    }
                }
                Effect::Reply { .. } => {}
                Effect::ArmShutdownTimers => self.timers_armed = true,
                Effect::CloseGpu => self.input(Input::GpuClosed),
                Effect::CloseBroker => {
                    // Only once every lease is released or quarantined for good.
                    assert!(
                        self.releases.is_empty(),
                        "the broker closed with releases in flight\n{}",
                        self.log.join("\n")
                    );
                    self.input(Input::BrokerClosed);
                }
                Effect::Stopped { .. } => {
                    assert!(!self.stopped, "stopped twice");
                    self.stopped = true;
                }
                Effect::OrphanCounted | Effect::TokenRefused(_) => {}
                Effect::Illegal(what) => panic!(
                    "the core refused an input the world made legally: {what}\n{}",
                    self.log.join("\n")
                ),
            }
        }
    }

    fn waiter_want(&self, waiter: WaiterId) -> Want {
        *self.wants.get(&waiter).expect("known waiter")
    }

    fn end_waiter(&mut self, waiter: WaiterId, how: &'static str) {
        self.waiting.retain(|w| *w != waiter);
        assert!(
            self.ended.insert(waiter, how).is_none(),
            "waiter {waiter} ended twice"
        );
    }
}

fn pick<T: Copy>(items: &[T], i: usize) -> Option<T> {
    (!items.is_empty()).then(|| items[i % items.len()])
}

impl World {
    /// Live leases of started jobs (the world's view).
    fn jobs(&self) -> Vec<LeaseKey> {
        self.known
            .iter()
            .filter(|(_, k)| k.job && k.started && !k.released && k.release_effects == 0)
            .map(|(key, _)| *key)
            .collect()
    }

    fn explicit(&self) -> Vec<LeaseKey> {
        self.known
            .iter()
            .filter(|(_, k)| !k.job && !k.surplus && !k.released)
            .map(|(key, _)| *key)
            .collect()
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Enqueue(want) => {
                let waiter = self.next_waiter.take();
                self.wants.insert(waiter, want);
                self.waiting.push(waiter);
                self.input(Input::Enqueue {
                    waiter,
                    ask: Ask::one(want),
                });
            }
            Op::Withdraw(i) => {
                if let Some(waiter) = pick(&self.waiting, i) {
                    self.input(Input::Withdraw {
                        waiter,
                        why: Withdrawal::Cancelled,
                    });
                }
            }
            Op::Acquire(i, kind) => {
                let Some(request) = pick(&self.acquiring, i) else {
                    return;
                };
                self.acquiring.retain(|r| *r != request);
                let result = match kind {
                    1 => Err(BrokerError::new("refused")),
                    // The shell caught the broker's panic (on the first poll or later).
                    3 => Err(BrokerError::panicked("the broker's acquire panicked")),
                    2 => match self.held.iter().find(|(_, lease)| {
                        !self.releases.iter().any(|(_, t)| t.lease_id() == **lease)
                    }) {
                        // A broker bug: a slot it still holds for a live lease (one whose
                        // release is in flight may be granted again: the core accepts that).
                        Some((&slot, _)) => {
                            let lease = self.next_lease;
                            self.next_lease += 1;
                            Ok(SlotToken::new(slot, lease))
                        }
                        None => Err(BrokerError::new("refused")),
                    },
                    _ => {
                        let Some(slot) = (0..self.capacity).find(|s| !self.held.contains_key(s))
                        else {
                            // The core asked for more than the broker has (invariant 1), unless
                            // an acquire it dropped was answered meanwhile and holds a slot: a
                            // broker then makes the new one wait.
                            assert!(
                                !self.aborted.is_empty(),
                                "an acquire with every slot held\n{}",
                                self.log.join("\n")
                            );
                            self.acquiring.push(request);
                            return;
                        };
                        let lease = self.next_lease;
                        self.next_lease += 1;
                        self.held.insert(slot, lease);
                        Ok(SlotToken::new(slot, lease))
                    }
                };
                self.input(Input::Acquired { request, result });
            }
            Op::Worker(i, kind) => {
                let Some(key) = pick(&self.jobs(), i) else {
                    return;
                };
                let k = self.known[&key].clone();
                if k.ended {
                    // The driver has reported its end: nothing more comes from it.
                    return;
                }
                let input = match kind {
                    0 if !k.joined && !k.tasks => {
                        let m = self.known.get_mut(&key).unwrap();
                        m.joined = true;
                        m.tasks = true;
                        Input::Proven {
                            key,
                            proofs: Proofs::JOINED.with(Proofs::TASKS),
                        }
                    }
                    1 if !k.joined => {
                        self.known.get_mut(&key).unwrap().joined = true;
                        Input::Proven {
                            key,
                            proofs: Proofs::JOINED,
                        }
                    }
                    2 if k.joined && !k.tasks && k.processes_open.is_empty() => {
                        self.known.get_mut(&key).unwrap().tasks = true;
                        Input::Proven {
                            key,
                            proofs: Proofs::TASKS,
                        }
                    }
                    3 | 11 | 13 if k.processes_open.is_empty() => {
                        // The driver's end: every proof it has not sent yet, then the dir.
                        let mut proofs = Proofs::default();
                        if !k.joined {
                            proofs = proofs.with(Proofs::JOINED);
                        }
                        if !k.tasks {
                            proofs = proofs.with(Proofs::TASKS);
                        }
                        let gpu = k.device.is_some() && !k.gpu_done && k.gpu_lost.is_none();
                        if gpu {
                            proofs = proofs.with(Proofs::GPU);
                        }
                        let m = self.known.get_mut(&key).unwrap();
                        m.joined = true;
                        m.tasks = true;
                        m.gpu_done |= gpu;
                        m.ended = true;
                        let dir = if kind == 13 {
                            m.temp_dir_proven = true;
                            None
                        } else {
                            dir_of(key)
                        };
                        Input::Ended { key, proofs, dir }
                    }
                    4 if !k.tasks => {
                        let p = self.next_process.take();
                        self.known.get_mut(&key).unwrap().processes_open.insert(p);
                        Input::ProcessStarted { key, process: p }
                    }
                    5 | 6 if !k.processes_open.is_empty() => {
                        let p = *k.processes_open.iter().next().unwrap();
                        let m = self.known.get_mut(&key).unwrap();
                        m.processes_open.remove(&p);
                        if kind == 5 {
                            Input::ProvenOne {
                                key,
                                proof: Proof::Process(p),
                            }
                        } else {
                            m.processes_unproven.insert(p);
                            Input::Unproven {
                                key,
                                proof: Proof::Process(p),
                                detail: format!("group {p}"),
                            }
                        }
                    }
                    7 if k.joined && !k.tasks => Input::Late {
                        key,
                        proof: Proof::TasksJoined,
                        detail: "late".into(),
                    },
                    8 if k.tasks && k.device.is_some() && !k.gpu_done && k.gpu_lost.is_none() => {
                        self.known.get_mut(&key).unwrap().gpu_done = true;
                        Input::Proven {
                            key,
                            proofs: Proofs::GPU,
                        }
                    }
                    9 if k.tasks && k.device.is_some() && !k.gpu_done && k.gpu_lost.is_none() => {
                        Input::Late {
                            key,
                            proof: Proof::GpuFence,
                            detail: "slow".into(),
                        }
                    }
                    10 if k.tasks && k.device.is_some() && !k.gpu_done && k.gpu_lost.is_none() => {
                        let device = k.device.unwrap();
                        let generation = self.generation[device];
                        self.known.get_mut(&key).unwrap().gpu_lost = Some(generation);
                        Input::DeviceLost {
                            key,
                            device,
                            generation,
                            reason: "lost".into(),
                        }
                    }
                    // The engine's own device is lost (only its replacement brings it back).
                    14 if k.tasks && k.device.is_some() && !k.gpu_done && k.gpu_lost.is_none() => {
                        let device = k.device.unwrap();
                        let generation = self.generation[device];
                        self.known.get_mut(&key).unwrap().gpu_lost = Some(generation);
                        Input::EngineDeviceLost {
                            key,
                            device,
                            generation,
                            reason: "destroyed by the engine".into(),
                        }
                    }
                    _ => return,
                };
                self.input(input);
            }
            Op::TempDir(i, kind) => {
                let Some(key) = pick(&self.removing, i) else {
                    return;
                };
                match kind {
                    2 => {
                        // Still running past its bound: reported late once.
                        self.input(Input::Late {
                            key,
                            proof: Proof::TempDir,
                            detail: "slow fs".into(),
                        });
                    }
                    1 => {
                        self.removing.retain(|k| *k != key);
                        self.input(Input::TempDirFailed {
                            key,
                            detail: "temp dir".into(),
                            error: io::Error::other("busy"),
                        });
                    }
                    _ => {
                        self.removing.retain(|k| *k != key);
                        self.known.get_mut(&key).unwrap().temp_dir_proven = true;
                        self.input(Input::ProvenOne {
                            key,
                            proof: Proof::TempDir,
                        });
                    }
                }
            }
            Op::Release(i, kind) => {
                let Some((key, token)) = pick(&self.releases, i) else {
                    return;
                };
                self.releases.retain(|(k, _)| *k != key);
                // Whatever the answer, the broker no longer holds it for the supervisor (a
                // failure is the broker's problem from then on; a timeout is left to a TTL).
                if self.held.get(&token.slot_id()) == Some(&token.lease_id()) {
                    self.held.remove(&token.slot_id());
                }
                let result = match kind {
                    1 => Err(CleanupError::broker(token, BrokerError::new("refused"))),
                    // The shell caught the broker's panic: a failed release.
                    3 => Err(CleanupError::broker(
                        token,
                        BrokerError::panicked("the broker's release panicked"),
                    )),
                    2 => Err(CleanupError::timeout(
                        token,
                        std::time::Duration::from_secs(5),
                    )),
                    _ => Ok(()),
                };
                if let Some(k) = self.known.get_mut(&key) {
                    k.failed_release = result.is_err();
                }
                self.input(Input::Released { key, result });
            }
            Op::ReleaseExplicit(i) => {
                if let Some(key) = pick(&self.explicit(), i) {
                    self.known.get_mut(&key).unwrap().release_requested = true;
                    self.input(Input::ReleaseRequested { key });
                }
            }
            Op::LeaseLost(i) => {
                let live: Vec<_> = self
                    .known
                    .iter()
                    .filter(|(_, k)| !k.released)
                    .map(|(k, _)| *k)
                    .collect();
                if let Some(key) = pick(&live, i) {
                    self.input(Input::LeaseLost {
                        key,
                        reason: "ttl".into(),
                    });
                }
            }
            Op::DeviceReplaced(device) => {
                if self.gpu {
                    self.generation[device] += 1;
                    let generation = self.generation[device];
                    self.input(Input::DeviceReplaced { device, generation });
                }
            }
            Op::Reclaim => {
                let control = self.next_control.take();
                self.input(Input::Reclaim { control });
            }
            Op::Cancel(i) => {
                // The shell's look-up by job id: here one job, waiting or holding a lease.
                let waiting: Vec<WaiterId> = self
                    .waiting
                    .iter()
                    .copied()
                    .filter(|w| self.wants[w] == Want::Job)
                    .collect();
                let jobs = self.jobs();
                let control = self.next_control.take();
                let input = if i % 2 == 0 {
                    pick(&waiting, i / 2).map(|w| Input::CancelById {
                        control,
                        waiters: Box::new([w]),
                        leases: Box::default(),
                    })
                } else {
                    pick(&jobs, i / 2).map(|key| Input::CancelById {
                        control,
                        waiters: Box::default(),
                        leases: Box::new([key]),
                    })
                };
                if let Some(input) = input {
                    self.input(input);
                }
            }
            Op::Shutdown => {
                self.stopping = true;
                self.input(Input::Shutdown);
            }
            Op::GraceOver => {
                if self.timers_armed {
                    self.input(Input::ShutdownGraceOver);
                }
            }
            Op::Deadline => {
                if self.timers_armed {
                    self.input(Input::ShutdownDeadline);
                }
            }
        }
        self.check();
    }

    /// Invariants that hold after every input, settled or not.
    fn check(&self) {
        // 1. Capacity: the broker never holds more than its slots, and the core counts no more.
        assert!(self.held.len() <= self.capacity as usize);
        assert!(
            self.core.active() + self.core.quarantined()
                <= self.capacity as usize + self.releases.len()
        );
        // The accounting identity, in slots: every slot granted is released (or failed to be),
        // still held, or quarantined.
        let c = self.core.counters();
        assert_eq!(
            c.acquired_total,
            c.released_total
                + c.release_failed_total
                + (self.core.active() + self.core.quarantined()) as u64,
            "{}",
            self.log.join("\n")
        );
        // 6. Every waiter the core still holds is one the world sees waiting.
        assert_eq!(
            self.core.waiting(),
            if self.stopping { 0 } else { self.waiting.len() },
            "{}",
            self.log.join("\n")
        );
        // 7. A failed release of a lease nobody hears reaches the sink, exactly once.
        for (key, k) in &self.known {
            if k.released && k.failed_release {
                let reported = if k.surplus {
                    k.sinks == 1
                } else if k.job {
                    // One answer to the caller; the failure goes there, or to the sink when the
                    // caller was answered early (quarantine).
                    k.answers == 1 && k.sinks <= 1
                } else {
                    k.answers >= 1
                };
                assert!(
                    reported,
                    "lease {key}: a failed release was not reported once: {k:?}"
                );
            }
        }
    }

    /// Lets everything pending finish, in order, then checks conservation.
    fn finish(&mut self) {
        for _ in 0..10_000 {
            self.settle();
            // An acquire the broker can answer now (one with every slot held waits).
            if !self.acquiring.is_empty() && self.held.len() < self.capacity as usize {
                let before = self.acquiring.len();
                self.step(Op::Acquire(0, 0));
                if self.acquiring.len() < before || self.acquiring.is_empty() {
                    continue;
                }
            }
            if let Some(key) = self.jobs().into_iter().find(|key| {
                let k = &self.known[key];
                !k.ended || !k.processes_open.is_empty()
            }) {
                let k = self.known[&key].clone();
                let kind = if !k.processes_open.is_empty() { 5 } else { 3 };
                let jobs = self.jobs();
                let i = jobs.iter().position(|j| *j == key).unwrap();
                self.step(Op::Worker(i, kind));
                continue;
            }
            if !self.removing.is_empty() {
                self.step(Op::TempDir(0, 0));
                continue;
            }
            if !self.releases.is_empty() {
                self.step(Op::Release(0, 0));
                continue;
            }
            if let Some(i) = self
                .explicit()
                .iter()
                .position(|key| !self.known[key].release_requested)
            {
                self.step(Op::ReleaseExplicit(i));
                continue;
            }
            // A lost device whose replacement has not come yet: it comes.
            if let Some(device) = self.known.values().find_map(|k| {
                let d = k.device?;
                (!k.released && k.gpu_lost.is_some_and(|g| g >= self.generation[d])).then_some(d)
            }) {
                self.step(Op::DeviceReplaced(device));
                continue;
            }
            if let Some(&w) = self.waiting.first() {
                let _ = w;
                if self.stopping {
                    break;
                }
                // Withdraw what cannot be served any more: every slot held for ever.
                if self.core.quarantined() >= self.capacity as usize {
                    self.step(Op::Withdraw(0));
                    continue;
                }
            }
            break;
        }
        // Invariant 4: conservation. What is left is quarantined for a reason the world knows.
        let unproven_left = self
            .known
            .values()
            .filter(|k| !k.released && k.release_effects == 0)
            .count();
        assert_eq!(self.core.active(), 0, "{}", self.log.join("\n"));
        assert_eq!(self.core.quarantined(), unproven_left);
        assert_eq!(self.held.len(), self.core.quarantined());
        // Invariant 6: every waiter ended once, unless it still waits (not stopping).
        if self.stopping {
            assert!(self.waiting.is_empty());
        }
        // Invariant 5: every token granted and not quarantined was released exactly once.
        for k in self.known.values() {
            if k.released {
                assert_eq!(k.release_effects, 1, "{k:?}");
            }
        }
        // Invariant 8: a shutdown whose deadline passed has stopped.
        if self.stopping && self.timers_armed {
            let mut world = std::mem::replace(&mut self.core, Core::on_broker(None, false, false));
            world.apply(Input::ShutdownDeadline);
            self.core = world;
            self.effects();
            self.settle();
            while !self.releases.is_empty() {
                self.step(Op::Release(0, 0));
            }
            self.settle();
            assert!(
                self.stopped,
                "shutdown did not end once its deadline passed\n{}",
                self.log.join("\n")
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, max_shrink_iters: 4096, ..ProptestConfig::default() })]

    /// Each op is an input; the core settles only after those marked so (a batch ends there),
    /// so inputs share batches as in the mailbox.
    #[test]
    fn random_worlds_keep_every_invariant(seed in any::<u64>(), gpu in any::<bool>(), capacity in 1u32..4, ops in prop::collection::vec((op(), prop::bool::weighted(0.4)), 1..120)) {
        let mut world = World::new(capacity, gpu, seed);
        for (op, batch_ends) in ops {
            world.step(op);
            if batch_ends {
                world.settle();
                world.check();
            }
        }
        world.finish();
    }
}

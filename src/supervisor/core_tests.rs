//! Tests of the pure core: named edges, and a model-based test that drives [`Core`] with random
//! sequences of inputs and checks the invariants of DESIGN.md section 3 after every step.
//!
//! The harness is not a copy of the actor shell: it plays the *world* around the core (a
//! broker with its own slot records, callers who leave, workers whose proofs arrive in any
//! order or never, a file system that fails, devices that are lost) and answers each effect the
//! way that world would. Every decision stays with the core; the harness only records what it
//! was told to do and checks it against what it knows happened.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

// ---------------------------------------------------------------------------------------------
// Named edges
// ---------------------------------------------------------------------------------------------

fn drain(core: &mut Core) -> Vec<Effect> {
    let mut out = Vec::new();
    while let Some(e) = core.pop_effect() {
        out.push(e);
    }
    out
}

fn token(slot: u32, lease: u64) -> SlotToken {
    SlotToken::new(slot, lease)
}

#[test]
fn a_queued_waiter_keeps_its_id_and_what_it_wants_in_eight_bytes() {
    assert_eq!(std::mem::size_of::<Queued>(), 8);
    for waiter in [0, 1, 2, 0x1234_5678_9abc, (1 << 63) - 1] {
        for want in [Want::Lease, Want::Job] {
            let q = Queued::new(waiter, want);
            assert_eq!((q.waiter(), q.want()), (waiter, want));
        }
    }
}

#[test]
fn waiters_of_both_kinds_are_popped_in_queue_order_with_what_they_want() {
    let mut queue = WaitQueue::default();
    queue.push(7, Ask::one(Want::Job));
    queue.push(3, Ask::one(Want::Lease));
    queue.push(9, Ask::one(Want::Job));
    assert_eq!(queue.remove(3), Some(1));
    queue.push(4, Ask::one(Want::Lease));
    assert_eq!(queue.head(), Some(7));
    assert_eq!(
        queue.pop().map(|s| (s.waiter, s.want, s.slots)),
        Some((7, Want::Job, 1))
    );
    assert_eq!(
        queue.pop().map(|s| (s.waiter, s.want, s.slots)),
        Some((9, Want::Job, 1))
    );
    assert_eq!(
        queue.pop().map(|s| (s.waiter, s.want, s.slots)),
        Some((4, Want::Lease, 1))
    );
    assert_eq!(queue.pop(), None);
}

/// A core with one job granted and started on `token`; returns its key.
fn started_job(core: &mut Core, t: SlotToken, device: Option<usize>) -> LeaseKey {
    core.apply(Input::Enqueue {
        waiter: 1,
        ask: Ask::one(Want::Job),
    });
    core.settle();
    let request = match drain(core).as_slice() {
        [Effect::Acquire { request, .. }] => *request,
        other => panic!("expected one acquire, got {other:?}"),
    };
    core.apply(Input::Acquired {
        request,
        result: Ok(t),
    });
    let key = match drain(core).as_slice() {
        [Effect::Deliver { key, .. }] => *key,
        other => panic!("expected a delivery, got {other:?}"),
    };
    core.apply(Input::Started { key, device });
    assert!(drain(core).is_empty());
    key
}

fn releases(effects: &[Effect]) -> usize {
    effects
        .iter()
        .filter(|e| matches!(e, Effect::Release { .. }))
        .count()
}

#[test]
fn a_job_is_released_only_after_every_proof_and_its_temp_dir() {
    let mut core = Core::new(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::Proven {
        key,
        proofs: Proofs::JOINED,
    });
    assert!(drain(&mut core).is_empty());
    assert_eq!(core.lease(key).unwrap().phase(), Phase::Draining);
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::EventHandled,
    });
    assert!(drain(&mut core).is_empty(), "tasks are still owed");
    core.apply(Input::Proven {
        key,
        proofs: Proofs::TASKS,
    });
    let effects = drain(&mut core);
    assert!(matches!(effects.as_slice(), [Effect::RemoveScratch { .. }]));
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::Scratch,
    });
    assert_eq!(releases(&drain(&mut core)), 1);
}

#[test]
fn a_process_group_started_by_the_job_holds_the_temp_dir_until_it_is_proven_empty() {
    let mut core = Core::new(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::ProcessStarted { key, process: 7 });
    core.apply(Input::Proven {
        key,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
    });
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::EventHandled,
    });
    assert!(drain(&mut core).is_empty(), "the group is not proven empty");
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::Process(7),
    });
    assert!(matches!(
        drain(&mut core).as_slice(),
        [Effect::RemoveScratch { .. }]
    ));
}

#[test]
fn a_gpu_loss_and_an_unproven_process_group_on_one_lease_both_hold_it() {
    // Both must be proven: the replaced device says nothing about the process group.
    let mut core = Core::new(Some(1), false, true);
    let key = started_job(&mut core, token(0, 1), Some(0));
    core.apply(Input::ProcessStarted { key, process: 3 });
    core.apply(Input::Unproven {
        key,
        proof: Proof::Process(3),
        detail: "group 3 still has members".into(),
    });
    assert!(
        drain(&mut core).is_empty(),
        "the caller is answered only once the body has ended"
    );
    core.apply(Input::Proven {
        key,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
    });
    let early = drain(&mut core);
    assert!(
        matches!(early.as_slice(), [Effect::Answer { result: Err(e), .. }] if e.code() == "LEASE_CLEANUP_UNCONFIRMED"),
        "{early:?}"
    );
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::EventHandled,
    });
    core.apply(Input::DeviceLost {
        key,
        device: 0,
        generation: 1,
        reason: "destroyed".into(),
    });
    assert!(matches!(
        drain(&mut core).as_slice(),
        [Effect::RecreateDevice { device: 0 }]
    ));
    core.apply(Input::DeviceReplaced {
        device: 0,
        generation: 2,
    });
    let after = drain(&mut core);
    assert!(
        after.is_empty(),
        "the temp dir was removed with the group unproven: {after:?}"
    );
    assert_eq!(core.quarantined(), 1);
    core.apply(Input::ReclaimBegin);
    assert!(matches!(
        drain(&mut core).as_slice(),
        [Effect::Recheck {
            proof: Proof::Process(3),
            ..
        }]
    ));
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::Process(3),
    });
    core.apply(Input::ReclaimEnd);
    let effects = drain(&mut core);
    assert!(
        matches!(effects[0], Effect::RemoveScratch { .. }),
        "{effects:?}"
    );
    assert!(matches!(&effects[1], Effect::Reclaimed { reclaimed, .. } if reclaimed.len() == 1));
}

#[test]
fn a_loss_seen_on_an_older_generation_than_the_replacement_is_proven_by_it_but_not_a_newer_one() {
    let mut core = Core::new(Some(2), false, true);
    let key = started_job(&mut core, token(0, 1), Some(0));
    core.apply(Input::Proven {
        key,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
    });
    core.apply(Input::DeviceLost {
        key,
        device: 0,
        generation: 3,
        reason: "lost".into(),
    });
    drain(&mut core);
    // A stale replacement (generation 2) says nothing about work on generation 3.
    core.apply(Input::DeviceReplaced {
        device: 0,
        generation: 2,
    });
    assert!(
        core.lease(key)
            .unwrap()
            .waiting_for()
            .contains(&Proof::GpuFence)
    );
    core.apply(Input::DeviceReplaced {
        device: 0,
        generation: 4,
    });
    assert!(
        !core
            .lease(key)
            .unwrap()
            .waiting_for()
            .contains(&Proof::GpuFence)
    );
}

#[test]
fn two_reclaims_back_to_back_start_one_temp_dir_removal_and_apply_no_illegal_edge() {
    let mut core = Core::new(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::Proven {
        key,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
    });
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::EventHandled,
    });
    drain(&mut core);
    core.apply(Input::ScratchFailed {
        key,
        detail: "temp dir x could not be removed".into(),
        error: io::Error::other("busy"),
    });
    drain(&mut core);
    for _ in 0..2 {
        core.apply(Input::ReclaimBegin);
        core.apply(Input::ReclaimEnd);
    }
    let effects = drain(&mut core);
    let removals = effects
        .iter()
        .filter(|e| matches!(e, Effect::RemoveScratch { .. }))
        .count();
    assert_eq!(removals, 1, "{effects:?}");
    assert!(!effects.iter().any(|e| matches!(e, Effect::Illegal(_))));
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::Scratch,
    });
    assert_eq!(releases(&drain(&mut core)), 1);
}

#[test]
fn an_input_that_does_not_fit_changes_nothing_and_is_reported() {
    let mut core = Core::new(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    let before = (core.active(), core.quarantined(), core.counters());
    for input in [
        Input::ProvenOne {
            key: 99,
            proof: Proof::Scratch,
        },
        Input::Released {
            key,
            result: Ok(()),
        },
        Input::ProvenOne {
            key,
            proof: Proof::Scratch,
        },
        Input::Undelivered { key: 42 },
        Input::ReclaimEnd,
    ] {
        core.apply(input);
        assert!(
            matches!(drain(&mut core).as_slice(), [Effect::Illegal(_)]),
            "an illegal input must be reported"
        );
    }
    assert_eq!(before, (core.active(), core.quarantined(), core.counters()));
}

#[test]
fn shutdown_cancels_every_job_whatever_its_phase_and_quarantines_what_the_deadline_finds_unproven()
{
    let mut core = Core::new(Some(3), false, false);
    // A running job, a draining one (tasks still running), a quarantined one (late tasks).
    let mut keys = Vec::new();
    for i in 0..3u32 {
        core.apply(Input::Enqueue {
            waiter: u64::from(i) + 1,
            ask: Ask::one(Want::Job),
        });
    }
    core.settle();
    let requests: Vec<RequestId> = drain(&mut core)
        .into_iter()
        .map(|e| match e {
            Effect::Acquire { request, .. } => request,
            other => panic!("{other:?}"),
        })
        .collect();
    for (i, request) in requests.into_iter().enumerate() {
        core.apply(Input::Acquired {
            request,
            result: Ok(token(i as u32, i as u64 + 1)),
        });
        let Effect::Deliver { key, .. } = drain(&mut core).remove(0) else {
            panic!()
        };
        core.apply(Input::Started { key, device: None });
        keys.push(key);
    }
    core.apply(Input::Proven {
        key: keys[1],
        proofs: Proofs::JOINED,
    });
    core.apply(Input::Proven {
        key: keys[2],
        proofs: Proofs::JOINED,
    });
    core.apply(Input::Late {
        key: keys[2],
        proof: Proof::TasksJoined,
        detail: "late".into(),
    });
    drain(&mut core);
    core.apply(Input::Shutdown);
    let effects = drain(&mut core);
    let cancelled: BTreeSet<LeaseKey> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Cancel { key, .. } => Some(*key),
            _ => None,
        })
        .collect();
    assert_eq!(cancelled, keys.iter().copied().collect());
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::ArmShutdownTimers))
    );
    core.settle();
    assert!(drain(&mut core).is_empty(), "shutdown may not end yet");
    core.apply(Input::ShutdownGraceOver);
    let aborted = drain(&mut core)
        .into_iter()
        .filter(|e| matches!(e, Effect::AbortTasks { .. }))
        .count();
    assert_eq!(aborted, 3);
    core.apply(Input::ShutdownDeadline);
    drain(&mut core);
    core.settle();
    assert!(matches!(drain(&mut core).as_slice(), [Effect::Stopped]));
    assert_eq!(core.quarantined(), 3);
}

#[test]
fn an_explicit_lease_held_at_shutdown_is_revoked_then_released_once() {
    let mut core = Core::new(Some(1), false, false);
    core.apply(Input::Enqueue {
        waiter: 1,
        ask: Ask::one(Want::Lease),
    });
    core.settle();
    let Effect::Acquire { request, .. } = drain(&mut core).remove(0) else {
        panic!()
    };
    core.apply(Input::Acquired {
        request,
        result: Ok(token(0, 1)),
    });
    let Effect::Deliver { key, .. } = drain(&mut core).remove(0) else {
        panic!()
    };
    core.apply(Input::Shutdown);
    let effects = drain(&mut core);
    assert!(matches!(
        effects[0],
        Effect::Cancel {
            holder: Holder::Explicit,
            ..
        }
    ));
    assert_eq!(releases(&effects), 1);
    // The holder's own release afterwards joins the one in flight.
    core.apply(Input::ReleaseRequested { key });
    assert!(drain(&mut core).is_empty());
    core.apply(Input::Released {
        key,
        result: Ok(()),
    });
    let effects = drain(&mut core);
    assert!(matches!(effects[0], Effect::Answer { result: Ok(()), .. }));
    core.apply(Input::ReleaseRequested { key });
    assert!(matches!(
        drain(&mut core).as_slice(),
        [Effect::Answer { result: Ok(()), .. }]
    ));
}

#[test]
fn a_token_for_a_slot_held_by_a_live_lease_is_refused_and_not_released() {
    let mut core = Core::new(None, false, false);
    let _key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::Enqueue {
        waiter: 2,
        ask: Ask::one(Want::Lease),
    });
    core.settle();
    let Effect::Acquire { request, .. } = drain(&mut core).remove(0) else {
        panic!()
    };
    core.apply(Input::Acquired {
        request,
        result: Ok(token(0, 9)),
    });
    let effects = drain(&mut core);
    assert!(matches!(
        effects.as_slice(),
        [
            Effect::TokenRefused(_),
            Effect::Refuse {
                waiter: 2,
                error: AcquireError::Failed(_)
            }
        ]
    ));
}

// ---------------------------------------------------------------------------------------------
// Model-based test
// ---------------------------------------------------------------------------------------------

/// One step the world takes. Indices pick among what is pending (modulo its length).
#[derive(Debug, Clone)]
enum Op {
    Enqueue(Want),
    Withdraw(usize),
    /// Complete a broker acquire: 0 ok, 1 error, 2 a token colliding with a live lease.
    Acquire(usize, u8),
    /// A worker event for a started job: 0 join+tasks, 1 join only, 2 tasks, 3 event,
    /// 4 process start, 5 process end ok, 6 process unproven, 7 tasks late, 8 gpu done,
    /// 9 gpu late, 10 gpu lost.
    Worker(usize, u8),
    /// Complete a temp dir removal: 0 ok, 1 fail, 2 late (still running).
    Scratch(usize, u8),
    /// Complete a broker release: 0 ok, 1 fail, 2 timeout.
    Release(usize, u8),
    ReleaseExplicit(usize),
    LeaseLost(usize),
    DeviceReplaced(usize),
    Reclaim,
    Shutdown,
    GraceOver,
    Deadline,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => prop_oneof![Just(Want::Lease), Just(Want::Job)].prop_map(Op::Enqueue),
        1 => any::<usize>().prop_map(Op::Withdraw),
        3 => (any::<usize>(), prop_oneof![8 => Just(0u8), 1 => Just(1), 1 => Just(2)]).prop_map(|(i, k)| Op::Acquire(i, k)),
        6 => (any::<usize>(), 0u8..11).prop_map(|(i, k)| Op::Worker(i, k)),
        2 => (any::<usize>(), prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2)]).prop_map(|(i, k)| Op::Scratch(i, k)),
        3 => (any::<usize>(), prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2)]).prop_map(|(i, k)| Op::Release(i, k)),
        2 => any::<usize>().prop_map(Op::ReleaseExplicit),
        1 => any::<usize>().prop_map(Op::LeaseLost),
        1 => (0usize..2).prop_map(Op::DeviceReplaced),
        1 => Just(Op::Reclaim),
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
    event: bool,
    gpu_done: bool,
    gpu_lost: Option<u64>,
    processes_open: BTreeSet<u64>,
    processes_unproven: BTreeSet<u64>,
    scratch_proven: bool,
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
    /// Broker: slot → lease id held; the next lease id.
    held: BTreeMap<u32, u64>,
    next_lease: u64,
    acquiring: Vec<RequestId>,
    waiting: Vec<WaiterId>,
    wants: BTreeMap<WaiterId, Want>,
    next_waiter: WaiterId,
    /// Waiters and how they ended (one end each).
    ended: BTreeMap<WaiterId, &'static str>,
    known: BTreeMap<LeaseKey, Known>,
    scratch: Vec<LeaseKey>,
    releases: Vec<(LeaseKey, SlotToken)>,
    /// Tokens the core asked to release (each once).
    released_tokens: BTreeSet<(u32, u64)>,
    /// Callers' presence at delivery, from the seed.
    rng: u64,
    next_process: u64,
    generation: [u64; 2],
    stopping: bool,
    stopped: bool,
    timers_armed: bool,
    log: Vec<String>,
}

impl World {
    fn new(capacity: u32, gpu: bool, seed: u64) -> Self {
        Self {
            core: Core::new(Some(capacity), false, gpu),
            capacity,
            held: BTreeMap::new(),
            next_lease: 1,
            acquiring: Vec::new(),
            waiting: Vec::new(),
            wants: BTreeMap::new(),
            next_waiter: 1,
            ended: BTreeMap::new(),
            known: BTreeMap::new(),
            scratch: Vec::new(),
            releases: Vec::new(),
            released_tokens: BTreeSet::new(),
            rng: seed | 1,
            next_process: 1,
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
                Effect::AbortAcquires => {
                    // The futures are dropped; a broker may still have answered one (kept in
                    // `acquiring`, so the world can deliver that answer late).
                }
                Effect::Deliver { waiter, key, token } => {
                    assert!(
                        self.waiting.contains(&waiter),
                        "delivered to a waiter that left"
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
                            self.input(Input::NotStarted { key });
                        }
                        _ => {
                            self.end_waiter(waiter, "granted");
                            let job = want == Want::Job;
                            let device = (job && self.core.gpu).then(|| self.roll(2) as usize);
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
                Effect::RemoveScratch { key } => {
                    let k = &self.known[&key];
                    // Invariant 3: the temp dir goes only after every proof of the physical end.
                    assert!(
                        k.joined && k.tasks && k.event,
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
                    assert!(!self.scratch.contains(&key), "two removals at once");
                    self.scratch.push(key);
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
                            k.scratch_proven,
                            "a job's slot released before its temp dir: {k:?}"
                        );
                    }
                    self.releases.push((key, token));
                }
                Effect::Answer { key, result } => {
                    if let Some(k) = self.known.get_mut(&key) {
                        k.answers += 1;
                        if k.job {
                            // A job's caller hears exactly one answer.
                            assert_eq!(k.answers, 1, "job {key} answered twice");
                        }
                        let _ = result;
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
                Effect::Recheck { key, proof } => {
                    let Proof::Process(p) = proof else {
                        panic!("recheck of {proof:?}")
                    };
                    if self.roll(2) == 0 {
                        self.known
                            .get_mut(&key)
                            .unwrap()
                            .processes_unproven
                            .remove(&p);
                        self.input(Input::ProvenOne { key, proof });
                    }
                }
                Effect::Reclaimed { .. } => {}
                Effect::ArmShutdownTimers => self.timers_armed = true,
                Effect::CloseGpu => self.input(Input::GpuClosed),
                Effect::Stopped => {
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
                let waiter = self.next_waiter;
                self.next_waiter += 1;
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
                            // The core asked for more than the broker has: invariant 1.
                            panic!("an acquire with every slot held\n{}", self.log.join("\n"));
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
                    3 if !k.event => {
                        self.known.get_mut(&key).unwrap().event = true;
                        Input::ProvenOne {
                            key,
                            proof: Proof::EventHandled,
                        }
                    }
                    4 if !k.tasks => {
                        let p = self.next_process;
                        self.next_process += 1;
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
                    _ => return,
                };
                self.input(input);
            }
            Op::Scratch(i, kind) => {
                let Some(key) = pick(&self.scratch, i) else {
                    return;
                };
                match kind {
                    2 => {
                        // Still running past its bound: reported late once.
                        self.input(Input::Late {
                            key,
                            proof: Proof::Scratch,
                            detail: "slow fs".into(),
                        });
                    }
                    1 => {
                        self.scratch.retain(|k| *k != key);
                        self.input(Input::ScratchFailed {
                            key,
                            detail: "temp dir".into(),
                            error: io::Error::other("busy"),
                        });
                    }
                    _ => {
                        self.scratch.retain(|k| *k != key);
                        self.known.get_mut(&key).unwrap().scratch_proven = true;
                        self.input(Input::ProvenOne {
                            key,
                            proof: Proof::Scratch,
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
                if self.core.gpu {
                    self.generation[device] += 1;
                    let generation = self.generation[device];
                    self.input(Input::DeviceReplaced { device, generation });
                }
            }
            Op::Reclaim => {
                self.input(Input::ReclaimBegin);
                self.input(Input::ReclaimEnd);
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
        self.settle();
        self.check();
    }

    /// Invariants that hold after every step.
    fn check(&self) {
        // 1. Capacity: the broker never holds more than its slots, and the core counts no more.
        assert!(self.held.len() <= self.capacity as usize);
        assert!(
            self.core.active() + self.core.quarantined()
                <= self.capacity as usize + self.releases.len()
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
            if let Some(&request) = self.acquiring.first() {
                self.step(Op::Acquire(0, 0));
                let _ = request;
                continue;
            }
            if let Some(key) = self.jobs().into_iter().find(|key| {
                let k = &self.known[key];
                !(k.joined
                    && k.tasks
                    && k.event
                    && k.processes_open.is_empty()
                    && (k.device.is_none() || k.gpu_done || k.gpu_lost.is_some()))
            }) {
                let k = self.known[&key].clone();
                let kind = if !k.processes_open.is_empty() {
                    5
                } else if !k.joined {
                    0
                } else if !k.tasks {
                    2
                } else if !k.event {
                    3
                } else {
                    8
                };
                let jobs = self.jobs();
                let i = jobs.iter().position(|j| *j == key).unwrap();
                self.step(Op::Worker(i, kind));
                continue;
            }
            if !self.scratch.is_empty() {
                self.step(Op::Scratch(0, 0));
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
            let mut world = std::mem::replace(&mut self.core, Core::new(None, false, false));
            world.apply(Input::ShutdownDeadline);
            self.core = world;
            self.effects();
            self.settle();
            while !self.releases.is_empty() {
                self.step(Op::Release(0, 0));
            }
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

    #[test]
    fn random_worlds_keep_every_invariant(seed in any::<u64>(), gpu in any::<bool>(), capacity in 1u32..4, ops in prop::collection::vec(op(), 1..120)) {
        let mut world = World::new(capacity, gpu, seed);
        for op in ops {
            world.step(op);
        }
        world.finish();
    }
}

// ---------------------------------------------------------------------------------------------
// Priorities, multi-slot leases, try_acquire and resize on the in-process pool
// ---------------------------------------------------------------------------------------------

/// A core over the supervisor's own pool (trusted tokens, exact capacity).
fn pool_core(capacity: u32) -> Core {
    Core::new(Some(capacity), false, false).trusting_tokens()
}

/// A waiter joins the queue of a test core.
fn join(core: &mut Core, waiter: WaiterId, slots: u32, priority: Priority) {
    core.apply(Input::Enqueue {
        waiter,
        ask: ask(slots, priority),
    });
}

fn ask(slots: u32, priority: Priority) -> Ask {
    Ask {
        want: Want::Lease,
        slots,
        priority,
        now_only: false,
    }
}

/// Answers every acquire at once from a pool of numbered slots; returns what was delivered
/// (waiter, key, slots) and refused (waiter, code), in order.
#[derive(Default)]
struct Pool {
    free: Vec<u32>,
    next_lease: u64,
    delivered: Vec<(WaiterId, LeaseKey, usize)>,
    refused: Vec<(WaiterId, &'static str)>,
}

impl Pool {
    fn new(slots: u32) -> Self {
        Self {
            free: (0..slots).rev().collect(),
            next_lease: 1,
            ..Self::default()
        }
    }

    fn run(&mut self, core: &mut Core) {
        loop {
            core.settle();
            let effects = drain(core);
            if effects.is_empty() {
                return;
            }
            for effect in effects {
                match effect {
                    Effect::Acquire { request, .. } => {
                        let slot = self.free.pop().expect("the core asked past the capacity");
                        self.next_lease += 1;
                        core.apply(Input::Acquired {
                            request,
                            result: Ok(token(slot, self.next_lease)),
                        });
                    }
                    Effect::Deliver { waiter, key, .. } => {
                        let n = core.lease(key).unwrap().tokens().count();
                        self.delivered.push((waiter, key, n));
                    }
                    Effect::Refuse { waiter, error } => self.refused.push((waiter, error.code())),
                    Effect::Release { key, token } => {
                        self.free.push(token.slot_id());
                        core.apply(Input::Released {
                            key,
                            result: Ok(()),
                        });
                    }
                    _ => {}
                }
            }
        }
    }
}

#[test]
fn a_higher_class_is_served_first_and_fifo_holds_within_a_class() {
    let mut core = pool_core(1);
    let mut pool = Pool::new(1);
    join(&mut core, 1, 1, Priority::Normal);
    pool.run(&mut core);
    let held = pool.delivered[0].1;
    for (waiter, priority) in [
        (2, Priority::Low),
        (3, Priority::Normal),
        (4, Priority::High),
        (5, Priority::Normal),
        (6, Priority::High),
    ] {
        core.apply(Input::Enqueue {
            waiter,
            ask: ask(1, priority),
        });
    }
    pool.run(&mut core);
    // Each grant is released at once, so the next one is served.
    let mut order = Vec::new();
    let mut key = held;
    for _ in 0..5 {
        core.apply(Input::ReleaseRequested { key });
        pool.run(&mut core);
        let (waiter, next, _) = *pool.delivered.last().unwrap();
        order.push(waiter);
        key = next;
    }
    assert_eq!(order, [4, 6, 3, 5, 2]);
}

#[test]
fn a_low_waiter_is_overtaken_by_later_high_waiters_only_within_the_aging_bound() {
    let mut core = pool_core(1);
    let mut pool = Pool::new(1);
    join(&mut core, 1, 1, Priority::High);
    pool.run(&mut core);
    join(&mut core, 2, 1, Priority::Low);
    // A steady stream of high-priority work: one new High waiter per grant, for ever.
    let mut low_served_after = None;
    for grant in 0..(4 * PRIORITY_AGING_GRANTS) {
        join(&mut core, 3 + grant, 1, Priority::High);
        let key = pool.delivered.last().unwrap().1;
        core.apply(Input::ReleaseRequested { key });
        pool.run(&mut core);
        if pool.delivered.last().unwrap().0 == 2 {
            low_served_after = Some(grant);
            break;
        }
    }
    let after = low_served_after.expect("the low waiter starved");
    assert!(
        after <= 2 * PRIORITY_AGING_GRANTS,
        "the low waiter let {after} later high waiters pass"
    );
    assert!(
        after >= 2 * PRIORITY_AGING_GRANTS - 1,
        "it was not overtaken at all: {after}"
    );
}

#[test]
fn a_multi_slot_waiter_gets_all_its_slots_at_once_and_blocks_the_queue_while_it_gathers() {
    let mut core = pool_core(3);
    let mut pool = Pool::new(3);
    for waiter in 1..=2 {
        join(&mut core, waiter, 1, Priority::Normal);
    }
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 2);
    // Needs all three; one is free, two are held. A single-slot waiter behind it must wait.
    join(&mut core, 3, 3, Priority::Normal);
    join(&mut core, 4, 1, Priority::Normal);
    pool.run(&mut core);
    assert_eq!(
        pool.delivered.len(),
        2,
        "nothing granted while the head gathers"
    );
    assert_eq!(
        core.held_slots(),
        3,
        "the free slot is gathered, not left idle"
    );
    let first = pool.delivered[0].1;
    core.apply(Input::ReleaseRequested { key: first });
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 2);
    let second = pool.delivered[1].1;
    core.apply(Input::ReleaseRequested { key: second });
    pool.run(&mut core);
    assert_eq!(pool.delivered[2].0, 3);
    assert_eq!(pool.delivered[2].2, 3, "all three slots in one lease");
    // Its release gives all three back, as one lease.
    let released_before = core.counters().released_total;
    core.apply(Input::ReleaseRequested {
        key: pool.delivered[2].1,
    });
    pool.run(&mut core);
    assert_eq!(core.counters().released_total, released_before + 1);
    assert_eq!(pool.delivered[3].0, 4);
    assert_eq!(core.held_slots(), 1);
}

#[test]
fn a_multi_slot_waiter_that_leaves_while_gathering_hands_its_slots_on() {
    let mut core = pool_core(2);
    let mut pool = Pool::new(2);
    join(&mut core, 1, 1, Priority::Normal);
    pool.run(&mut core);
    join(&mut core, 2, 2, Priority::Normal);
    join(&mut core, 3, 1, Priority::Normal);
    pool.run(&mut core);
    assert_eq!(core.held_slots(), 2);
    core.apply(Input::Withdraw {
        waiter: 2,
        why: Withdrawal::Cancelled,
    });
    pool.run(&mut core);
    assert_eq!(pool.refused, [(2, "LEASE_ACQUIRE_CANCELLED")]);
    assert_eq!(pool.delivered.last().unwrap().0, 3);
    assert_eq!(core.held_slots(), 2);
    assert_eq!(core.waiting(), 0);
}

#[test]
fn try_is_served_only_when_a_slot_is_free_and_nobody_waits_ahead() {
    let now = |waiter| Input::Enqueue {
        waiter,
        ask: Ask {
            now_only: true,
            ..ask(1, Priority::Normal)
        },
    };
    let mut core = pool_core(2);
    let mut pool = Pool::new(2);
    core.apply(now(1));
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 1);
    join(&mut core, 2, 2, Priority::Normal);
    pool.run(&mut core);
    // One slot is free, but a waiter gathers ahead: refused, and the slot is not taken.
    core.apply(now(3));
    pool.run(&mut core);
    assert_eq!(pool.refused, [(3, "LEASE_NO_SLOT_FREE")]);
    // A broker that is not the pool refuses it outright.
    let mut remote = Core::new(Some(2), false, false);
    remote.apply(now(4));
    assert!(matches!(
        drain(&mut remote).as_slice(),
        [Effect::Refuse {
            waiter: 4,
            error: AcquireError::Unsupported(_)
        }]
    ));
}

#[test]
fn a_resize_wakes_waiters_when_raised_and_revokes_nothing_when_lowered() {
    let mut core = pool_core(1);
    let mut pool = Pool::new(3);
    for waiter in 1..=3 {
        join(&mut core, waiter, 1, Priority::Normal);
    }
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 1);
    core.apply(Input::Resize { capacity: 3 });
    pool.run(&mut core);
    assert_eq!(
        pool.delivered.len(),
        3,
        "raising the capacity woke both waiters"
    );
    join(&mut core, 4, 1, Priority::Normal);
    join(&mut core, 5, 3, Priority::Normal);
    core.apply(Input::Resize { capacity: 1 });
    pool.run(&mut core);
    // Nothing revoked; the 3-slot waiter can never be served now.
    assert_eq!(core.held_slots(), 3);
    assert_eq!(pool.refused, [(5, "LEASE_SLOT_COUNT_INVALID")]);
    for i in 0..2 {
        let key = pool.delivered[i].1;
        core.apply(Input::ReleaseRequested { key });
        pool.run(&mut core);
    }
    assert_eq!(
        pool.delivered.len(),
        3,
        "still two held against a capacity of one"
    );
    let key = pool.delivered[2].1;
    core.apply(Input::ReleaseRequested { key });
    pool.run(&mut core);
    assert_eq!(pool.delivered.last().unwrap().0, 4);
    assert_eq!(core.held_slots(), 1);
}

#[test]
fn zero_slots_more_than_the_capacity_and_multi_slot_on_a_remote_broker_are_refused() {
    let mut core = pool_core(2);
    join(&mut core, 1, 0, Priority::Normal);
    join(&mut core, 2, 3, Priority::Normal);
    let codes: Vec<_> = drain(&mut core)
        .into_iter()
        .map(|e| match e {
            Effect::Refuse { error, .. } => error.code(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(codes, ["LEASE_SLOT_COUNT_INVALID"; 2]);
    let mut remote = Core::new(None, false, false);
    remote.apply(Input::Enqueue {
        waiter: 3,
        ask: ask(2, Priority::Normal),
    });
    assert!(matches!(
        drain(&mut remote).as_slice(),
        [Effect::Refuse {
            error: AcquireError::Unsupported(_),
            ..
        }]
    ));
}

#[test]
fn cancelling_a_job_by_key_cancels_it_once_and_only_before_its_release() {
    let mut core = Core::new(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::CancelJob { key });
    core.apply(Input::CancelJob { key });
    let cancels = drain(&mut core)
        .into_iter()
        .filter(|e| matches!(e, Effect::Cancel { .. }))
        .count();
    assert_eq!(cancels, 1);
}

/// One step of the pool world.
#[derive(Debug, Clone)]
enum PoolOp {
    /// Join: class rank, slots (1–3), try.
    Enqueue(usize, u32, bool),
    Withdraw(usize),
    Release(usize),
    Resize(u32),
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        5 => (0usize..3, prop_oneof![6 => Just(1u32), 1 => Just(2), 1 => Just(3)], prop::bool::weighted(0.15))
            .prop_map(|(r, k, t)| PoolOp::Enqueue(r, k, t)),
        1 => any::<usize>().prop_map(PoolOp::Withdraw),
        4 => any::<usize>().prop_map(PoolOp::Release),
        1 => (1u32..5).prop_map(PoolOp::Resize),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The real core over the in-process pool, with random classes, multi-slot requests, tries,
    /// withdrawals, releases and resizes. After every step: the pool never lends past the
    /// capacity in force when it was asked; no slot is held twice; every lease holds exactly
    /// the slots asked for; FIFO holds within a class; a waiter is overtaken by one that
    /// arrived later only within the documented aging bound; a try is answered at once. At the
    /// end every slot is back.
    #[test]
    fn the_pool_keeps_its_queueing_promises(capacity in 1u32..4, ops in prop::collection::vec(pool_op(), 1..150)) {
        let ranks = [Priority::High, Priority::Normal, Priority::Low];
        let mut core = pool_core(capacity);
        let mut cap = capacity;
        let mut free: Vec<u32> = (0..8).rev().collect();
        let mut lease_ids = 1u64;
        // Live slots, for no double grant.
        let mut holding: BTreeSet<u32> = BTreeSet::new();
        // waiter → (rank, slots, the aging clock at arrival)
        let mut waiting: BTreeMap<WaiterId, (usize, u32, u64)> = BTreeMap::new();
        let mut leases: Vec<(LeaseKey, usize)> = Vec::new();
        let mut next_waiter = 1;
        for op in ops {
            let mut tried = None;
            match op {
                PoolOp::Enqueue(rank, slots, now_only) => {
                    let waiter = next_waiter;
                    next_waiter += 1;
                    waiting.insert(waiter, (rank, slots, core.served()));
                    if now_only { tried = Some(waiter); }
                    core.apply(Input::Enqueue { waiter, ask: Ask { want: Want::Lease, slots, priority: ranks[rank], now_only } });
                }
                PoolOp::Withdraw(i) => {
                    if let Some(&waiter) = waiting.keys().nth(i % waiting.len().max(1)) {
                        core.apply(Input::Withdraw { waiter, why: Withdrawal::Cancelled });
                    }
                }
                PoolOp::Release(i) => {
                    if !leases.is_empty() {
                        let (key, _) = leases.remove(i % leases.len());
                        core.apply(Input::ReleaseRequested { key });
                    }
                }
                PoolOp::Resize(n) => {
                    cap = n;
                    core.apply(Input::Resize { capacity: n });
                }
            }
            loop {
                core.settle();
                let effects = drain(&mut core);
                if effects.is_empty() { break; }
                for effect in effects {
                    match effect {
                        Effect::Acquire { request, .. } => {
                            prop_assert!(core.held_slots() < cap as usize,
                                "asked past the capacity {} with {} held", cap, core.held_slots());
                            let slot = free.pop().expect("slots");
                            lease_ids += 1;
                            prop_assert!(holding.insert(slot), "slot {} lent twice", slot);
                            core.apply(Input::Acquired { request, result: Ok(token(slot, lease_ids)) });
                        }
                        Effect::Deliver { waiter, key, .. } => {
                            let (rank, slots, arrived) = waiting.remove(&waiter).expect("a waiter");
                            let n = core.lease(key).unwrap().tokens().count();
                            prop_assert_eq!(n, slots as usize, "all or none");
                            // The documented order: the earliest deadline (arrival on the aging
                            // clock + rank × N) first, the earlier caller on a tie. So FIFO
                            // within a class, and a later waiter passes an earlier one of a
                            // lower class only if it arrived within (rank gap) × N grants.
                            let deadline = arrived + rank as u64 * PRIORITY_AGING_GRANTS;
                            for (other, (orank, _, oarrived)) in &waiting {
                                if *other < waiter && tried != Some(waiter) {
                                    let odeadline = oarrived + *orank as u64 * PRIORITY_AGING_GRANTS;
                                    prop_assert!(deadline < odeadline,
                                        "waiter {} (rank {}, arrived at {}) passed {} (rank {}, arrived at {})",
                                        waiter, rank, arrived, other, orank, oarrived);
                                }
                            }
                            leases.push((key, n));
                        }
                        Effect::Refuse { waiter, .. } => { waiting.remove(&waiter); }
                        Effect::Release { key, token } => {
                            prop_assert!(holding.remove(&token.slot_id()));
                            free.push(token.slot_id());
                            core.apply(Input::Released { key, result: Ok(()) });
                        }
                        Effect::Illegal(what) => prop_assert!(false, "illegal: {what}"),
                        _ => {}
                    }
                }
            }
            if let Some(waiter) = tried {
                prop_assert!(!waiting.contains_key(&waiter), "a try was left waiting");
            }
            prop_assert_eq!(core.held_slots(), holding.len());
        }
        // Everything back: release every lease, and those granted meanwhile, until none is left.
        while let Some((key, _)) = leases.pop() {
            core.apply(Input::ReleaseRequested { key });
            loop {
                core.settle();
                let effects = drain(&mut core);
                if effects.is_empty() { break; }
                for effect in effects {
                    match effect {
                        Effect::Acquire { request, .. } => {
                            let slot = free.pop().expect("slots");
                            lease_ids += 1;
                            holding.insert(slot);
                            core.apply(Input::Acquired { request, result: Ok(token(slot, lease_ids)) });
                        }
                        Effect::Deliver { waiter, key, .. } => {
                            waiting.remove(&waiter);
                            leases.push((key, 0));
                        }
                        Effect::Refuse { waiter, .. } => { waiting.remove(&waiter); }
                        Effect::Release { key, token } => {
                            holding.remove(&token.slot_id());
                            free.push(token.slot_id());
                            core.apply(Input::Released { key, result: Ok(()) });
                        }
                        _ => {}
                    }
                }
            }
        }
        // Only waiters the pool can never serve (more slots than the capacity now) may be left,
        // and only if nothing is held.
        prop_assert_eq!(core.held_slots(), holding.len());
        prop_assert!(waiting.is_empty() || holding.is_empty(), "waiters left with slots free: {:?}", waiting);
    }
}

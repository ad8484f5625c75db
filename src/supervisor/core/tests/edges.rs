//! Named edges of the pure core: each test one behaviour, driven through `Core::apply`.

use std::collections::BTreeSet;
use std::io;

use super::prelude::*;

// ---------------------------------------------------------------------------------------------
// Named edges
// ---------------------------------------------------------------------------------------------

#[test]
fn a_queued_waiter_keeps_its_id_and_what_it_wants_in_eight_bytes() {
    use crate::supervisor::core::admission::Queued;
    assert_eq!(std::mem::size_of::<Queued>(), 8);
    for waiter in [0, 1, 2, 0x1234_5678_9abc, (1 << 63) - 1] {
        for want in [Want::Lease, Want::Job] {
            let q = Queued::new(WaiterId(waiter), want);
            assert_eq!((q.waiter(), q.want()), (WaiterId(waiter), want));
        }
    }
}

#[test]
fn waiters_of_both_kinds_are_popped_in_queue_order_with_what_they_want() {
    let mut queue = crate::supervisor::core::admission::WaitQueue::default();
    queue.push(WaiterId(7), Ask::one(Want::Job));
    queue.push(WaiterId(3), Ask::one(Want::Lease));
    queue.push(WaiterId(9), Ask::one(Want::Job));
    assert_eq!(queue.remove(WaiterId(3)), Some(1));
    queue.push(WaiterId(4), Ask::one(Want::Lease));
    assert_eq!(queue.head(), Some(WaiterId(7)));
    assert_eq!(
        queue.pop().map(|s| (s.waiter, s.want, s.slots)),
        Some((WaiterId(7), Want::Job, 1))
    );
    assert_eq!(
        queue.pop().map(|s| (s.waiter, s.want, s.slots)),
        Some((WaiterId(9), Want::Job, 1))
    );
    assert_eq!(
        queue.pop().map(|s| (s.waiter, s.want, s.slots)),
        Some((WaiterId(4), Want::Lease, 1))
    );
    assert_eq!(queue.pop(), None);
}

/// A core with one job granted and started on `token`; returns its key.
fn started_job(core: &mut Core, t: SlotToken, device: Option<usize>) -> LeaseKey {
    core.ask_one_slot_each([1], Want::Job);
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

/// A job on slot 0 that started the process `groups`, then ended, its body and tasks joined,
/// naming its temp dir: with no group, the core has asked for the dir's removal (the effects
/// are not drained).
fn ended_job(core: &mut Core, groups: &[ProcessKey]) -> LeaseKey {
    let key = started_job(core, token(0, 1), None);
    for process in groups {
        core.apply(Input::ProcessStarted {
            key,
            process: *process,
        });
    }
    core.apply(Input::Ended {
        key,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
        dir: dir_of(key),
    });
    key
}

/// Asks for a reclaim (control 1) and answers its re-checks: the effects that follow.
fn reclaim(core: &mut Core, clean: impl Fn(LeaseKey, Proof) -> bool) -> Vec<Effect> {
    core.apply(Input::Reclaim {
        control: ControlId(1),
    });
    let asked = drain(core);
    answer_rechecks(core, asked, clean)
}

/// Answers the re-checks among `effects` (a proof passes when `proven` says so) and returns the
/// other effects, followed by those the answers led to.
fn answer_rechecks(
    core: &mut Core,
    effects: Vec<Effect>,
    proven: impl Fn(LeaseKey, Proof) -> bool,
) -> Vec<Effect> {
    let mut out = Vec::new();
    for effect in effects {
        match effect {
            Effect::Recheck {
                checks,
                leases,
                purpose,
            } => {
                let results = checks
                    .into_iter()
                    .map(|(key, proof)| Rechecked {
                        key,
                        proof,
                        outcome: if proven(key, proof) {
                            Ok(())
                        } else {
                            Err("still there".to_owned())
                        },
                    })
                    .collect();
                core.apply(Input::Rechecked {
                    results,
                    leases,
                    purpose,
                });
                out.extend(drain(core));
            }
            other => out.push(other),
        }
    }
    out
}

fn releases(effects: &[Effect]) -> usize {
    effects
        .iter()
        .filter(|e| matches!(e, Effect::Release { .. }))
        .count()
}

#[test]
fn a_job_is_released_only_after_every_proof_and_its_temp_dir() {
    let mut core = Core::on_broker(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::Proven {
        key,
        proofs: Proofs::JOINED,
    });
    assert!(drain(&mut core).is_empty());
    assert_eq!(core.lease(key).unwrap().phase(), Phase::Draining);
    // The driver says the job asked for a temp dir: the core has it removed, then releases.
    core.apply(Input::Ended {
        key,
        proofs: Proofs::TASKS,
        dir: dir_of(key),
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::RemoveTempDir { .. }]),
        "{effects:?}"
    );
    assert_eq!(core.lease(key).unwrap().phase(), Phase::Draining);
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::TempDir,
    });
    assert_eq!(releases(&drain(&mut core)), 1);
}

#[test]
fn a_job_without_a_temp_dir_ends_in_one_report_when_nothing_is_late() {
    let mut core = Core::on_broker(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::Ended {
        key,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
        dir: None,
    });
    let effects = drain(&mut core);
    assert_eq!(releases(&effects), 1, "{effects:?}");
    assert!(
        !effects
            .iter()
            .any(|e| matches!(e, Effect::RemoveTempDir { .. } | Effect::Illegal(_))),
        "{effects:?}"
    );
}

#[test]
fn the_core_never_removes_a_temp_dir_before_the_workers_physical_end() {
    // A process group still owed: the dir stays, whatever the driver's end says.
    let mut core = Core::on_broker(Some(1), false, false);
    ended_job(&mut core, &[ProcessKey(7)]);
    let effects = drain(&mut core);
    assert!(effects.is_empty(), "{effects:?}");
}

#[test]
fn a_temp_dir_removal_that_fails_quarantines_the_slot_and_a_reclaim_retries_it() {
    let mut core = Core::on_broker(Some(1), false, false);
    let key = ended_job(&mut core, &[]);
    let asked = drain(&mut core);
    assert!(
        matches!(asked.as_slice(), [Effect::RemoveTempDir { .. }]),
        "{asked:?}"
    );
    core.apply(Input::TempDirFailed {
        key,
        detail: "temp dir x could not be removed".into(),
        error: io::Error::other("busy"),
    });
    let early = drain(&mut core);
    assert!(
        matches!(early.as_slice(), [Effect::Answer { answer: Answer::Job { cleanup: Err(e), .. }, .. }] if e.code() == "LEASE_CLEANUP_UNCONFIRMED"),
        "{early:?}"
    );
    assert_eq!(core.quarantined(), 1);
    let effects = reclaim(&mut core, |_, _| false);
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::RemoveTempDir { .. })),
        "{effects:?}"
    );
}

#[test]
fn a_process_group_started_by_the_job_holds_the_temp_dir_until_it_is_proven_empty() {
    let mut core = Core::on_broker(Some(1), false, false);
    // The group is not proven yet: the core keeps the dir.
    let key = ended_job(&mut core, &[ProcessKey(7)]);
    assert!(drain(&mut core).is_empty(), "the group is not proven empty");
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::Process(ProcessKey(7)),
    });
    assert!(matches!(
        drain(&mut core).as_slice(),
        [Effect::RemoveTempDir { .. }]
    ));
}

#[test]
fn a_gpu_loss_and_an_unproven_process_group_on_one_lease_both_hold_it() {
    // Both must be proven: the replaced device says nothing about the process group.
    let mut core = Core::on_broker(Some(1), false, true);
    let key = started_job(&mut core, token(0, 1), Some(0));
    core.apply(Input::ProcessStarted {
        key,
        process: ProcessKey(3),
    });
    core.apply(Input::Unproven {
        key,
        proof: Proof::Process(ProcessKey(3)),
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
        matches!(early.as_slice(), [Effect::Answer { answer: Answer::Job { cleanup: Err(e), .. }, .. }] if e.code() == "LEASE_CLEANUP_UNCONFIRMED"),
        "{early:?}"
    );
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
    core.apply(Input::Ended {
        key,
        proofs: Proofs::default(),
        dir: dir_of(key),
    });
    assert!(drain(&mut core).is_empty());
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
    core.apply(Input::Reclaim {
        control: ControlId(1),
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::Recheck { checks, .. }] if **checks == [(key, Proof::Process(ProcessKey(3)))]),
        "{effects:?}"
    );
    let effects = answer_rechecks(&mut core, effects, |_, _| true);
    assert!(
        matches!(effects.as_slice(), [Effect::RemoveTempDir { .. }]),
        "the reclaim answers once the removal it retried has ended: {effects:?}"
    );
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::TempDir,
    });
    let effects = drain(&mut core);
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Reply { reply: Reply::Reclaimed { reclaimed, still }, .. }
                if reclaimed.len() == 1 && still.is_empty()
        )),
        "{effects:?}"
    );
}

#[test]
fn a_loss_seen_on_an_older_generation_than_the_replacement_is_proven_by_it_but_not_a_newer_one() {
    let mut core = Core::on_broker(Some(2), false, true);
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

/// A job on slot 0 whose temp dir could not be removed: its slot is quarantined.
fn quarantined_job(core: &mut Core) -> LeaseKey {
    let key = ended_job(core, &[]);
    drain(core);
    core.apply(Input::TempDirFailed {
        key,
        detail: "temp dir x could not be removed".into(),
        error: io::Error::other("busy"),
    });
    drain(core);
    key
}

#[test]
fn two_reclaims_back_to_back_start_one_temp_dir_removal_and_apply_no_illegal_edge() {
    let mut core = Core::on_broker(Some(1), false, false);
    let key = quarantined_job(&mut core);
    let mut effects = Vec::new();
    for control in 1..=2 {
        core.apply(Input::Reclaim {
            control: ControlId(control),
        });
        let asked = drain(&mut core);
        effects.extend(answer_rechecks(&mut core, asked, |_, _| false));
    }
    let removals = effects
        .iter()
        .filter(|e| matches!(e, Effect::RemoveTempDir { .. }))
        .count();
    assert_eq!(removals, 1, "{effects:?}");
    assert!(!effects.iter().any(|e| matches!(e, Effect::Illegal(_))));
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::TempDir,
    });
    assert_eq!(releases(&drain(&mut core)), 1);
}

#[test]
fn an_input_that_does_not_fit_changes_nothing_and_is_reported() {
    let mut core = Core::on_broker(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    let before = (core.active(), core.quarantined(), core.counters());
    for input in [
        Input::ProvenOne {
            key: LeaseKey(99),
            proof: Proof::TempDir,
        },
        Input::Released {
            key,
            result: Ok(()),
        },
        Input::ProvenOne {
            key,
            proof: Proof::TempDir,
        },
        Input::Undelivered { key: LeaseKey(42) },
        Input::Rechecked {
            results: Box::default(),
            leases: Box::default(),
            purpose: RecheckFor::Shutdown,
        },
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
    let mut core = Core::on_broker(Some(3), false, false);
    // A running job, a draining one (tasks still running), a quarantined one (late tasks).
    let mut keys = Vec::new();
    core.ask_one_slot_each(1..=3, Want::Job);
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
    // Two more callers wait behind them: refused at the shutdown.
    core.ask_one_slot_each([4, 5], Want::Job);
    drain(&mut core);
    core.apply(Input::Shutdown);
    let effects = drain(&mut core);
    let effects = answer_rechecks(&mut core, effects, |_, _| false);
    let refused: BTreeSet<WaiterId> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Refuse { waiter, .. } => Some(*waiter),
            _ => None,
        })
        .collect();
    assert_eq!(refused, [WaiterId(4), WaiterId(5)].into());
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
    // Every lease released or quarantined: the broker closes, then the supervisor stops.
    assert!(matches!(drain(&mut core).as_slice(), [Effect::CloseBroker]));
    core.apply(Input::BrokerClosed);
    core.settle();
    let stopped = drain(&mut core);
    let [
        Effect::Stopped {
            tally,
            keep_work_root,
            quarantine,
        },
    ] = stopped.as_slice()
    else {
        panic!("{stopped:?}")
    };
    // An owned work root is kept: quarantined slots may hold their temp dirs.
    assert_eq!(quarantine.len(), 3);
    assert!(keep_work_root);
    // Each counted once: the report says what the shutdown did.
    assert_eq!(
        (
            tally.refused_waiters,
            tally.cancelled_jobs,
            tally.released_leases
        ),
        (2, 3, 0)
    );
    assert_eq!(core.quarantined(), 3);
}

/// A core on a one-slot broker that has delivered its slot to a first caller wanting `want`.
fn one_delivered(want: Want) -> (Core, LeaseKey) {
    let mut core = Core::on_broker(Some(1), false, false);
    core.ask_one_slot_each([1], want);
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
    (core, key)
}

#[test]
fn an_explicit_lease_held_at_shutdown_is_revoked_then_released_once() {
    let (mut core, key) = one_delivered(Want::Lease);
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
    assert!(matches!(
        effects[0],
        Effect::Answer {
            answer: Answer::Released(Ok(())),
            ..
        }
    ));
    core.apply(Input::ReleaseRequested { key });
    assert!(matches!(
        drain(&mut core).as_slice(),
        [Effect::Answer {
            answer: Answer::Released(Ok(())),
            ..
        }]
    ));
}

#[test]
fn a_token_for_a_slot_held_by_a_live_lease_is_refused_and_not_released() {
    let mut core = Core::on_broker(None, false, false);
    let _key = started_job(&mut core, token(0, 1), None);
    core.ask_one_slot_each([2], Want::Lease);
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
                waiter: WaiterId(2),
                error: AcquireError::Failed(_)
            }
        ]
    ));
}

// ---------------------------------------------------------------------------------------------
// Priorities, multi-slot leases, try_acquire and resize on the in-process pool
// ---------------------------------------------------------------------------------------------

/// A core over the supervisor's own pool (trusted tokens, exact capacity).
fn pool_core(capacity: u32) -> Core {
    Core::pool(capacity)
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

/// Performs every effect of a core on its own pool, as the shell would; records what was
/// delivered (waiter, key, slots), refused (waiter, code) and dropped (the acquire), in order.
struct Pool {
    delivered: Vec<(WaiterId, LeaseKey, usize)>,
    refused: Vec<(WaiterId, &'static str)>,
    aborted: Vec<RequestId>,
}

impl Pool {
    fn new(_slots: u32) -> Self {
        Self {
            delivered: Vec::new(),
            refused: Vec::new(),
            aborted: Vec::new(),
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
                    Effect::Acquire { .. } | Effect::Release { .. } => {
                        panic!("{effect:?}: the core owns its pool and never asks the shell")
                    }
                    Effect::Deliver { waiter, key, .. } => {
                        let n = core.lease(key).unwrap().tokens().count();
                        self.delivered.push((waiter, key, n));
                    }
                    Effect::Refuse { waiter, error } => self.refused.push((waiter, error.code())),
                    Effect::AbortAcquire { request } => self.aborted.push(request),
                    // Nothing here starts a process group: every re-check finds none.
                    Effect::Recheck {
                        checks,
                        leases,
                        purpose,
                    } => {
                        assert!(checks.is_empty(), "{checks:?}");
                        core.apply(Input::Rechecked {
                            results: Box::default(),
                            leases,
                            purpose,
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
    join(&mut core, WaiterId(1), 1, Priority::Normal);
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
            waiter: WaiterId(waiter),
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
        order.push(waiter.0);
        key = next;
    }
    assert_eq!(order, [4, 6, 3, 5, 2]);
}

#[test]
fn a_low_waiter_is_overtaken_by_later_high_waiters_only_within_the_aging_bound() {
    let mut core = pool_core(1);
    let mut pool = Pool::new(1);
    join(&mut core, WaiterId(1), 1, Priority::High);
    pool.run(&mut core);
    join(&mut core, WaiterId(2), 1, Priority::Low);
    // A steady stream of high-priority work: one new High waiter per grant, for ever.
    let mut low_served_after = None;
    for grant in 0..(4 * PRIORITY_AGING_GRANTS) {
        join(&mut core, WaiterId(3 + grant), 1, Priority::High);
        let key = pool.delivered.last().unwrap().1;
        core.apply(Input::ReleaseRequested { key });
        pool.run(&mut core);
        if pool.delivered.last().unwrap().0 == WaiterId(2) {
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
        join(&mut core, WaiterId(waiter), 1, Priority::Normal);
    }
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 2);
    // Needs all three; one is free, two are held. A single-slot waiter behind it must wait.
    join(&mut core, WaiterId(3), 3, Priority::Normal);
    join(&mut core, WaiterId(4), 1, Priority::Normal);
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
    assert_eq!(pool.delivered[2].0, WaiterId(3));
    assert_eq!(pool.delivered[2].2, 3, "all three slots in one lease");
    // Its release gives all three back, as one lease.
    let released_before = core.counters().released_total;
    core.apply(Input::ReleaseRequested {
        key: pool.delivered[2].1,
    });
    pool.run(&mut core);
    assert_eq!(
        core.counters().released_total,
        released_before + 3,
        "counted in slots"
    );
    assert_eq!(pool.delivered[3].0, WaiterId(4));
    assert_eq!(core.held_slots(), 1);
}

#[test]
fn a_multi_slot_waiter_that_leaves_while_gathering_hands_its_slots_on() {
    let mut core = pool_core(2);
    let mut pool = Pool::new(2);
    join(&mut core, WaiterId(1), 1, Priority::Normal);
    pool.run(&mut core);
    join(&mut core, WaiterId(2), 2, Priority::Normal);
    join(&mut core, WaiterId(3), 1, Priority::Normal);
    pool.run(&mut core);
    assert_eq!(core.held_slots(), 2);
    core.apply(Input::Withdraw {
        waiter: WaiterId(2),
        why: Withdrawal::Cancelled,
    });
    pool.run(&mut core);
    assert_eq!(pool.refused, [(WaiterId(2), "LEASE_ACQUIRE_CANCELLED")]);
    assert_eq!(pool.delivered.last().unwrap().0, WaiterId(3));
    assert_eq!(core.held_slots(), 2);
    assert_eq!(core.waiting(), 0);
}

#[test]
fn try_is_served_only_when_a_slot_is_free_and_nobody_waits_ahead() {
    let mut core = pool_core(2);
    let mut pool = Pool::new(2);
    core.apply(now(1, 1));
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 1);
    join(&mut core, WaiterId(2), 2, Priority::Normal);
    pool.run(&mut core);
    // One slot is free, but a waiter gathers ahead: refused, and the slot is not taken.
    core.apply(now(3, 1));
    pool.run(&mut core);
    assert_eq!(pool.refused, [(WaiterId(3), "LEASE_NO_SLOT_FREE")]);
    // A broker that is not the pool refuses it outright.
    let mut remote = Core::on_broker(Some(2), false, false);
    remote.apply(now(4, 1));
    assert!(matches!(
        drain(&mut remote).as_slice(),
        [Effect::Refuse {
            waiter: WaiterId(4),
            error: AcquireError::Unsupported(_)
        }]
    ));
}

#[test]
fn a_resize_wakes_waiters_when_raised_and_revokes_nothing_when_lowered() {
    let mut core = pool_core(1);
    let mut pool = Pool::new(3);
    for waiter in 1..=3 {
        join(&mut core, WaiterId(waiter), 1, Priority::Normal);
    }
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 1);
    core.apply(Input::Resize {
        control: ControlId(1),
        slots: 3,
    });
    pool.run(&mut core);
    assert_eq!(
        pool.delivered.len(),
        3,
        "raising the capacity woke both waiters"
    );
    join(&mut core, WaiterId(4), 1, Priority::Normal);
    join(&mut core, WaiterId(5), 3, Priority::Normal);
    core.apply(Input::Resize {
        control: ControlId(2),
        slots: 1,
    });
    pool.run(&mut core);
    // Nothing revoked; the 3-slot waiter can never be served now.
    assert_eq!(core.held_slots(), 3);
    assert_eq!(pool.refused, [(WaiterId(5), "LEASE_SLOT_COUNT_INVALID")]);
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
    assert_eq!(pool.delivered.last().unwrap().0, WaiterId(4));
    assert_eq!(core.held_slots(), 1);
}

#[test]
fn zero_slots_more_than_the_capacity_and_multi_slot_on_a_remote_broker_are_refused() {
    let mut core = pool_core(2);
    join(&mut core, WaiterId(1), 0, Priority::Normal);
    join(&mut core, WaiterId(2), 3, Priority::Normal);
    let codes: Vec<_> = drain(&mut core)
        .into_iter()
        .map(|e| match e {
            Effect::Refuse { error, .. } => error.code(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(codes, ["LEASE_SLOT_COUNT_INVALID"; 2]);
    let mut remote = Core::on_broker(None, false, false);
    remote.apply(Input::Enqueue {
        waiter: WaiterId(3),
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
    let mut core = Core::on_broker(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    for control in 1..=2 {
        core.apply(Input::CancelById {
            control: ControlId(control),
            waiters: Box::default(),
            leases: Box::new([key]),
        });
    }
    let cancels = drain(&mut core)
        .into_iter()
        .filter(|e| matches!(e, Effect::Cancel { .. }))
        .count();
    assert_eq!(cancels, 1);
}

#[test]
fn each_orphan_that_expires_is_counted_once() {
    let mut core = Core::on_broker(Some(1), false, false);
    for n in 1..=3 {
        core.apply(Input::OrphanExpired);
        assert!(matches!(
            drain(&mut core).as_slice(),
            [Effect::OrphanCounted]
        ));
        assert_eq!(core.counters().orphan_expired_total, n);
    }
}

#[test]
fn a_process_started_once_the_jobs_tasks_have_joined_is_illegal_and_owes_nothing() {
    // The tasks that could start a process are gone: a report of one is a driver's bug, and
    // must not hold the slot for a group nobody will prove.
    let mut core = Core::on_broker(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::Proven {
        key,
        proofs: Proofs::TASKS,
    });
    drain(&mut core);
    core.apply(Input::ProcessStarted {
        key,
        process: ProcessKey(9),
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::Illegal(what)] if what.contains("process")),
        "{effects:?}"
    );
    core.apply(Input::Ended {
        key,
        proofs: Proofs::JOINED,
        dir: dir_of(key),
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::RemoveTempDir { .. }]),
        "the group that never was is not owed: {effects:?}"
    );
}

/// A renewing core with one job started and one explicit lease delivered; their keys.
fn renewing_job_and_lease() -> (Core, LeaseKey, LeaseKey) {
    let mut core = Core::on_broker(Some(2), true, false);
    for (w, want) in [(1, Want::Job), (2, Want::Lease)] {
        core.apply(Input::Enqueue {
            waiter: WaiterId(w),
            ask: Ask::one(want),
        });
    }
    let delivered = grant_every_acquire(&mut core);
    assert_eq!(delivered.len(), 2);
    let key_of = |w| delivered.iter().find(|(x, _)| *x == WaiterId(w)).unwrap().1;
    let (job, lease) = (key_of(1), key_of(2));
    core.apply(Input::Started {
        key: job,
        device: None,
    });
    drain(&mut core);
    (core, job, lease)
}

#[test]
fn a_lease_lost_under_a_running_job_or_an_explicit_holder_cancels_it_once_with_the_reason() {
    let (mut core, job, lease) = renewing_job_and_lease();
    for key in [job, lease] {
        core.apply(Input::LeaseLost {
            key,
            reason: format!("ttl of {key} expired"),
        });
        let effects = drain(&mut core);
        let holder = if key == job {
            Holder::Job
        } else {
            Holder::Explicit
        };
        assert!(
            matches!(effects.as_slice(),
                [Effect::Cancel { key: k, holder: h, lost: Some(why) }]
                    if *k == key && *h == holder && why.contains("expired")),
            "{effects:?}"
        );
        // Its renewal has ended: a second report acts on nothing.
        core.apply(Input::LeaseLost {
            key,
            reason: "again".into(),
        });
        let effects = drain(&mut core);
        assert!(effects.is_empty(), "{effects:?}");
    }
}

#[test]
fn a_lease_lost_after_the_jobs_work_has_ended_is_only_reported() {
    let (mut core, job, _) = renewing_job_and_lease();
    // The body ended and its tasks joined; the temp dir's removal is still owed.
    core.apply(Input::Proven {
        key: job,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
    });
    drain(&mut core);
    core.apply(Input::LeaseLost {
        key: job,
        reason: "ttl expired".into(),
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::LostAfterExit { key, .. }] if *key == job),
        "{effects:?}"
    );
}

#[test]
fn a_job_that_could_not_be_prepared_is_noted_and_any_other_lease_is_refused_as_illegal() {
    let (mut core, job, lease) = renewing_job_and_lease();
    core.apply(Input::Unprepared {
        key: job,
        why: PrepareError::NoGpuSlot,
    });
    let effects = drain(&mut core);
    assert!(effects.is_empty(), "{effects:?}");
    core.apply(Input::Unprepared {
        key: lease,
        why: PrepareError::NoGpuSlot,
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::Illegal(what)] if what.contains("unprepared")),
        "{effects:?}"
    );
}

#[test]
fn the_quarantine_is_listed_to_the_control_that_asked() {
    let mut core = Core::on_broker(Some(1), false, false);
    core.apply(Input::ListQuarantine {
        control: ControlId(3),
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::Reply { control: ControlId(3), reply: Reply::Quarantine(e) }] if e.is_empty()),
        "{effects:?}"
    );
    let key = quarantined_job(&mut core);
    core.apply(Input::ListQuarantine {
        control: ControlId(4),
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(),
            [Effect::Reply { control: ControlId(4), reply: Reply::Quarantine(e) }]
                if e.len() == 1 && e[0].key == key && e[0].token == token(0, 1)),
        "{effects:?}"
    );
}

#[test]
fn the_waiters_are_listed_in_the_order_they_would_be_served() {
    let mut core = Core::on_broker(Some(1), false, false);
    let _held = started_job(&mut core, token(0, 1), None);
    for (w, priority) in [
        (2, Priority::Normal),
        (3, Priority::High),
        (4, Priority::Low),
        (5, Priority::Normal),
    ] {
        core.apply(Input::Enqueue {
            waiter: WaiterId(w),
            ask: Ask {
                priority,
                ..Ask::one(Want::Job)
            },
        });
    }
    drain(&mut core);
    core.apply(Input::ListWaiters {
        control: ControlId(9),
    });
    let effects = drain(&mut core);
    let [
        Effect::Reply {
            control: ControlId(9),
            reply: Reply::Waiters(list),
        },
    ] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    let order: Vec<_> = list.iter().map(|e| (e.waiter.0, e.priority)).collect();
    assert_eq!(
        order,
        [
            (3, Priority::High),
            (2, Priority::Normal),
            (5, Priority::Normal),
            (4, Priority::Low)
        ]
    );
    assert!(list.iter().all(|e| e.slots == 1 && e.gathered == 0));
}

#[test]
fn the_leases_touched_are_taken_sorted_and_once_each() {
    let mut core = Core::on_broker(Some(2), false, false);
    let first = started_job(&mut core, token(0, 1), None);
    let second = started_job(&mut core, token(1, 2), None);
    let mut seen = Vec::new();
    core.take_touched(&mut seen);
    seen.clear();
    for key in [second, first, second] {
        core.apply(Input::ProcessStarted {
            key,
            process: ProcessKey(key.0 + 10),
        });
    }
    core.take_touched(&mut seen);
    assert_eq!(seen, [first, second]);
}

#[test]
fn every_proof_is_described_in_words_of_its_own() {
    let kinds = [
        Proof::WorkerJoined,
        Proof::TasksJoined,
        Proof::Process(ProcessKey(1)),
        Proof::GpuFence,
        Proof::TempDir,
    ];
    let words: BTreeSet<&str> = kinds.iter().map(|p| p.describe()).collect();
    assert_eq!(words.len(), kinds.len(), "{words:?}");
    assert!(words.iter().all(|w| w.len() > 4), "{words:?}");
    assert!(Proof::TempDir.describe().contains("temp dir"));
}

fn acquires(effects: &[Effect]) -> Vec<(RequestId, Option<WaiterId>)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Acquire {
                request,
                for_waiter,
            } => Some((*request, *for_waiter)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_remote_broker_is_asked_once_per_waiter_with_the_head_as_a_hint() {
    let mut core = Core::on_broker(Some(3), false, false);
    core.ask_one_slot_each([7], Want::Lease);
    let first = acquires(&drain(&mut core));
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].1, Some(WaiterId(7)), "the head travels as a hint");
    core.ask_one_slot_each([8], Want::Lease);
    let second = acquires(&drain(&mut core));
    assert_eq!(
        second.len(),
        1,
        "one more waiter, one more acquire: {second:?}"
    );
}

#[test]
fn acquires_nobody_needs_any_more_are_dropped_newest_first_and_only_those() {
    let mut core = Core::on_broker(Some(4), false, false);
    core.ask_one_slot_each(1..=3, Want::Lease);
    let asked: Vec<RequestId> = acquires(&drain(&mut core))
        .into_iter()
        .map(|(r, _)| r)
        .collect();
    assert_eq!(asked.len(), 3);
    for w in [1, 2] {
        core.apply(Input::Withdraw {
            waiter: WaiterId(w),
            why: Withdrawal::Cancelled,
        });
    }
    let mut aborted: Vec<RequestId> = drain(&mut core)
        .into_iter()
        .filter_map(|e| match e {
            Effect::AbortAcquire { request } => Some(request),
            _ => None,
        })
        .collect();
    aborted.sort_unstable();
    let mut newest = asked.clone();
    newest.sort_unstable();
    assert_eq!(aborted, newest[1..], "two dropped, the newest two");
}

#[test]
fn the_in_process_pool_is_never_asked_by_effect_its_slot_is_granted_in_the_step_that_asked() {
    let mut core = Core::pool(2);
    core.ask_one_slot_each([1], Want::Lease);
    let effects = drain(&mut core);
    assert!(
        matches!(
            effects.as_slice(),
            [Effect::Deliver {
                waiter: WaiterId(1),
                ..
            }]
        ),
        "{effects:?}"
    );
    assert_eq!(core.pool_held(), 1);
    // Alone, with room: served without passing through the queue (whose aging clock counts
    // every waiter it serves).
    assert_eq!(core.served(), 0);
    core.ask_one_slot_each([2], Want::Lease);
    let effects = drain(&mut core);
    assert!(
        matches!(
            effects.as_slice(),
            [Effect::Deliver {
                waiter: WaiterId(2),
                ..
            }]
        ),
        "{effects:?}"
    );
    assert_eq!((core.served(), core.pool_held()), (0, 2));
}

#[test]
fn a_report_about_the_wrong_kind_of_lease_or_a_proof_not_owed_is_illegal_and_changes_nothing() {
    let (mut core, job, lease) = renewing_job_and_lease();
    let before = (core.active(), core.quarantined(), core.counters());
    let inputs = [
        // Only a job has a driver that ends, or a job that cannot start.
        Input::Ended {
            key: lease,
            proofs: Proofs::default(),
            dir: None,
        },
        Input::NotStarted {
            key: lease,
            why: PrepareError::NoGpuSlot,
        },
        // The job runs on no GPU: no fence is owed, so none can be late.
        Input::Late {
            key: job,
            proof: Proof::GpuFence,
            detail: "late".into(),
        },
    ];
    for input in inputs {
        let what = format!("{input:?}");
        core.apply(input);
        let effects = drain(&mut core);
        assert!(
            matches!(effects.as_slice(), [Effect::Illegal(_)]),
            "{what}: {effects:?}"
        );
    }
    assert_eq!(before, (core.active(), core.quarantined(), core.counters()));
    // A driver ends once.
    core.apply(Input::Ended {
        key: job,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
        dir: dir_of(job),
    });
    drain(&mut core);
    core.apply(Input::Ended {
        key: job,
        proofs: Proofs::default(),
        dir: None,
    });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::Illegal(_)]),
        "{effects:?}"
    );
}

#[test]
fn a_job_started_just_as_the_shutdown_began_is_cancelled_once() {
    let (mut core, key) = one_delivered(Want::Job);
    core.apply(Input::Shutdown);
    let cancels = |effects: &[Effect]| {
        effects
            .iter()
            .filter(|e| matches!(e, Effect::Cancel { key: k, .. } if *k == key))
            .count()
    };
    assert_eq!(cancels(&drain(&mut core)), 1);
    core.apply(Input::Started { key, device: None });
    let effects = drain(&mut core);
    assert_eq!(cancels(&effects), 0, "cancelled already: {effects:?}");
}

#[test]
fn only_an_explicit_lease_is_released_on_request() {
    let (mut core, job, _) = renewing_job_and_lease();
    core.apply(Input::ReleaseRequested { key: job });
    let effects = drain(&mut core);
    assert!(
        matches!(effects.as_slice(), [Effect::Illegal(what)] if what.contains("job lease")),
        "{effects:?}"
    );
}

#[test]
fn a_lease_of_two_slots_goes_back_to_the_pool_whole_in_the_step_that_releases_it() {
    let mut core = Core::pool(2);
    core.apply(Input::Enqueue {
        waiter: WaiterId(1),
        ask: Ask {
            slots: 2,
            ..Ask::one(Want::Lease)
        },
    });
    core.settle();
    let effects = drain(&mut core);
    let [Effect::Deliver { key, more, .. }] = effects.as_slice() else {
        panic!("granted in the step that asked: {effects:?}")
    };
    assert_eq!(more.len(), 1);
    assert_eq!(core.pool_held(), 2);
    let key = *key;
    core.apply(Input::ReleaseRequested { key });
    let effects = drain(&mut core);
    assert!(
        matches!(
            effects.as_slice(),
            [
                Effect::Answer {
                    answer: Answer::Released(Ok(())),
                    ..
                },
                Effect::Forget { .. }
            ]
        ),
        "{effects:?}"
    );
    assert_eq!((core.active(), core.pool_held()), (0, 0));
    assert_eq!(core.counters().released_total, 2, "one release per slot");
    // Nothing more to release: the lease is gone, and a second request is answered as done.
    core.apply(Input::Released {
        key,
        result: Ok(()),
    });
    assert!(matches!(drain(&mut core).as_slice(), [Effect::Illegal(_)]));
}

#[test]
fn cancel_by_id_finds_a_waiter_or_a_running_job_and_nothing_else() {
    let (mut core, job, lease) = renewing_job_and_lease();
    // Both slots held: a third caller waits.
    core.ask_one_slot_each([3], Want::Job);
    drain(&mut core);
    let cancel = |core: &mut Core, waiters: &[u64], leases: &[LeaseKey]| {
        core.apply(Input::CancelById {
            control: ControlId(5),
            waiters: waiters.iter().map(|w| WaiterId(*w)).collect(),
            leases: leases.into(),
        });
        drain(core)
    };
    // An explicit lease is not a job: cancel by id does not reach it.
    let effects = cancel(&mut core, &[], &[lease]);
    assert!(
        matches!(
            effects.as_slice(),
            [Effect::Reply {
                reply: Reply::Cancelled(false),
                ..
            }]
        ),
        "{effects:?}"
    );
    // The waiter is found, and hears that it was cancelled.
    let effects = cancel(&mut core, &[3, 77], &[]);
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Reply {
                reply: Reply::Cancelled(true),
                ..
            }
        )),
        "{effects:?}"
    );
    assert!(!effects.iter().any(|e| matches!(e, Effect::Cancel { .. })));
    // The job is found and cancelled once.
    let effects = cancel(&mut core, &[], &[job]);
    assert!(
        matches!(
            effects.as_slice(),
            [
                Effect::Cancel { key, holder: Holder::Job, lost: None },
                Effect::Reply { reply: Reply::Cancelled(true), .. }
            ] if *key == job
        ),
        "{effects:?}"
    );
    let effects = cancel(&mut core, &[], &[job]);
    assert!(
        matches!(
            effects.as_slice(),
            [Effect::Reply {
                reply: Reply::Cancelled(true),
                ..
            }]
        ),
        "found, cancelled already: {effects:?}"
    );
}

#[test]
fn a_lowered_capacity_keeps_the_waiters_that_ask_exactly_for_it_and_refuses_those_above() {
    let mut core = pool_core(3);
    let mut pool = Pool::new(3);
    join(&mut core, WaiterId(1), 2, Priority::Normal);
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 1);
    // The head gathers the one free slot and waits for a second; another waits behind it.
    join(&mut core, WaiterId(2), 2, Priority::Normal);
    join(&mut core, WaiterId(3), 2, Priority::Normal);
    pool.run(&mut core);
    assert_eq!(core.figures().waiting, 2);
    core.apply(Input::Resize {
        control: ControlId(1),
        slots: 2,
    });
    pool.run(&mut core);
    assert!(
        pool.refused.is_empty(),
        "two slots can still serve them: {:?}",
        pool.refused
    );
    assert_eq!(core.figures().waiting, 2);
    core.apply(Input::Resize {
        control: ControlId(2),
        slots: 1,
    });
    pool.run(&mut core);
    let mut refused = pool.refused.clone();
    refused.sort_unstable();
    assert_eq!(
        refused,
        [
            (WaiterId(2), "LEASE_SLOT_COUNT_INVALID"),
            (WaiterId(3), "LEASE_SLOT_COUNT_INVALID")
        ]
    );
    assert_eq!(core.figures().waiting, 0);
}

#[test]
fn a_proof_made_twice_or_a_driver_end_claiming_it_again_is_illegal() {
    let mut core = Core::on_broker(Some(1), false, false);
    let key = started_job(&mut core, token(0, 1), None);
    core.apply(Input::Proven {
        key,
        proofs: Proofs::TASKS,
    });
    assert!(drain(&mut core).is_empty());
    for input in [
        Input::Proven {
            key,
            proofs: Proofs::TASKS,
        },
        Input::Ended {
            key,
            proofs: Proofs::JOINED.with(Proofs::TASKS),
            dir: dir_of(key),
        },
    ] {
        core.apply(input);
        let effects = drain(&mut core);
        assert!(
            matches!(effects.as_slice(), [Effect::Illegal(_)]),
            "{effects:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Waiters in every place, stray timers, aborted acquires, late temp dirs
// ---------------------------------------------------------------------------------------------

/// A `try_acquire` ask for `slots` of the pool.
fn now(waiter: u64, slots: u32) -> Input {
    Input::Enqueue {
        waiter: WaiterId(waiter),
        ask: Ask {
            now_only: true,
            ..ask(slots, Priority::Normal)
        },
    }
}

#[test]
fn the_callers_waiting_in_every_place_are_counted_and_each_refused_once_at_shutdown() {
    let mut core = pool_core(3);
    let mut pool = Pool::new(3);
    join(&mut core, WaiterId(1), 1, Priority::Normal);
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 1);
    // A three-slot waiter: the two slots left are taken and gathered at the head.
    join(&mut core, WaiterId(3), 3, Priority::Normal);
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 1, "it gathers");
    // A `try_acquire` caller now: refused at once (the pool serves it in its own turn or not).
    core.apply(now(2, 1));
    pool.run(&mut core);
    assert_eq!(pool.refused, [(WaiterId(2), "LEASE_NO_SLOT_FREE")]);
    pool.refused.clear();
    // And one queued behind the gathering head.
    join(&mut core, WaiterId(4), 1, Priority::Normal);
    assert_eq!(core.waiting(), 2, "the gathering head and the queue");
    core.apply(Input::Shutdown);
    pool.run(&mut core);
    let stopped = AcquireError::Stopped.code();
    assert_eq!(
        pool.refused,
        [(WaiterId(3), stopped), (WaiterId(4), stopped)]
    );
    assert!(pool.aborted.is_empty(), "the pool is never asked in flight");
    core.apply(Input::BrokerClosed);
    core.settle();
    let effects = drain(&mut core);
    let [
        Effect::Stopped {
            tally,
            keep_work_root,
            quarantine,
        },
    ] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!((tally.refused_waiters, tally.released_leases), (2, 1));
    assert!(quarantine.is_empty() && !keep_work_root, "nothing is left");
}

#[test]
fn a_try_never_overtakes_a_queued_waiter_and_is_served_when_the_free_slots_just_fit() {
    let mut core = pool_core(2);
    // A two-slot waiter gathers behind a held slot: the try would overtake it.
    join(&mut core, WaiterId(3), 1, Priority::Normal);
    join(&mut core, WaiterId(1), 2, Priority::Normal);
    core.apply(now(2, 1));
    let effects = drain(&mut core);
    assert!(
        effects.iter().any(|e| matches!(e,
            Effect::Refuse { waiter: WaiterId(2), error } if error.code() == "LEASE_NO_SLOT_FREE")),
        "{effects:?}"
    );
    // Exactly as many slots free as asked for: served.
    let mut core = pool_core(2);
    let mut pool = Pool::new(2);
    core.apply(now(1, 2));
    pool.run(&mut core);
    assert_eq!(pool.delivered.len(), 1, "refused: {:?}", pool.refused);
    assert_eq!(pool.delivered[0].2, 2);
}

#[test]
fn a_stray_grace_timer_aborts_nothing_while_serving() {
    let (mut core, _, _) = renewing_job_and_lease();
    core.apply(Input::ShutdownGraceOver);
    let effects = drain(&mut core);
    assert!(effects.is_empty(), "{effects:?}");
}

#[test]
fn the_failure_of_an_acquire_that_was_dropped_refuses_nobody() {
    let mut core = Core::on_broker(Some(2), false, false);
    core.ask_one_slot_each([1], Want::Lease);
    let [(dropped, _)] = acquires(&drain(&mut core))[..] else {
        panic!("one acquire")
    };
    core.apply(Input::Withdraw {
        waiter: WaiterId(1),
        why: Withdrawal::Cancelled,
    });
    drain(&mut core);
    core.ask_one_slot_each([2], Want::Lease);
    assert_eq!(acquires(&drain(&mut core)).len(), 1);
    // The dropped acquire's failure arrives after all: nobody waits for it.
    core.apply(Input::Acquired {
        request: dropped,
        result: Err(BrokerError::new("gave up")),
    });
    let effects = drain(&mut core);
    assert!(effects.is_empty(), "{effects:?}");
    assert_eq!(core.waiting(), 1);
}

#[test]
fn a_lease_already_releasing_cannot_be_undelivered() {
    let (mut core, key) = one_delivered(Want::Lease);
    core.apply(Input::ReleaseRequested { key });
    assert_eq!(releases(&drain(&mut core)), 1);
    let before = (core.active(), core.counters());
    core.apply(Input::Undelivered { key });
    assert!(
        matches!(drain(&mut core).as_slice(), [Effect::Illegal(_)]),
        "an illegal input must be reported"
    );
    assert_eq!(before, (core.active(), core.counters()));
    assert!(core.lease(key).is_some(), "its release is still awaited");
}

#[test]
fn a_process_proven_while_its_recheck_was_out_is_not_proven_twice() {
    let mut core = Core::on_broker(Some(1), false, false);
    let key = ended_job(&mut core, &[ProcessKey(7)]);
    let process = Proof::Process(ProcessKey(7));
    core.apply(Input::Unproven {
        key,
        proof: process,
        detail: "the group may have escaped".into(),
    });
    drain(&mut core);
    assert_eq!(core.quarantined(), 1);
    core.apply(Input::Reclaim {
        control: ControlId(1),
    });
    let asked = drain(&mut core);
    // The group is proven empty on its own before the re-check answers.
    core.apply(Input::ProvenOne {
        key,
        proof: process,
    });
    let removal = drain(&mut core);
    assert!(
        matches!(removal.as_slice(), [Effect::RemoveTempDir { .. }]),
        "{removal:?}"
    );
    // Nothing to learn from the re-check (no proof made twice); the reclaim waits for the
    // removal, then finds the slot clean.
    let effects = answer_rechecks(&mut core, asked, |_, _| true);
    assert!(effects.is_empty(), "{effects:?}");
    core.apply(Input::ProvenOne {
        key,
        proof: Proof::TempDir,
    });
    let effects = drain(&mut core);
    assert!(
        effects.iter().any(|e| matches!(e,
            Effect::Reply { reply: Reply::Reclaimed { reclaimed, still }, .. }
                if reclaimed.len() == 1 && still.is_empty())),
        "{effects:?}"
    );
}

#[test]
fn a_reclaim_does_not_wait_for_a_temp_dir_removal_already_late() {
    let mut core = Core::on_broker(Some(1), false, false);
    let key = ended_job(&mut core, &[]);
    drain(&mut core);
    core.apply(Input::Late {
        key,
        proof: Proof::TempDir,
        detail: "the temp dir's removal is slow".into(),
    });
    drain(&mut core);
    assert_eq!(core.quarantined(), 1);
    let effects = reclaim(&mut core, |_, _| true);
    assert!(
        effects.iter().any(|e| matches!(e,
            Effect::Reply { reply: Reply::Reclaimed { reclaimed, still }, .. }
                if reclaimed.is_empty() && still.len() == 1 && still[0].key == key)),
        "{effects:?}"
    );
}

#[test]
fn the_shutdown_grace_aborts_the_tasks_of_the_jobs_that_still_run_them_and_no_others() {
    let mut core = Core::on_broker(Some(2), false, false);
    core.ask_one_slot_each(1..=2, Want::Job);
    let delivered = grant_every_acquire(&mut core);
    let [(_, running), (_, draining)] = delivered[..] else {
        panic!("{delivered:?}")
    };
    for key in [running, draining] {
        core.apply(Input::Started { key, device: None });
    }
    // The second job's body and tasks have ended: only its temp dir is owed.
    core.apply(Input::Proven {
        key: draining,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
    });
    core.apply(Input::Shutdown);
    drain(&mut core);
    core.apply(Input::ShutdownGraceOver);
    let aborted: Vec<LeaseKey> = drain(&mut core)
        .into_iter()
        .filter_map(|e| match e {
            Effect::AbortTasks { key } => Some(key),
            _ => None,
        })
        .collect();
    assert_eq!(aborted, [running]);
}

#[test]
fn a_shutdown_ends_only_once_its_re_checks_are_in() {
    let mut core = pool_core(1);
    core.apply(Input::Shutdown);
    let asked: Vec<Effect> = drain(&mut core)
        .into_iter()
        .filter(|e| matches!(e, Effect::Recheck { .. }))
        .collect();
    assert_eq!(asked.len(), 1);
    core.settle();
    let effects = drain(&mut core);
    assert!(effects.is_empty(), "a re-check is out: {effects:?}");
    assert!(answer_rechecks(&mut core, asked, |_, _| true).is_empty());
    core.settle();
    assert!(matches!(drain(&mut core).as_slice(), [Effect::CloseBroker]));
}

#[test]
fn a_core_dropped_without_a_shutdown_keeps_the_work_root_only_while_it_holds_a_lease() {
    let (mut core, key) = one_delivered(Want::Lease);
    assert!(core.abandon().keep_work_root, "lease {key} is held");
    core.apply(Input::ReleaseRequested { key });
    assert_eq!(releases(&drain(&mut core)), 1);
    assert!(core.abandon().keep_work_root, "its release is not answered");
    core.apply(Input::Released {
        key,
        result: Ok(()),
    });
    drain(&mut core);
    assert!(!core.abandon().keep_work_root);
}

#[test]
fn a_slot_freed_on_the_pool_goes_to_the_next_waiter_in_the_same_step_under_a_new_lease_id() {
    let mut core = Core::pool(1);
    core.ask_one_slot_each([1, 2], Want::Lease);
    let effects = drain(&mut core);
    let [Effect::Deliver { key, token, .. }] = effects.as_slice() else {
        panic!("one grant, one waiter queued: {effects:?}")
    };
    let (first, old) = (*key, *token);
    assert_eq!(core.waiting(), 1);
    core.apply(Input::ReleaseRequested { key: first });
    let effects = drain(&mut core);
    let [
        Effect::Answer {
            key: answered,
            answer: Answer::Released(Ok(())),
        },
        Effect::Forget { key: forgotten },
        Effect::Deliver {
            waiter: WaiterId(2),
            token: new,
            ..
        },
    ] = effects.as_slice()
    else {
        panic!("answered, forgotten and handed on in one step: {effects:?}")
    };
    assert_eq!((*answered, *forgotten), (first, first));
    assert_eq!(new.slot_id(), old.slot_id());
    assert!(new.lease_id() > old.lease_id(), "{new} after {old}");
    assert_eq!((core.waiting(), core.pool_held(), core.active()), (0, 1, 1));
}

#[test]
fn a_caller_alone_is_served_at_once_only_within_the_capacity_in_force_and_never_past_a_waiter() {
    use crate::supervisor::core::CoreConfig;
    // A pool of 3 capped at 2 by the GPU sub-slots: the third caller waits, slots free or not.
    let mut core = Core::new(CoreConfig {
        broker_capacity: Some(3),
        pool: Some(crate::broker::Pool::new(3)),
        gpu_slots: Some(2),
        renews: false,
    });
    core.ask_one_slot_each([1, 2, 3], Want::Lease);
    let effects = drain(&mut core);
    let delivered: Vec<WaiterId> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Deliver { waiter, .. } => Some(*waiter),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, [WaiterId(1), WaiterId(2)], "{effects:?}");
    assert_eq!((core.waiting(), core.pool_held()), (1, 2));
    // No slot was taken beyond the capacity only to go back (a surplus counts as a grant).
    assert_eq!(core.counters().acquired_total, 2);
    // A fourth caller queues behind the third.
    core.ask_one_slot_each([4], Want::Lease);
    assert_eq!(core.waiting(), 2);
    assert!(drain(&mut core).is_empty());
    // A slot freed goes to the third, then the fourth: in the order they came.
    let first = match &effects[0] {
        Effect::Deliver { key, .. } => *key,
        other => panic!("{other:?}"),
    };
    core.apply(Input::ReleaseRequested { key: first });
    let effects = drain(&mut core);
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Deliver {
                waiter: WaiterId(3),
                ..
            }
        )),
        "{effects:?}"
    );
    assert_eq!(core.waiting(), 1);
}

#[test]
fn a_reclaim_on_the_pool_reports_a_slot_its_recheck_freed_in_the_same_step() {
    let mut core = Core::pool(1);
    core.ask_one_slot_each([1], Want::Job);
    core.settle();
    let key = match drain(&mut core).as_slice() {
        [Effect::Deliver { key, .. }] => *key,
        other => panic!("{other:?}"),
    };
    core.apply(Input::Started { key, device: None });
    core.apply(Input::ProcessStarted {
        key,
        process: ProcessKey(7),
    });
    // No temp dir: once the body and its tasks are done, only the process group is owed.
    core.apply(Input::Ended {
        key,
        proofs: Proofs::JOINED.with(Proofs::TASKS),
        dir: None,
    });
    core.apply(Input::Unproven {
        key,
        proof: Proof::Process(ProcessKey(7)),
        detail: "escaped".into(),
    });
    drain(&mut core);
    assert_eq!(core.quarantined(), 1);
    let effects = reclaim(&mut core, |_, _| true);
    assert_eq!(core.pool_held(), 0, "released: {effects:?}");
    assert!(
        effects.iter().any(|e| matches!(e,
            Effect::Reply { reply: Reply::Reclaimed { reclaimed, still }, .. }
                if reclaimed.len() == 1 && still.is_empty())),
        "{effects:?}"
    );
}

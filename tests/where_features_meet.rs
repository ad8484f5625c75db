//! Promises kept where two features meet: resize beside multi-slot leases and `try_acquire`,
//! quarantine beside multi-slot jobs and shutdown, job actors cancelled while they start, the
//! lease desk's failures with nobody left to hear them, and answers that mean the effect is
//! already visible. Each test is named as the behaviour it pins; each failed before the
//! admission rewrite that fixed it (see CHANGELOG.md).
//!
//! No test sleeps to win a race: bodies and brokers wait on gates, and a wait that must never
//! last runs on tokio's paused clock, where an idle runtime jumps straight to the timeout.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Plan, TestBroker, pool, until};
use leasehold::{JobSpec, LeaseKind, LeaseMsg, LeasePhase, Supervisor};
use ractor::{Actor, ActorProcessingErr, ActorRef, call, call_t};
use tokio::sync::{Notify, oneshot};

// ---------------------------------------------------------------------------------------------
// 1. Resize beside a gathering multi-slot request
// ---------------------------------------------------------------------------------------------

/// Capacity 4, two leases held, a 4-slot request holding the other two, two callers behind it.
/// `resize(2)` refuses the 4-slot request; the two slots it had gathered are above the new
/// capacity (two are still held) and go back to the pool, never to the callers behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_a_refused_gathering_request_held_never_go_past_a_lowered_capacity() {
    let (sup, _root) = pool(4).await;
    let a = sup.acquire().await.unwrap();
    let b = sup.acquire().await.unwrap();
    let big = tokio::spawn({
        let sup = sup.clone();
        async move { sup.acquire_many(4).await }
    });
    until("the 4-slot request gathered the two free slots", || {
        sup.stats().held_slots == 4
    })
    .await;
    let behind: Vec<_> = (0..2)
        .map(|_| {
            let sup = sup.clone();
            tokio::spawn(async move { sup.acquire().await })
        })
        .collect();
    until("two callers wait behind it", || sup.stats().waiting == 3).await;

    assert_eq!(sup.resize(2).await.unwrap(), 2);
    // The answer means the effect is visible: the refused request's slots are back.
    let stats = sup.stats();
    assert_eq!(stats.capacity, Some(2));
    assert_eq!(stats.held_slots, 2, "{stats:?}");
    assert_eq!(sup.leases().len(), 2, "{:?}", sup.leases());
    assert_eq!(stats.waiting, 2, "the callers behind still wait: {stats:?}");
    let err = big.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_SLOT_COUNT_INVALID");

    // One back: one caller behind is served, on a slot under the new size.
    drop(a);
    until("a caller behind is served", || sup.stats().waiting == 1).await;
    assert_eq!(sup.stats().held_slots, 2);
    assert!(
        sup.leases().iter().all(|l| l.slot_id < 2),
        "{:?}",
        sup.leases()
    );
    drop(b);
    for waiter in behind {
        let lease = waiter.await.unwrap().unwrap();
        assert!(lease.slot_id().unwrap() < 2);
    }
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.stats.held_slots, 0);
}

/// Capacity 3, one held, a 3-slot request gathering the other two, a 2-slot request behind it.
/// `resize(2)` refuses the 3-slot request; slot 2 is retired (above the new size) and the 2-slot
/// request is granted only slots 0 and 1, once they are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_retired_by_a_resize_is_never_handed_to_the_request_behind_a_refused_one() {
    let (sup, _root) = pool(3).await;
    let held = sup.acquire().await.unwrap();
    let big = tokio::spawn({
        let sup = sup.clone();
        async move { sup.acquire_many(3).await }
    });
    until("the 3-slot request gathered two slots", || {
        sup.stats().held_slots == 3
    })
    .await;
    let pair = tokio::spawn({
        let sup = sup.clone();
        async move { sup.acquire_many(2).await }
    });
    until("the 2-slot request waits", || sup.stats().waiting == 2).await;

    sup.resize(2).await.unwrap();
    assert_eq!(
        big.await.unwrap().unwrap_err().code(),
        "LEASE_SLOT_COUNT_INVALID"
    );
    let stats = sup.stats();
    assert!(stats.held_slots <= 2, "{stats:?}");
    assert!(
        sup.leases()
            .iter()
            .all(|l| l.tokens.iter().all(|t| t.slot_id() < 2)),
        "{:?}",
        sup.leases()
    );
    drop(held);
    let mut pair = pair.await.unwrap().unwrap();
    let mut slots: Vec<u32> = pair.tokens().unwrap().iter().map(|t| t.slot_id()).collect();
    slots.sort_unstable();
    assert_eq!(slots, [0, 1]);
    pair.release().await.unwrap();
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// 2. A quarantined multi-slot lease counts every slot
// ---------------------------------------------------------------------------------------------

/// A 2-slot job whose temp dir cannot be removed: both of its slots are quarantined, counted,
/// listed and reported by a reclaim; the stats identity holds in slots.
#[tokio::test]
async fn a_quarantined_two_slot_job_counts_lists_and_reclaims_both_slots() {
    let (sup, _root) = pool(3).await;
    let (dir_tx, dir_rx) = oneshot::channel();
    let err = sup
        .run(
            JobSpec::new("clobbered").unwrap().with_slots(2),
            |ctx| async move {
                // A regular file where the temp dir was: removing a directory there fails.
                let _ = dir_tx.send(common::clobber_temp_dir(&ctx)?);
                Ok::<_, std::io::Error>(())
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{err}");
    let path = dir_rx.await.unwrap();
    let stats = sup.stats();
    assert_eq!(
        (stats.held_slots, stats.quarantined, stats.active),
        (2, 2, 0),
        "{stats:?}"
    );
    assert_eq!(
        stats.acquired_total,
        stats.released_total
            + stats.release_failed_total
            + stats.active as u64
            + stats.quarantined as u64,
        "{stats:?}"
    );
    let listed = sup.quarantined().await.unwrap();
    let mut slots: Vec<u32> = listed.iter().map(|q| q.token.slot_id()).collect();
    slots.sort_unstable();
    assert_eq!(slots.len(), 2, "{listed:?}");
    slots.dedup();
    assert_eq!(slots.len(), 2, "each slot listed once: {listed:?}");
    assert!(
        listed
            .iter()
            .all(|q| q.job_id.as_deref() == Some("clobbered"))
    );

    std::fs::remove_file(&path).unwrap();
    let report = sup.reclaim_quarantined().await.unwrap();
    assert_eq!(report.reclaimed.len(), 2, "{report:?}");
    until("both slots came back", || sup.stats().held_slots == 0).await;
    let stats = sup.stats();
    assert_eq!(
        (stats.acquired_total, stats.released_total),
        (2, 2),
        "{stats:?}"
    );
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// 3. try_acquire beside a resize in one batch
// ---------------------------------------------------------------------------------------------

/// On a current-thread runtime a `try_acquire` and a `resize(1)` land in one batch. The try is
/// answered in that turn (granted, since it came first and a slot was free; or refused), never
/// left waiting for a release.
#[tokio::test(start_paused = true)]
async fn a_try_acquire_in_the_same_batch_as_a_resize_is_answered_at_once() {
    let (sup, _root) = pool(2).await;
    let held = sup.acquire().await.unwrap();
    let both = async { tokio::join!(sup.try_acquire(), sup.resize(1)) };
    // On the paused clock an idle runtime jumps to this timeout: a try left waiting fails here.
    let (tried, resized) = tokio::time::timeout(Duration::from_secs(3600), both)
        .await
        .expect("the try_acquire waited instead of being answered");
    assert_eq!(resized.unwrap(), 1);
    match tried {
        Ok(lease) => {
            assert_eq!(sup.stats().held_slots, 2);
            drop(lease);
        }
        Err(err) => assert_eq!(err.code(), "LEASE_NO_SLOT_FREE"),
    }
    // And a try after the resize, with one slot held on a capacity of one, is refused at once.
    let err = tokio::time::timeout(Duration::from_secs(3600), sup.try_acquire())
        .await
        .expect("answered at once")
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_NO_SLOT_FREE");
    drop(held);
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// 4. Shutdown ends a quarantined job's tasks
// ---------------------------------------------------------------------------------------------

/// Signals when it is dropped (the task that owns it ended, or was aborted).
struct DropSignal(Option<oneshot::Sender<()>>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// A job quarantined because a child process escaped its group, with a tracked task that
/// ignores cancellation: shutdown aborts the task after the cancel grace and returns only once
/// it has ended, whatever the lease's quarantine reasons.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_aborts_the_tasks_of_a_job_quarantined_for_an_escaped_process() {
    use leasehold::ProcessSpec;
    use std::process::Stdio;

    let root = tempfile::tempdir().unwrap();
    let sup = Supervisor::builder()
        .slots(1)
        .work_root(root.path())
        .process_proof_bound(Duration::from_millis(100))
        .cancel_grace(Duration::from_millis(50))
        .shutdown_timeout(Duration::from_secs(60))
        .start()
        .await
        .unwrap();
    let (dropped_tx, mut dropped_rx) = oneshot::channel();
    let (pid_tx, pid_rx) = oneshot::channel();
    let err = sup
        .run(JobSpec::new("daemon").unwrap(), |ctx| async move {
            let signal = DropSignal(Some(dropped_tx));
            // A tracked task that never looks at cancellation.
            ctx.spawn(async move {
                let _signal = signal;
                std::future::pending::<()>().await;
            });
            // The parent exits at once: the escapee is orphaned, outside the job's group.
            let mut child = ctx
                .spawn_process(
                    ProcessSpec::new("sh")
                        .arg("-c")
                        .arg("setsid sleep 30 & echo $!")
                        .stdout(Stdio::piped()),
                )
                .unwrap();
            let pid = common::first_line(child.stdout.take().unwrap()).await;
            let _ = pid_tx.send(pid);
            child.wait().await.unwrap();
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{err}");
    let pid = pid_rx.await.unwrap();
    assert!(dropped_rx.try_recv().is_err(), "the task still runs");

    let report = sup.shutdown().await.unwrap();
    assert!(
        dropped_rx.try_recv().is_ok(),
        "shutdown returned while the job's task still ran"
    );
    assert_eq!(report.quarantined, 1, "{report:?}");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// 5. A job actor cancelled in pre_start
// ---------------------------------------------------------------------------------------------

/// An actor whose `pre_start` waits on a gate that never opens.
struct SlowStarter {
    entered: Arc<Notify>,
}

impl Actor for SlowStarter {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        self.entered.notify_one();
        std::future::pending::<()>().await;
        Ok(())
    }
}

/// A supervisor with one slot and a 200 ms cancel grace, and a job actor (`loader`) whose
/// `pre_start` has begun and never returns: its `spawn_job` call, and the grace.
async fn a_job_actor_stuck_in_pre_start() -> (
    Supervisor,
    tempfile::TempDir,
    tokio::task::JoinHandle<Result<(), leasehold::JobError<leasehold::ActorJobError>>>,
    Duration,
) {
    let root = tempfile::tempdir().unwrap();
    let grace = Duration::from_millis(200);
    let sup = Supervisor::builder()
        .slots(1)
        .work_root(root.path())
        .cancel_grace(grace)
        .shutdown_timeout(Duration::from_secs(600))
        .start()
        .await
        .unwrap();
    let entered = Arc::new(Notify::new());
    let spawned = tokio::spawn({
        let (sup, entered) = (sup.clone(), Arc::clone(&entered));
        async move {
            sup.spawn_job(
                JobSpec::new("loader").unwrap(),
                SlowStarter { entered },
                |_| (),
            )
            .await
            .map(|_| ())
        }
    });
    entered.notified().await;
    (sup, root, spawned, grace)
}

/// `sup.cancel(id)` while the job actor's `pre_start` awaits: the actor is stopped (killed at
/// the cancel grace) like a running one, the job ends `LEASE_BODY_CANCELLED` and its slot comes
/// back, within the grace.
#[tokio::test(start_paused = true)]
async fn a_job_actor_cancelled_in_pre_start_ends_within_the_cancel_grace() {
    let (sup, _root, spawned, grace) = a_job_actor_stuck_in_pre_start().await;
    let start = tokio::time::Instant::now();
    assert!(sup.cancel("loader").await.unwrap());
    let err = tokio::time::timeout(Duration::from_secs(5), spawned)
        .await
        .expect("the job actor was never stopped")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED", "{err}");
    assert!(
        start.elapsed() <= grace + Duration::from_millis(50),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(sup.stats().held_slots, 0);
    sup.shutdown().await.unwrap();
}

/// A shutdown while a job actor's `pre_start` awaits ends within the cancel grace, not at the
/// shutdown timeout.
#[tokio::test(start_paused = true)]
async fn a_shutdown_while_a_job_actor_starts_ends_within_the_cancel_grace() {
    let (sup, _root, spawned, grace) = a_job_actor_stuck_in_pre_start().await;
    let start = tokio::time::Instant::now();
    let report = sup.shutdown().await.unwrap();
    assert!(
        start.elapsed() <= grace + Duration::from_millis(50),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(
        (report.cancelled_jobs, report.quarantined),
        (1, 0),
        "{report:?}"
    );
    let err = spawned.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED", "{err}");
}

// ---------------------------------------------------------------------------------------------
// 6. The lease desk: every cleanup failure has a receiver; holders are told and named
// ---------------------------------------------------------------------------------------------

/// An actor that does nothing: a lease holder.
struct Idle;

impl Actor for Idle {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }
}

/// A `LeaseMsg::Release` whose caller gave up (its `call!` timed out) before the broker release
/// failed: the failure reaches the error sink, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desk_release_whose_caller_gave_up_reports_its_failure_to_the_error_sink_once() {
    let broker = TestBroker::new(1);
    let gate = Arc::new(Notify::new());
    {
        let gate = Arc::clone(&gate);
        broker.on_release(move |_| Plan::GateThenFail(Arc::clone(&gate)));
    }
    let (sink, mut failures) = common::sink_channel();
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .error_sink(sink)
        .start()
        .await
        .unwrap();
    let desk = sup.lease_desk().await.unwrap();
    let (holder, holder_join) = Actor::spawn(None, Idle, ()).await.unwrap();
    let lease = call!(desk, LeaseMsg::Acquire, holder.get_cell())
        .unwrap()
        .unwrap();
    let lease_id = lease.lease_id();
    let asked = call_t!(desk, LeaseMsg::Release, 50, holder.get_cell(), lease_id);
    assert!(
        asked.is_err(),
        "the release answered through its gate: {asked:?}"
    );
    gate.notify_one();
    let failure = failures.recv().await.expect("the failure reached the sink");
    assert_eq!(failure.error.code(), "LEASE_CLEANUP_FAILED", "{failure:?}");
    drop(lease);
    holder.stop(None);
    holder_join.await.unwrap();
    sup.shutdown().await.unwrap();
    assert!(failures.try_recv().is_err(), "reported more than once");
    assert_eq!(broker.release_calls(), 1);
}

/// An `ActorLease` is told when its lease is lost or revoked (`is_lost`, `lost`), and the lease
/// table names the actor that holds a desk lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_desk_lease_is_named_in_the_table_and_told_when_shutdown_revokes_it() {
    let (sup, _root) = pool(1).await;
    let desk = sup.lease_desk().await.unwrap();
    let (holder, holder_join) = Actor::spawn(None, Idle, ()).await.unwrap();
    let lease = call!(desk, LeaseMsg::Acquire, holder.get_cell())
        .unwrap()
        .unwrap();
    let table = sup.leases();
    assert_eq!(table.len(), 1);
    assert_eq!(table[0].kind, LeaseKind::Explicit);
    assert_eq!(table[0].holder, Some(holder.get_id()), "{table:?}");
    assert!(!lease.is_lost());
    let shutdown = tokio::spawn({
        let sup = sup.clone();
        async move { sup.shutdown().await }
    });
    lease.lost().await;
    assert!(lease.is_lost());
    shutdown.await.unwrap().unwrap();
    drop(lease);
    holder.stop(None);
    holder_join.await.unwrap();
}

/// After a shutdown, a slot still quarantined stays in the lease table while it is held.
#[tokio::test]
async fn a_quarantined_slot_stays_in_the_lease_table_after_shutdown() {
    let (sup, _root) = pool(1).await;
    let path = common::quarantine_by_clobbering(&sup, "clobbered").await;
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 1);
    let table = sup.leases();
    assert_eq!(table.len(), 1, "{table:?}");
    assert_eq!(table[0].phase, LeasePhase::Quarantined);
    assert_eq!(table[0].job_id.as_deref(), Some("clobbered"));
    std::fs::remove_file(path).unwrap();
}

// ---------------------------------------------------------------------------------------------
// 7. An answer means the effect is visible
// ---------------------------------------------------------------------------------------------

/// On a multi-thread runtime, `stats()` read right after `resize` answers shows the new
/// capacity, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_read_after_a_resize_answers_show_the_new_capacity() {
    let (sup, _root) = pool(2).await;
    for i in 0..200u32 {
        let slots = 1 + i % 5;
        assert_eq!(sup.resize(slots).await.unwrap(), slots);
        assert_eq!(
            sup.stats().capacity,
            Some(slots as usize),
            "after resize {i}"
        );
    }
    sup.shutdown().await.unwrap();
}

/// On a multi-thread runtime, `stats()` and `leases()` read right after `cancel` answers already
/// show the cancelled job gone from the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_read_after_a_cancel_answers_show_the_waiter_gone() {
    let (sup, _root) = pool(1).await;
    let held = sup.acquire().await.unwrap();
    let waits = Arc::new(AtomicUsize::new(0));
    for i in 0..100 {
        let id = format!("queued-{i}");
        let job = tokio::spawn({
            let (sup, id, waits) = (sup.clone(), id.clone(), Arc::clone(&waits));
            async move {
                waits.fetch_add(1, Ordering::SeqCst);
                sup.run(JobSpec::new(id).unwrap(), |_| async {
                    Ok::<_, std::io::Error>(())
                })
                .await
            }
        });
        until("the job waits", || sup.stats().waiting == 1).await;
        assert!(sup.cancel(&id).await.unwrap());
        assert_eq!(sup.stats().waiting, 0, "after cancel {i}");
        let err = job.await.unwrap().unwrap_err();
        assert_eq!(err.code(), "LEASE_ACQUIRE_CANCELLED");
    }
    assert_eq!(waits.load(Ordering::SeqCst), 100);
    drop(held);
    sup.shutdown().await.unwrap();
}

//! Starting, stopping and waiting: the builder's rules, the work root's lifetime, shutdown, the
//! last handle, a runtime that is gone, acquire timeouts and cancellation, FIFO order, broker
//! validation, the error sink and the cleanup timeout.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::{EventLog, Plan, TestBroker, sink_channel, supervise, until};
use leasehold::{
    AcquireError, AcquireRequest, BrokerError, BrokerErrorKind, CancellationToken,
    CleanupErrorKind, JobSpec, SlotBroker, SlotToken, StartError, Supervisor,
};
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

// ---------------------------------------------------------------------------------------------
// Builder rules
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_builder_with_neither_slots_nor_broker_refuses_to_start() {
    let err = Supervisor::builder().start().await.unwrap_err();
    assert!(matches!(err, StartError::NoBroker), "{err:?}");
    assert_eq!(err.code(), "SUPERVISOR_START_FAILED");
}

#[tokio::test]
async fn zero_slots_are_refused_as_zero_capacity() {
    let err = Supervisor::builder().slots(0).start().await.unwrap_err();
    assert!(matches!(err, StartError::ZeroCapacity), "{err:?}");
    assert_eq!(err.code(), "SUPERVISOR_START_FAILED");
}

#[tokio::test]
async fn a_broker_reporting_zero_capacity_is_refused_as_zero_capacity() {
    let broker = TestBroker::new(0);
    let err = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap_err();
    assert!(matches!(err, StartError::ZeroCapacity), "{err:?}");
    assert_eq!(err.code(), "SUPERVISOR_START_FAILED");
    assert_eq!(broker.acquire_calls(), 0);
}

#[tokio::test]
async fn a_zero_cleanup_timeout_is_refused() {
    let err = Supervisor::builder()
        .slots(1)
        .cleanup_timeout(Duration::ZERO)
        .start()
        .await
        .unwrap_err();
    assert!(
        matches!(err, StartError::ZeroDuration("cleanup_timeout")),
        "{err:?}"
    );
    assert_eq!(err.code(), "SUPERVISOR_START_FAILED");
}

#[tokio::test]
async fn a_work_root_that_is_an_existing_regular_file_is_refused() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let err = Supervisor::builder()
        .slots(1)
        .work_root(file.path())
        .start()
        .await
        .unwrap_err();
    assert_eq!(err.code(), "SUPERVISOR_START_FAILED");
    match &err {
        StartError::WorkRoot { path, .. } => assert_eq!(path, file.path()),
        other => panic!("expected StartError::WorkRoot, got {other:?}"),
    }
    assert!(std::error::Error::source(&err).is_some());
    // The file was not touched.
    assert!(file.path().is_file());
}

/// `.broker(b)` after `.slots(n)` replaces it: the broker's single slot is the capacity.
#[tokio::test(start_paused = true)]
async fn broker_after_slots_wins_and_decides_capacity() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .slots(3)
        .broker(broker.clone())
        .acquire_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    let mut first = sup.acquire().await.unwrap();
    assert_eq!(broker.held(), 1, "the slot did not come from the broker");
    let err = sup.acquire().await.unwrap_err();
    assert_eq!(
        err.code(),
        "LEASE_ACQUIRE_TIMEOUT",
        "more than the broker's one slot"
    );
    first.release().await.unwrap();
    let report = sup.shutdown().await.unwrap();
    broker.assert_quiescent(report.stats);
}

/// `.slots(n)` after `.broker(b)` replaces it: three local slots, the broker is never asked.
#[tokio::test(start_paused = true)]
async fn slots_after_broker_wins_and_the_broker_is_never_called() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .slots(3)
        .acquire_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(sup.acquire().await.unwrap());
    }
    let mut slots: Vec<u32> = leases.iter().map(|l| l.slot_id().unwrap()).collect();
    slots.sort_unstable();
    assert_eq!(slots, [0, 1, 2]);
    let err = sup.acquire().await.unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_TIMEOUT", "more than three slots");
    assert_eq!(broker.acquire_calls(), 0);
    for lease in &mut leases {
        lease.release().await.unwrap();
    }
    sup.shutdown().await.unwrap();
    assert_eq!(broker.release_calls(), 0);
}

// ---------------------------------------------------------------------------------------------
// Work root
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_default_work_root_exists_while_running_and_is_removed_by_shutdown() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let root = sup.work_root().to_path_buf();
    assert!(root.is_dir());
    assert!(
        root.starts_with(std::env::temp_dir()),
        "not under the OS temp dir: {}",
        root.display()
    );
    let job_dir = sup
        .run(JobSpec::new("writes").unwrap(), |ctx| async move {
            std::fs::write(ctx.temp_dir().join("out.bin"), b"x")?;
            Ok::<_, std::io::Error>(ctx.temp_dir().to_path_buf())
        })
        .await
        .unwrap();
    assert!(job_dir.starts_with(&root));
    assert!(root.is_dir(), "work root removed while running");
    sup.shutdown().await.unwrap();
    assert!(!root.exists(), "default work root left behind");
}

#[tokio::test]
async fn a_user_work_root_is_created_if_missing_and_kept_after_shutdown() {
    let parent = tempfile::tempdir().unwrap();
    let root = parent.path().join("nested").join("root");
    let sup = Supervisor::builder()
        .slots(1)
        .work_root(&root)
        .start()
        .await
        .unwrap();
    assert!(root.is_dir());
    sup.run(JobSpec::new("j").unwrap(), |ctx| async move {
        std::fs::write(ctx.temp_dir().join("f"), b"x")?;
        Ok::<_, std::io::Error>(())
    })
    .await
    .unwrap();
    sup.shutdown().await.unwrap();
    assert!(root.is_dir(), "a user work root was removed");
    assert_eq!(
        std::fs::read_dir(&root).unwrap().count(),
        0,
        "job temp dirs (or a probe) left inside the user's work root"
    );
}

// ---------------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------------

/// One slot holds a running job, the other an explicit lease, and a third caller waits.
/// Shutdown refuses the waiter, cancels the job and waits for it, and releases the lease on its
/// holder's behalf. Runs on tokio's paused clock: a `sleep` returns only once every other task is
/// idle, which proves that shutdown is still waiting for the job.
#[tokio::test(start_paused = true)]
async fn shutdown_refuses_waiters_cancels_and_awaits_jobs_and_releases_held_leases() {
    let broker = TestBroker::new(2);
    let sup = supervise(&broker).await;
    let mut lease = sup.acquire().await.unwrap();
    let lease_token = lease.token().unwrap();

    let (started_tx, started_rx) = oneshot::channel();
    let (saw_cancel_tx, saw_cancel_rx) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    let job = {
        let (sup, gate) = (sup.clone(), Arc::clone(&gate));
        tokio::spawn(async move {
            sup.run(JobSpec::new("long").unwrap(), move |ctx| async move {
                started_tx.send(()).unwrap();
                ctx.cancelled().await;
                saw_cancel_tx.send(ctx.is_cancelled()).unwrap();
                gate.notified().await;
                Err::<(), _>(std::io::Error::other("stopped early"))
            })
            .await
        })
    };
    started_rx.await.unwrap();
    let waiter = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.acquire().await })
    };
    until("the third caller waits", || sup.stats().waiting == 1).await;

    let shutting = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.shutdown().await })
    };
    assert!(saw_cancel_rx.await.unwrap(), "the body saw no cancellation");
    let err = waiter.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "SUPERVISOR_STOPPED");
    assert!(matches!(err, AcquireError::Stopped));

    // The job still runs: shutdown must still be waiting for it (less than the 5 s cancel grace).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !shutting.is_finished(),
        "shutdown returned while a job still ran"
    );
    assert_eq!(broker.held(), 1, "the job's slot is still held");
    assert_eq!(
        broker.releases_per_token().get(&lease_token),
        Some(&1),
        "the held lease was not released by the supervisor"
    );

    gate.notify_one();
    let report = shutting.await.unwrap().unwrap();
    assert_eq!(report.refused_waiters, 1);
    assert_eq!(report.cancelled_jobs, 1);
    assert_eq!(report.released_leases, 1);
    assert_eq!(report.quarantined, 0);
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    assert_eq!(
        err.body_error().unwrap().error().unwrap().to_string(),
        "stopped early"
    );
    assert_eq!(broker.held(), 0);
    broker.assert_quiescent(report.stats);

    // The holder's own release afterwards is a no-op: Ok, and no second broker release.
    let calls = broker.release_calls();
    let late = lease.release().await;
    assert!(
        late.is_ok(),
        "release() of a lease the supervisor already released at shutdown: {late:?}"
    );
    assert_eq!(broker.release_calls(), calls);
    assert_eq!(broker.releases_per_token().get(&lease_token), Some(&1));
    drop(lease);

    // After shutdown, nothing new starts.
    let ran = Arc::new(AtomicBool::new(false));
    let ran2 = Arc::clone(&ran);
    let err = sup
        .run(JobSpec::new("late").unwrap(), move |_ctx| async move {
            ran2.store(true, Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "SUPERVISOR_STOPPED");
    assert!(!ran.load(Ordering::SeqCst));
    assert_eq!(
        sup.acquire().await.unwrap_err().code(),
        "SUPERVISOR_STOPPED"
    );
    let again = sup.shutdown().await.unwrap();
    assert_eq!(again.stats.acquired_total, 2);
    assert_eq!(broker.acquire_calls(), 2);
    broker.assert_quiescent(sup.stats());
}

/// The same rule seen from a release that races with shutdown: asked for while the supervisor
/// is still draining (a job keeps it busy), it is answered `Ok` and calls the broker no more.
#[tokio::test(start_paused = true)]
async fn a_lease_released_by_shutdown_can_still_be_released_by_its_holder_during_the_drain() {
    let broker = TestBroker::new(2);
    let sup = supervise(&broker).await;
    let mut lease = sup.acquire().await.unwrap();
    let (started_tx, started_rx) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    let job = {
        let (sup, gate) = (sup.clone(), Arc::clone(&gate));
        tokio::spawn(async move {
            sup.run(JobSpec::new("busy").unwrap(), move |_ctx| async move {
                started_tx.send(()).unwrap();
                gate.notified().await;
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    started_rx.await.unwrap();
    let shutting = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.shutdown().await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(broker.release_calls(), 1, "the lease was not released");
    lease.release().await.unwrap();
    assert_eq!(broker.release_calls(), 1);
    gate.notify_one();
    let report = shutting.await.unwrap().unwrap();
    assert_eq!(report.released_leases, 1);
    // The body ignored the cancellation and returned Ok: that is its result.
    job.await.unwrap().unwrap();
    broker.assert_quiescent(report.stats);
}

// ---------------------------------------------------------------------------------------------
// The last handle
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn dropping_the_last_handle_shuts_the_supervisor_down() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let root = sup.work_root().to_path_buf();
    assert_eq!(
        Arc::strong_count(&broker.0),
        2,
        "the supervisor holds a clone"
    );
    drop(sup);
    until("the supervisor has stopped", || {
        !root.exists() && Arc::strong_count(&broker.0) == 1
    })
    .await;
}

/// A `Lease` keeps its supervisor alive after the last handle is gone; dropping it (unreleased)
/// releases its slot once and then lets the supervisor shut down.
#[tokio::test(start_paused = true)]
async fn a_lease_keeps_the_supervisor_alive_until_it_is_dropped() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let root = sup.work_root().to_path_buf();
    let lease = sup.acquire().await.unwrap();
    drop(sup);
    // Paused clock: this returns only once every other task is idle.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(root.is_dir(), "the supervisor stopped under a live lease");
    assert_eq!(Arc::strong_count(&broker.0), 2);
    assert_eq!(lease.slot_id().unwrap(), 0);
    assert_eq!(broker.release_calls(), 0);

    drop(lease);
    until("the supervisor has stopped", || {
        !root.exists() && Arc::strong_count(&broker.0) == 1
    })
    .await;
    assert_eq!(broker.release_calls(), 1);
    assert_eq!(broker.held(), 0);
}

// ---------------------------------------------------------------------------------------------
// Runtime gone
// ---------------------------------------------------------------------------------------------

fn runtime_gone_answers_every_call(multi_thread: bool) {
    let build = || {
        let mut b = if multi_thread {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(2);
            b
        } else {
            tokio::runtime::Builder::new_current_thread()
        };
        b.enable_all().build().unwrap()
    };
    let first = build();
    let broker = TestBroker::new(1);
    let sup = first.block_on(supervise(&broker));
    // Prove it worked on its own runtime.
    first
        .block_on(sup.run(JobSpec::new("before").unwrap(), |_ctx| async {
            Ok::<_, std::io::Error>(())
        }))
        .unwrap();
    drop(first);

    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let limit = Duration::from_secs(10);
        let ran = Arc::new(AtomicBool::new(false));
        let ran2 = Arc::clone(&ran);
        let run = tokio::time::timeout(
            limit,
            sup.run(JobSpec::new("after").unwrap(), move |_ctx| async move {
                ran2.store(true, Ordering::SeqCst);
                Ok::<_, std::io::Error>(())
            }),
        )
        .await
        .expect("run hung on a supervisor whose runtime is gone");
        assert_eq!(run.unwrap_err().code(), "SUPERVISOR_STOPPED");
        assert!(!ran.load(Ordering::SeqCst));

        let acquire = tokio::time::timeout(limit, sup.acquire())
            .await
            .expect("acquire hung on a supervisor whose runtime is gone");
        assert_eq!(acquire.unwrap_err().code(), "SUPERVISOR_STOPPED");

        let shutdown = tokio::time::timeout(limit, sup.shutdown())
            .await
            .expect("shutdown hung on a supervisor whose runtime is gone");
        let err = shutdown.unwrap_err();
        assert_eq!(err.code(), "SUPERVISOR_STOPPED");
    });
    drop(sup);
    assert_eq!(broker.release_calls(), 1);
}

#[test]
fn a_supervisor_whose_current_thread_runtime_is_gone_answers_errors_and_never_hangs() {
    runtime_gone_answers_every_call(false);
}

#[test]
fn a_supervisor_whose_multi_thread_runtime_is_gone_answers_errors_and_never_hangs() {
    runtime_gone_answers_every_call(true);
}

// ---------------------------------------------------------------------------------------------
// Acquire timeout and cancellation
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn acquire_timeout_ends_both_acquire_and_run_with_lease_acquire_timeout_and_leaks_nothing() {
    let timeout = Duration::from_secs(2);
    let (broker, sup, mut holder) = common::one_slot_held_under_acquire_timeout(timeout).await;

    let t0 = tokio::time::Instant::now();
    let err = sup.acquire().await.unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_TIMEOUT");
    assert!(
        matches!(err, AcquireError::TimedOut { after } if after == timeout),
        "{err:?}"
    );
    let waited = t0.elapsed();
    assert!(
        waited >= timeout && waited < timeout * 2,
        "waited {waited:?}"
    );

    let ran = Arc::new(AtomicBool::new(false));
    let ran2 = Arc::clone(&ran);
    let t0 = tokio::time::Instant::now();
    let err = sup
        .run(JobSpec::new("late").unwrap(), move |_ctx| async move {
            ran2.store(true, Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_TIMEOUT");
    assert!(matches!(
        err.acquire_error(),
        Some(AcquireError::TimedOut { .. })
    ));
    assert!(err.body_error().is_none() && err.cleanup_error().is_none());
    assert!(t0.elapsed() >= timeout);
    assert!(!ran.load(Ordering::SeqCst), "the body ran without a slot");

    let stats = sup.stats();
    assert_eq!(stats.waiting, 0);
    assert_eq!(stats.active, 1);
    assert_eq!(stats.acquired_total, 1);
    assert_eq!(broker.acquire_calls(), 1);
    holder.release().await.unwrap();
    broker.assert_quiescent(sup.stats());
}

/// A detached job's wait is nobody's to watch: the supervisor's side still takes it out of the
/// queue at its acquire timeout, and it never runs.
#[tokio::test(start_paused = true)]
async fn a_detached_job_leaves_the_queue_at_its_acquire_timeout() {
    let timeout = Duration::from_secs(2);
    let (broker, sup, mut holder) = common::one_slot_held_under_acquire_timeout(timeout).await;
    let ran = Arc::new(AtomicBool::new(false));
    let ran2 = Arc::clone(&ran);
    sup.submit(JobSpec::new("detached").unwrap(), move |_ctx| async move {
        ran2.store(true, Ordering::SeqCst);
        Ok::<_, std::io::Error>(())
    })
    .detach();
    until("the detached job waits", || sup.stats().waiting == 1).await;
    // The paused clock moves past the timeout (no real time passes).
    tokio::time::sleep(timeout + Duration::from_millis(1)).await;
    until("the detached job leaves the queue", || {
        sup.stats().waiting == 0
    })
    .await;
    holder.release().await.unwrap();
    let mut next = sup.acquire().await.unwrap();
    next.release().await.unwrap();
    assert!(!ran.load(Ordering::SeqCst), "the job ran after its timeout");
    assert_eq!(
        sup.stats().acquired_total,
        2,
        "the holder and the next caller only"
    );
    broker.assert_quiescent(sup.stats());
    sup.shutdown().await.unwrap();
}

/// A handle nobody polls while its job waits: the supervisor refuses the job when it would grant
/// it past its acquire timeout, the slot goes on, and the handle reads `LEASE_ACQUIRE_TIMEOUT`.
#[tokio::test(start_paused = true)]
async fn a_job_whose_handle_is_not_polled_is_refused_at_its_grant_past_its_acquire_timeout() {
    let timeout = Duration::from_secs(2);
    let (broker, sup, mut holder) = common::one_slot_held_under_acquire_timeout(timeout).await;
    let ran = Arc::new(AtomicBool::new(false));
    let ran2 = Arc::clone(&ran);
    let mut handle = sup.submit(JobSpec::new("unpolled").unwrap(), move |_ctx| async move {
        ran2.store(true, Ordering::SeqCst);
        // Were it granted, it would keep the slot.
        std::future::pending::<()>().await;
        Ok::<_, std::io::Error>(())
    });
    tokio::time::sleep(timeout + Duration::from_millis(1)).await;
    // Released: the grant reaches the job, past its timeout, and is refused in that turn.
    holder.release().await.unwrap();
    let mut next = sup.acquire().await.unwrap();
    assert!(!ran.load(Ordering::SeqCst), "the job ran after its timeout");
    let err = loop {
        if let Some(result) = handle.try_take() {
            break result.unwrap_err();
        }
        tokio::task::yield_now().await;
    };
    assert_eq!(err.code(), "LEASE_ACQUIRE_TIMEOUT", "{err:?}");
    assert!(
        matches!(err.acquire_error(), Some(AcquireError::TimedOut { after }) if *after == timeout),
        "{err:?}"
    );
    next.release().await.unwrap();
    broker.assert_quiescent(sup.stats());
    sup.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_job_cancelled_before_run_acquires_nothing_and_ends_lease_acquire_cancelled() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let token = CancellationToken::new();
    token.cancel();
    let ran = Arc::new(AtomicBool::new(false));
    let ran2 = Arc::clone(&ran);
    let err = sup
        .run(
            JobSpec::new("pre-cancelled").unwrap().with_cancel(token),
            move |_ctx| async move {
                ran2.store(true, Ordering::SeqCst);
                Ok::<_, std::io::Error>(())
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_CANCELLED");
    assert!(matches!(err.acquire_error(), Some(AcquireError::Cancelled)));
    assert!(!ran.load(Ordering::SeqCst));
    assert_eq!(broker.acquire_calls(), 0);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.stats.acquired_total, 0);
    broker.assert_quiescent(report.stats);
}

#[tokio::test]
async fn cancelling_a_waiting_job_with_its_token_ends_it_lease_acquire_cancelled_without_leaking() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let mut holder = sup.acquire().await.unwrap();
    let token = CancellationToken::new();
    let ran = Arc::new(AtomicBool::new(false));
    let job = {
        let (sup, token, ran) = (sup.clone(), token.clone(), Arc::clone(&ran));
        tokio::spawn(async move {
            sup.run(
                JobSpec::new("waits").unwrap().with_cancel(token),
                move |_ctx| async move {
                    ran.store(true, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        })
    };
    until("the job waits", || sup.stats().waiting == 1).await;
    token.cancel();
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_CANCELLED");
    assert!(!ran.load(Ordering::SeqCst));
    // The holder still holds; nothing else was asked of the broker.
    assert_eq!(sup.stats().waiting, 0);
    assert_eq!(sup.stats().active, 1);
    assert_eq!(broker.acquire_calls(), 1);
    assert_eq!(holder.slot_id().unwrap(), 0);
    holder.release().await.unwrap();
    broker.assert_quiescent(sup.stats());
}

/// Job A is cancelled and the holder releases right after, before A's task has even run: the
/// supervisor sees the release (and the grant) before A's withdrawal. The slot must go to B, the
/// next waiter, and never to A; cancelling A's token again changes nothing.
#[tokio::test]
async fn a_grant_racing_with_a_cancellation_goes_to_the_next_waiter_not_the_cancelled_one() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let mut holder = sup.acquire().await.unwrap();
    let token_a = CancellationToken::new();
    let a_ran = Arc::new(AtomicBool::new(false));
    let a = {
        let (sup, token, ran) = (sup.clone(), token_a.clone(), Arc::clone(&a_ran));
        tokio::spawn(async move {
            sup.run(
                JobSpec::new("a").unwrap().with_cancel(token),
                move |_ctx| async move {
                    ran.store(true, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        })
    };
    until("A waits", || sup.stats().waiting == 1).await;
    let b = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("b").unwrap(), |ctx| async move {
                Ok::<_, std::io::Error>(ctx.token())
            })
            .await
        })
    };
    until("A and B wait", || sup.stats().waiting == 2).await;

    token_a.cancel();
    token_a.cancel();
    holder.release().await.unwrap();

    let err = a.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_CANCELLED");
    assert!(!a_ran.load(Ordering::SeqCst), "the cancelled job ran");
    let b_token = b.await.unwrap().unwrap();
    assert_eq!(b_token, SlotToken::new(0, 2));

    token_a.cancel();
    let stats = sup.stats();
    assert_eq!(stats.acquired_total, 2);
    assert_eq!(stats.waiting, 0);
    assert_eq!(broker.acquire_calls(), 2);
    broker.assert_quiescent(stats);
}

// ---------------------------------------------------------------------------------------------
// FIFO
// ---------------------------------------------------------------------------------------------

/// Five callers, jobs and explicit leases alternating, queue behind a held slot and are served
/// in the order they arrived.
#[tokio::test]
async fn waiters_behind_a_held_slot_are_granted_in_fifo_order() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let mut holder = sup.acquire().await.unwrap();
    let log = EventLog::default();
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (sup2, log) = (sup.clone(), log.clone());
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                sup2.run(JobSpec::new(format!("job-{i}")).unwrap(), move |_ctx| {
                    log.push(format!("waiter-{i}"));
                    async { Ok::<_, std::io::Error>(()) }
                })
                .await
                .unwrap();
            } else {
                let mut lease = sup2.acquire().await.unwrap();
                log.push(format!("waiter-{i}"));
                lease.release().await.unwrap();
            }
        }));
        until("the waiter is queued", || sup.stats().waiting == i + 1).await;
    }
    assert!(log.events().is_empty());
    holder.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(
        log.events(),
        ["waiter-0", "waiter-1", "waiter-2", "waiter-3", "waiter-4"]
    );
    broker.assert_quiescent(sup.stats());
}

// ---------------------------------------------------------------------------------------------
// Broker validation
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    /// Every token after the first names slot 0 again, under a new lease id.
    SlotAlreadyHeld,
    /// Every token after the first reuses lease id 1, on a new slot.
    LeaseIdAlreadyLive,
}

/// A broker that grants `(slot 0, lease 1)` first, then tokens that collide with it.
#[derive(Clone)]
struct CollidingBroker(Arc<CollidingInner>);

struct CollidingInner {
    mode: Misbehaviour,
    acquires: AtomicU64,
    released: Mutex<Vec<SlotToken>>,
}

impl CollidingBroker {
    fn new(mode: Misbehaviour) -> Self {
        Self(Arc::new(CollidingInner {
            mode,
            acquires: AtomicU64::new(0),
            released: Mutex::new(Vec::new()),
        }))
    }

    fn released(&self) -> Vec<SlotToken> {
        self.0.released.lock().clone()
    }
}

impl SlotBroker for CollidingBroker {
    async fn acquire(&self, _request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        let n = self.0.acquires.fetch_add(1, Ordering::SeqCst);
        Ok(match (n, self.0.mode) {
            (0, _) => SlotToken::new(0, 1),
            (n, Misbehaviour::SlotAlreadyHeld) => SlotToken::new(0, 100 + n),
            (n, Misbehaviour::LeaseIdAlreadyLive) => SlotToken::new(n as u32, 1),
        })
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.0.released.lock().push(token);
        Ok(())
    }

    fn capacity(&self) -> Option<u32> {
        Some(4)
    }
}

async fn a_colliding_token_is_refused(mode: Misbehaviour) {
    let broker = CollidingBroker::new(mode);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let mut first = sup.acquire().await.unwrap();
    assert_eq!(first.token().unwrap(), SlotToken::new(0, 1));

    let err = sup.acquire().await.unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_FAILED", "{mode:?}");
    match &err {
        AcquireError::Failed(e) => assert_eq!(e.kind(), BrokerErrorKind::InvalidResponse),
        other => panic!("{mode:?}: expected Failed, got {other:?}"),
    }

    let ran = Arc::new(AtomicBool::new(false));
    let ran2 = Arc::clone(&ran);
    let err = sup
        .run(JobSpec::new("collides").unwrap(), move |_ctx| async move {
            ran2.store(true, Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_FAILED", "{mode:?}");
    match err.acquire_error() {
        Some(AcquireError::Failed(e)) => assert_eq!(e.kind(), BrokerErrorKind::InvalidResponse),
        other => panic!("{mode:?}: expected Failed, got {other:?}"),
    }
    assert!(!ran.load(Ordering::SeqCst));

    let stats = sup.stats();
    assert_eq!(
        stats.acquired_total, 1,
        "{mode:?}: a colliding token was granted"
    );
    assert_eq!(stats.active, 1);
    assert_eq!(stats.waiting, 0);
    assert_eq!(broker.0.acquires.load(Ordering::SeqCst), 3);
    assert!(
        broker.released().is_empty(),
        "{mode:?}: a refused token was released: {:?}",
        broker.released()
    );

    first.release().await.unwrap();
    assert_eq!(broker.released(), [SlotToken::new(0, 1)], "{mode:?}");
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.stats.released_total, 1);
    assert_eq!(report.stats.active, 0);
}

#[tokio::test]
async fn a_broker_token_for_a_slot_held_by_a_live_lease_is_refused_and_not_released() {
    a_colliding_token_is_refused(Misbehaviour::SlotAlreadyHeld).await;
}

#[tokio::test]
async fn a_broker_token_reusing_a_live_lease_id_is_refused_and_not_released() {
    a_colliding_token_is_refused(Misbehaviour::LeaseIdAlreadyLive).await;
}

// ---------------------------------------------------------------------------------------------
// Error sink and cleanup timeout
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_dropped_lease_whose_release_fails_reaches_the_error_sink_exactly_once() {
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Fail);
    let (sink, mut failures) = sink_channel();
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .error_sink(sink)
        .start()
        .await
        .unwrap();
    let lease = sup.acquire().await.unwrap();
    let token = lease.token().unwrap();
    drop(lease);

    let failure = failures.recv().await.unwrap();
    assert_eq!(failure.token, token);
    assert_eq!(failure.job_id, None);
    assert_eq!(failure.error.code(), "LEASE_CLEANUP_FAILED");
    assert_eq!(failure.error.token(), Some(token));
    assert!(failure.error.broker_error().is_some());
    assert_eq!(sup.stats().release_failed_total, 1);

    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.stats.release_failed_total, 1);
    assert_eq!(report.stats.released_total, 0);
    drop(sup);
    assert!(
        failures.recv().await.is_none(),
        "the sink was called more than once"
    );
    broker.assert_quiescent(report.stats);
}

/// The broker's release never answers. `release()` ends `LEASE_CLEANUP_TIMEOUT` after exactly
/// the cleanup timeout (paused clock). A caller that gives up earlier cannot shorten it: the
/// broker release keeps running until the supervisor's own deadline, and its failure, which
/// nobody hears any more, goes to the error sink.
#[tokio::test(start_paused = true)]
async fn a_hung_release_times_out_at_the_cleanup_timeout_which_the_caller_cannot_shorten() {
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Hang);
    let (sink, mut failures) = sink_channel();
    let cleanup_timeout = Duration::from_secs(3);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .cleanup_timeout(cleanup_timeout)
        .error_sink(sink)
        .start()
        .await
        .unwrap();

    // A caller that waits hears the timeout after exactly the cleanup timeout.
    let mut lease = sup.acquire().await.unwrap();
    let t0 = tokio::time::Instant::now();
    let err = lease.release().await.unwrap_err();
    let took = t0.elapsed();
    assert_eq!(err.code(), "LEASE_CLEANUP_TIMEOUT");
    assert_eq!(err.kind(), CleanupErrorKind::Timeout);
    assert!(
        took >= cleanup_timeout && took < cleanup_timeout + Duration::from_millis(100),
        "took {took:?}"
    );
    assert_eq!(broker.held(), 0, "the hung release future was not dropped");
    lease.release().await.unwrap();
    assert_eq!(broker.release_calls(), 1);

    // A caller that gives up after one second.
    let mut lease = sup.acquire().await.unwrap();
    let token = lease.token().unwrap();
    let t0 = tokio::time::Instant::now();
    let gave_up = tokio::time::timeout(Duration::from_secs(1), lease.release()).await;
    assert!(gave_up.is_err(), "release ended before the caller gave up");
    assert_eq!(
        broker.held(),
        1,
        "the broker release was dropped with the caller's future"
    );
    tokio::time::sleep_until(t0 + cleanup_timeout - Duration::from_millis(100)).await;
    assert_eq!(
        broker.held(),
        1,
        "the broker release was cut short before the cleanup timeout"
    );
    assert!(failures.try_recv().is_err());

    let failure = failures.recv().await.unwrap();
    assert!(t0.elapsed() >= cleanup_timeout, "{:?}", t0.elapsed());
    assert_eq!(broker.held(), 0);
    assert_eq!(failure.token, token);
    assert_eq!(failure.error.code(), "LEASE_CLEANUP_TIMEOUT");
    assert_eq!(sup.stats().release_failed_total, 2);
    drop(lease);

    let report = sup.shutdown().await.unwrap();
    drop(sup);
    assert!(failures.recv().await.is_none(), "more than one sink call");
    broker.assert_quiescent(report.stats);
}

/// DESIGN.md section 2, steps 6 and 7: the freed slot goes to the next waiter before the caller
/// of the job that held it hears its result. Both happen in one turn of the supervisor; on a
/// current-thread runtime the tasks it wakes then run in the order they were woken, so the next
/// waiter's task runs first.
#[tokio::test]
async fn the_next_waiter_is_granted_before_the_released_jobs_caller_hears() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let log = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let (a_started_tx, a_started_rx) = oneshot::channel::<()>();
    let (a_go_tx, a_go_rx) = oneshot::channel::<()>();
    let a = {
        let (sup, log) = (sup.clone(), Arc::clone(&log));
        tokio::spawn(async move {
            let result = sup
                .run(JobSpec::new("a").unwrap(), move |_ctx| async move {
                    a_started_tx.send(()).unwrap();
                    a_go_rx.await.unwrap();
                    Ok::<_, std::io::Error>(())
                })
                .await;
            log.lock().push("a's caller answered");
            result
        })
    };
    a_started_rx.await.unwrap();
    let b = {
        let (sup, log) = (sup.clone(), Arc::clone(&log));
        tokio::spawn(async move {
            let lease = sup.acquire().await;
            log.lock().push("b granted");
            lease
        })
    };
    until("b waits", || sup.stats().waiting == 1).await;

    a_go_tx.send(()).unwrap();
    a.await.unwrap().unwrap();
    let mut lease = b.await.unwrap().unwrap();
    assert_eq!(*log.lock(), ["b granted", "a's caller answered"]);
    lease.release().await.unwrap();
    sup.shutdown().await.unwrap();
}

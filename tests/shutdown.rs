//! Shutdown ends everything it started (DESIGN.md invariant 8): whatever phase a job is in, its
//! body, tracked tasks and process groups are told to stop, shutdown returns within its bound,
//! and what cannot be proven gone is quarantined and reported, never waited for without end.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::TestBroker;
use leasehold::{JobSpec, ProcessSpec, Supervisor};
use tokio::sync::oneshot;

/// Fires its sender when dropped: shows that a task was stopped (completed or aborted).
struct OnDrop(Option<oneshot::Sender<()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// The body has returned; a task it spawned through its context still waits for cancellation.
/// Shutdown must cancel the job although its body is over (it is draining, not running), and
/// then return: on the paused clock, a shutdown that never cancels it would only end at the
/// test's hour-long bound.
#[tokio::test(start_paused = true)]
async fn shutdown_cancels_a_job_whose_body_returned_while_its_tracked_task_still_runs() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let (saw_cancel_tx, saw_cancel_rx) = oneshot::channel();
    let (body_done_tx, body_done_rx) = oneshot::channel();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("draining").unwrap(), move |ctx| async move {
                let task_ctx = ctx.clone();
                drop(ctx.spawn(async move {
                    task_ctx.cancelled().await;
                    let _ = saw_cancel_tx.send(());
                }));
                let _ = body_done_tx.send(());
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    body_done_rx.await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(3600), sup.shutdown())
        .await
        .expect("shutdown waited for a task it never told to stop")
        .unwrap();
    saw_cancel_rx
        .await
        .expect("the tracked task never saw the cancellation");
    assert_eq!(report.cancelled_jobs, 1);
    assert_eq!(report.quarantined, 0);
    // The body had returned Ok before the cancel: its result stands.
    job.await.unwrap().unwrap();
    broker.assert_quiescent(report.stats);
}

/// With a drain bound set, a tracked task that ignores cancellation used to leave shutdown
/// with the slot quarantined and the task running for ever. Now the shutdown aborts it once the
/// cancel grace has passed (it is an async task: aborting it is possible), the slot is proven
/// clean and released.
#[tokio::test(start_paused = true)]
async fn shutdown_aborts_a_tracked_task_that_ignores_cancellation_once_the_cancel_grace_has_passed()
{
    let broker = TestBroker::new(1);
    let grace = Duration::from_secs(2);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .cancel_grace(grace)
        .drain_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    let (stopped_tx, stopped_rx) = oneshot::channel();
    let (body_done_tx, body_done_rx) = oneshot::channel();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("stubborn").unwrap(), move |ctx| async move {
                drop(ctx.spawn(async move {
                    let _guard = OnDrop(Some(stopped_tx));
                    loop {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }));
                let _ = body_done_tx.send(());
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    body_done_rx.await.unwrap();
    let t0 = tokio::time::Instant::now();
    let report = sup.shutdown().await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_secs(3600), stopped_rx)
            .await
            .is_ok_and(|stopped| stopped.is_ok()),
        "the tracked task still runs after shutdown"
    );
    assert!(t0.elapsed() >= grace, "aborted before the cancel grace");
    assert_eq!(report.quarantined, 0, "{report:?}");
    assert!(report.unproven.is_empty());
    // The drain bound had passed first: the caller heard the slot was quarantined then.
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{err}");
    broker.assert_quiescent(report.stats);
    assert_eq!(broker.release_calls(), 1);
}

/// A blocking closure cannot be aborted. Shutdown waits for it only up to its bound, then
/// reports the slot as quarantined with the reason, and returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_within_its_bound_when_a_blocking_closure_never_ends_and_reports_it() {
    let broker = TestBroker::new(1);
    let bound = Duration::from_millis(300);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .cancel_grace(Duration::from_millis(50))
        .shutdown_timeout(bound)
        .start()
        .await
        .unwrap();
    let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
    let (started_tx, started_rx) = oneshot::channel();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(
                JobSpec::new("stuck-thread").unwrap(),
                move |ctx| async move {
                    drop(ctx.spawn_blocking(move || {
                        let _ = started_tx.send(());
                        let _ = gate_rx.recv();
                    }));
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        })
    };
    started_rx.await.unwrap();
    let t0 = std::time::Instant::now();
    let report = tokio::time::timeout(Duration::from_secs(30), sup.shutdown())
        .await
        .expect("shutdown waited without bound for a blocking closure")
        .unwrap();
    let took = t0.elapsed();
    assert!(took >= bound, "returned before its bound: {took:?}");
    assert_eq!(report.quarantined, 1);
    assert_eq!(report.unproven.len(), 1);
    assert_eq!(report.unproven[0].job_id.as_deref(), Some("stuck-thread"));
    assert!(
        report.unproven[0]
            .reason
            .contains("tasks spawned through the worker context"),
        "{}",
        report.unproven[0].reason
    );
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED");
    assert_eq!(
        broker.release_calls(),
        0,
        "a slot still in use was released"
    );
    gate_tx.send(()).unwrap();
}

/// The body returned; the process it started left a member behind in its group (a background
/// `sleep`). Shutdown stops the group (SIGTERM, then SIGKILL), proves it empty and releases the
/// slot; it used to wait for the member for as long as it lived.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_a_process_the_job_left_in_its_group() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .process_grace(Duration::from_millis(200))
        .start()
        .await
        .unwrap();
    let leader_done = Arc::new(AtomicBool::new(false));
    let job = {
        let (sup, leader_done) = (sup.clone(), Arc::clone(&leader_done));
        tokio::spawn(async move {
            sup.run(
                JobSpec::new("left-behind").unwrap(),
                move |ctx| async move {
                    let mut sh = ctx
                        .spawn_process(ProcessSpec::new("sh").arg("-c").arg("sleep 30 & exit 0"))
                        .unwrap();
                    assert!(sh.wait().await.unwrap().success());
                    leader_done.store(true, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        })
    };
    while !leader_done.load(Ordering::SeqCst) {
        tokio::task::yield_now().await;
    }
    let t0 = std::time::Instant::now();
    let report = tokio::time::timeout(Duration::from_secs(20), sup.shutdown())
        .await
        .expect("shutdown waited for the background sleep")
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert_eq!(report.quarantined, 0, "{report:?}");
    job.await.unwrap().unwrap();
    broker.assert_quiescent(report.stats);
    assert_eq!(broker.release_calls(), 1);
}

/// An explicit lease released by shutdown on its holder's behalf refuses use afterwards (the
/// slot may already be someone else's), and its `lost()` resolves; its own release is then a
/// no-op.
#[tokio::test(start_paused = true)]
async fn a_lease_released_by_shutdown_refuses_use_and_its_lost_signal_resolves() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let mut lease = sup.acquire().await.unwrap();
    assert!(lease.slot_id().is_ok());
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.released_leases, 1);
    tokio::time::timeout(Duration::from_secs(60), lease.lost())
        .await
        .expect("lost() never resolved for a lease shutdown released");
    assert!(lease.is_lost());
    assert!(lease.is_released());
    let err = lease.slot_id().unwrap_err();
    assert_eq!(err.code(), "LEASE_RELEASED");
    assert!(lease.lease_id().is_err());
    lease.release().await.unwrap();
    assert_eq!(broker.release_calls(), 1);
    broker.assert_quiescent(sup.stats());
}

/// A broker that renews its leases, and reports one lost when told (its TTL lapsed).
struct Losing {
    pool: leasehold::LocalBroker,
    lose: Arc<tokio::sync::Notify>,
}

impl leasehold::SlotBroker for Losing {
    async fn acquire(
        &self,
        request: leasehold::AcquireRequest,
    ) -> Result<leasehold::SlotToken, leasehold::BrokerError> {
        self.pool.acquire(request).await
    }
    async fn release(&self, token: leasehold::SlotToken) -> Result<(), leasehold::BrokerError> {
        self.pool.release(token).await
    }
    fn capacity(&self) -> Option<u32> {
        self.pool.capacity()
    }
    fn renews(&self) -> bool {
        true
    }
    async fn keep_alive(&self, _token: leasehold::SlotToken) -> leasehold::BrokerError {
        self.lose.notified().await;
        leasehold::BrokerError::new("its ttl lapsed")
    }
}

/// A lease lost at the broker, then released on its holder's behalf by a shutdown: its own
/// release afterwards is a no-op, as for any lease a shutdown released (before, it stayed only
/// "lost", and its release answered `SUPERVISOR_STOPPED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_that_shutdown_released_is_released_without_error_afterwards() {
    let lose = Arc::new(tokio::sync::Notify::new());
    let sup = Supervisor::builder()
        .broker(Losing {
            pool: leasehold::LocalBroker::new(1),
            lose: Arc::clone(&lose),
        })
        .start()
        .await
        .unwrap();
    let mut lease = sup.acquire().await.unwrap();
    lose.notify_one();
    tokio::time::timeout(Duration::from_secs(60), lease.lost())
        .await
        .expect("the loss never reached the lease");
    assert!(
        lease.is_lost() && !lease.is_released(),
        "lost, and not released yet: its holder still owes the release"
    );
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.released_leases, 1, "{report:?}");
    assert!(lease.is_lost() && lease.is_released());
    lease.release().await.unwrap();
}

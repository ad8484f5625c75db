//! A slot goes back only after the worker that used it has physically finished: its task,
//! every task and blocking closure it spawned through its context, and its temp dir.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::{EventLog, Plan, TestBroker, ThreadGate};
use leasehold::{CancellationToken, JobSpec, Supervisor};
use tokio::sync::oneshot;

/// The seed's own scenario: a cancelled job whose blocking thread still reads its input keeps
/// both the temp dir and the slot until the thread ends; then the temp dir is removed, then the
/// slot is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_job_keeps_temp_dir_and_slot_until_its_blocking_thread_ends() {
    let broker = TestBroker::new(1);
    let log = EventLog::default();
    let dir_seen: Arc<parking_lot::Mutex<Option<PathBuf>>> = Arc::default();
    {
        // The broker logs each release and whether the temp dir was already gone at that moment.
        let (log, dir_seen) = (log.clone(), Arc::clone(&dir_seen));
        broker.on_release(move |_| {
            let gone = dir_seen.lock().as_ref().is_some_and(|d| !d.exists());
            log.push(if gone {
                "release:dir-gone"
            } else {
                "release:dir-present"
            });
            Plan::Ok
        });
    }
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();

    let gate = ThreadGate::default();
    let cancel = CancellationToken::new();
    let (started_tx, started_rx) = oneshot::channel();
    let job = {
        let (sup, gate, log, dir_seen) = (
            sup.clone(),
            gate.clone(),
            log.clone(),
            Arc::clone(&dir_seen),
        );
        let spec = JobSpec::new("reader").unwrap().with_cancel(cancel.clone());
        tokio::spawn(async move {
            sup.run(spec, move |ctx| async move {
                let input = ctx.temp_dir().join("input.bin");
                std::fs::write(&input, b"frame data").unwrap();
                *dir_seen.lock() = Some(ctx.temp_dir().to_path_buf());
                let thread_log = log.clone();
                let _reader = ctx.spawn_blocking(move || {
                    started_tx.send(()).unwrap();
                    gate.wait();
                    // Still readable: the temp dir outlived the cancellation.
                    assert_eq!(std::fs::read(&input).unwrap(), b"frame data");
                    thread_log.push("thread-end");
                });
                ctx.cancelled().await;
                log.push("body-end");
                Err::<(), _>(std::io::Error::other("cancelled"))
            })
            .await
        })
    };
    started_rx.await.unwrap();
    // A second job waits for the only slot.
    let (b_tx, b_rx) = oneshot::channel();
    let second = {
        let (sup, log) = (sup.clone(), log.clone());
        tokio::spawn(async move {
            sup.run(JobSpec::new("next").unwrap(), move |_ctx| async move {
                log.push("next-start");
                let _ = b_tx.send(());
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    cancel.cancel();
    // The body ends at once; the thread does not. Nothing may move while it runs. Wait until
    // the supervisor has handled the worker's end (the job shows as draining): a release on
    // the worker's exit (or its supervision event) alone would have been started by then.
    tokio::time::timeout(Duration::from_secs(30), async {
        while sup.stats().draining == 0 && broker.release_calls() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the supervisor never saw the worker end");
    assert_eq!(broker.release_calls(), 0, "released while the thread ran");
    assert_eq!(sup.stats().draining, 1);
    let mut b_rx = b_rx;
    assert!(b_rx.try_recv().is_err(), "slot reused while the thread ran");
    let dir = dir_seen.lock().clone().unwrap();
    assert!(
        dir.exists(),
        "temp dir removed while the thread still reads it"
    );
    assert_eq!(broker.held(), 1);
    assert_eq!(sup.stats().active, 1);
    assert_eq!(log.events(), ["body-end"]);

    gate.open();
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    second.await.unwrap().unwrap();
    assert!(!dir.exists());
    assert_eq!(
        log.events(),
        [
            "body-end",
            "thread-end",
            "release:dir-gone",
            "next-start",
            "release:dir-gone"
        ]
    );
    broker.assert_quiescent(sup.stats());
}

/// The worker actor has ended (its join handle has resolved) while a task it spawned through its
/// context still runs. On tokio's paused clock nothing else can happen until that task's timer
/// fires, so a release made on the worker's end alone would be seen here deterministically.
#[tokio::test(start_paused = true)]
async fn the_workers_end_alone_never_releases_the_slot() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let log = EventLog::default();
    let job = {
        let (sup, log) = (sup.clone(), log.clone());
        tokio::spawn(async move {
            sup.run(JobSpec::new("sibling").unwrap(), move |ctx| async move {
                let dir = ctx.temp_dir().to_path_buf();
                let sibling_log = log.clone();
                ctx.spawn(async move {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    assert!(dir.exists());
                    sibling_log.push("sibling-end");
                });
                log.push("body-end");
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    // Virtual time: every message the body's end caused has been handled long before this.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(log.events(), ["body-end"]);
    assert_eq!(
        broker.held(),
        1,
        "slot released before the sibling task ended"
    );
    assert_eq!(broker.release_calls(), 0);
    assert_eq!(sup.stats().active, 1);
    job.await.unwrap().unwrap();
    assert_eq!(log.events(), ["body-end", "sibling-end"]);
    broker.assert_quiescent(sup.stats());
}

/// After the cancel grace the body future is dropped (its destructors run inside the worker,
/// before the release), but tracked blocking work is still awaited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_ignores_cancellation_is_dropped_after_the_grace_and_its_threads_still_awaited()
{
    struct RecordDrop(EventLog);
    impl Drop for RecordDrop {
        fn drop(&mut self) {
            self.0.push("body-dropped");
        }
    }
    let broker = TestBroker::new(1);
    let log = EventLog::default();
    broker.log_releases(&log);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .cancel_grace(Duration::from_millis(20))
        .start()
        .await
        .unwrap();
    let gate = ThreadGate::default();
    let cancel = CancellationToken::new();
    let (started_tx, started_rx) = oneshot::channel();
    let job = {
        let (sup, gate, log) = (sup.clone(), gate.clone(), log.clone());
        let spec = JobSpec::new("stubborn")
            .unwrap()
            .with_cancel(cancel.clone());
        tokio::spawn(async move {
            sup.run(spec, move |ctx| async move {
                let guard = RecordDrop(log.clone());
                let thread_log = log.clone();
                ctx.spawn_blocking(move || {
                    gate.wait();
                    thread_log.push("thread-end");
                });
                started_tx.send(()).unwrap();
                std::future::pending::<()>().await;
                drop(guard);
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    started_rx.await.unwrap();
    cancel.cancel();
    // The body is dropped after the grace even though the thread is still blocked.
    while !log.events().contains(&"body-dropped".to_owned()) {
        tokio::task::yield_now().await;
    }
    assert_eq!(broker.release_calls(), 0);
    gate.open();
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    assert!(err.body_error().unwrap().error().is_none());
    assert_eq!(log.events(), ["body-dropped", "thread-end", "release"]);
    broker.assert_quiescent(sup.stats());
}

/// Dropping the `run` future is a cancellation request, not a release: the supervisor finishes
/// the pipeline on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_run_future_cancels_cooperatively_and_the_pipeline_still_completes() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let gate = ThreadGate::default();
    let (seen_tx, seen_rx) = oneshot::channel();
    let (started_tx, started_rx) = oneshot::channel();
    let dir: Arc<parking_lot::Mutex<Option<PathBuf>>> = Arc::default();
    let task = {
        let (sup, gate, dir) = (sup.clone(), gate.clone(), Arc::clone(&dir));
        tokio::spawn(async move {
            sup.run(JobSpec::new("dropped").unwrap(), move |ctx| async move {
                *dir.lock() = Some(ctx.temp_dir().to_path_buf());
                ctx.spawn_blocking(move || gate.wait());
                started_tx.send(()).unwrap();
                ctx.cancelled().await;
                seen_tx.send(()).unwrap();
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    started_rx.await.unwrap();
    task.abort();
    seen_rx.await.expect("the body saw the cancellation");
    let dir = dir.lock().clone().unwrap();
    assert!(dir.exists());
    assert_eq!(broker.held(), 1);
    let released = broker.0.released.notified();
    gate.open();
    released.await;
    assert!(!dir.exists());
    // The broker has answered; the supervisor hears it next. Shutdown waits for that.
    let report = sup.shutdown().await.unwrap();
    broker.assert_quiescent(report.stats);
}

#[tokio::test]
async fn temp_dirs_are_fresh_and_strictly_inside_the_work_root_whatever_the_id() {
    let root = tempfile::tempdir().unwrap();
    let sup = Supervisor::builder()
        .slots(2)
        .work_root(root.path())
        .start()
        .await
        .unwrap();
    let canonical_root = std::fs::canonicalize(root.path()).unwrap();
    let mut seen = Vec::new();
    for id in [".", "..", "a:b", "..", "x.-_"] {
        let dir = sup
            .run(JobSpec::new(id).unwrap(), |ctx| async move {
                assert!(ctx.temp_dir().is_dir());
                assert_eq!(
                    std::fs::read_dir(ctx.temp_dir()).unwrap().count(),
                    0,
                    "not fresh"
                );
                Ok::<_, std::io::Error>(ctx.temp_dir().to_path_buf())
            })
            .await
            .unwrap();
        assert_eq!(
            dir.parent().unwrap(),
            canonical_root,
            "{id:?} escaped: {}",
            dir.display()
        );
        assert!(!dir.exists());
        seen.push(dir);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 5, "temp dirs reused");
    sup.shutdown().await.unwrap();
    // A user-given work root is the user's: it stays.
    assert!(root.path().exists());
}

#[tokio::test]
async fn an_unremovable_temp_dir_quarantines_the_slot_and_says_so() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let err = sup
        .run(JobSpec::new("evidence").unwrap(), |ctx| async move {
            // Replace the temp dir by a file of the same name: removal as a directory fails.
            common::clobber_temp_dir(&ctx).unwrap();
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED");
    let stats = sup.stats();
    assert_eq!(stats.quarantined, 1);
    assert_eq!(stats.active, 0);
    assert_eq!(
        broker.release_calls(),
        0,
        "a quarantined slot is never released as clean"
    );
    broker.assert_quiescent(stats);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 1);
}

/// A context kept past its job (here returned by the body) starts nothing once the job has
/// ended: its slot already serves another lease, and nobody would wait for the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_kept_past_its_job_starts_no_task_and_no_blocking_closure() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let broker = TestBroker::new(1);
    let sup = common::supervise(&broker).await;
    let kept: leasehold::WorkerContext = sup
        .run(JobSpec::new("kept").unwrap(), |ctx| async move {
            Ok::<_, std::io::Error>(ctx)
        })
        .await
        .unwrap();
    // The slot serves someone else now.
    let mut other = sup.acquire().await.unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let task = {
        let ran = Arc::clone(&ran);
        kept.spawn(async move { ran.store(true, Ordering::SeqCst) })
    };
    let err = task.await.unwrap_err();
    assert!(err.is_cancelled(), "{err:?}");
    let closure = {
        let ran = Arc::clone(&ran);
        kept.spawn_blocking(move || ran.store(true, Ordering::SeqCst))
    };
    let err = closure.await.unwrap_err();
    assert!(err.is_cancelled(), "{err:?}");
    assert!(
        !ran.load(Ordering::SeqCst),
        "work started under a lease that had ended"
    );
    other.release().await.unwrap();
    broker.assert_quiescent(sup.stats());
    sup.shutdown().await.unwrap();
}

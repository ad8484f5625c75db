//! What cannot be proven clean is quarantined, reported and re-checked; nothing is swallowed
//! (DESIGN.md invariants 3, 7 and 9).
#![cfg(target_os = "linux")]

mod common;
#[cfg(feature = "gpu")]
mod gpu_support;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::{Plan, TestBroker, first_line};
use leasehold::{JobSpec, ProcessSpec, Supervisor};
use tokio::sync::{Notify, oneshot};

/// The process subreaper and orphan checks are process-wide: tests with processes run one at a
/// time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn kill(pid: i32) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
}

/// A job whose temp dir cannot be removed: the caller hears `LEASE_CLEANUP_UNCONFIRMED` with
/// the I/O error as its source, the slot stays quarantined (not reused, listed), and a reclaim
/// retries the removal and releases the slot once it can be removed.
#[tokio::test]
async fn a_temp_dir_that_cannot_be_removed_quarantines_the_slot_until_a_reclaim_removes_it() {
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let (dir_tx, dir_rx) = oneshot::channel();
    let err = sup
        .run(JobSpec::new("clobbered").unwrap(), |ctx| async move {
            // A regular file where the temp dir was: removing a directory there fails.
            let _ = dir_tx.send(common::clobber_temp_dir(&ctx)?);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    let path = dir_rx.await.unwrap();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{err}");
    let cleanup = err.cleanup_error().unwrap();
    let source = std::error::Error::source(cleanup).expect("the I/O error is kept");
    assert!(
        source.downcast_ref::<std::io::Error>().is_some(),
        "{source}"
    );
    assert_eq!(sup.stats().quarantined, 1);
    assert_eq!(broker.release_calls(), 0);
    let listed = sup.quarantined().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0].reason.contains("could not be removed"),
        "{}",
        listed[0].reason
    );

    // Still a file: a reclaim retries the removal, which fails again: the report says so.
    let report = sup.reclaim_quarantined().await.unwrap();
    assert_eq!(report.reclaimed, [], "{report:?}");
    assert_eq!(report.still_quarantined.len(), 1, "{report:?}");
    assert_eq!(sup.quarantined().await.unwrap().len(), 1);
    assert_eq!(broker.release_calls(), 0);

    // Removable now: the next reclaim removes it and releases the slot.
    std::fs::remove_file(&path).unwrap();
    let released = broker.0.released.notified();
    let report = sup.reclaim_quarantined().await.unwrap();
    assert_eq!(report.reclaimed.len(), 1, "{report:?}");
    assert_eq!(report.still_quarantined, [], "{report:?}");
    released.await;
    assert_eq!(broker.release_calls(), 1);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
}

/// Two `reclaim_quarantined` calls handled back to back, with a broker whose release does not
/// answer on its first poll, used to start the temp dir removal twice and then apply an
/// illegal edge that stopped the supervisor (debug builds). The slot is reclaimed once and the
/// supervisor keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reclaims_back_to_back_reclaim_a_slot_once_and_the_supervisor_keeps_serving() {
    let _serial = SERIAL.lock().await;
    let broker = TestBroker::new(1);
    let gate = Arc::new(Notify::new());
    {
        let gate = Arc::clone(&gate);
        broker.on_release(move |_| Plan::Gate(Arc::clone(&gate)));
    }
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .process_proof_bound(Duration::from_millis(100))
        .start()
        .await
        .unwrap();
    // An escaped, orphaned descendant keeps the slot quarantined while it lives.
    let (pid_tx, pid_rx) = oneshot::channel();
    let err = sup
        .run(JobSpec::new("daemon").unwrap(), |ctx| async move {
            let mut child = ctx
                .spawn_process(
                    ProcessSpec::new("sh")
                        .arg("-c")
                        .arg("setsid sleep 30 & echo $!")
                        .stdout(Stdio::piped()),
                )
                .unwrap();
            let pid = first_line(child.stdout.take().unwrap()).await;
            child.wait().await.unwrap();
            let _ = pid_tx.send(pid);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{err}");
    assert_eq!(sup.stats().quarantined, 1);
    let pid = pid_rx.await.unwrap();
    kill(pid);
    while common::proc_alive(pid) {
        tokio::task::yield_now().await;
    }
    let (a, b) = tokio::join!(sup.reclaim_quarantined(), sup.reclaim_quarantined());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.reclaimed.len() + b.reclaimed.len(), 1, "{a:?} {b:?}");
    // The release is gated: the supervisor still answers meanwhile, and then serves again.
    assert!(sup.quarantined().await.unwrap().is_empty());
    gate.notify_one();
    let mut lease = tokio::time::timeout(Duration::from_secs(20), sup.acquire())
        .await
        .expect("the slot never came back")
        .expect("the supervisor stopped serving");
    gate.notify_one();
    lease.release().await.unwrap();
    let report = sup.shutdown().await.unwrap();
    broker.assert_quiescent(report.stats);
    assert_eq!(broker.release_calls(), 2);
}

/// A job submitted without waiting, whose handle was detached (or dropped): when its release
/// fails, the failure reaches the error sink, exactly once.
#[tokio::test]
async fn a_cleanup_failure_of_a_submitted_job_nobody_waits_for_reaches_the_error_sink_once() {
    for detach in [true, false] {
        let (sup, mut failures) = common::supervisor_whose_releases_fail().await;
        let (ran_tx, ran_rx) = oneshot::channel();
        let handle = sup.submit(
            JobSpec::new("fire-and-forget").unwrap(),
            move |_ctx| async move {
                let _ = ran_tx.send(());
                Ok::<_, std::io::Error>(())
            },
        );
        ran_rx.await.unwrap();
        if detach {
            handle.detach();
        } else {
            drop(handle);
        }
        let failure = tokio::time::timeout(Duration::from_secs(20), failures.recv())
            .await
            .expect("the failure never reached the sink")
            .unwrap();
        assert_eq!(failure.job_id.as_deref(), Some("fire-and-forget"));
        assert_eq!(failure.error.code(), "LEASE_CLEANUP_FAILED");
        let report = sup.shutdown().await.unwrap();
        drop(sup);
        assert!(
            failures.recv().await.is_none(),
            "more than one sink call (detach={detach})"
        );
        assert_eq!(report.stats.release_failed_total, 1);
    }
}

/// The same when the job has finished before its handle goes away: its result, with the
/// cleanup failure, is already in the handle and would be dropped unread. It reaches the sink,
/// once. (Found by CI: the test above raced into this order on a loaded machine.)
#[tokio::test]
async fn a_cleanup_failure_already_in_a_dropped_or_detached_handle_reaches_the_error_sink_once() {
    for detach in [true, false] {
        let (sup, mut failures) = common::supervisor_whose_releases_fail().await;
        let handle = sup.submit(JobSpec::new("finished-early").unwrap(), |_ctx| async {
            Ok::<_, std::io::Error>(())
        });
        // Gated on the handle itself: the whole pipeline has run and the result is in it.
        while !handle.is_finished() {
            tokio::task::yield_now().await;
        }
        if detach {
            handle.detach();
        } else {
            drop(handle);
        }
        let report = sup.shutdown().await.unwrap();
        drop(sup);
        let failure = failures.recv().await.expect("the failure reached the sink");
        assert_eq!(failure.job_id.as_deref(), Some("finished-early"));
        assert_eq!(failure.error.code(), "LEASE_CLEANUP_FAILED");
        assert!(
            failures.recv().await.is_none(),
            "more than one sink call (detach={detach})"
        );
        assert_eq!(report.stats.release_failed_total, 1);
    }
}

/// A GPU device loss and processes that cannot be proven gone, on one lease: replacing the
/// device says nothing about the processes. The slot stays quarantined (its temp dir kept)
/// until a reclaim proves the group gone; it used to be released once the device was replaced.
#[cfg(feature = "gpu")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_loss_does_not_release_a_slot_whose_processes_are_unproven() {
    use leasehold::GpuOptions;
    let _serial = SERIAL.lock().await;
    let broker = TestBroker::new(1);
    let Some(sup) = gpu_support::start(
        Supervisor::builder()
            .broker(broker.clone())
            .process_proof_bound(Duration::from_millis(100)),
        GpuOptions::new(),
    )
    .await
    else {
        return;
    };
    let (pid_tx, pid_rx) = oneshot::channel();
    let (lose_tx, lose_rx) = oneshot::channel::<()>();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("both").unwrap(), move |ctx| async move {
                let mut child = ctx
                    .spawn_process(
                        ProcessSpec::new("sh")
                            .arg("-c")
                            .arg("setsid sleep 30 & echo $!")
                            .stdout(Stdio::piped()),
                    )
                    .unwrap();
                let pid = first_line(child.stdout.take().unwrap()).await;
                child.wait().await.unwrap();
                let dir = ctx.temp_dir().to_path_buf();
                let _ = pid_tx.send((pid, dir));
                lose_rx.await.unwrap();
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    let (pid, dir) = pid_rx.await.unwrap();
    let device = sup.gpu_device(0).unwrap();
    device.destroy();
    // The device-lost callback runs from the device's maintenance: the loss is known from here.
    let _ = device.poll(leasehold::wgpu::PollType::Poll);
    drop(device);
    lose_tx.send(()).unwrap();
    let err = job.await.unwrap().unwrap_err();
    assert!(
        ["LEASE_GPU_DEVICE_LOST", "LEASE_CLEANUP_UNCONFIRMED"].contains(&err.code()),
        "{err}"
    );
    // The device comes back (generation 2); the supervisor hears of it, and the loss no longer
    // holds the slot: only the processes do.
    let mut seen_loss = false;
    loop {
        let listed = sup.quarantined().await.unwrap();
        assert_eq!(listed.len(), 1);
        seen_loss |= listed[0].reason.contains("gpu device");
        if seen_loss && !listed[0].reason.contains("gpu device") {
            assert!(listed[0].reason.contains("alive"), "{}", listed[0].reason);
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(sup.gpu_device_generation(0), Some(2));
    let report = sup.reclaim_quarantined().await.unwrap();
    assert!(report.reclaimed.is_empty(), "{report:?}");
    assert_eq!(sup.stats().quarantined, 1);
    assert!(
        dir.exists(),
        "the temp dir was removed with processes unproven"
    );
    assert_eq!(
        broker.release_calls(),
        0,
        "released with processes unproven"
    );
    kill(pid);
    while common::proc_alive(pid) {
        tokio::task::yield_now().await;
    }
    let released = broker.0.released.notified();
    let report = sup.reclaim_quarantined().await.unwrap();
    assert_eq!(report.reclaimed.len(), 1, "{report:?}");
    assert_eq!(report.still_quarantined, [], "{report:?}");
    released.await;
    assert!(!dir.exists());
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
}

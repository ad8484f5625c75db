//! Descendants that leave their job's process group (into a session of their own) are either
//! stopped and proven gone, or the slot stays quarantined while they live: never a clean
//! release while one is alive. These tests run one at a time: the child subreaper and the
//! orphan check are process-wide.
#![cfg(target_os = "linux")]

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::{EventLog, Plan, TestBroker, first_line};
use leasehold::{CancellationToken, JobSpec, ProcessSpec, Supervisor};
use tokio::sync::oneshot;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn broker_logging_escapee(log: EventLog, pid: Arc<parking_lot::Mutex<Option<i32>>>) -> TestBroker {
    let broker = TestBroker::new(1);
    broker.on_release(move |_| {
        let p = pid.lock().expect("escapee recorded before any release");
        log.push(if common::proc_alive(p) {
            "release:escapee-alive"
        } else {
            "release:escapee-gone"
        });
        Plan::Ok
    });
    broker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escapee_whose_parent_is_alive_is_stopped_and_proven_gone_before_the_release() {
    let _serial = SERIAL.lock().await;
    let log = EventLog::default();
    let escapee: Arc<parking_lot::Mutex<Option<i32>>> = Arc::default();
    let broker = broker_logging_escapee(log.clone(), Arc::clone(&escapee));
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let (tx, rx) = oneshot::channel();
    let job = {
        let (sup, escapee) = (sup.clone(), Arc::clone(&escapee));
        let spec = JobSpec::new("escape").unwrap().with_cancel(cancel.clone());
        tokio::spawn(async move {
            sup.run(spec, move |ctx| async move {
                // `setsid` in a background job is not a group leader, so it does not fork: $! is
                // the escapee, now in a session and group of its own.
                let mut child = ctx
                    .spawn_process(
                        ProcessSpec::new("sh")
                            .arg("-c")
                            .arg("setsid sleep 30 & echo $!; wait")
                            .stdout(Stdio::piped()),
                    )
                    .unwrap();
                let pid = first_line(child.stdout.take().unwrap()).await;
                *escapee.lock() = Some(pid);
                tx.send(pid).unwrap();
                ctx.cancelled().await;
                Err::<(), _>(std::io::Error::from(std::io::ErrorKind::Interrupted))
            })
            .await
        })
    };
    let pid = rx.await.unwrap();
    // Wait until the escape has happened (setsid ran).
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains("(setsid)"))
    {
        tokio::task::yield_now().await;
    }
    assert!(common::proc_alive(pid));
    cancel.cancel();
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    assert!(!common::proc_alive(pid));
    assert_eq!(log.events(), ["release:escapee-gone"]);
    let report = sup.shutdown().await.unwrap();
    broker.assert_quiescent(report.stats);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphaned_escapee_keeps_the_slot_quarantined_until_it_is_gone_and_reclaimed() {
    let _serial = SERIAL.lock().await;
    let log = EventLog::default();
    let escapee: Arc<parking_lot::Mutex<Option<i32>>> = Arc::default();
    let broker = broker_logging_escapee(log.clone(), Arc::clone(&escapee));
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .process_proof_bound(Duration::from_millis(200))
        .start()
        .await
        .unwrap();
    let err = {
        let escapee = Arc::clone(&escapee);
        sup.run(JobSpec::new("daemon").unwrap(), move |ctx| async move {
            // The parent exits at once: the escapee is orphaned, reparented to this process (the
            // child subreaper), outside any job's group.
            let mut child = ctx
                .spawn_process(
                    ProcessSpec::new("sh")
                        .arg("-c")
                        .arg("setsid sleep 30 & echo $!")
                        .stdout(Stdio::piped()),
                )
                .unwrap();
            let pid = first_line(child.stdout.take().unwrap()).await;
            *escapee.lock() = Some(pid);
            assert!(child.wait().await.unwrap().success());
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err()
    };
    let pid = escapee.lock().unwrap();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{err}");
    assert!(err.body_error().is_none());
    assert!(common::proc_alive(pid));
    let stats = sup.stats();
    assert_eq!(stats.quarantined, 1);
    assert_eq!(
        broker.release_calls(),
        0,
        "released while the escapee lives"
    );
    let listed = sup.quarantined().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].job_id.as_deref(), Some("daemon"));
    assert!(
        listed[0].reason.contains(&pid.to_string()),
        "{}",
        listed[0].reason
    );

    // Still alive: reclaiming changes nothing.
    let report = sup.reclaim_quarantined().await.unwrap();
    assert!(report.reclaimed.is_empty());
    assert_eq!(report.still_quarantined.len(), 1);

    // Gone: the next reclaim releases the slot (its zombie is reaped by the check).
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    while common::proc_alive(pid) {
        tokio::task::yield_now().await;
    }
    let released = broker.0.released.notified();
    let report = sup.reclaim_quarantined().await.unwrap();
    assert_eq!(report.reclaimed.len(), 1);
    released.await;
    assert_eq!(log.events(), ["release:escapee-gone"]);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "escapee left as a zombie"
    );
}

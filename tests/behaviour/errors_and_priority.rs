//! The error contract: every stable code, the priority ladder among a job's own failures, both
//! errors kept when body and cleanup fail, `Display` and `source` conventions, and the `Send` /
//! `Sync` guarantees.

use crate::common;

use std::error::Error as StdError;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use common::{Plan, TestBroker, supervise};
use leasehold::{
    AcquireError, BodyErrorKind, BrokerError, BrokerErrorKind, CancellationToken, CleanupError,
    CleanupErrorKind, InvalidJob, JobError, JobSpec, Lease, LeaseReleased, PrepareError,
    ShutdownError, StartError, Supervisor, SupervisorStopped, WorkerContext, codes,
};
use tokio::sync::oneshot;

type Res<T> = Result<T, JobError<io::Error>>;

async fn ok_job(sup: &Supervisor, id: &str) -> Res<()> {
    sup.run(JobSpec::new(id).unwrap(), |_ctx| async {
        Ok::<_, io::Error>(())
    })
    .await
}

/// Runs `body` as a job whose caller cancels it (through the token given to `JobSpec`) once the
/// job has started; `body` runs after the cancellation has been requested.
async fn run_cancelled_by_caller<T, F, Fut>(sup: &Supervisor, id: &str, body: F) -> Res<T>
where
    F: FnOnce(WorkerContext) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, io::Error>> + Send + 'static,
    T: Send + 'static,
{
    let token = CancellationToken::new();
    let (started_tx, started_rx) = oneshot::channel();
    let spec = JobSpec::new(id).unwrap().with_cancel(token.clone());
    let sup = sup.clone();
    let job = tokio::spawn(async move {
        sup.run(spec, move |ctx| async move {
            started_tx.send(()).unwrap();
            ctx.cancelled().await;
            body(ctx).await
        })
        .await
    });
    started_rx.await.unwrap();
    token.cancel();
    job.await.unwrap()
}

/// `(code, body_error().is_some(), cleanup_error().is_some())`.
fn shape<E>(err: &JobError<E>) -> (&'static str, bool, bool) {
    (
        err.code(),
        err.body_error().is_some(),
        err.cleanup_error().is_some(),
    )
}

// ---------------------------------------------------------------------------------------------
// Every code of the contract table
// ---------------------------------------------------------------------------------------------

/// The contract table, with whether `body_error()` / `cleanup_error()` return `Some`.
const CONTRACT: [(&str, bool, bool); 12] = [
    ("JOB_INVALID", false, false),
    ("LEASE_ACQUIRE_CANCELLED", false, false),
    ("LEASE_ACQUIRE_TIMEOUT", false, false),
    ("LEASE_ACQUIRE_FAILED", false, false),
    ("LEASE_BODY_FAILED", true, false),
    ("LEASE_BODY_PANICKED", true, false),
    ("LEASE_BODY_CANCELLED", true, false),
    ("LEASE_DELIVERY_UNKNOWN", true, false),
    ("LEASE_CLEANUP_TIMEOUT", false, true),
    ("LEASE_CLEANUP_FAILED", false, true),
    ("LEASE_BODY_AND_CLEANUP_FAILED", true, true),
    ("SUPERVISOR_STOPPED", false, false),
];

#[tokio::test(start_paused = true)]
async fn every_code_of_the_contract_table_is_produced_with_its_exact_string_and_parts() {
    let mut seen: Vec<(&'static str, bool, bool)> = Vec::new();

    // JOB_INVALID: refused at the boundary.
    let invalid = JobSpec::new("a/b").unwrap_err();
    assert_eq!(invalid.code(), "JOB_INVALID");
    assert_eq!(InvalidJob::CODE, "JOB_INVALID");
    let err = JobError::<io::Error>::from(invalid);
    assert!(matches!(err, JobError::Invalid(_)));
    seen.push(shape(&err));

    // Ordinary supervisor: body outcomes, pre-cancelled job, shutdown.
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let pre = CancellationToken::new();
    pre.cancel();
    let err = sup
        .run(
            JobSpec::new("pre").unwrap().with_cancel(pre),
            |_ctx| async { Ok::<_, io::Error>(()) },
        )
        .await
        .unwrap_err();
    seen.push(shape(&err));

    let err = sup
        .run(JobSpec::new("fails").unwrap(), |_ctx| async {
            Err::<(), _>(io::Error::other("render failed"))
        })
        .await
        .unwrap_err();
    assert_eq!(err.body_error().unwrap().kind(), BodyErrorKind::Failed);
    seen.push(shape(&err));

    let err = sup
        .run(JobSpec::new("panics").unwrap(), |_ctx| async {
            if true {
                panic!("body exploded");
            }
            Ok::<(), io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.body_error().unwrap().panics(), ["body exploded"]);
    seen.push(shape(&err));

    let err = run_cancelled_by_caller(&sup, "cancelled", |_ctx| async {
        Err::<(), _>(io::Error::other("gave up"))
    })
    .await
    .unwrap_err();
    seen.push(shape(&err));

    let err = sup
        .run(JobSpec::new("unknown").unwrap(), |ctx| async move {
            ctx.mark_delivery_unknown("ack lost");
            Ok::<_, io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(
        err.body_error().unwrap().delivery_unknown(),
        Some("ack lost")
    );
    seen.push(shape(&err));
    let report = sup.shutdown().await.unwrap();
    broker.assert_quiescent(report.stats);

    let err = ok_job(&sup, "after-shutdown").await.unwrap_err();
    assert!(matches!(err.acquire_error(), Some(AcquireError::Stopped)));
    seen.push(shape(&err));

    // Acquire timeout: the only slot is held.
    let broker = TestBroker::new(1);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .acquire_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    let mut holder = sup.acquire().await.unwrap();
    seen.push(shape(&ok_job(&sup, "late").await.unwrap_err()));
    holder.release().await.unwrap();
    broker.assert_quiescent(sup.stats());

    // Acquire failure.
    let broker = TestBroker::new(1);
    broker.on_acquire(|_| Plan::Fail);
    let sup = supervise(&broker).await;
    seen.push(shape(&ok_job(&sup, "refused").await.unwrap_err()));
    broker.assert_quiescent(sup.stats());

    // Cleanup failure, alone and with a body failure.
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Fail);
    let sup = supervise(&broker).await;
    seen.push(shape(&ok_job(&sup, "cleanup").await.unwrap_err()));
    let err = sup
        .run(JobSpec::new("both").unwrap(), |_ctx| async {
            Err::<(), _>(io::Error::other("body"))
        })
        .await
        .unwrap_err();
    seen.push(shape(&err));
    broker.assert_quiescent(sup.stats());

    // Cleanup timeout: the release never answers (paused clock).
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Hang);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .cleanup_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    let err = ok_job(&sup, "hangs").await.unwrap_err();
    assert_eq!(
        err.cleanup_error().unwrap().kind(),
        CleanupErrorKind::Timeout
    );
    seen.push(shape(&err));
    broker.assert_quiescent(sup.stats());

    let mut expected = CONTRACT.to_vec();
    expected.sort_unstable();
    seen.sort_unstable();
    assert_eq!(seen, expected);

    // The exported constants spell the same strings.
    let exported = [
        codes::JOB_INVALID,
        codes::LEASE_ACQUIRE_CANCELLED,
        codes::LEASE_ACQUIRE_TIMEOUT,
        codes::LEASE_ACQUIRE_FAILED,
        codes::LEASE_BODY_FAILED,
        codes::LEASE_BODY_PANICKED,
        codes::LEASE_BODY_CANCELLED,
        codes::LEASE_DELIVERY_UNKNOWN,
        codes::LEASE_CLEANUP_TIMEOUT,
        codes::LEASE_CLEANUP_FAILED,
        codes::LEASE_BODY_AND_CLEANUP_FAILED,
        codes::SUPERVISOR_STOPPED,
    ];
    assert_eq!(exported, CONTRACT.map(|(code, _, _)| code));
}

#[tokio::test]
async fn the_body_error_code_matches_the_job_code_when_only_the_body_failed() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = sup
        .run(JobSpec::new("fails").unwrap(), |_ctx| async {
            Err::<(), _>(io::Error::other("x"))
        })
        .await
        .unwrap_err();
    assert_eq!(err.body_error().unwrap().code(), err.code());
    assert!(err.acquire_error().is_none());
    broker.assert_quiescent(sup.stats());
}

// ---------------------------------------------------------------------------------------------
// The priority ladder
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn delivery_unknown_from_the_body_wins_over_cancellation_and_a_body_error() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = run_cancelled_by_caller(&sup, "upload", |ctx| async move {
        ctx.mark_delivery_unknown("upload ack lost");
        ctx.mark_delivery_unknown("second reason is not kept");
        Err::<(), _>(io::Error::other("upload failed"))
    })
    .await
    .unwrap_err();
    assert_eq!(err.code(), "LEASE_DELIVERY_UNKNOWN");
    let body = err.body_error().unwrap();
    assert_eq!(body.kind(), BodyErrorKind::DeliveryUnknown);
    assert_eq!(body.delivery_unknown(), Some("upload ack lost"));
    assert_eq!(body.error().unwrap().to_string(), "upload failed");
    assert!(err.cleanup_error().is_none());
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn delivery_unknown_from_a_sibling_task_wins_over_an_ok_body() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = sup
        .run(JobSpec::new("sibling").unwrap(), |ctx| async move {
            let sibling = ctx.clone();
            ctx.spawn(async move { sibling.mark_delivery_unknown("sibling lost the ack") })
                .await
                .unwrap();
            Ok::<_, io::Error>(42)
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_DELIVERY_UNKNOWN");
    assert_eq!(
        err.body_error().unwrap().delivery_unknown(),
        Some("sibling lost the ack")
    );
    broker.assert_quiescent(sup.stats());
}

/// The job's result is decided after every part has ended: a sibling that marks
/// delivery-unknown after the body has already returned still decides it, with or without a
/// cancellation. Paused clock: the `sleep` returns only once every other task is idle, so the job
/// would have finished by then if it did not wait for its sibling.
#[tokio::test(start_paused = true)]
async fn delivery_unknown_from_a_sibling_that_finishes_after_the_body_still_wins() {
    for cancel in [false, true] {
        let broker = TestBroker::new(1);
        let sup = supervise(&broker).await;
        let token = CancellationToken::new();
        let (returned_tx, returned_rx) = oneshot::channel();
        let (gate_tx, gate_rx) = oneshot::channel::<()>();
        let job = {
            let sup = sup.clone();
            let spec = JobSpec::new("late-sibling")
                .unwrap()
                .with_cancel(token.clone());
            tokio::spawn(async move {
                sup.run(spec, move |ctx| async move {
                    let sibling = ctx.clone();
                    ctx.spawn(async move {
                        gate_rx.await.unwrap();
                        sibling.mark_delivery_unknown("late");
                    });
                    returned_tx.send(()).unwrap();
                    if cancel {
                        Err(io::Error::other("body error"))
                    } else {
                        Ok(())
                    }
                })
                .await
            })
        };
        returned_rx.await.unwrap();
        if cancel {
            token.cancel();
        }
        // The body has returned; the sibling is still waiting, and so is the job.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!job.is_finished(), "the job ended before its sibling");
        assert_eq!(broker.held(), 1);
        gate_tx.send(()).unwrap();
        let err = job.await.unwrap().unwrap_err();
        assert_eq!(err.code(), "LEASE_DELIVERY_UNKNOWN", "cancel={cancel}");
        assert_eq!(err.body_error().unwrap().delivery_unknown(), Some("late"));
        assert_eq!(err.body_error().unwrap().error().is_some(), cancel);
        broker.assert_quiescent(sup.stats());
    }
}

#[tokio::test]
async fn cancellation_wins_over_a_body_error_and_the_body_error_is_kept() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = run_cancelled_by_caller(&sup, "cancelled", |_ctx| async {
        Err::<(), _>(io::Error::other("render failed"))
    })
    .await
    .unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    let body = err.body_error().unwrap();
    assert_eq!(body.kind(), BodyErrorKind::Cancelled);
    assert_eq!(body.error().unwrap().to_string(), "render failed");
    assert!(err.cleanup_error().is_none());
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn cancellation_wins_over_a_panic_of_the_body_and_the_panic_is_kept() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = run_cancelled_by_caller(&sup, "panics", |_ctx| async {
        if true {
            panic!("panicked while cancelling");
        }
        Ok::<(), io::Error>(())
    })
    .await
    .unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    assert_eq!(
        err.body_error().unwrap().panics(),
        ["panicked while cancelling"]
    );
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn cancellation_wins_over_a_panic_of_a_sibling_task() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = run_cancelled_by_caller(&sup, "sibling-panics", |ctx| async move {
        let h = ctx.spawn(async {
            if true {
                panic!("sibling panicked while cancelling");
            }
        });
        assert!(h.await.unwrap_err().is_panic());
        Ok::<(), io::Error>(())
    })
    .await;
    // A body that returned Ok despite the cancellation would be Ok (see below), but a sibling
    // panic makes it a failure, and the cancellation outranks it.
    let err = err.unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    assert_eq!(
        err.body_error().unwrap().panics(),
        ["sibling panicked while cancelling"]
    );
    broker.assert_quiescent(sup.stats());
}

/// The sibling panics after the body has returned `Ok` (paused clock, as above).
#[tokio::test(start_paused = true)]
async fn a_sibling_panic_with_an_ok_body_ends_lease_body_panicked_with_its_message() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let (returned_tx, returned_rx) = oneshot::channel();
    let (gate_tx, gate_rx) = oneshot::channel::<()>();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("sibling").unwrap(), move |ctx| async move {
                ctx.spawn(async move {
                    gate_rx.await.unwrap();
                    panic!("sibling exploded after the body");
                });
                returned_tx.send(()).unwrap();
                Ok::<_, io::Error>("value")
            })
            .await
        })
    };
    returned_rx.await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!job.is_finished(), "the job ended before its sibling");
    assert_eq!(broker.held(), 1);
    gate_tx.send(()).unwrap();
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_PANICKED");
    let body = err.body_error().unwrap();
    assert_eq!(body.kind(), BodyErrorKind::Panicked);
    assert_eq!(body.panics(), ["sibling exploded after the body"]);
    assert!(body.error().is_none());
    assert!(err.cleanup_error().is_none());
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn a_panicking_blocking_closure_is_recorded_like_a_sibling_panic() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = sup
        .run(JobSpec::new("blocking").unwrap(), |ctx| async move {
            let h = ctx.spawn_blocking(|| {
                if true {
                    panic!("blocking closure exploded");
                }
            });
            assert!(h.await.unwrap_err().is_panic());
            Ok::<_, io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_PANICKED");
    assert_eq!(
        err.body_error().unwrap().panics(),
        ["blocking closure exploded"]
    );
    broker.assert_quiescent(sup.stats());
}

/// Panic and ordinary error share the lowest rung; the crate reports the panic and keeps the
/// error.
#[tokio::test]
async fn a_sibling_panic_and_a_body_error_keep_both_and_report_the_panic() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = sup
        .run(JobSpec::new("both").unwrap(), |ctx| async move {
            let h = ctx.spawn(async {
                if true {
                    panic!("sibling");
                }
            });
            let _ = h.await;
            Err::<(), _>(io::Error::other("body"))
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_PANICKED");
    let body = err.body_error().unwrap();
    assert_eq!(body.panics(), ["sibling"]);
    assert_eq!(body.error().unwrap().to_string(), "body");
    broker.assert_quiescent(sup.stats());
}

/// Cancellation is a request: a body that still completes with a value has succeeded.
#[tokio::test]
async fn a_body_that_completes_ok_despite_a_cancellation_request_returns_ok() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let v = run_cancelled_by_caller(&sup, "finishes-anyway", |ctx| async move {
        assert!(ctx.is_cancelled());
        Ok::<_, io::Error>(7)
    })
    .await
    .unwrap();
    assert_eq!(v, 7);
    broker.assert_quiescent(sup.stats());
}

/// Body and cleanup both fail: both are kept, whichever way the body failed.
#[tokio::test]
async fn both_body_and_cleanup_failures_are_kept_for_every_body_kind() {
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Fail);
    let sup = supervise(&broker).await;

    let failed = sup
        .run(JobSpec::new("failed").unwrap(), |_ctx| async {
            Err::<(), _>(io::Error::other("body failed"))
        })
        .await
        .unwrap_err();
    let panicked = sup
        .run(JobSpec::new("panicked").unwrap(), |_ctx| async {
            if true {
                panic!("body panicked");
            }
            Ok::<(), io::Error>(())
        })
        .await
        .unwrap_err();
    let cancelled = run_cancelled_by_caller(&sup, "cancelled", |_ctx| async {
        Err::<(), _>(io::Error::other("body cancelled"))
    })
    .await
    .unwrap_err();
    let unknown = sup
        .run(JobSpec::new("unknown").unwrap(), |ctx| async move {
            ctx.mark_delivery_unknown("maybe sent");
            Ok::<_, io::Error>(())
        })
        .await
        .unwrap_err();

    for (err, kind, code) in [
        (&failed, BodyErrorKind::Failed, "LEASE_BODY_FAILED"),
        (&panicked, BodyErrorKind::Panicked, "LEASE_BODY_PANICKED"),
        (&cancelled, BodyErrorKind::Cancelled, "LEASE_BODY_CANCELLED"),
        (
            &unknown,
            BodyErrorKind::DeliveryUnknown,
            "LEASE_DELIVERY_UNKNOWN",
        ),
    ] {
        assert_eq!(err.code(), "LEASE_BODY_AND_CLEANUP_FAILED", "{kind:?}");
        assert!(matches!(err, JobError::BodyAndCleanup { .. }));
        let body = err.body_error().unwrap();
        assert_eq!(body.kind(), kind);
        assert_eq!(body.code(), code);
        let cleanup = err.cleanup_error().unwrap();
        assert_eq!(cleanup.code(), "LEASE_CLEANUP_FAILED", "{kind:?}");
        assert!(cleanup.broker_error().is_some());
        // Display names both.
        let shown = err.to_string();
        assert!(shown.contains(&body.to_string()), "{shown}");
        assert!(shown.contains(&cleanup.to_string()), "{shown}");
    }
    assert_eq!(
        failed.body_error().unwrap().error().unwrap().to_string(),
        "body failed"
    );
    assert_eq!(panicked.body_error().unwrap().panics(), ["body panicked"]);
    assert_eq!(
        cancelled.body_error().unwrap().error().unwrap().to_string(),
        "body cancelled"
    );
    assert_eq!(
        unknown.body_error().unwrap().delivery_unknown(),
        Some("maybe sent")
    );
    let stats = sup.stats();
    assert_eq!(stats.release_failed_total, 4);
    broker.assert_quiescent(stats);
}

// ---------------------------------------------------------------------------------------------
// Display and source
// ---------------------------------------------------------------------------------------------

fn assert_display_convention(what: &str, shown: &str) {
    let first = shown
        .chars()
        .next()
        .unwrap_or_else(|| panic!("{what}: empty"));
    assert!(
        first.is_lowercase(),
        "{what}: {shown:?} does not start lowercase"
    );
    assert!(
        !shown.ends_with('.'),
        "{what}: {shown:?} ends with a full stop"
    );
    assert_eq!(
        shown.trim_end(),
        shown,
        "{what}: {shown:?} has trailing whitespace"
    );
    assert!(!shown.contains('\n'), "{what}: {shown:?} spans lines");
}

/// Errors produced by real scenarios, for the parts that cannot be built by hand.
struct Produced {
    body_failed: JobError<io::Error>,
    body_panicked: JobError<io::Error>,
    body_cancelled: JobError<io::Error>,
    delivery_unknown: JobError<io::Error>,
    cleanup_failed: JobError<io::Error>,
    both: JobError<io::Error>,
    cleanup_timeout: CleanupError,
    cleanup_unconfirmed: JobError<io::Error>,
    lease_released: LeaseReleased,
    shutdown: ShutdownError,
    stopped: SupervisorStopped,
    start_work_root: StartError,
}

async fn produce() -> Produced {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let body_failed = sup
        .run(JobSpec::new("f").unwrap(), |_ctx| async {
            Err::<(), _>(io::Error::other("disk full"))
        })
        .await
        .unwrap_err();
    let body_panicked = sup
        .run(JobSpec::new("p").unwrap(), |_ctx| async {
            if true {
                panic!("index out of range");
            }
            Ok::<(), io::Error>(())
        })
        .await
        .unwrap_err();
    let body_cancelled = run_cancelled_by_caller(&sup, "c", |_ctx| async {
        Err::<(), _>(io::Error::other("interrupted"))
    })
    .await
    .unwrap_err();
    let delivery_unknown = sup
        .run(JobSpec::new("d").unwrap(), |ctx| async move {
            ctx.mark_delivery_unknown("upload acknowledgement lost");
            Ok::<_, io::Error>(())
        })
        .await
        .unwrap_err();
    let cleanup_unconfirmed = sup
        .run(JobSpec::new("u").unwrap(), |ctx| async move {
            common::clobber_temp_dir(&ctx)?;
            Ok::<_, io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(cleanup_unconfirmed.code(), codes::LEASE_CLEANUP_UNCONFIRMED);
    sup.shutdown().await.unwrap();
    drop(sup);

    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Fail);
    let sup = supervise(&broker).await;
    let cleanup_failed = ok_job(&sup, "cf").await.unwrap_err();
    let both = sup
        .run(JobSpec::new("b").unwrap(), |_ctx| async {
            Err::<(), _>(io::Error::other("disk full"))
        })
        .await
        .unwrap_err();
    sup.shutdown().await.unwrap();

    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Hang);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .cleanup_timeout(Duration::from_millis(10))
        .start()
        .await
        .unwrap();
    let mut lease = sup.acquire().await.unwrap();
    let cleanup_timeout = lease.release().await.unwrap_err();
    let lease_released = lease.slot_id().unwrap_err();
    drop(lease);
    sup.shutdown().await.unwrap();

    let shutdown = {
        // A supervisor started on a runtime that is then dropped.
        let gone = tokio::task::spawn_blocking(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
            drop(rt);
            sup
        })
        .await
        .unwrap();
        let stopped = gone.quarantined().await.unwrap_err();
        (gone.shutdown().await.unwrap_err(), stopped)
    };
    let (shutdown, stopped) = shutdown;

    let file = tempfile::NamedTempFile::new().unwrap();
    let start_work_root = Supervisor::builder()
        .slots(1)
        .work_root(file.path())
        .start()
        .await
        .unwrap_err();

    Produced {
        body_failed,
        body_panicked,
        body_cancelled,
        delivery_unknown,
        cleanup_failed,
        both,
        cleanup_timeout,
        cleanup_unconfirmed,
        lease_released,
        shutdown,
        stopped,
        start_work_root,
    }
}

#[tokio::test]
async fn every_error_display_is_lowercase_without_a_trailing_full_stop() {
    let p = produce().await;
    let mut shown: Vec<(String, String)> = Vec::new();
    let mut push = |what: &str, e: &dyn std::fmt::Display| {
        shown.push((what.to_owned(), e.to_string()));
    };

    for id in ["", "a/b", &"x".repeat(200)] {
        push("InvalidJob", &JobSpec::new(id).unwrap_err());
    }
    for (what, e) in [
        ("BrokerError::new", BrokerError::new("lost")),
        ("BrokerError::timeout", BrokerError::timeout("slow")),
        ("BrokerError::unavailable", BrokerError::unavailable("down")),
        (
            "BrokerError::delivery_unknown",
            BrokerError::delivery_unknown("maybe"),
        ),
        (
            "BrokerError::invalid_response",
            BrokerError::invalid_response("dup"),
        ),
    ] {
        push(what, &e);
    }
    for (what, e) in [
        ("AcquireError::Cancelled", AcquireError::Cancelled),
        (
            "AcquireError::TimedOut",
            AcquireError::TimedOut {
                after: Duration::from_secs(1),
            },
        ),
        (
            "AcquireError::Failed",
            AcquireError::Failed(BrokerError::new("x")),
        ),
        ("AcquireError::Stopped", AcquireError::Stopped),
    ] {
        push(what, &e);
        push(what, &JobError::<io::Error>::Acquire(e));
    }
    for (what, e) in [
        (
            "PrepareError::TempDir",
            PrepareError::TempDir(Arc::new(io::Error::other("x"))),
        ),
        ("PrepareError::NoGpuSlot", PrepareError::NoGpuSlot),
        (
            "PrepareError::WorkerSpawn",
            PrepareError::WorkerSpawn("refused".into()),
        ),
    ] {
        push(what, &e);
        push(
            what,
            &JobError::<io::Error>::Unprepared {
                why: e.clone(),
                cleanup: None,
            },
        );
        push(
            what,
            &JobError::<io::Error>::Unprepared {
                why: e,
                cleanup: Some(p.cleanup_timeout.clone()),
            },
        );
    }
    push("SupervisorStopped", &p.stopped);
    push("StartError::NoBroker", &StartError::NoBroker);
    push("StartError::ZeroCapacity", &StartError::ZeroCapacity);
    push(
        "StartError::ZeroDuration",
        &StartError::ZeroDuration("cleanup_timeout"),
    );
    push("StartError::Spawn", &StartError::Spawn("no runtime".into()));
    push(
        "StartError::BrokerAttach",
        &StartError::BrokerAttach("attach refused".into()),
    );
    push("StartError::WorkRoot", &p.start_work_root);
    push(
        "JobError::Invalid",
        &JobError::<io::Error>::from(JobSpec::new("a b").unwrap_err()),
    );
    for (what, e) in [
        ("body failed", &p.body_failed),
        ("body panicked", &p.body_panicked),
        ("body cancelled", &p.body_cancelled),
        ("delivery unknown", &p.delivery_unknown),
        ("cleanup failed", &p.cleanup_failed),
        ("cleanup unconfirmed", &p.cleanup_unconfirmed),
        ("body and cleanup", &p.both),
    ] {
        push(&format!("JobError ({what})"), e);
        if let Some(b) = e.body_error() {
            push(&format!("BodyError ({what})"), b);
        }
        if let Some(c) = e.cleanup_error() {
            push(&format!("CleanupError ({what})"), c);
        }
    }
    push("CleanupError (timeout)", &p.cleanup_timeout);
    push("LeaseReleased", &p.lease_released);
    push("ShutdownError", &p.shutdown);

    assert!(shown.len() > 30);
    for (what, s) in &shown {
        assert_display_convention(what, s);
    }
}

/// Walks `source()` and returns each cause's `Display`.
fn chain(err: &(dyn StdError + 'static)) -> Vec<String> {
    let mut out = Vec::new();
    let mut next = err.source();
    while let Some(e) = next {
        out.push(e.to_string());
        next = e.source();
    }
    out
}

#[tokio::test]
async fn source_chains_lead_to_the_underlying_cause() {
    let p = produce().await;

    // JobError -> BodyError -> the body's own error.
    let src = p.body_failed.source().unwrap();
    assert!(
        src.downcast_ref::<leasehold::BodyError<io::Error>>()
            .is_some()
    );
    assert_eq!(chain(&p.body_failed).last().unwrap(), "disk full");
    // A body error with no `E` (panic, delivery unknown) has no further cause.
    assert_eq!(chain(&p.body_panicked).len(), 1);
    assert_eq!(chain(&p.delivery_unknown).len(), 1);
    // ...and a cancelled body whose `E` is kept still leads to it.
    assert_eq!(chain(&p.body_cancelled).last().unwrap(), "interrupted");

    // JobError -> CleanupError -> BrokerError.
    let cleanup = p.cleanup_failed.source().unwrap();
    let cleanup = cleanup.downcast_ref::<CleanupError>().unwrap();
    assert_eq!(cleanup.kind(), CleanupErrorKind::Failed);
    let broker = cleanup.source().unwrap().downcast_ref::<BrokerError>();
    assert_eq!(broker, cleanup.broker_error());
    assert!(broker.is_some());
    // An unconfirmed cleanup leads to the io error that failed the temp dir's removal.
    let unconfirmed = p.cleanup_unconfirmed.cleanup_error().unwrap();
    assert!(
        unconfirmed
            .source()
            .unwrap()
            .downcast_ref::<io::Error>()
            .is_some()
    );
    // A timeout has no cause beyond itself.
    assert!(p.cleanup_timeout.source().is_none());

    // Both failed: Display names both, `source()` cannot pick one.
    assert!(p.both.source().is_none());

    // AcquireError -> BrokerError / io::Error.
    let failed = AcquireError::Failed(BrokerError::unavailable("down"));
    let cause = failed
        .source()
        .unwrap()
        .downcast_ref::<BrokerError>()
        .unwrap();
    assert_eq!(cause.kind(), BrokerErrorKind::Unavailable);
    let scratch = PrepareError::TempDir(Arc::new(io::Error::other("no space")));
    assert_eq!(scratch.source().unwrap().to_string(), "no space");
    assert_eq!(scratch.code(), "LEASE_PREPARE_FAILED");
    let unprepared = JobError::<io::Error>::Unprepared {
        why: scratch,
        cleanup: None,
    };
    assert_eq!(chain(&unprepared).last().unwrap(), "no space");
    assert!(AcquireError::Cancelled.source().is_none());
    assert!(AcquireError::Stopped.source().is_none());
    let job = JobError::<io::Error>::Acquire(failed);
    assert_eq!(chain(&job).len(), 2);

    // JobError -> InvalidJob.
    let invalid = JobError::<io::Error>::from(JobSpec::new("a/b").unwrap_err());
    assert!(
        invalid
            .source()
            .unwrap()
            .downcast_ref::<InvalidJob>()
            .is_some()
    );

    // StartError::WorkRoot -> io::Error.
    assert!(
        p.start_work_root
            .source()
            .unwrap()
            .downcast_ref::<io::Error>()
            .is_some()
    );
    assert!(StartError::NoBroker.source().is_none());
}

// ---------------------------------------------------------------------------------------------
// Send, Sync, 'static
// ---------------------------------------------------------------------------------------------

fn is_error<T: StdError + Send + Sync + 'static>() {}
fn is_send<T: Send>() {}
fn is_send_sync<T: Send + Sync>() {}
fn future_is_send<F: Future + Send>(_: &F) {}

/// Checked by the compiler; the test only has to build.
#[test]
fn errors_are_send_sync_static_and_handles_contexts_and_futures_are_send() {
    is_error::<JobError<io::Error>>();
    is_error::<AcquireError>();
    is_error::<CleanupError>();
    is_error::<StartError>();
    is_error::<BrokerError>();
    is_error::<InvalidJob>();
    is_error::<ShutdownError>();
    is_error::<SupervisorStopped>();
    is_error::<PrepareError>();
    is_error::<LeaseReleased>();
    is_error::<leasehold::BodyError<io::Error>>();
    is_send_sync::<Supervisor>();
    is_send_sync::<WorkerContext>();
    is_send::<Lease>();

    // Never called: it exists so that the compiler checks the futures' types.
    let _futures: fn(&Supervisor, &mut Lease, &WorkerContext) = |sup, lease, ctx| {
        future_is_send(&sup.run(JobSpec::new("x").unwrap(), |_ctx| async {
            Ok::<_, io::Error>(())
        }));
        future_is_send(&sup.acquire());
        future_is_send(&sup.shutdown());
        future_is_send(&lease.release());
        future_is_send(&ctx.cancelled());
    };
}
